"""A remat plan as data: which checkpoint names a stack saves, recomputes or offloads (or one
preset), with what the planner measured; ``use_plan`` applies one to every ``policy="auto"``
stack traced under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

from jaxmem._src.remat import auto as _auto
from jaxmem._src.remat import policies as _policies
from jaxmem._src.remat import presets as _presets
from jaxmem._src.remat.flops import _discover


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One choice for the ``"auto"`` stacks, as the search compiles it.

    Attributes:
      save: names saved on the device (the rest recomputed).
      offload: names offloaded to host memory.
      preset: a :mod:`jaxmem.policies` preset used instead of names (``save``/``offload``
        empty).
      checkpoints: the stacks' ``checkpoints=`` (None: every step's residuals kept).
      no_remat: no ``jax.checkpoint`` at all (the FLOPs baseline).
    """

    save: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    preset: str | None = None
    checkpoints: int | str | None = None
    no_remat: bool = False

    @property
    def policy(self) -> Callable | None:
        """The remat policy of each step (None for no remat)."""
        if self.no_remat:
            return None
        if self.preset is not None:
            return _presets.by_name(self.preset)
        parts = []
        if self.save:
            parts.append(_policies.Save(tuple(sorted(self.save))))
        if self.offload:
            parts.append(_policies.Offload(tuple(sorted(self.offload))))
        if not parts:
            return _policies.nothing
        return parts[0] if len(parts) == 1 else _policies.Either(tuple(parts))

    def setting(self) -> _auto.Setting:
        return _auto.Setting(self.policy, self.checkpoints)

    @property
    def key(self) -> str:
        """A short readable key, e.g. ``"save mlp_in,qkv_proj"`` or ``"preset dots"``."""
        if self.no_remat:
            return "no remat"
        if self.preset is not None:
            parts = [f"preset {self.preset}"]
        else:
            parts = [f"save {','.join(sorted(self.save))}" if self.save else "save nothing"]
            if self.offload:
                parts.append(f"offload {','.join(sorted(self.offload))}")
        if self.checkpoints is not None:
            parts.append(f"checkpoints {self.checkpoints}")
        return "; ".join(parts)

    @classmethod
    def from_key(cls, key: str) -> Candidate:
        """The candidate :attr:`key` names."""
        if key == "no remat":
            return cls(no_remat=True)
        fields: dict[str, Any] = {}
        for part in key.split("; "):
            word, _, rest = part.partition(" ")
            if word == "preset":
                fields["preset"] = rest
            elif word == "save":
                fields["save"] = frozenset() if rest == "nothing" else frozenset(rest.split(","))
            elif word == "offload":
                fields["offload"] = frozenset(rest.split(","))
            elif word == "checkpoints":
                fields["checkpoints"] = int(rest) if rest.isdigit() else rest
            else:
                raise ValueError(f"jaxmem.RematPlan: unreadable trial key {key!r}")
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What ``policy="auto"`` stacks do so a gradient fits a memory budget.

    Attributes:
      save: names saved on the device.
      recompute: names recomputed in the backward pass.
      offload: names offloaded to host memory.
      preset: a :mod:`jaxmem.policies` preset the plan uses instead of per-name decisions
        (``save``, ``recompute`` and ``offload`` are then empty), or None.
      checkpoints: ``checkpoints=`` for every ``"auto"`` scan that does not set its own
        (binomial checkpointing over the layers), or None.
      budget: the temp-memory budget in bytes the plan was made for (None if made by hand).
      measured_temp_bytes: compiled temp of the gradient under the plan (``memory_analysis``).
      predicted_temp_bytes: the planner's estimate before compiling (None for presets).
      recompute_flops: FLOPs of the planned gradient minus those of the no-remat gradient.
      baseline_flops: FLOPs of the no-remat gradient (``cost_analysis``).
      no_remat: no remat at all: the gradient without ``jax.checkpoint`` fits.
      compiles: AOT compiles the search ran.
      seconds: wall time of the search.
      trials: every measured candidate, ``(key, temp bytes, flops)``, the key as
        :attr:`Candidate.key` writes it (``"no remat"``, ``"preset dots"``, ``"save a,b"``...).
      notes: what the search could not do here (e.g. offload not measurable on CPU).
      step_time_s: median measured step time of the planned gradient (``plan(time=True)``).
      no_remat_step_time_s: the same for the no-remat gradient, measured interleaved.
      op_names: the names are op kinds of unmodified code (apply with
        ``jaxmem.optimize(loss_fn, plan=p)``, which names the values the same way).

    Examples:
      >>> p = RematPlan(save=frozenset({"mlp_in"}), recompute=frozenset({"mlp_act"}))
      >>> p.policy
      save('mlp_in')
      >>> RematPlan.from_json(p.to_json()) == p
      True
    """

    save: frozenset[str] = frozenset()
    recompute: frozenset[str] = frozenset()
    offload: frozenset[str] = frozenset()
    preset: str | None = None
    checkpoints: int | str | None = None
    budget: int | None = None
    measured_temp_bytes: int | None = None
    predicted_temp_bytes: int | None = None
    recompute_flops: float | None = None
    baseline_flops: float | None = None
    no_remat: bool = False
    compiles: int = 0
    seconds: float = 0.0
    trials: tuple[tuple[str, int, float], ...] = ()
    notes: tuple[str, ...] = ()
    step_time_s: float | None = None
    no_remat_step_time_s: float | None = None
    op_names: bool = False

    def __post_init__(self):
        for field in ("save", "recompute", "offload"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(n, str) for n in value):
                raise TypeError(
                    f"RematPlan.{field} must be a set of checkpoint names, got {value!r}"
                )
            object.__setattr__(self, field, frozenset(value))
        for a, b in (("save", "recompute"), ("save", "offload"), ("recompute", "offload")):
            both = getattr(self, a) & getattr(self, b)
            if both:
                raise ValueError(
                    f"RematPlan: {sorted(both)} in both {a} and {b}; give each one action"
                )
        if self.preset is not None:
            _presets.by_name(self.preset)  # Raises on an unknown preset, listing them.
            if self.save or self.offload:
                raise ValueError("RematPlan: a preset plan takes no save/offload names")
        object.__setattr__(
            self, "trials", tuple((str(k), int(t), float(f)) for k, t, f in self.trials)
        )
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def candidate(self) -> Candidate:
        """The :class:`Candidate` this plan applies."""
        return Candidate(
            save=self.save,
            offload=self.offload,
            preset=self.preset,
            checkpoints=self.checkpoints,
            no_remat=self.no_remat,
        )

    @property
    def policy(self) -> Callable:
        """The remat policy, ``jaxmem.policies.save(*self.save)`` (a preset, or ``everything``
        with no remat; offloaded names add ``jaxmem.policies.offload(...)``).

        Usable as ``jaxmem.scan(policy=...)``, in :mod:`jaxmem.flax` stacks and in
        ``jax.checkpoint(policy=...)``. ``checkpoints`` is not part of a policy: pass
        ``checkpoints=plan.checkpoints`` to the stack too (``use_plan`` does both).
        """
        return _policies.everything if self.no_remat else self.candidate.policy

    def validate(self, loss_fn: Callable, *args: Any) -> RematPlan:
        """Checks that the plan's names all occur in ``loss_fn`` (traced, not compiled).

        Args:
          loss_fn: the loss the plan is for.
          *args: its arguments (arrays or ``jax.ShapeDtypeStruct``).

        Returns:
          The plan itself.

        Raises:
          ValueError: a name of the plan does not occur; the message lists those that do.
        """
        occurring = {e.name for e in _discover(loss_fn, args)}
        unknown = sorted((self.save | self.recompute | self.offload) - occurring)
        if unknown:
            raise ValueError(
                f"RematPlan: {', '.join(map(repr, unknown))} not among the checkpoint names "
                f"loss_fn uses: {', '.join(sorted(occurring)) or '(none)'}."
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data (sets as sorted lists)."""
        d = dataclasses.asdict(self)
        for field in ("save", "recompute", "offload"):
            d[field] = sorted(d[field])
        d["trials"] = [list(t) for t in self.trials]
        d["notes"] = list(self.notes)
        return d

    def to_json(self) -> str:
        """The plan as a JSON string (:meth:`from_json` reads it back)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RematPlan:
        """The plan :meth:`to_json` wrote."""
        d = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"jaxmem.RematPlan.from_json: unknown fields {unknown}")
        d["trials"] = tuple(tuple(t) for t in d.get("trials", ()))
        return cls(**d)

    def __str__(self) -> str:
        def mib(b):
            return "?" if b is None else f"{b / 2**20:.3f} MiB"

        head = f"Plan for budget {mib(self.budget)}: temp {mib(self.measured_temp_bytes)} measured"
        if self.predicted_temp_bytes is not None:
            head += f" ({mib(self.predicted_temp_bytes)} predicted)"
        lines = [head]
        if self.no_remat:
            lines.append("  no remat at all (every residual saved)")
        elif self.preset is not None:
            lines.append(f"  preset:    {self.preset} (jaxmem.policies.{self.preset})")
        else:
            lines.append(f"  save:      {', '.join(sorted(self.save)) or '-'}")
            lines.append(f"  recompute: {', '.join(sorted(self.recompute)) or '-'}")
            if self.offload:
                lines.append(f"  offload:   {', '.join(sorted(self.offload))}")
        if self.checkpoints is not None:
            lines.append(f"  checkpoints={self.checkpoints!r} in the stacks")
        if self.recompute_flops is not None and self.baseline_flops:
            pct = 100 * self.recompute_flops / self.baseline_flops
            lines.append(
                f"  cost:      {self.recompute_flops:.4g} FLOPs recomputed ({pct:.1f}% over the "
                f"no-remat gradient's {self.baseline_flops:.4g})"
            )
        if self.step_time_s is not None and self.no_remat_step_time_s:
            ratio = self.step_time_s / self.no_remat_step_time_s
            lines.append(
                f"  time:      {1e3 * self.step_time_s:.2f} ms per gradient ({ratio:.2f}x no remat)"
            )
        lines.append(f"  search:    {self.compiles} compiles, {self.seconds:.1f} s")
        lines.extend(f"  note:      {n}" for n in self.notes)
        return "\n".join(lines)


@contextlib.contextmanager
def use_plan(plan: RematPlan) -> Iterator[RematPlan]:
    """Applies ``plan`` to every ``policy="auto"`` stack traced inside the block.

    The plan is part of ``jax.jit``'s cache key: a function jitted before the block is traced
    again inside it (as for ``jax.default_matmul_precision``).

    Args:
      plan: a :class:`RematPlan` (from :func:`plan` or :meth:`RematPlan.from_json`).

    Yields:
      ``plan``.

    Raises:
      TypeError: ``plan`` is not a :class:`RematPlan`.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxmem
      >>> def loss(w, xs):
      ...     step = lambda h, x: (jnp.tanh(jaxmem.name(h * w + x, "mlp_act")), None)
      ...     return jaxmem.scan(step, jnp.zeros(4), xs, policy="auto")[0].sum()
      >>> p = RematPlan(save=frozenset({"mlp_act"}))
      >>> with use_plan(p):
      ...     g = jax.grad(loss)(1.0, jnp.ones((3, 4)))
    """
    if not isinstance(plan, RematPlan):
        raise TypeError(
            f"jaxmem.use_plan: expected a jaxmem.RematPlan, got {type(plan).__name__}; make one "
            "with jaxmem.plan(loss_fn, *args, budget=...)."
        )
    with _auto.use_setting(plan.candidate.setting()):
        yield plan
