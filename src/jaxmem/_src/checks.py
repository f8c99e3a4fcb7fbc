"""Input checks shared by jaxmem's public functions, run before anything is traced.

Every message starts with the public function that failed (``caller``), names the offending
argument by its pytree path (:func:`jax.tree_util.keystr`) and says what would be accepted, e.g.
``profile: argument args[1]['w'] is a str ('abc'); only arrays, scalars and
jax.ShapeDtypeStruct can be traced``.
"""

from __future__ import annotations

import fractions
import functools
import math
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


# Byte units, case-insensitive: decimal (SI) powers of 1000 and binary (IEC) powers of 1024. A
# bare "K", "M" or "G" is refused: it means 10**3 to some and 2**10 to others.
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
_AMBIGUOUS = {"k": ("kB", "KiB"), "m": ("MB", "MiB"), "g": ("GB", "GiB"), "t": ("TB", "TiB")}
BYTE_FORMS = (
    "an int, a float or a string such as '64MiB' or '40MB' (units B; kB, MB, GB, TB: "
    "powers of 1000; KiB, MiB, GiB, TiB: powers of 1024; any case; a bare K, M or G is not "
    "accepted)"
)


def byte_count(value: Any, argname: str, caller: str) -> int:
    """A number of bytes, as an int, from what a user types: an int, a float (rounded down to
    whole bytes: ``0.3 * temp``) or a string with a unit, case-insensitive, with or without a
    space (``"64MiB"``, ``"40MB"``, ``"1.5 GiB"``, ``"100kB"``, ``"123"``, ``"123B"``). kB, MB,
    GB and TB are powers of 1000, KiB, MiB, GiB and TiB of 1024; a bare ``"K"``, ``"M"`` or
    ``"G"`` is refused (it means either). A string is read exactly (``"1.001kB"`` is 1001).

    Args:
      value: the size as given.
      argname: the argument's name in the caller's API, e.g. ``"budget"``.
      caller: the public function, e.g. ``"jaxmem.optimize"``.

    Returns:
      The size in whole bytes (>= 0).

    Raises:
      TypeError: not a number or a string (``True``, None, a list).
      ValueError: negative, nan or infinite, or a string that is not a size (the message
        names the forms accepted).

    Examples:
        >>> byte_count("64MiB", "budget", "f"), byte_count("40 mb", "budget", "f")
        (67108864, 40000000)
        >>> byte_count(5.2e7, "budget", "f"), byte_count(1e3 / 3, "budget", "f")
        (52000000, 333)
        >>> byte_count("40 MBs", "budget", "jaxmem.optimize")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: jaxmem.optimize: budget='40 MBs' is not a byte size; use an int, a float ...
        >>> byte_count(-1, "budget", "jaxmem.plan")
        Traceback (most recent call last):
        ...
        ValueError: jaxmem.plan: budget=-1 is negative; a byte size is 0 or more
    """
    if isinstance(value, str):
        number = _parse_bytes(value, argname, caller)
    elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        number = value
        if not np.isfinite(float(value)):
            raise ValueError(
                f"{caller}: {argname}={value!r} is not a finite byte size; use {BYTE_FORMS}"
            )
    else:
        raise TypeError(
            f"{caller}: {argname} must be a byte size, {BYTE_FORMS}; got {describe(value)}"
        )
    if number < 0:
        raise ValueError(f"{caller}: {argname}={value!r} is negative; a byte size is 0 or more")
    return math.floor(number)


def _parse_bytes(text: str, argname: str, caller: str) -> fractions.Fraction:
    """``text``'s bytes, exact (a Fraction: ``"1.001kB"`` is 1001, where floats give 1000.99...)."""
    match = _BYTES.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        hint = ""
        if unit in _AMBIGUOUS:
            decimal, binary = _AMBIGUOUS[unit]
            hint = f" ({match.group(2)!r} alone is ambiguous: write {decimal} or {binary})"
        raise ValueError(f"{caller}: {argname}={text!r} is not a byte size{hint}; use {BYTE_FORMS}")
    return fractions.Fraction(match.group(1)) * _UNITS[unit]


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
