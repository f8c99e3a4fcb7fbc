"""Readers of the text XLA dumps: the optimized HLO module (instructions, their metadata and source
lines, what each value comes from) and the buffer assignment with its live ranges.
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from jaxmem._src.frames import Frame, model_chain

_TESTED = "0.10.2 and 0.12.0.1"  # the versions whose dump formats the tests read


class BufferDumpError(ValueError):
    """XLA's dump of a compiled module is missing a file or holds a line this module cannot read.

    The message names the file (and line) and the JAX version, whose XLA wrote the dump.

    Examples:
        >>> from jaxmem._src.profile.buffers import read_dump  # reads a dump directory
        >>> try:
        ...     read_dump("/nonexistent")
        ... except BufferDumpError as e:
        ...     print(e)
        no XLA buffer assignment (*-buffer-assignment.txt) in /nonexistent (jax ...)
    """


def _error(what: str, path: str | None = None, lineno: int | None = None, line: str = ""):
    """A :class:`BufferDumpError` for a line or file of a dump that cannot be read."""
    where = ""
    if path is not None:
        where = f" in {os.path.basename(path)}" + (f", line {lineno}" if lineno else "")
        where += f" ({path})" if lineno is None else ""
    shown = f": {line.strip()[:200]!r}" if line else ""
    return BufferDumpError(
        f"{what}{where}{shown}: jax {jax.__version__} wrote a format jaxmem cannot read "
        f"(jaxmem reads the dumps of jax {_TESTED})"
    )


def _missing(what: str, cache_hint: bool = True) -> BufferDumpError:
    """A :class:`BufferDumpError` for a dump file that is not there (with ``cache_hint``, saying
    that the persistent compilation cache, when on, may be why)."""
    hint = ""
    cache_dir = jax.config.jax_compilation_cache_dir
    if cache_hint and cache_dir and jax.config.jax_enable_compilation_cache:
        hint = (
            f"; the persistent compilation cache ({cache_dir}) may have served the executable "
            "without compiling it, and XLA dumps only what it compiles (JAX leaves the dump "
            "options out of the cache key): disable the cache from the start of the process "
            "(JAX_ENABLE_COMPILATION_CACHE=false) to read buffers"
        )
    return BufferDumpError(f"{what} (jax {jax.__version__}){hint}")


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    computation: str
    opcode: str
    operands: tuple[str, ...]
    # For each operand, the tuple element it names (``%t#2``: newer XLA reads a tuple's element
    # without a get-tuple-element), ``()`` for the whole value.
    elements: tuple[tuple[int, ...], ...]
    operand_text: str  # the text inside the operand parentheses ("0" for parameter(0))
    attrs: str  # everything after the operand list
    op_name: str
    frames: tuple[Frame, ...]  # its Python stack, innermost first
    is_root: bool

    @property
    def source(self) -> str:
        """``"file:line (function)"`` of the innermost frame, ``""`` if none."""
        return str(self.frames[0]) if self.frames else ""

    @property
    def model_chain(self) -> tuple[Frame, ...]:
        """Its stack's model frames: the innermost one out to the user's file (of the frames that
        belong to this trace: :func:`_this_trace`)."""
        return model_chain(_this_trace(self.frames, self.op_name))


@dataclasses.dataclass(frozen=True)
class _Module:
    instrs: dict[str, _Instr]
    roots: dict[str, str]  # computation -> root instruction
    callers: dict[str, str]  # called computation -> calling instruction (fusion/while/call)
    entry: str  # the entry computation
    users: dict[str, tuple[str, ...]]  # instruction -> the instructions reading it, in order


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")


_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.*)$")


_TABLE_ROW = re.compile(r"^(\d+) (.*)$")


_KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s,}]+)')


_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply|branch_computations)=(\{[^}]*\}|[^,\s]+)")


def _matching(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _unquote(v: str) -> str:
    if len(v) >= 2 and v[0] == v[-1] == '"':
        return re.sub(r"\\(.)", r"\1", v[1:-1])
    return v


def _metadata(attrs: str) -> dict[str, str]:
    i = attrs.find("metadata={")
    if i < 0:
        return {}
    body = attrs[i + len("metadata={") :]
    out = {}
    pos = 0
    while True:
        m = _KV.match(body, pos)
        if m is None:
            break
        out[m.group(1)] = _unquote(m.group(2))
        pos = m.end()
        while pos < len(body) and body[pos] == " ":
            pos += 1
        if pos >= len(body) or body[pos] == "}":
            break
    return out


def _read_tables(lines: list[str], path: str) -> dict[str, dict[int, str]]:
    tables: dict[str, dict[int, str]] = {}
    current = None
    for lineno, line in enumerate(lines, 1):
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        if current is None:
            continue
        if not line.strip():
            current = None
            continue
        m = _TABLE_ROW.match(line)
        if m is None:
            raise _error("unknown row in a stack-frame table", path, lineno, line)
        current[int(m.group(1))] = m.group(2)
    return tables


def _frame_chains(tables: dict[str, dict[int, str]], path: str) -> dict[int, tuple[Frame, ...]]:
    """``stack_frame_id -> frames``, the frame itself first, then its callers out.

    The dump prints each ``StackFrames`` row's parent as the parent's id plus one (0 + 1 for a
    frame without a parent: the outermost one JAX kept, ``jax_traceback_in_locations_limit``
    frames in), the same on the XLA of jax 0.10.2 and 0.12.
    """
    files = {k: _unquote(v) for k, v in tables.get("FileNames", {}).items()}
    functions = {k: _unquote(v) for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        kv = dict(_KV.findall(v))
        try:
            fn = functions.get(int(kv.get("function_name_id", 0)), "")
            locations[k] = Frame(files[int(kv["file_name_id"])], int(kv["line"]), fn)
        except (KeyError, ValueError) as e:
            raise _error(f"unknown FileLocations row {k}", path, None, v) from e
    rows = {}
    for k, v in tables.get("StackFrames", {}).items():
        kv = dict(_KV.findall(v))
        try:
            rows[k] = (
                locations[int(kv["file_location_id"])],
                int(kv.get("parent_frame_id", 1)) - 1,
            )
        except (KeyError, ValueError) as e:
            raise _error(f"unknown StackFrames row {k}", path, None, v) from e
    chains: dict[int, tuple[Frame, ...]] = {}
    for k in rows:
        chain, frame = [], k
        while frame in rows and len(chain) < len(rows):
            location, parent = rows[frame]
            chain.append(location)
            frame = parent if parent != frame else 0
        chains[k] = tuple(chain)
    return chains


def _frames(meta: dict[str, str], chains: dict[int, tuple[Frame, ...]]) -> tuple[Frame, ...]:
    """The stack of an instruction's metadata, innermost frame first."""
    if "stack_frame_id" in meta:
        return chains.get(int(meta["stack_frame_id"]), ())
    if "source_file" in meta:  # older XLA: the innermost user frame, inline
        line = meta.get("source_line", "")
        return (Frame(meta["source_file"], int(line) if line.isdigit() else 0, ""),)
    return ()


