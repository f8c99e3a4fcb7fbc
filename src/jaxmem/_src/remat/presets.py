"""Policies by name: the presets ("nothing", "dots", ...) and their aliases, and the one function
that turns what a user passes as policy= into a policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxmem._src.remat.policies import (
    Policy,
    Selective,
    dots,
    dots_no_batch,
    everything,
    nothing,
)

_PRESETS: dict[str, Policy] = {
    "nothing": nothing,
    "everything": everything,
    "dots": dots,
    "dots_no_batch": dots_no_batch,
    "selective": Selective(),
}


# jax.checkpoint_policies' names for the same policies, for configs written for them.
_ALIASES: dict[str, str] = {
    "nothing_saveable": "nothing",
    "everything_saveable": "everything",
    "dots_saveable": "dots",
    "checkpoint_dots": "dots",
    "dots_with_no_batch_dims_saveable": "dots_no_batch",
    "checkpoint_dots_with_no_batch_dims": "dots_no_batch",
}


def by_name(policy_name: str) -> Policy:
    """Returns the preset policy called ``policy_name``, for config files and Flax modules.

    Presets: ``"nothing"``, ``"everything"``, ``"dots"``, ``"dots_no_batch"``, ``"selective"``
    (and jax's names for the first four, e.g. ``"dots_saveable"``). Policies with arguments
    (:func:`save`, :func:`offload`, :func:`custom`) are built in code. ``PRESETS`` names the
    five, in the order every planner search measures them (``"nothing"`` is full remat).

    Args:
      policy_name: the preset's name.

    Returns:
      The policy.

    Raises:
      TypeError: ``policy_name`` is not a str.
      ValueError: an unknown name; the message lists the known ones.

    Examples:
      >>> by_name("selective")
      selective()
      >>> by_name("dots_saveable")
      dots
      >>> by_name("full")
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.policies.by_name: unknown policy 'full'; known policies: nothing, ...
    """
    caller = "jaxmem.policies.by_name"
    if not isinstance(policy_name, str):
        raise TypeError(
            f"{caller}: policy_name must be a str, got {type(policy_name).__name__} "
            f"({policy_name!r})."
        )
    key = _ALIASES.get(policy_name, policy_name)
    if key not in _PRESETS:
        raise ValueError(
            f"{caller}: unknown policy {policy_name!r}; known policies: "
            f"{', '.join([*_PRESETS, *_ALIASES])}. Build save(...), offload(...) and "
            "custom(...) in code."
        )
    return _PRESETS[key]


def resolve(policy: Any, fname: str) -> Callable | str | None:
    """The one place a ``policy=`` argument is read: ``None``, a policy, ``"auto"``, or a name.

    A preset name (:func:`by_name`, jax's names included) becomes its policy; ``None``, a callable
    policy and ``"auto"`` (resolved by the active :func:`jaxmem.use_plan` when the step is traced)
    are returned as they are. Every API that takes ``policy=`` (:func:`jaxmem.scan`,
    :func:`jaxmem.scanned`, :func:`jaxmem.reversible_scan`, the :mod:`jaxmem.flax` stacks and
    remat) reads it through here.

    Args:
      policy: what the caller was given.
      fname: the public API's name, for error messages.

    Returns:
      ``None``, ``"auto"`` or a policy.

    Raises:
      ValueError: an unknown preset name (the message lists the known ones).
      TypeError: anything else that is not a policy.

    Examples:
      >>> resolve("dots_saveable", "jaxmem.scan")
      dots
      >>> resolve(None, "jaxmem.scan") is None
      True
      >>> resolve(3, "jaxmem.scan")
      Traceback (most recent call last):
        ...
      TypeError: jaxmem.scan got policy=3 (int); expected None, 'auto', a remat policy ...
    """
    if policy is None or callable(policy) or (isinstance(policy, str) and policy == "auto"):
        return policy
    if isinstance(policy, str):
        try:
            return by_name(policy)
        except ValueError as e:
            raise ValueError(f"{fname}: {e}") from None
    raise TypeError(
        f"{fname} got policy={policy!r} ({type(policy).__name__}); expected None, 'auto', a remat "
        "policy (jaxmem.policies.* or jax.checkpoint_policies.*) or a preset name such as "
        "'dots' or 'selective'."
    )
