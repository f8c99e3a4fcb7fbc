"""Checkpoint schedules for long scans: binomial checkpointing (Griewank and Walther's Revolve).

A scan of ``T`` steps reversed with at most ``k`` stored carries ("snapshots", the initial carry
being one of them) recomputes some forward steps. Revolve's binomial schedule recomputes the
fewest: with the repetition number ``r``, the least integer with ``beta(k, r) >= T`` where
``beta(k, r) = C(k + r, k)``, it advances ``r * T - beta(k + 1, r - 1)`` steps in all (the first
forward sweep included), and tapes each step once (Griewank and Walther, "Algorithm 799: revolve",
ACM TOMS 26(1), 2000). The schedule is computed offline here, as static tables that
:func:`jaxmem.scan` runs inside two loops; nothing of it is traced.

How a schedule is read (positions are carries: carry ``j`` is the input of step ``j``): steps are
reversed from ``T - 1`` down to ``0``. Before reversing step ``i``, the carry stored in slot
``restore_slot[i]`` (carry ``restore_pos[i]``) is advanced to carry ``i``; on the way, carry ``j``
is stored in slot ``snap_slot[j]`` when ``snap_when[j] == i``. The chain of step ``T - 1`` is the
first forward sweep, from the initial carry in slot 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def beta(s: int, r: int) -> int:
    """``C(s + r, s)``: the most steps ``s`` snapshots reverse with ``r`` repetitions."""
    if r < 0:
        return 0
    return math.comb(s + r, s)


def repetitions(length: int, snapshots: int) -> int:
    """The repetition number: the least ``r`` with ``beta(snapshots, r) >= length``."""
    r = 0
    while beta(snapshots, r) < length:
        r += 1
    return r


def revolve_advances(length: int, snapshots: int) -> int:
    """The fewest forward steps (advances, the first sweep included) that reverse ``length`` steps
    with ``snapshots`` stored carries, the initial carry being one: ``r * T - beta(s + 1, r - 1)``.

    Examples:
      >>> revolve_advances(10, 1)  # 9 + 8 + ... + 0: every carry from the initial one
      45
      >>> revolve_advances(10, 10)  # every carry stored: the first sweep only
      9
    """
    if length <= 1:
        return 0
    r = repetitions(length, snapshots)
    return r * length - beta(snapshots + 1, r - 1)


def _split(length: int, snapshots: int) -> int:
    """An optimal first snapshot position (steps from the start) for ``length`` steps and
    ``snapshots >= 2``: every position in ``[lo, hi]`` attains :func:`revolve_advances`."""
    r = repetitions(length, snapshots)
    lo = max(beta(snapshots, r - 2), length - beta(snapshots - 1, r), 1)
    hi = min(beta(snapshots, r - 1), length - beta(snapshots - 1, r - 1), length - 1)
    assert lo <= hi, (length, snapshots, lo, hi)
    return hi


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
    """The static tables of a schedule (see the module docstring), numpy int32 arrays."""

    restore_slot: np.ndarray  # [T]
    restore_pos: np.ndarray  # [T]
    snap_slot: np.ndarray  # [T], -1 where carry j is never stored after the initial one
    snap_when: np.ndarray  # [T], the step whose chain stores carry j, -1 if none
    advances: int  # forward steps the chains take in all (the first sweep included)
    max_slots: int  # the most slots in use at once


def revolve(length: int, snapshots: int) -> Tables:
    """The binomial schedule reversing ``length`` steps with ``snapshots`` slots (slot 0 holds the
    initial carry). Runs in ``O(length)`` time.

    Examples:
      >>> t = revolve(6, 2)
      >>> t.advances == revolve_advances(6, 2), t.max_slots
      (True, 2)
    """
    if length < 1 or snapshots < 1:
        raise ValueError(f"revolve needs length >= 1 and snapshots >= 1, got {length}, {snapshots}")
    snapshots = min(snapshots, length)
    restore_slot = np.full(length, -1, np.int32)
    restore_pos = np.full(length, -1, np.int32)
    snap_slot = np.full(length, -1, np.int32)
    snap_when = np.full(length, -1, np.int32)
    free = list(range(snapshots - 1, 0, -1))
    in_use = 1
    max_in_use = 1
    advances = 0
    # A chain: (restore slot, restore position, snapshots taken: [(position, slot)]), begun at
    # the last restore and ended by the next reversal.
    chain = None
    # Work items: ("rev", a, b, s, slot) reverses steps [a, b) with carry a in ``slot`` and ``s``
    # slots (that one included); ("free", slot) returns a slot.
    work = [("rev", 0, length, snapshots, 0)]
    while work:
        item = work.pop()
        if item[0] == "free":
            free.append(item[1])
            in_use -= 1
            continue
        _, a, b, s, slot = item
        if s == 1 or b - a == 1:
            # No free slot (or one step): every step of [a, b) from carry a, last first; the
            # first continues the current chain, the others restore carry a.
            for i in range(b - 1, a - 1, -1):
                rslot, rpos, snaps = chain if chain is not None else (slot, a, [])
                restore_slot[i], restore_pos[i] = rslot, rpos
                advances += i - rpos
                for pos, sl in snaps:
                    if pos < i:  # A snapshot of the reversed step's own carry is never read.
                        snap_slot[pos], snap_when[pos] = sl, i
                chain = None
            continue
        if chain is None:
            chain = (slot, a, [])
        m = a + _split(b - a, s)
        new = free.pop()
        in_use += 1
        max_in_use = max(max_in_use, in_use)
        chain[2].append((m, new))
        # Right part first (popped first): [m, b) with the new slot; then free it; then [a, m).
        work.append(("rev", a, m, s, slot))
        work.append(("free", new))
        work.append(("rev", m, b, s - 1, new))
    return Tables(restore_slot, restore_pos, snap_slot, snap_when, advances, max_in_use)


def check_checkpoints(checkpoints, length: int, fname: str) -> int | None:
    """Normalises ``checkpoints`` (None, a positive int, or ``"sqrt"``) to a slot count.

    ``"sqrt"`` is ``ceil(sqrt(length))``; a count above ``length`` is clamped to ``length`` (every
    carry stored: no step recomputed twice).
    """
    if checkpoints is None:
        return None
    if isinstance(checkpoints, str):
        if checkpoints != "sqrt":
            raise ValueError(
                f"{fname} got checkpoints={checkpoints!r}; expected None, a positive int, or "
                "'sqrt'."
            )
        return max(1, math.isqrt(max(length - 1, 0)) + 1) if length > 1 else 1
    if isinstance(checkpoints, bool) or not isinstance(checkpoints, (int, np.integer)):
        raise TypeError(
            f"{fname} got checkpoints={checkpoints!r} ({type(checkpoints).__name__}); expected "
            "None, a positive int, or 'sqrt'."
        )
    if checkpoints <= 0:
        raise ValueError(
            f"{fname} got checkpoints={checkpoints}; expected None, a positive int (the most "
            "carries stored, the initial one included), or 'sqrt'."
        )
    return int(min(checkpoints, max(length, 1)))


@dataclasses.dataclass(frozen=True)
class CheckpointSchedule:
    """The binomial checkpoint schedule of a scan with ``checkpoints`` (what
    :func:`jaxmem.scan_residuals` reports as ``plan.schedule``).

    Attributes:
      length: number of steps ``T``.
      checkpoints: carries stored at most (the initial carry included), after clamping to ``T``.
      repetitions: Revolve's repetition number ``r``: no step is evaluated more than ``r + 1``
        times.
      forward_steps: step evaluations for one gradient: the forward sweep, the recomputation from
        checkpoints, and one taped evaluation per step (``T + advances``, Revolve's minimum).
      recomputed_steps: ``forward_steps - T``.
      carry_bytes: bytes of one carry.
      kept_bytes: bytes of the checkpoints (``checkpoints * carry_bytes``), what the scan keeps
        for its backward pass besides its inputs.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> plan = jaxmem.scan_residuals(lambda h, x: (jnp.tanh(h + x), None), jnp.zeros(256),
      ...                              jnp.ones((2048, 256)), checkpoints=64)
      >>> s = plan.schedule
      >>> s.checkpoints, s.repetitions, s.forward_steps, s.kept_bytes
      (64, 2, 6078, 65536)
    """

    length: int
    checkpoints: int
    repetitions: int
    forward_steps: int
    recomputed_steps: int
    carry_bytes: int
    kept_bytes: int

    def __str__(self) -> str:
        return (
            f"checkpoints: {self.checkpoints} carries of {self.carry_bytes:,d} B "
            f"({self.kept_bytes:,d} B) for {self.length} steps; {self.forward_steps} forward "
            f"steps ({self.recomputed_steps} recomputed, each step at most "
            f"{self.repetitions + 1} times)"
        )


def describe(length: int, slots: int, carry_bytes: int) -> CheckpointSchedule:
    """The public summary of the binomial schedule for ``length`` steps and ``slots``."""
    advances = revolve_advances(length, slots)
    return CheckpointSchedule(
        length=length,
        checkpoints=slots,
        repetitions=repetitions(length, slots),
        forward_steps=length + advances,
        recomputed_steps=advances,
        carry_bytes=carry_bytes,
        kept_bytes=slots * carry_bytes,
    )
