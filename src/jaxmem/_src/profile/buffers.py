"""What is live at the peak: XLA's own buffer assignment and live ranges, read back as data.

:func:`read_buffers` compiles a function with XLA's dump options into a temporary directory and
reads three of the files XLA writes for the compiled module (then deletes the directory):

- ``*after_optimizations.txt``: the optimized HLO. Each instruction's ``metadata`` carries the
  JAX ``op_name`` path (``jit(loss)/transpose(jvp())/...``) and a ``stack_frame_id`` into the
  ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables at the top of
  the module (older XLA: ``source_file=... source_line=...`` in the metadata itself).
- ``*-buffer-assignment.txt``: the allocations (arguments, outputs, constants, the
  preallocated temp block) and, for each, the HLO values placed in it with offset and size.
- ``*-live-range.txt``: the instruction sequence (program order, while bodies flattened in)
  and each value's live range ``start-end`` over it.

From these, :class:`BufferReport` computes live bytes at every program point, the peak, the
buffers live at the peak (largest first) and groups them by source line or ``op_name`` prefix.

Counting: a program point ``t`` is an index into :attr:`BufferReport.program`, plus one last
point ``len(program)`` for the end of the program (arguments and outputs live to it). A value is
live at ``t`` when ``start <= t <= end``. Values that share one slice of an allocation (a while
loop's phi values alias its operand and result; a ``bitcast`` aliases its operand) are one piece
of memory: each ``(allocation, offset)`` slice is counted once at a point, with the largest size
any of its live values has. Values absent from the live-range file (thread-local values of
called computations) have no range and are not counted.

This module reads text formats that XLA does not promise to keep; anything it does not
understand raises :class:`BufferDumpError` naming the file and the JAX version.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._src import jax_compat
from jaxmem._src.frames import in_a_package
from jaxmem._src.profile.attribution import attribute
from jaxmem._src.profile.xla_dump import (
    BufferDumpError,
    _Allocation,
    _error,
    _LiveRanges,
    _missing,
    _Module,
    _origin,
    _read_assignment,
    _read_live_ranges,
    _read_module,
    _shape,
)

__all__ = [
    "Buffer",
    "BufferDumpError",
    "BufferGroup",
    "BufferReport",
    "compile_with_buffers",
    "read_buffers",
    "read_dump",
]

# Kinds of a buffer, from its allocation.
KINDS = ("argument", "output", "temp", "constant", "thread-local")

# Every module this compilation makes is dumped, whatever filter XLA_FLAGS names (MaxText sets
# --xla_dump_hlo_module_re=jit_train_step, which would leave the dump empty).
_DUMP_OPTIONS = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": ".*"}


# --------------------------------------------------------------------------------------------
# Data classes


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One HLO value placed in memory by XLA's buffer assignment.

    Attributes:
        name: the HLO value, ``instruction{index}`` for an element of a tuple-shaped value
            (e.g. ``"arg_tuple.3{2}"``), the instruction name otherwise.
        bytes: bytes of the value's slice of its allocation.
        shape: array shape (``()`` for scalars and tuples).
        dtype: HLO element type, e.g. ``"f32"``, ``"bf16"``, ``"s32"``, ``"pred"``; ``"tuple"``
            for a tuple's index table.
        kind: from the allocation: ``"argument"``, ``"output"``, ``"temp"`` (the preallocated
            temp block), ``"constant"`` or ``"thread-local"``.
        loop_state: the value is a while loop's state (a phi: the loop's operand, its body's
            and condition's parameter, or the loop's result), sharing its slice with the loop's
            initial value and each iteration's new state.
        instruction: the HLO instruction that defines the value.
        origin: the instruction the value's ``op_name`` and ``source`` were read from: the
            defining one, or, for loop state, copies, bitcasts, tuples and fusions without
            metadata, the one that computes the data (for a scan's stacked output, the update
            written into it each step).
        op_name: JAX's ``op_name`` path from the metadata, ``""`` if none.
        source: ``"file:line (function)"``: the line of the model's code that made the value
            (not JAX's, jaxmem's or a framework's transform internals, see
            :mod:`jaxmem._src.frames`; inside the loop body for loop-stacked values), ``""``
            if none.
        start: first program point where the value is live, None if the live ranges omit it.
        end: last program point where the value is live, None if the live ranges omit it.
        memory_space: XLA's memory space (color) of the value: 0 default; host memory on
            GPU/TPU is 5 (``S(5)``). XLA:CPU colors everything 0.
        allocation: index of its allocation in the buffer assignment.
        offset: offset of its slice in the allocation.
        chain: the model's frames of the call stack that made the value, ``source`` first,
            then the calls that led to it (a framework's layer, then the user's files), out
            to the outermost frame JAX recorded.
        argument: the pytree path of the argument the value is (or is a slice or copy of),
            e.g. ``"params['layers']['w1']"``, ``""`` if none.

    Examples:
        >>> b = Buffer("add.1", 1024, (256,), "f32", "temp", False, "add.1", "add.1",
        ...            "jit(f)/add", "f.py:3 (f)", 2, 5, 0, 4, 0)
        >>> b.backward, b.live_at(5), b.live_at(6)
        (False, True, False)
    """

    name: str
    bytes: int
    shape: tuple[int, ...]
    dtype: str
    kind: str
    loop_state: bool
    instruction: str
    origin: str
    op_name: str
    source: str
    start: int | None
    end: int | None
    memory_space: int
    allocation: int
    offset: int
    chain: tuple[str, ...] = ()
    argument: str = ""

    @property
    def attribution(self) -> str:
        """What the bytes are attributed to: the model's line (:attr:`source`), else the
        argument's pytree path (:attr:`argument`), else ``""``.

        Examples:
            >>> Buffer("p.1", 64, (16,), "f32", "argument", False, "p.1", "p.1", "params['w']",
            ...        "", 0, 9, 0, 0, 0, argument="params['w']").attribution
            "params['w']"
        """
        return self.source or self.argument

    @property
    def backward(self) -> bool:
        """Whether the value belongs to a backward pass (its ``op_name`` has ``transpose(``)."""
        return "transpose(" in self.op_name

    def live_at(self, point: int) -> bool:
        """Whether the value is live at program point ``point``."""
        return self.start is not None and self.start <= point <= self.end