def _skip_shape(rest: str) -> str:
    """The text of an instruction after its shape: a tuple ``(...)`` or one token."""
    if rest.startswith("("):
        end = _matching(rest, 0)
        return rest[end + 1 :].lstrip() if end >= 0 else ""
    return rest.split(" ", 1)[1] if " " in rest else ""


def _read_instr(
    line: str, computation: str, chains: dict[int, tuple[Frame, ...]], where: tuple[str, int]
) -> _Instr:
    """One HLO instruction line of ``computation``; ``where`` is ``(path, lineno)`` for errors."""
    m = _INSTR.match(line)
    if m is None:
        raise _error("unknown HLO instruction line", *where, line)
    is_root, name, rest = bool(m.group(1)), m.group(2), _skip_shape(m.group(3))
    om = re.match(r"([\w\-]+)\(", rest)
    if om is None:
        raise _error("unknown HLO instruction line", *where, line)
    close = _matching(rest, om.end() - 1)
    if close < 0:
        raise _error("unbalanced parentheses in an HLO instruction", *where, line)
    found = re.findall(r"%([\w.\-]+)(?:#(\d+))?", rest[om.end() : close])
    operands = tuple(name for name, _ in found)
    elements = tuple((int(e),) if e else () for _, e in found)
    attrs = rest[close + 1 :]
    meta = _metadata(attrs)
    return _Instr(
        name,
        computation,
        om.group(1),
        operands,
        elements,
        rest[om.end() : close],
        attrs,
        meta.get("op_name", ""),
        _frames(meta, chains),
        is_root,
    )


