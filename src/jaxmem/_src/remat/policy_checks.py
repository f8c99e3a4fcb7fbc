"""What a remat policy refers to by name, and whether the program it governs carries it: the
``name_unmatched`` and ``offload_noop`` findings of :func:`jaxmem.lint` for ``jax.checkpoint``
(and every loop jaxmem runs under a policy).

A name governs only the values inside the ``jax.checkpoint`` whose policy refers to it: a policy
naming ``"mlp_in"`` over a function that tags nothing ``"mlp_in"`` saves nothing by that name,
whatever the rest of the program tags (MaxText #4990: an offload setting that matched no name
left the program byte for byte the same). So a name is *matched* when a ``checkpoint_name``
(:func:`jaxmem.name`) with it is inside that checkpoint's function, at any depth.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax

from jaxmem._src import jax_compat as _jc

REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})  # jax.checkpoint: 0.10.2 and 0.12


def remat_params(eqn) -> tuple[Any, Any] | None:
    """``(jaxpr, policy)`` of a ``jax.checkpoint`` equation (``remat2``, or the hijax primitive
    of ``jax_remat3``), else None. The jaxpr is open."""
    if eqn.primitive.name in REMAT_PRIMITIVES:
        jaxpr = eqn.params["jaxpr"]
        return (_jc.open_jaxpr(jaxpr) if _jc.is_closed_jaxpr(jaxpr) else jaxpr), eqn.params.get(
            "policy"
        )
    staged = _jc.remat3_params(eqn)
    if staged is None:
        return None
    jaxpr = staged[0]
    return (_jc.open_jaxpr(jaxpr) if _jc.is_closed_jaxpr(jaxpr) else jaxpr), staged[1]


def iter_eqns(jaxpr) -> Iterator[Any]:
    """The equations of ``jaxpr`` and, recursively, of the jaxprs in their parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _jc.subjaxprs(eqn):
            yield from iter_eqns(sub)


def names_in(jaxpr) -> frozenset[str]:
    """The checkpoint names given to values anywhere in ``jaxpr``."""
    return frozenset(n for e in iter_eqns(jaxpr) if (n := _jc.eqn_checkpoint_name(e)))


def _string_set(value: Any) -> frozenset[str] | None:
    if isinstance(value, (set, frozenset, tuple, list)) and value:
        if all(isinstance(v, str) for v in value):
            return frozenset(value)
    return None


def _parts(policy: Any) -> list:
    """The values a policy is built from: a dataclass's fields (jax 0.10.2's
    ``SaveOnlyTheseNames(saveable_names)``), a closure's cells (jax 0.12's
    ``save_only_these_names`` closes over ``names_which_can_be_saved``,
    ``save_and_offload_only_these_names`` over both its sets, ``save_from_both_policies`` over
    its two policies). Read by structure, not by name: public constructors, private shapes."""
    if dataclasses.is_dataclass(policy) and not isinstance(policy, type):
        return [getattr(policy, f.name) for f in dataclasses.fields(policy)]
    cells = getattr(policy, "__closure__", None) or ()
    out = []
    for cell in cells:
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def policy_names(policy: Any, depth: int = 0) -> frozenset[str]:
    """The checkpoint names a remat policy refers to.

    jaxmem's policies say so themselves (``explicit_actions``: ``selective()`` refers to no name
    it needs); ``jax.checkpoint_policies`` are read by structure (:func:`_parts`), combinations
    of policies searched through.

    Examples:
      >>> import jax
      >>> from jaxmem._src.remat import policies
      >>> sorted(policy_names(jax.checkpoint_policies.save_only_these_names("a", "b")))
      ['a', 'b']
      >>> sorted(policy_names(policies.save("mlp_in") | jax.checkpoint_policies.dots_saveable))
      ['mlp_in']
    """
    if policy is None or depth > 4:
        return frozenset()
    actions = getattr(policy, "explicit_actions", None)
    if callable(actions):  # jaxmem's policies; either() also holds JAX's
        found = set(actions())
        for member in getattr(policy, "policies", ()):
            if not callable(getattr(member, "explicit_actions", None)):
                found |= policy_names(member, depth + 1)
        return frozenset(found)
    found = set()
    for part in _parts(policy):
        names = _string_set(part)
        if names is not None:
            found |= names
        elif callable(part):
            found |= policy_names(part, depth + 1)
    return frozenset(found)