@dataclasses.dataclass(frozen=True)
class BufferGroup:
    """Buffers live at the peak that share a source line or an ``op_name`` prefix.

    Attributes:
        key: the source line (``"file:line (function)"``) or ``op_name`` prefix; ``""`` for
            buffers without one (arguments, loop counters, ...).
        bytes: their bytes together.
        count: how many buffers.
        backward: their ``op_name`` contains ``transpose(`` (JAX's backward pass).
        names: the HLO values, largest first.

    Examples:
        >>> BufferGroup("f.py:3 (f)", 2048, 2, False, ("add.1", "add.2")).bytes
        2048
    """

    key: str
    bytes: int
    count: int
    backward: bool
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class BufferReport:
    """XLA's buffer assignment of one compiled module: live bytes over time and the peak.

    All figures are per device: for a sharded program XLA compiles one SPMD program, whose
    buffers hold each device's shard.

    Attributes:
        module: the HLO module's name, e.g. ``"jit_loss"``.
        buffers: every value of the buffer assignment, in XLA's allocation order.
        program: the instruction names in program order (while bodies flattened in); program
            point ``t < len(program)`` is during ``program[t]``, ``len(program)`` the end.
        timeline: live bytes of device memory at each program point (``len(program) + 1``
            points), each ``(allocation, offset)`` slice counted once.
        peak_index: the first program point where the timeline is largest.
        peak_bytes: the timeline's largest value.
        peak_buffers: one buffer per slice live at the peak (the value holding it then: the
            latest defined), largest first; their bytes add up to ``peak_bytes``.
        argument_bytes: bytes of the argument (parameter) allocations.
        output_bytes: bytes of the output allocations that are not arguments;
            ``memory_analysis().output_size_in_bytes`` is ``output_bytes + alias_bytes``.
        alias_bytes: bytes of argument allocations that also hold an output (donated
            arguments), ``memory_analysis().alias_size_in_bytes``.
        temp_allocation_bytes: bytes of the preallocated temp allocation(s), what
            ``memory_analysis().temp_size_in_bytes`` reports.
        constant_bytes: bytes of the constant allocations.
        xla_peak_index: the program point XLA's live-range dump calls the peak, None if absent.
            XLA computes it its own way; it can differ from ``peak_index`` (an instruction's
            operands and its result are both live at its point here).
        jax_version: the JAX version that compiled the module.
        host_peak_bytes: the largest live bytes in memory spaces other than the device's
            (host memory holding offloaded values; 0 where nothing is offloaded, and on CPU,
            where host offload is the identity). ``timeline``, ``peak_*`` are device memory only.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def loss(w, xs):
        ...     h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), xs[0], xs)
        ...     return jnp.sum(h)
        >>> report = read_buffers(jax.grad(loss), jnp.eye(16), jnp.ones((8, 4, 16)))
        >>> report.peak_bytes <= (report.argument_bytes + report.output_bytes
        ...                       + report.temp_allocation_bytes + report.constant_bytes)
        True
        >>> top = report.peak_buffers[0]
        >>> top.bytes == max(b.bytes for b in report.peak_buffers)
        True
    """

    module: str
    buffers: tuple[Buffer, ...]
    program: tuple[str, ...]
    timeline: tuple[int, ...]
    peak_index: int
    peak_bytes: int
    peak_buffers: tuple[Buffer, ...]
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_allocation_bytes: int
    constant_bytes: int
    xla_peak_index: int | None
    jax_version: str
    host_peak_bytes: int = 0

    @property
    def peak_instruction(self) -> str:
        """The instruction running at the peak (``"<end>"`` if the peak is the program's end)."""
        return self.program[self.peak_index] if self.peak_index < len(self.program) else "<end>"

    def live_at(self, point: int) -> tuple[Buffer, ...]:
        """One buffer per slice live at program point ``point``, largest first."""
        return _holders(self.buffers, point)

    def by_source(self, fold: str = "line") -> tuple[BufferGroup, ...]:
        """Peak buffers grouped by what they are attributed to, largest group first.

        The buffers of one group make a forward and a backward group when both passes keep
        some (``backward``: their ``op_name`` has ``transpose(``), but at the ``"function"``
        and ``"file"`` folds an argument's buffers make one group (a weight's slice that the
        backward pass reads is the weight).

        Args:
            fold: ``"line"``: the model's line that made them (else the argument's pytree
                path); ``"call"``: the line in the user's own files that led there (a
                framework layer's lines fold into the user's line that calls the layer);
                ``"function"``: that line's function (a layer's lines fold together; arguments
                by their path's first two keys, ``params['layers']``); ``"file"``: that
                line's file (arguments by their first key, ``params``).

        Examples:
            >>> import jax.numpy as jnp
            >>> report = read_buffers(lambda x: jnp.sin(x) * 2, jnp.ones(64))
            >>> sum(g.bytes for g in report.by_source()) == report.peak_bytes
            True
        """
        if fold not in FOLDS:
            raise ValueError(f"by_source: fold={fold!r}; expected one of {FOLDS}")
        whole_arguments = FOLDS.index(fold) >= FOLDS.index("function")
        return _groups(
            self.peak_buffers,
            lambda b: _source_key(b, fold),
            lambda b: b.backward and not (whole_arguments and b.argument and not b.source),
        )

    def by_op_name(self, depth: int = 3) -> tuple[BufferGroup, ...]:
        """Peak buffers grouped by the first ``depth`` components of their ``op_name``.

        Components are split at ``/`` outside parentheses: ``jit(f)/transpose(jvp())/while``
        has three. Largest group first. A group is ``backward`` when its buffers' ``op_name``
        has ``transpose(``: the buffers of a prefix too short to tell (``jit(f)``) make a
        forward and a backward group.

        Examples:
            >>> import jax.numpy as jnp
            >>> report = read_buffers(lambda x: jnp.sin(x) * 2, jnp.ones(64))
            >>> sum(g.bytes for g in report.by_op_name(1)) == report.peak_bytes
            True
        """
        if depth < 1:
            raise ValueError(f"by_op_name needs depth >= 1, got {depth}")
        return _groups(self.peak_buffers, lambda b: "/".join(_op_name_parts(b.op_name)[:depth]))

    def __str__(self) -> str:
        lines = [
            f"BufferReport: {self.module} (jax {self.jax_version}), peak {self.peak_bytes:,} B "
            f"at point {self.peak_index}/{len(self.program)} ({self.peak_instruction})",
            f"  argument {self.argument_bytes:,} B, output {self.output_bytes:,} B, "
            f"temp allocation {self.temp_allocation_bytes:,} B",
        ]
        for b in self.peak_buffers[:10]:
            where = b.source or b.op_name or b.kind
            loop = " loop state" if b.loop_state else ""
            lines.append(f"  {b.bytes:>12,} B  {b.kind}{loop}  {b.name}  {where}")
        if len(self.peak_buffers) > 10:
            lines.append(f"  ... {len(self.peak_buffers) - 10} more")
        return "\n".join(lines)


