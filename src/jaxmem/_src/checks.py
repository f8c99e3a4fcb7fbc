"""Input checks shared by jaxmem's public functions, run before anything is traced.

Every message starts with the public function that failed (``caller``), names the offending
argument by its pytree path (:func:`jax.tree_util.keystr`) and says what would be accepted, e.g.
``profile: argument args[1]['w'] is a str ('abc'); only arrays, scalars and
jax.ShapeDtypeStruct can be traced``.
"""

from __future__ import annotations

import functools
import re
import reprlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 40

_PY_SCALARS = (bool, int, float, complex)

# The warnings given once per process (by key): one registry behind a lock, since the planner
# compiles candidates in threads.
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()


def warn_once(
    key: str, message: Callable[[], str], category: type[Warning], stacklevel: int
) -> bool:
    """Warns ``message()`` the first time ``key`` is seen in this process (from any thread).

    Args:
        key: what the warning is about; a second call with the same key does nothing.
        message: builds the text (only when it is shown).
        category: the warning class.
        stacklevel: as for :func:`warnings.warn`, counted from the caller of ``warn_once``.

    Returns:
        Whether this call warned.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = warn_once("doctest-key", lambda: "shown once", UserWarning, 1)
        ...     _ = warn_once("doctest-key", lambda: "shown once", UserWarning, 1)
        >>> [str(w.message) for w in caught]
        ['shown once']
    """
    with _WARNED_LOCK:
        if key in _WARNED:
            return False
        _WARNED.add(key)
    warnings.warn(message(), category, stacklevel=stacklevel + 1)
    return True


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def byte_count(value: Any, argname: str, caller: str) -> int:
    """A number of bytes, as an int: an int, a float (rounded down) or a string with a unit
    (``"48MiB"``, ``"1.5GB"``, ``"8GiB"``, ``"512"``; kB/MB/GB/TB are powers of 1000, KiB/MiB/
    GiB/TiB of 1024, case-insensitive).

    Raises:
      TypeError: not a number or a string (``True``, None, a list).
      ValueError: negative, not finite, or a string that is not a size.

    Examples:
        >>> byte_count("48MiB", "budget", "f"), byte_count("1.5GB", "budget", "f")
        (50331648, 1500000000)
        >>> byte_count(5.2e7, "budget", "f")
        52000000
        >>> byte_count("-1GB", "budget", "f")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: f: budget must be a size in bytes (...), got str ('-1GB')
    """
    bad = ValueError(
        f"{caller}: {argname} must be a size in bytes (an int, a float or a string such as "
        f'"48MiB", "1.5GB", "8GiB"), got {describe(value)}'
    )
    if isinstance(value, str):
        match = _BYTES.fullmatch(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise bad
        number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        number = value
    else:
        raise TypeError(str(bad))
    if not np.isfinite(float(number)) or number < 0:
        raise bad
    return int(number)


def describe(x: Any) -> str:
    """Short description of a value for error messages: its type and a truncated repr.

    Examples:
        >>> describe("abc")
        "str ('abc')"
        >>> describe(3)
        'int (3)'
    """
    return f"{type(x).__name__} ({_repr.repr(x)})"


def fn_name(fn: Any) -> str:
    """Readable name of a callable: its qualified name (without ``<locals>`` prefixes), or
    ``partial(name)`` for partials.

    Examples:
        >>> def loss(w):
        ...     return w
        >>> fn_name(loss)
        'loss'
        >>> import functools
        >>> fn_name(functools.partial(loss))
        'partial(loss)'
        >>> def outer():
        ...     def step(h):
        ...         return h
        ...     return step
        >>> fn_name(outer())
        'step'
    """
    if isinstance(fn, functools.partial):
        return f"partial({fn_name(fn.func)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str) and name:
        return name.rpartition("<locals>.")[2]
    return type(fn).__name__


def check_callable(fn: Any, argname: str, caller: str) -> Callable[..., Any]:
    """Raise TypeError unless ``fn`` is callable.

    Args:
        fn: the value to check.
        argname: how the caller's user spells the argument, e.g. ``"fn"`` or ``"fns['stock']"``.
        caller: the public function doing the check, e.g. ``"profile"``.

    Returns:
        ``fn`` unchanged.

    Raises:
        TypeError: ``fn`` is not callable; the message names ``argname`` and what was given.

    Examples:
        >>> check_callable(3, "fn", "profile")
        Traceback (most recent call last):
        ...
        TypeError: profile: fn must be callable (a function), got int (3)
    """
    if not callable(fn):
        raise TypeError(f"{caller}: {argname} must be callable (a function), got {describe(fn)}")
    return fn


def is_traceable_leaf(x: Any, allow_structs: bool = True) -> bool:
    """Whether a pytree leaf can be an argument of ``jax.jit(...).lower``.

    Accepted: ``jax.Array`` (tracers included), ``jax.ShapeDtypeStruct``, numpy arrays and scalars
    of a numeric or boolean dtype (bfloat16 and other ml_dtypes included), Python
    ``bool``/``int``/``float``/``complex``, and objects defining ``__jax_array__``.

    Examples:
        >>> import jax.numpy as jnp
        >>> is_traceable_leaf(jnp.ones(3)), is_traceable_leaf(2.0), is_traceable_leaf("a")
        (True, True, False)
    """
    if isinstance(x, jax.Array):
        return True
    if isinstance(x, jax.ShapeDtypeStruct):
        return allow_structs
    if isinstance(x, np.ndarray | np.generic):
        return _is_numeric_dtype(x.dtype)
    if isinstance(x, _PY_SCALARS):
        return True
    return hasattr(x, "__jax_array__")


def _is_numeric_dtype(dtype: Any) -> bool:
    try:
        return bool(jnp.issubdtype(dtype, np.number) or jnp.issubdtype(dtype, np.bool_))
    except TypeError:
        return False


def check_traceable(tree: Any, argname: str, caller: str, allow_structs: bool = True) -> None:
    """Raise TypeError at the first leaf of ``tree`` that JAX cannot trace.

    Args:
        tree: any pytree of arguments (``None`` and empty containers are fine: they have no
            leaves).
        argname: the name the path is appended to, e.g. ``"args"``, ``"kwargs"`` or ``"xs"``.
        caller: the public function doing the check, e.g. ``"profile"`` or ``"scan"``.
        allow_structs: whether ``jax.ShapeDtypeStruct`` placeholders are accepted (they are
            where a function is only traced, not run).

    Raises:
        TypeError: a leaf is not traceable; the message gives its pytree path, its type and a
            short repr.

    Examples:
        >>> import jax.numpy as jnp
        >>> check_traceable(({"w": jnp.ones(2)}, 1.0), "args", "profile")
        >>> check_traceable((jnp.ones(2), {"w": "abc"}), "args", "profile")
        Traceback (most recent call last):
        ...
        TypeError: profile: argument args[1]['w'] is a str ('abc'); only arrays, scalars and
        jax.ShapeDtypeStruct can be traced
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in leaves:
        if not is_traceable_leaf(leaf, allow_structs):
            what = describe(leaf)
            if isinstance(leaf, np.ndarray | np.generic):
                what = f"numpy value of dtype {leaf.dtype}"
            accepted = (
                "arrays, scalars and jax.ShapeDtypeStruct"
                if allow_structs
                else ("arrays and scalars")
            )
            raise TypeError(
                f"{caller}: argument {argname}{jax.tree_util.keystr(path)} is a {what}; "
                f"only {accepted} can be traced"
            )