# A jit inside the compiled function: ``jit(name)`` (``pjit(name)`` on older JAX) in the op_name.
_INNER_JIT = re.compile(r"(?<![\w])p?jit\(([^()/]*)\)")


def _this_trace(frames: tuple[Frame, ...], op_name: str) -> tuple[Frame, ...]:
    """The frames of an instruction's stack that this trace of the function recorded.

    JAX traces a jitted function once per signature and reuses its jaxpr, tracebacks included:
    the frames of an instruction inside an inner ``jit(name)`` (``lax.dynamic_index_in_dim``,
    a user's jitted block) that lie outside ``name`` are those of the call that traced it
    first, maybe another model's. Kept: the frames up to ``name``'s own; none where no frame
    is ``name``'s (a library's jitted helper, whose own frames JAX filtered out).
    """
    names = _INNER_JIT.findall(op_name)[1:]  # the first is the compiled function itself
    if not names:
        return frames
    inner = names[-1]
    for i, frame in enumerate(frames):
        if frame.function.rsplit(".", 1)[-1] == inner:
            return frames[: i + 1]
    return ()


def _called(attrs: str) -> list[str]:
    """The computations an instruction calls (fusion, loop body and condition, call, ...)."""
    return [
        c.strip().lstrip("%")
        for called in _CALLS.findall(attrs)
        for c in called.strip("{}").split(",")
    ]


def _read_module(path: str) -> _Module:
    """The HLO module dumped at ``path``: its instructions, roots and callers."""
    lines = _read_lines(path)
    chains = _frame_chains(_read_tables(lines, path), path)
    instrs: dict[str, _Instr] = {}
    roots: dict[str, str] = {}
    callers: dict[str, str] = {}
    users: dict[str, list[str]] = {}
    computation = entry = None
    for lineno, line in enumerate(lines, 1):
        if computation is None:
            m = _COMPUTATION.match(line)
            if m is not None:
                computation = m.group(1)
                entry = computation if line.startswith("ENTRY ") else entry
            continue
        if line.startswith("}"):
            computation = None
            continue
        if not line.strip():
            continue
        instr = _read_instr(line, computation, chains, (path, lineno))
        instrs[instr.name] = instr
        for operand in instr.operands:
            users.setdefault(operand, []).append(instr.name)
        if instr.is_root:
            roots[computation] = instr.name
        for called in _called(instr.attrs):
            callers.setdefault(called, instr.name)
    if not instrs:
        raise _error("no HLO computation found", path)
    return _Module(instrs, roots, callers, entry or "", {k: tuple(v) for k, v in users.items()})


# Opcodes that only move or wrap data: their metadata (if any) says less than their operand's.
_PASS_THROUGH = {"tuple", "get-tuple-element", "parameter", "while", "dynamic-update-slice"}


# Where _origin goes next from the value ``index`` of ``instr``, one step per opcode it follows:
# (instruction, index), or None where the step leads nowhere.
_Next = tuple[str, tuple[int, ...]]


def _operand(instr: _Instr, i: int, index: tuple[int, ...]) -> _Next:
    """Operand ``i`` of ``instr``, element ``index`` of it (past the element the operand names)."""
    return instr.operands[i], instr.elements[i] + index