# How finely BufferReport.by_source groups, finest first.
FOLDS = ("line", "call", "function", "file")


def _source_key(b: Buffer, fold: str = "line") -> str:
    """A buffer's group in :meth:`BufferReport.by_source`: what it is attributed to (the model's
    line, else the argument's pytree path), folded as ``fold`` says; anything else by kind
    (``"temp: no source"``)."""
    if b.source and fold != "line":
        user = next((c for c in b.chain if not in_a_package(c.split(":", 1)[0])), b.source)
        if fold == "call":
            return user
        file, _, rest = user.partition(":")
        function = rest.partition(" ")[2]
        return f"{file} {function}" if function and fold == "function" else file
    if b.argument and not b.source and fold in ("function", "file"):
        return _path_prefix(b.argument, 2 if fold == "function" else 1)
    return b.attribution or f"{b.kind}: no source"


def _path_prefix(path: str, keys: int) -> str:
    """The first ``keys`` components of a pytree path: ``a['b']['c'].d`` -> ``a['b']``."""
    parts = re.findall(r"\[[^\]]*\]|\.\w+|^[^\[.]+", path)
    return "".join(parts[:keys]) if parts else path


def _op_name_parts(op_name: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in op_name:
        if ch == "/" and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        depth += (ch == "(") - (ch == ")")
        cur.append(ch)
    if cur or parts:
        parts.append("".join(cur))
    return parts


def _groups(
    buffers: tuple[Buffer, ...],
    key_of: Callable[[Buffer], str],
    backward_of: Callable[[Buffer], bool] = lambda b: b.backward,
):
    groups: dict[tuple[str, bool], list[Buffer]] = {}
    for b in buffers:
        key = key_of(b)
        groups.setdefault((key, backward_of(b) or "transpose(" in key), []).append(b)
    out = [
        BufferGroup(key, sum(b.bytes for b in bs), len(bs), backward, tuple(b.name for b in bs))
        for (key, backward), bs in groups.items()
    ]
    return tuple(sorted(out, key=lambda g: (-g.bytes, g.key)))


def _holders(buffers: tuple[Buffer, ...], point: int) -> tuple[Buffer, ...]:
    held: dict[tuple[int, int], Buffer] = {}
    for b in buffers:
        if not b.live_at(point):
            continue
        slot = (b.allocation, b.offset)
        cur = held.get(slot)
        if cur is None or (b.start, b.bytes) > (cur.start, cur.bytes):
            held[slot] = b
    return tuple(sorted(held.values(), key=lambda b: (-b.bytes, b.name)))


# --------------------------------------------------------------------------------------------
# Reading the HLO module: instructions, their metadata, the stack-frame tables


# --------------------------------------------------------------------------------------------
# Reading the buffer assignment and the live ranges


# --------------------------------------------------------------------------------------------
# Putting it together


def _assignment_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(directory), "*-buffer-assignment.txt")))


