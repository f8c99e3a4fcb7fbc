"""``policy="auto"``: a remat policy chosen later, by the plan active where the step is traced.

Layer stacks opt in with ``policy="auto"`` (:func:`jaxmem.scan`, the :mod:`jaxmem.flax` stacks).
The string is resolved when the step is traced, from a context variable that
:func:`jaxmem.use_plan` sets; outside any plan it means no remat, said once with a
:class:`UserWarning`.

The policy is resolved at trace time, so a function jitted (and cached) outside a
``use_plan`` block keeps the policy it was traced with: apply the plan around the first trace
(or jit a new function inside the block).

Examples:
  >>> from jaxmem._src import auto
  >>> from jaxmem._src.policies import nothing
  >>> with auto.use_policy(nothing):
  ...     auto.resolve("auto", "f")
  nothing
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable, Iterator
from typing import Any

AUTO = "auto"

_NO_PLAN = object()
_current: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxmem_auto_policy", default=_NO_PLAN
)
_warned = False


def is_auto(policy: Any) -> bool:
    """Whether ``policy`` is the string ``"auto"``."""
    return isinstance(policy, str) and policy == AUTO


@contextlib.contextmanager
def use_policy(policy: Callable | None) -> Iterator[None]:
    """Makes ``policy`` what ``"auto"`` means for steps traced inside the block."""
    token = _current.set(policy)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Any:
    """The policy ``"auto"`` means here, or ``_NO_PLAN``."""
    return _current.get()


def resolve(policy: Any, fname: str) -> Any:
    """``"auto"`` -> the active plan's policy (None, with a one-time warning, outside a plan)."""
    global _warned
    if not is_auto(policy):
        return policy
    active = _current.get()
    if active is not _NO_PLAN:
        return active
    if not _warned:
        _warned = True
        warnings.warn(
            f'{fname} got policy="auto" outside any plan: no remat (every residual is saved). '
            "Wrap the trace in `with jaxmem.use_plan(jaxmem.plan(loss_fn, *args, budget=...)):` "
            "to choose a policy for a memory budget.",
            UserWarning,
            stacklevel=4,
        )
    return None