def _into_tuple(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """Element ``index[0]`` of a tuple: the operand that fills it."""
    if index and index[0] < len(instr.operands):
        return _operand(instr, index[0], index[1:])
    return None


def _out_of_tuple(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """A get-tuple-element: element ``index=`` of its operand."""
    m = re.search(r"\bindex=(\d+)", instr.attrs)
    if not instr.operands or m is None:
        return None
    return _operand(instr, 0, (int(m.group(1)), *index))


def _into_loop(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """A while loop's result: what the loop body's root writes into the slot."""
    body = re.search(r"\bbody=%?([\w.\-]+)", instr.attrs)
    if body is not None and body.group(1) in module.roots:
        return module.roots[body.group(1)], index
    return None


def _out_of_parameter(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """A parameter of a called computation: the loop state, or the fusion's or call's operand."""
    caller = module.instrs.get(module.callers.get(instr.computation, ""))
    if caller is not None and caller.opcode == "while":
        return caller.name, index  # loop state: what the body writes into the slot
    if caller is not None and caller.opcode in ("fusion", "call"):
        num = instr.operand_text.strip()
        if num.isdigit() and int(num) < len(caller.operands):
            return _operand(caller, int(num), index)
    return None


def _into_fusion(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """A fusion's result: the root of the fused computation."""
    calls = re.search(r"\bcalls=%?([\w.\-]+)", instr.attrs)
    if calls is not None and calls.group(1) in module.roots:
        return module.roots[calls.group(1)], index
    return None


def _update(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """A dynamic-update-slice: the update written into the buffer."""
    return _operand(instr, 1, index) if len(instr.operands) > 1 else None


def _copied(module: _Module, instr: _Instr, index: tuple[int, ...]) -> _Next | None:
    """A copy or bitcast (without a source location): its operand."""
    return _operand(instr, 0, index) if instr.operands else None


_ORIGIN_STEPS = {
    "tuple": _into_tuple,
    "get-tuple-element": _out_of_tuple,
    "while": _into_loop,
    "parameter": _out_of_parameter,
    "fusion": _into_fusion,
    "dynamic-update-slice": _update,
    "copy": _copied,
    "bitcast": _copied,
}


def _origin(
    module: _Module, name: str, index: tuple[int, ...], seen: frozenset = frozenset()
) -> _Instr | None:
    """The instruction whose metadata best says where the value ``name{index}`` comes from.

    Follows tuples, get-tuple-elements, loop state (to what the loop body writes into the slot),
    fusions (to their root), fusion parameters (to the fusion's operand), dynamic-update-slices
    (to the update) and copies/bitcasts without metadata, to the first instruction with a
    source location; falls back to the value's own instruction.
    """
    instr = module.instrs.get(name)
    if instr is None or (name, index) in seen or len(seen) > 256:
        return None
    seen = seen | {(name, index)}
    own = instr if instr.source or instr.op_name else None
    # A source location ends the search, but at what only moves or wraps data and at fusions,
    # whose operands or roots say more (a copy or bitcast with one is its own origin).
    if instr.source and instr.opcode not in _PASS_THROUGH | {"fusion"}:
        return instr
    step = _ORIGIN_STEPS.get(instr.opcode)
    nxt = None if step is None else step(module, instr, index)
    if nxt is not None:
        found = _origin(module, nxt[0], nxt[1], seen)
        if found is not None and (found.source or not own):
            return found
    return own


@dataclasses.dataclass(frozen=True)
class _Value:
    name: str
    instruction: str
    index: tuple[int, ...]
    phi: bool
    color: int
    size: int
    offset: int
    shape: str


@dataclasses.dataclass(frozen=True)
class _Allocation:
    index: int
    size: int
    kind: str
    color: int
    live_out: bool  # holds an output (an argument that does is donated: aliased)
    values: tuple[_Value, ...]


_ALLOCATION = re.compile(r"^allocation (\d+): (?:0x[0-9a-f]+, )?size (\d+)(.*):$")


_VALUE = re.compile(
    r"^ value: <(\d+) ([\w.\-]+)(\{[\d,]*\})?( \(phi\))?(?: @(\d+))?> "
    r"\(size=(\d+),offset=(\d+)\): (.*)$"
)


_TRAILERS = ("Total bytes used", "Used values", "BufferAssignment stats")


def _allocation_kind(flags: str) -> str:
    # XLA's preallocated temp is what is none of the others (BufferAllocation::
    # IsPreallocatedTempBuffer), marked "preallocated-temp".
    if ", parameter " in flags:
        return "argument"
    if "output shape is" in flags or "maybe-live-out" in flags:
        return "output"
    if ", constant" in flags:
        return "constant"
    if ", thread-local" in flags:
        return "thread-local"
    return "temp"


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError as e:
        raise _missing(f"could not read the XLA dump file {path}: {e}") from e


def _read_assignment(path: str) -> list[_Allocation]:
    allocations: list[_Allocation] = []
    header = None
    values: list[_Value] = []

    def close():
        if header is not None:
            allocations.append(dataclasses.replace(header, values=tuple(values)))

    for lineno, line in enumerate(_read_lines(path), 1):
        if not line.strip() or line.strip() == "BufferAssignment:":
            continue
        if line.startswith(_TRAILERS):
            break
        if line.startswith("allocation "):
            m = _ALLOCATION.match(line)
            if m is None:
                raise _error("unknown allocation line", path, lineno, line)
            close()
            flags = m.group(3)
            color = re.search(r", color (\d+)", flags)
            header = _Allocation(
                int(m.group(1)),
                int(m.group(2)),
                _allocation_kind(flags),
                int(color.group(1)) if color else 0,
                "maybe-live-out" in flags or "output shape is" in flags,
                (),
            )
            values = []
            continue
        m = _VALUE.match(line)
        if m is None or header is None:
            raise _error("unknown line", path, lineno, line)
        index = tuple(int(i) for i in (m.group(3) or "{}")[1:-1].split(",") if i)
        values.append(
            _Value(
                m.group(2) + (m.group(3) or ""),
                m.group(2),
                index,
                bool(m.group(4)),
                int(m.group(5) or header.color),
                int(m.group(6)),
                int(m.group(7)),
                m.group(8),
            )
        )
    close()
    if not allocations:
        raise _error("no allocation found", path)
    return allocations


@dataclasses.dataclass(frozen=True)
class _LiveRanges:
    program: tuple[str, ...]
    ranges: dict[str, tuple[int, int]]  # "name{index}" -> (start, end)
    peak: int | None


_SEQ_ROW = re.compile(r"^\s+(\d+):(\S+)$")


_RANGE_ROW = re.compile(r"^\s+(\S+\{[\d,]*\}):(-?\d+)-(-?\d+)$")


_SECTIONS = {"InstructionSequence:": "sequence", "BufferLiveRange:": "ranges"}


def _section(stripped: str) -> str | None:
    """The section of the live-range dump a (stripped) header line starts, or None."""
    if stripped.startswith("HloLiveRange"):
        return "head"
    return _SECTIONS.get(stripped)


def _read_sequence_row(program: list[str], line: str, path: str, lineno: int) -> None:
    """Appends the instruction of an InstructionSequence row (numbered in order) to ``program``."""
    m = _SEQ_ROW.match(line)
    if m is None or int(m.group(1)) != len(program):
        raise _error("unknown instruction-sequence line", path, lineno, line)
    program.append(m.group(2))


def _read_range_row(ranges: dict[str, tuple[int, int]], line: str, path: str, lineno: int):
    """Adds the ``(start, end)`` of a BufferLiveRange row to ``ranges``."""
    m = _RANGE_ROW.match(line)
    if m is None:
        raise _error("unknown live-range line", path, lineno, line)
    ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))


def _read_live_ranges(path: str) -> _LiveRanges:
    """The live-range dump at ``path``: instruction sequence, ranges and the peak's position."""
    program: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    peak = None
    section = None
    for lineno, line in enumerate(_read_lines(path), 1):
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("Live ranges at"):
            m = re.match(r"Live ranges at (\d+)", stripped)
            peak = int(m.group(1)) if m else None
            break  # the rest (XLA's own peak listing, a stack-trace tree) is not needed
        if (header := _section(stripped)) is not None:
            section = header
        elif section == "sequence":
            _read_sequence_row(program, line, path, lineno)
        elif section == "ranges":
            _read_range_row(ranges, line, path, lineno)
        else:
            raise _error("unknown line", path, lineno, line)
    if not program or not ranges:
        raise _error("no InstructionSequence or BufferLiveRange section", path)
    return _LiveRanges(tuple(program), ranges, peak)


_ARRAY_SHAPE = re.compile(r"^(\w+)\[([^\]]*)\]")


def _shape(text: str) -> tuple[tuple[int, ...], str]:
    if text.startswith("("):
        return (), "tuple"
    m = _ARRAY_SHAPE.match(text)
    if m is None:
        return (), text.split("{")[0]
    dims = tuple(int(re.sub(r"\D", "", d)) for d in m.group(2).split(",") if d.strip())
    return dims, m.group(1)
