"""Policies written as a function: :func:`custom` decides for each value (keep on the device,
offload, or recompute) from what made it: its primitive, checkpoint name and shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from jax.ad_checkpoint import Offloadable

from jaxmem._src.remat.names import check_name, check_names
from jaxmem._src.remat.policies import ACTIONS, Policy, _is_name, _offload_or_fallback


@dataclasses.dataclass(frozen=True, repr=False)
class Custom(Policy):
    """A per-name map (MaxText's ``remat_policy: custom``): each name kept, offloaded or recomputed.

    Attributes:
      entries: ``(name, action)`` pairs sorted by name, each action one of :data:`ACTIONS`.
      default: the action for every value the map does not name (unnamed values included).

    Examples:
      >>> Custom((("mlp_in", "offload"), ("qkv_proj", "device")), default="remat")
      custom({'mlp_in': 'offload', 'qkv_proj': 'device'}, default='remat')
    """

    entries: tuple[tuple[str, str], ...]
    default: str = "remat"

    def __call__(self, prim: Any, *avals: Any, **params: Any) -> bool | Offloadable:
        action = self.default
        if _is_name(prim):
            action = dict(self.entries).get(params["name"], self.default)
        if action == "offload":
            return _offload_or_fallback()
        return action == "device"

    def __repr__(self) -> str:
        return f"custom({dict(self.entries)!r}, default={self.default!r})"

    def explicit_actions(self) -> dict[str, str]:
        return dict(self.entries)


def custom(
    mapping: Mapping[str, str] | None = None,
    /,
    *,
    device: Iterable[str] = (),
    offload: Iterable[str] = (),
    remat: Iterable[str] = (),
    default: str = "remat",
    allow_unknown: bool = False,
) -> Custom:
    """A per-name policy, MaxText's ``remat_policy: custom``: keep, offload or recompute each name.

    Give the map as ``{name: "device" | "offload" | "remat"}``, as name lists per action
    (``device=[...]``, ``offload=[...]``, ``remat=[...]``), or both. ``"device"`` saves the value
    on the device, ``"offload"`` saves it in host memory (as :func:`offload`, with its fallback),
    ``"remat"`` recomputes it. ``default`` applies to every value the map does not name, unnamed
    values included: ``"remat"`` (MaxText's behaviour), ``"device"`` (save them all, as
    :data:`everything`) or ``"offload"``.

    A ``"remat"`` entry only works with ``default="remat"``: a policy decides per value, and
    under a saving default the value that *enters* the name (the same tensor, unnamed) would be
    saved instead, so such a map is refused rather than silently ignored.

    Args:
      mapping: ``{name: action}``, each action one of :data:`ACTIONS`.
      device: names to save on the device.
      offload: names to offload to ``pinned_host``.
      remat: names to recompute.
      default: the action for everything else, one of :data:`ACTIONS`.
      allow_unknown: accept names outside the vocabulary.

    Returns:
      A :class:`Custom` policy.

    Raises:
      TypeError: ``mapping`` is not a mapping, or a name is not a str.
      ValueError: an action that is not one of :data:`ACTIONS`; a name given two actions; a
        name not in the vocabulary (and ``allow_unknown`` is False); a ``"remat"`` entry with a
        ``default`` other than ``"remat"``.

    Examples:
      >>> policy = custom({"qkv_proj": "device", "decoder_layer_input": "offload"})
      >>> policy
      custom({'decoder_layer_input': 'offload', 'qkv_proj': 'device'}, default='remat')
      >>> policy == custom(device=["qkv_proj"], offload=["decoder_layer_input"])
      True
      >>> custom({"qkv_proj": "save"})
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.policies.custom: mapping['qkv_proj'] is 'save'; expected one of ...
      >>> custom({"qkv_proj": "device"}, remat=["qkv_proj"])
      Traceback (most recent call last):
        ...
      ValueError: jaxmem.policies.custom: 'qkv_proj' is given two actions, ...
    """
    caller = "jaxmem.policies.custom"
    if default not in ACTIONS:
        raise ValueError(
            f"{caller}: default={default!r}; expected one of {', '.join(map(repr, ACTIONS))}."
        )
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"{caller}: mapping must be a dict {{name: action}}, got {type(mapping).__name__} "
            f"({mapping!r}); e.g. custom({{'qkv_proj': 'device'}})."
        )
    actions: dict[str, list[str]] = {}
    for key, action in mapping.items():
        check_name(key, allow_unknown=allow_unknown, what="mapping key", caller=caller)
        if action not in ACTIONS:
            raise ValueError(
                f"{caller}: mapping[{key!r}] is {action!r}; expected one of "
                f"{', '.join(map(repr, ACTIONS))}."
            )
        actions.setdefault(key, []).append(f"{action!r} (in the mapping)")
    groups = {"device": device, "offload": offload, "remat": remat}
    entries: dict[str, str] = dict(mapping)
    for action, names in groups.items():
        for n in check_names(names, allow_unknown=allow_unknown, what=action, caller=caller):
            actions.setdefault(n, []).append(f"{action!r} (in {action}=)")
            entries[n] = action
    both = {n: where for n, where in actions.items() if len(where) > 1}
    if both:
        detail = "; ".join(
            f"{n!r} is given two actions, {' and '.join(w)}" for n, w in both.items()
        )
        raise ValueError(f"{caller}: {detail}. Give each name one action.")
    remats = sorted(n for n, a in entries.items() if a == "remat")
    if remats and default != "remat":
        raise ValueError(
            f"{caller}: 'remat' entries {remats} have no effect with default={default!r}: the "
            "value entering each name would be kept instead. Use default='remat' and list what "
            "to keep, e.g. custom({'qkv_proj': 'device'}, default='remat')."
        )
    return Custom(tuple(sorted(entries.items())), default)