def _dump_module_id(path: str) -> int:
    m = re.match(r"module_(\d+)\.", os.path.basename(path))
    return int(m.group(1)) if m else -1


def _dump_module_name(path: str) -> str:
    # module_0020.jit_loss.cpu_after_optimizations-buffer-assignment.txt -> jit_loss
    base = os.path.basename(path)
    m = re.match(r"module_\d+\.(.*?)\.[^.]*after_optimizations-buffer-assignment\.txt$", base)
    return m.group(1) if m else base


def _dump_files(directory: str, module: str | None) -> tuple[str, str, str, str]:
    """``(name, hlo, buffer assignment, live range)`` paths of the module to read."""
    assignments = _assignment_files(directory)
    if not assignments:
        # No directory at all: a wrong path, not a compilation the cache served.
        raise _missing(
            f"no XLA buffer assignment (*-buffer-assignment.txt) in {directory}",
            cache_hint=os.path.isdir(directory),
        )
    candidates = [p for p in assignments if module is None or _dump_module_name(p) == module]
    if not candidates:
        found = sorted({_dump_module_name(p) for p in assignments})
        raise _missing(f"no buffer-assignment dump of module {module!r} in {directory}: {found}")
    chosen = max(candidates, key=_dump_module_id)
    stem = chosen[: -len("-buffer-assignment.txt")]
    files = (stem + ".txt", chosen, stem + "-live-range.txt")
    for path in files:
        if not os.path.exists(path):
            raise _missing(f"missing XLA dump file {os.path.basename(path)} in {directory}")
    return (_dump_module_name(chosen), *files)


