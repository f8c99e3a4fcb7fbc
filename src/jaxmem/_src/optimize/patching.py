"""Attributes of JAX's objects replaced while :func:`jaxmem.optimize` traces, for every thread,
acting for the threads that replaced them.

:mod:`~jaxmem._src.optimize.intercept` replaces ``lax.scan``'s primitive's ``bind`` and
:mod:`~jaxmem._src.optimize.swaps` three functions of ``jax`` and ``jax.nn``. An attribute is
replaced while any thread's trace is within :func:`replaced` and restored as it was (an
instance attribute that shadowed its class's is removed again) when the last leaves. Each
thread keeps a stack of states per attribute: the replacement reads this thread's innermost
(:func:`top`) and calls the original where it is None (another thread's call, or one turned off
by :func:`passing`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_STATE = threading.local()  # .stacks: (id(owner), name) -> this thread's states, innermost last
_LOCK = threading.Lock()
_ACTIVE: dict = {}  # (id(owner), name) -> [traces within, over every thread; what it was]
_ABSENT = object()  # the owner had no attribute of its own (its class's was read)


@contextlib.contextmanager
def replaced(owner, name: str, replacement, state) -> Iterator[None]:
    """``owner.name`` is ``replacement`` while any thread is within; ``state`` is this
    thread's innermost for the time (:func:`top`)."""
    key = (id(owner), name)
    stack = _stack(key)
    stack.append(state)
    with _LOCK:
        if key not in _ACTIVE:
            _ACTIVE[key] = [0, vars(owner).get(name, _ABSENT)]
            setattr(owner, name, replacement)
        _ACTIVE[key][0] += 1
    try:
        yield
    finally:
        stack.pop()
        with _LOCK:
            _ACTIVE[key][0] -= 1
            if _ACTIVE[key][0] == 0:
                _, original = _ACTIVE.pop(key)
                if original is _ABSENT:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)


@contextlib.contextmanager
def passing(owner, name: str) -> Iterator[None]:
    """Within: this thread's calls of the replacement of ``owner.name`` see no state (a
    replacement's own work, whose calls should reach the original)."""
    stack = _stack((id(owner), name))
    stack.append(None)
    try:
        yield
    finally:
        stack.pop()


def top(owner, name: str):
    """This thread's innermost state for ``owner.name`` (None: none, or passing)."""
    stack = _stack((id(owner), name))
    return stack[-1] if stack else None


def _stack(key) -> list:
    if not hasattr(_STATE, "stacks"):
        _STATE.stacks = {}
    return _STATE.stacks.setdefault(key, [])
