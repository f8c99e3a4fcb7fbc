"""Which frames of a call stack are the model's code: where a report points the user.

JAX records the Python stack of every equation (``source_info``) and XLA keeps it in each
instruction's metadata, innermost frame first, JAX's own frames filtered out. What is left still
holds frames that are nobody's model: jaxmem's loops, a framework's transform internals (Flax's
``nnx.scan`` wrapper, ``flax/core``'s lifting, Equinox's filtered transforms), the standard
library's wrappers. A *model frame* is any other: the user's files and a framework's layers
(``flax/nnx/nn``, ``flax/linen/linear.py``, ``equinox/nn``), which are the model as its author
wrote it. :func:`model_chain` keeps the model frames, innermost first: the line that made a
value and the calls that led there; :func:`user_frame` is the first of them in the user's own
files (outside installed packages).

Examples:
    >>> f = Frame("/home/me/model.py", 12, "mlp")
    >>> str(f), is_model_file(f.file)
    ('/home/me/model.py:12 (mlp)', True)
    >>> import jax
    >>> is_model_file(jax.__file__)
    False
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import sysconfig
from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Frame", "in_a_package", "is_model_file", "model_chain", "user_frame"]


class Frame(NamedTuple):
    """One frame of a call stack: file, line and function.

    Examples:
        >>> str(Frame("/a/b.py", 3, "f")), str(Frame("/a/b.py", 3, ""))
        ('/a/b.py:3 (f)', '/a/b.py:3')
    """

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (f" ({self.function})" if self.function else "")


# Which files of installed packages are the model's code, as (package, path inside it, model?):
# the longest path that holds a file decides. A framework's layers are model code; its
# transforms, lifting, named-array plumbing and pytree machinery are not. Files of other
# installed packages are (their layers, an optimizer's update); the standard library is not.
_RULES = (
    ("jax", "", False),
    ("jaxlib", "", False),
    ("jaxmem", "", False),
    ("flax", "core", False),
    ("flax", "nnx", False),
    ("flax", "nnx/nn", True),
    ("flax", "nnx/training", True),
    ("flax", "linen/module.py", False),
    ("flax", "linen/transforms.py", False),
    ("flax", "linen/spmd.py", False),
    ("flax", "linen/partitioning.py", False),
    ("flax", "linen/kw_only_dataclasses.py", False),
    ("flax", "struct.py", False),
    ("equinox", "", False),  # its filtered transforms (_jit, _vmap_pmap, _ad), _module, internal
    ("equinox", "nn", True),
    ("haliax", "", False),  # named arrays: Levanter's jax.numpy, its scans and partitioning
    ("haliax", "nn", True),
    ("haliax", "nn/scan.py", False),
)


def _package_dir(package: str) -> str | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations)))


@functools.cache
def _tables() -> tuple[tuple[tuple[str, bool], ...], tuple[str, ...]]:
    """The rules as (absolute path, model?), longest first; the standard library's folders."""
    rules = []
    for package, inside, model in _RULES:
        root = _package_dir(package)
        if root is not None:
            rules.append((os.path.join(root, inside) if inside else root, model))
    stdlib = tuple(
        os.path.realpath(p)
        for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    )
    return tuple(sorted(rules, key=lambda r: -len(r[0]))), stdlib


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


@functools.lru_cache(maxsize=4096)
def is_model_file(path: str) -> bool:
    """Whether a frame in file ``path`` is the model's code: not JAX's, jaxlib's, jaxmem's, the
    standard library's, nor a framework's transform internals (``flax/core``, ``flax/nnx`` but
    its layers ``flax/nnx/nn``, Flax linen's module and transforms, Equinox but ``equinox/nn``,
    Haliax but its layers ``haliax/nn``).

    Examples:
        >>> is_model_file("/home/me/train.py"), is_model_file(os.__file__)
        (True, False)
    """
    if not path or path.startswith(("<frozen", "<string>")):  # frozen stdlib; code exec'd
        return False  # from a string (dataclass methods, execnet's workers)
    if path.startswith("<"):  # <doctest ...>, <ipython-input-...>: the user's code
        return True
    real = os.path.realpath(path)
    rules, stdlib = _tables()
    for root, model in rules:
        if _under(real, (root,)):
            return model
    parts = pathlib.PurePath(real).parts
    if "site-packages" in parts or "dist-packages" in parts:
        return True  # another installed library: its layers, an optimizer's update
    return not _under(real, stdlib)


def in_a_package(path: str) -> bool:
    """Whether ``path`` is a file of an installed package (``site-packages``), not the user's.

    Examples:
        >>> in_a_package("/home/me/train.py")
        False
    """
    real = os.path.realpath(path)
    parts = pathlib.PurePath(real).parts
    return "site-packages" in parts or "dist-packages" in parts or not is_model_file(path)


def model_chain(frames: Iterable[Frame]) -> tuple[Frame, ...]:
    """The model frames of a stack, innermost first: the model's line, then the calls that led
    to it (a framework's layer, then the user's own files), ``()`` if it has none. The chain
    ends at the user's outermost file: the installed packages that called it (a test runner,
    a notebook's kernel) are not the model.

    Examples:
        >>> jax_frame = Frame(os.path.join(_package_dir("jax"), "numpy/x.py"), 1, "sin")
        >>> layer = Frame("/venv/lib/site-packages/flax/nnx/nn/linear.py", 422, "Linear.__call__")
        >>> user = Frame("/home/me/model.py", 21, "Block.__call__")
        >>> runner = Frame("/venv/lib/site-packages/_pytest/python.py", 157, "pyfunc_call")
        >>> [f.function for f in model_chain([jax_frame, layer, jax_frame, user, user, runner])]
        ['Linear.__call__', 'Block.__call__']

    A frame is kept once: JAX records one per column of a line, and the stack of a loop body
    traced inside another trace holds the outer trace's frames again.
    """
    chain = list(dict.fromkeys(frame for frame in frames if is_model_file(frame.file)))
    while len(chain) > 1 and in_a_package(chain[-1].file) and user_frame(chain) is not None:
        chain.pop()
    return tuple(chain)


def user_frame(chain: Iterable[Frame]) -> Frame | None:
    """The first frame of ``chain`` in the user's own files (outside installed packages).

    Examples:
        >>> layer = Frame("/venv/lib/site-packages/flax/nnx/nn/linear.py", 422, "Linear.__call__")
        >>> user_frame([layer, Frame("/home/me/model.py", 21, "Block.__call__")]).line
        21
    """
    return next((frame for frame in chain if not in_a_package(frame.file)), None)