def _buffers(
    allocations: list[_Allocation], module: _Module, live: _LiveRanges
) -> tuple[Buffer, ...]:
    loop_computations = {
        c for c, caller in module.callers.items() if module.instrs[caller].opcode == "while"
    }
    out = []
    for alloc in allocations:
        for v in alloc.values:
            instr = module.instrs.get(v.instruction)
            loop_state = v.phi or (
                instr is not None
                and (
                    instr.opcode == "while"
                    or (instr.opcode == "parameter" and instr.computation in loop_computations)
                )
            )
            origin = _origin(module, v.instruction, v.index)
            where = attribute(module, v.instruction, v.index)
            key = v.name if "{" in v.name else v.name + "{}"
            start, end = live.ranges.get(key, (None, None))
            shape, dtype = _shape(v.shape)
            out.append(
                Buffer(
                    name=v.name,
                    bytes=v.size,
                    shape=shape,
                    dtype=dtype,
                    kind=alloc.kind,
                    loop_state=loop_state,
                    instruction=v.instruction,
                    origin=origin.name if origin is not None else v.instruction,
                    op_name=origin.op_name if origin is not None else "",
                    source=str(where.chain[0]) if where.chain else "",
                    start=start,
                    end=end,
                    memory_space=v.color,
                    allocation=alloc.index,
                    offset=v.offset,
                    chain=tuple(str(f) for f in where.chain),
                    argument=where.argument,
                )
            )
    return tuple(out)


def _timeline(buffers: tuple[Buffer, ...], points: int) -> tuple[int, ...]:
    """Live bytes per point: each ``(allocation, offset)`` slice once, at its largest live size."""
    by_slot: dict[tuple[int, int], list[Buffer]] = {}
    for b in buffers:
        if b.start is not None:
            by_slot.setdefault((b.allocation, b.offset), []).append(b)
    diff = np.zeros(points + 1, dtype=np.int64)  # slices whose values all have one size
    direct = np.zeros(points, dtype=np.int64)  # the others, point by point
    for bs in by_slot.values():
        ranges = sorted((max(b.start, 0), min(b.end, points - 1)) for b in bs)
        if len({b.bytes for b in bs}) == 1:
            size = bs[0].bytes
            lo, hi = ranges[0]
            for start, end in ranges[1:] + [(points + 1, points + 1)]:
                if start > hi + 1:  # a gap: close the union so far
                    diff[lo] += size
                    diff[hi + 1] -= size
                    lo, hi = start, end
                else:
                    hi = max(hi, end)
        else:
            lo, hi = ranges[0][0], max(end for _, end in ranges)
            sizes = np.zeros(hi - lo + 1, dtype=np.int64)
            for b in bs:
                span = slice(max(b.start, 0) - lo, min(b.end, points - 1) - lo + 1)
                sizes[span] = np.maximum(sizes[span], b.bytes)
            direct[lo : hi + 1] += sizes
    return tuple(int(v) for v in np.cumsum(diff)[:points] + direct)


