"""``policy="auto"``: a remat policy chosen later, by the plan active where the step is traced.

Layer stacks opt in with ``policy="auto"`` (:func:`jaxmem.scan`, the :mod:`jaxmem.flax` stacks).
The string is resolved when the step is traced, from a JAX context state that
:func:`jaxmem.use_plan` sets; outside any plan it means no remat, said once with a
:class:`UserWarning`.

The state is part of ``jax.jit``'s cache key (and of JAX's trace caches), like
``jax.default_matmul_precision``: a function jitted outside a ``use_plan`` block and called
inside one is traced again with the plan's policy, and the other way round.

Examples:
  >>> from jaxmem._src.remat import auto
  >>> from jaxmem._src.remat.policies import nothing
  >>> with auto.use_setting(auto.Setting(nothing)):
  ...     auto.resolve("auto", "f")
  nothing
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Setting:
    """What ``"auto"`` means inside a :func:`use_setting` block.

    Attributes:
      policy: the remat policy of each step (None: no ``jax.checkpoint`` at all).
      checkpoints: the ``checkpoints=`` of each ``"auto"`` scan that does not set its own.
      trial: a candidate being measured (the planner's), not a plan the user applies: the
        loops report no finding of its policy (``jaxmem.lint``, ``LintWarning``).
    """

    policy: Callable | None
    checkpoints: int | str | None = None
    trial: bool = False


_STATE = _jc.trace_keyed_state(
    "jaxmem_auto_policy",
    None,
    'What policy="auto" means in jaxmem stacks (set by jaxmem.use_plan; None: no plan).',
)
OUTSIDE_A_PLAN = "policy=auto outside a plan"  # the key of its warning (checks.warn_once)


def is_auto(policy: Any) -> bool:
    """Whether ``policy`` is the string ``"auto"``."""
    return isinstance(policy, str) and policy == AUTO


@contextlib.contextmanager
def use_setting(setting: Setting) -> Iterator[None]:
    """Makes ``setting`` what ``"auto"`` means for steps traced inside the block."""
    with _STATE(setting):
        yield


def current() -> Setting | None:
    """The active :class:`Setting`, or None outside any plan."""
    value = _STATE.value
    return value if isinstance(value, Setting) else None


def resolve(policy: Any, fname: str) -> Any:
    """``"auto"`` -> the active plan's policy (None, with a one-time warning, outside a plan)."""
    if not is_auto(policy):
        return policy
    active = current()
    if active is not None:
        return active.policy
    checks.warn_once(
        OUTSIDE_A_PLAN,
        lambda: (
            f'{fname} got policy="auto" outside any plan: no remat (every residual is saved). '
            "Wrap the trace in `with jaxmem.use_plan(jaxmem.plan(loss_fn, *args, budget=...)):` "
            "to choose a policy for a memory budget."
        ),
        UserWarning,
        stacklevel=4,
    )
    return None


def in_trial() -> bool:
    """Whether ``"auto"`` means a candidate being measured (:attr:`Setting.trial`)."""
    active = current()
    return active is not None and active.trial


def resolve_checkpoints(policy: Any, checkpoints: Any) -> Any:
    """An ``"auto"`` scan's ``checkpoints``: its own if set, else the active plan's."""
    if checkpoints is not None or not is_auto(policy):
        return checkpoints
    active = current()
    return None if active is None else active.checkpoints
