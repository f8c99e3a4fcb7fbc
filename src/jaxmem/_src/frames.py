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


# What is not a model frame, as (package, folders or files inside it; () for all of it). A
# framework's layers are model code; its transforms, lifting and pytree plumbing are not.
_INTERNAL = (
    ("jax", ()),
    ("jaxlib", ()),
    ("jaxmem", ()),
    ("flax", ("core", "nnx", "linen/module.py", "linen/transforms.py", "linen/spmd.py",
              "linen/partitioning.py", "linen/kw_only_dataclasses.py", "struct.py")),
    ("equinox", ("internal", "debug", "_module")),
)  # fmt: skip

# ... except these, inside an internal folder above: Flax NNX's layers and optimizer.
_MODEL_INSIDE = (("flax", ("nnx/nn", "nnx/training")),)


def _package_dir(package: str) -> str | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(next(iter(spec.submodule_search_locations)))


def _paths(table) -> tuple[str, ...]:
    out = []
    for package, inside in table:
        root = _package_dir(package)
        if root is not None:
            out += [os.path.join(root, p) for p in inside] if inside else [root]
    return tuple(out)


@functools.cache
def _tables() -> tuple[tuple[str, ...], tuple[str, ...], str, tuple[str, ...]]:
    internal = _paths(_INTERNAL)
    model_inside = _paths(_MODEL_INSIDE)
    # Equinox's top-level private modules are its filtered transforms (_jit, _vmap_pmap, _ad).
    eqx = _package_dir("equinox")
    eqx_private = os.path.join(eqx, "_") if eqx else ""
    stdlib = tuple(
        os.path.realpath(p)
        for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    )
    return internal, model_inside, eqx_private, stdlib


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


@functools.lru_cache(maxsize=4096)
def is_model_file(path: str) -> bool:
    """Whether a frame in file ``path`` is the model's code: not JAX's, jaxlib's, jaxmem's, the
    standard library's, nor a framework's transform internals (``flax/core``,
    ``flax/nnx`` but its layers ``flax/nnx/nn``, Flax linen's module and transforms, Equinox's
    ``internal`` and private modules).

    Examples:
        >>> is_model_file("/home/me/train.py"), is_model_file(os.__file__)
        (True, False)
    """
    if not path or path.startswith("<frozen"):  # the standard library, frozen in
        return False
    if path.startswith("<"):  # <doctest ...>, <ipython-input-...>, <string>: the user's code
        return True
    real = os.path.realpath(path)
    internal, model_inside, eqx_private, stdlib = _tables()
    if _under(real, model_inside):
        return True
    if eqx_private and real.startswith(eqx_private) and os.sep not in real[len(eqx_private) :]:
        return False
    if _under(real, internal):
        return False
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
    to it (a framework's layer, then the user's own files), ``()`` if it has none.

    Examples:
        >>> jax_frame = Frame(os.path.join(_package_dir("jax"), "numpy/x.py"), 1, "sin")
        >>> layer = Frame("/venv/lib/site-packages/flax/nnx/nn/linear.py", 422, "Linear.__call__")
        >>> user = Frame("/home/me/model.py", 21, "Block.__call__")
        >>> [f.function for f in model_chain([jax_frame, layer, jax_frame, user, user])]
        ['Linear.__call__', 'Block.__call__']

    A frame repeated next to itself (JAX records one per column of a line) is kept once.
    """
    chain: list[Frame] = []
    for frame in frames:
        if is_model_file(frame.file) and (not chain or chain[-1] != frame):
            chain.append(frame)
    return tuple(chain)


def user_frame(chain: Iterable[Frame]) -> Frame | None:
    """The first frame of ``chain`` in the user's own files (outside installed packages).

    Examples:
        >>> layer = Frame("/venv/lib/site-packages/flax/nnx/nn/linear.py", 422, "Linear.__call__")
        >>> user_frame([layer, Frame("/home/me/model.py", 21, "Block.__call__")]).line
        21
    """
    return next((frame for frame in chain if not in_a_package(frame.file)), None)