def read_dump(directory: str, module: str | None = None) -> BufferReport:
    """Reads the buffer assignment XLA dumped into ``directory`` for one compiled module.

    Args:
        directory: an ``xla_dump_to`` directory written with ``xla_dump_hlo_as_text``.
        module: the HLO module's name (``"jit_loss"``); by default the last module compiled
            (the largest ``module_NNNN`` id) that has a buffer assignment.

    Returns:
        A :class:`BufferReport`.

    Raises:
        BufferDumpError: a file is missing or holds a line this reader does not understand.

    Examples:
        >>> import tempfile, jax, jax.numpy as jnp
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = jax.jit(jnp.sin).lower(jnp.ones(8)).compile(
        ...         compiler_options={"xla_dump_to": d, "xla_dump_hlo_as_text": True})
        ...     report = read_dump(d)
        >>> report.argument_bytes
        32
    """
    name, hlo_path, assignment_path, live_path = _dump_files(directory, module)
    hlo = _read_module(hlo_path)
    allocations = _read_assignment(assignment_path)
    live = _read_live_ranges(live_path)
    buffers = _buffers(allocations, hlo, live)
    if not any(b.start is not None for b in buffers):
        raise _error("no value of the buffer assignment has a live range", live_path)
    points = max([len(live.program) + 1] + [b.end + 1 for b in buffers if b.end is not None])
    # Device memory (space 0) and the other spaces (host memory: offloaded values) apart.
    device = tuple(b for b in buffers if b.memory_space == 0)
    host = tuple(b for b in buffers if b.memory_space != 0)
    timeline = _timeline(device, points)
    peak_bytes = max(timeline)
    peak_index = timeline.index(peak_bytes)
    host_timeline = _timeline(host, points) if host else (0,) * points

    def total(kind: str) -> int:
        return sum(a.size for a in allocations if a.kind == kind)

    return BufferReport(
        module=name,
        buffers=buffers,
        program=live.program,
        timeline=timeline,
        peak_index=peak_index,
        peak_bytes=peak_bytes,
        peak_buffers=_holders(device, peak_index),
        host_peak_bytes=max(host_timeline),
        argument_bytes=total("argument"),
        output_bytes=total("output"),
        alias_bytes=sum(a.size for a in allocations if a.kind == "argument" and a.live_out),
        temp_allocation_bytes=total("temp"),
        constant_bytes=total("constant"),
        xla_peak_index=live.peak,
        jax_version=jax.__version__,
    )


def _module_name(lowered: Any) -> str | None:
    m = re.search(r"module @([\w.\-]+)", lowered.as_text()[:2000])
    return m.group(1) if m else None


def compile_with_buffers(lowered: jax.stages.Lowered):
    """Compiles ``lowered`` once with XLA's dump options and reads its buffer assignment.

    Returns:
      ``(compiled, report)``: the ``jax.stages.Compiled`` and its :class:`BufferReport`, or the
      :class:`BufferDumpError` saying why the dump could not be read (the compiled program is
      good either way).
    """
    with tempfile.TemporaryDirectory(prefix="jaxmem-buffers-") as directory:
        with jax_compat.persistent_cache_off():  # a cached executable would dump nothing
            compiled = lowered.compile(compiler_options={"xla_dump_to": directory, **_DUMP_OPTIONS})
        # Only this compilation dumps here; prefer its module by name, else the last one.
        name = _module_name(lowered)
        if name not in {_dump_module_name(p) for p in _assignment_files(directory)}:
            name = None
        try:
            return compiled, read_dump(directory, name)
        except BufferDumpError as e:
            return compiled, e


def read_buffers(fn: Callable[..., Any] | jax.stages.Lowered, *args: Any, **kwargs: Any):
    """Compiles ``fn`` on example arguments and reads XLA's buffer assignment of it.

    ``jax.jit(fn).lower(*args, **kwargs)`` (or ``fn`` itself, when it is already a
    ``jax.stages.Lowered`` and no arguments are given) is compiled with XLA's dump options into
    a temporary directory, which is deleted after reading. Arguments may be arrays or
    ``jax.ShapeDtypeStruct`` placeholders (with shardings, for a sharded program: the report
    is then per device).

    Args:
        fn: the function (jitted or not) or a ``Lowered``.
        *args: example positional arguments.
        **kwargs: example keyword arguments.

    Returns:
        A :class:`BufferReport`: every buffer, live bytes per program point, what is live at
        the peak and where in the user's code it was made.

    Raises:
        BufferDumpError: XLA wrote no dump this module can read.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> def loss(x):
        ...     big = jnp.broadcast_to(x, (16, 64))
        ...     return jnp.sum(jnp.sin(big) @ jnp.cos(big).T)
        >>> report = read_buffers(jax.grad(loss), jnp.ones(64))
        >>> report.temp_allocation_bytes == (
        ...     jax.jit(jax.grad(loss)).lower(jnp.ones(64)).compile()
        ...     .memory_analysis().temp_size_in_bytes)
        True
    """
    if isinstance(fn, jax.stages.Lowered):
        if args or kwargs:
            raise TypeError("read_buffers(lowered) takes no arguments: they were given to lower")
        lowered = fn
    else:
        lowered = jax.jit(fn).lower(*args, **kwargs)
    _, report = compile_with_buffers(lowered)
    if isinstance(report, BufferDumpError):
        raise report
    return report