def offloaded_names(policy: Any, names) -> frozenset[str]:
    """Those of ``names`` that ``policy`` offloads (asked as it is asked: the name's primitive,
    a value, the name)."""
    aval = jax.core.ShapedArray((1,), jax.numpy.float32)
    out = set()
    for n in names:
        try:
            answer = policy(_jc.name_p, aval, name=n)
        except Exception:  # noqa: BLE001 - a policy that cannot be asked offloads nothing known
            continue
        if type(answer).__name__ == "Offloadable":
            out.add(n)
    return frozenset(out)


def offload_does_nothing() -> bool:
    """Whether offloading to host memory does nothing on the default backend (XLA:CPU, where
    ``pinned_host`` is the same memory: the move is the identity)."""
    return jax.default_backend() == "cpu"


class Issue(NamedTuple):
    """A remat policy's setting that does nothing: a finding of :func:`jaxmem.lint`
    (``kind``, ``subject``, ``message``), reported where its caller knows the user's line."""

    kind: str
    subject: str
    message: str


def check_remat(eqn) -> list[Issue]:
    """The names of a ``jax.checkpoint`` equation's policy that no value inside it carries
    (``name_unmatched``), and its offloaded names where offload does nothing
    (``offload_noop``)."""
    params = remat_params(eqn)
    if params is None:
        return []
    jaxpr, policy = params
    referred = policy_names(policy)
    if not referred:
        return []
    present = names_in(jaxpr)
    issues = [
        Issue(
            "name_unmatched",
            f"name {n!r}",
            f"is in the remat policy {describe(policy)}, but no value inside the checkpointed "
            f"function is named {n!r} (its names: {', '.join(sorted(present)) or 'none'}): the "
            "policy acts on nothing by that name. Name the value with jaxmem.name(x, "
            f"{n!r}) inside the function, or fix the name.",
        )
        for n in sorted(referred - present)
    ]
    offloaded = offloaded_names(policy, referred & present)
    if offloaded and offload_does_nothing():
        issues.append(
            Issue(
                "offload_noop",
                f"offload of {', '.join(map(repr, sorted(offloaded)))}",
                f"by the remat policy {describe(policy)} does nothing on the "
                f"{jax.default_backend()} backend (host memory is the same memory): the values "
                "are saved as if on the device. Offload where the accelerator has host memory "
                "(GPU, TPU), or save them here.",
            )
        )
    return issues


def check_remats(jaxpr) -> list[tuple[Issue, Any]]:
    """:func:`check_remat` for each ``jax.checkpoint`` of ``jaxpr``, at any depth: each issue
    with None for those at the top (where jaxmem applies a loop's policy: the loop's call is
    their line) and the equation for those deeper (their own line)."""
    out = []
    for eqn in jaxpr.eqns:
        out += [(issue, None) for issue in check_remat(eqn)]
        for sub in _jc.subjaxprs(eqn):
            for inner in iter_eqns(sub):
                out += [(issue, inner) for issue in check_remat(inner)]
    return out


def describe(policy: Any) -> str:
    """A policy as its user wrote it: jaxmem's and jax 0.10.2's by their repr, jax 0.12's
    closures by the function that made them."""
    if hasattr(policy, "explicit_actions") or dataclasses.is_dataclass(policy):
        return repr(policy)
    qualname = getattr(policy, "__qualname__", None) or type(policy).__name__
    return f"{qualname.split('.<locals>')[0]}(...)" if ".<locals>" in qualname else qualname
