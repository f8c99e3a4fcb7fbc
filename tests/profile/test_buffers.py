"""jaxmem._src.profile.buffers: XLA's buffer assignment and live ranges, checked against known
answers and against ``compiled.memory_analysis()``."""

import os
import re
import subprocess
import sys
from itertools import pairwise

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxmem._src.jax_compat import persistent_cache_off
from jaxmem._src.profile.buffers import (
    KINDS,
    Buffer,
    BufferDumpError,
    BufferReport,
    read_buffers,
    read_dump,
)

HERE = os.path.basename(__file__)


def line_of(marker: str) -> int:
    """The line of this file that holds the comment ``# <marker>`` (after the code)."""
    with open(__file__, encoding="utf-8") as f:
        hits = [i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def at_line(buffer: Buffer, line: int) -> bool:
    """Whether a buffer's source is line ``line`` of this file."""
    return re.search(rf"(^|/){re.escape(HERE)}:{line}\b", buffer.source) is not None


def memory_analysis(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis()


# --- functions with known answers -------------------------------------------------------------


def outer_loss(w, a, b):
    big = jnp.sin(a[:, None] * b[None, :])  # BIG
    return jnp.sum(jnp.tanh(big @ w))


OUTER_ARGS = (jnp.ones((1024, 4)), jnp.linspace(0, 1, 256), jnp.linspace(0, 1, 1024))
BIG_BYTES = 256 * 1024 * 4  # big: f32[256, 1024], kept for dL/dw = big.T @ g


def rnn_loss(w, xs, h0):
    def step(h, x):
        h = jnp.tanh(h @ w + x)  # STEP
        return h, None

    h, _ = jax.lax.scan(step, h0, xs)
    return jnp.sum(h**2)


T, B, D = 64, 8, 32
RNN_ARGS = (jnp.eye(D) * 0.5, jnp.full((T, B, D), 0.1), jnp.zeros((B, D)))


@pytest.fixture(scope="module")
def outer():
    return read_buffers(jax.grad(outer_loss), *OUTER_ARGS)


@pytest.fixture(scope="module")
def rnn():
    return read_buffers(jax.grad(rnn_loss), *RNN_ARGS)


# --- the peak and where it comes from ---------------------------------------------------------


def test_largest_buffer_at_the_peak_points_at_its_line(outer):
    top = outer.peak_buffers[0]
    assert top.bytes == BIG_BYTES
    assert top.shape in ((256, 1024), (1024, 256))
    assert top.dtype == "f32"
    assert top.kind == "temp"
    assert at_line(top, line_of("BIG")), top
    assert "jvp(" in top.op_name and not top.backward
    assert [b.bytes for b in outer.peak_buffers] == sorted(
        (b.bytes for b in outer.peak_buffers), reverse=True
    )


def test_peak_buffers_add_up_to_the_peak(outer, rnn):
    for report in (outer, rnn):
        assert sum(b.bytes for b in report.peak_buffers) == report.peak_bytes
        assert report.peak_bytes == max(report.timeline) == report.timeline[report.peak_index]
        assert len(report.timeline) == len(report.program) + 1
        assert all(b.live_at(report.peak_index) for b in report.peak_buffers)
        slots = [(b.allocation, b.offset) for b in report.peak_buffers]
        assert len(slots) == len(set(slots))  # each slice once
        assert report.live_at(report.peak_index) == report.peak_buffers


def test_timeline_agrees_with_xla_packing(outer, rnn):
    # Counting a value live on [start, end] (both ends included) never puts two live values in
    # overlapping bytes of one allocation: the counting agrees with XLA's own packing.
    for report in (outer, rnn):
        for t in range(len(report.timeline)):
            live = report.live_at(t)
            assert sum(b.bytes for b in live) == report.timeline[t]
            by_allocation = {}
            for b in live:
                by_allocation.setdefault(b.allocation, []).append(b)
            for bs in by_allocation.values():
                bs.sort(key=lambda b: b.offset)
                assert all(x.offset + x.bytes <= y.offset for x, y in pairwise(bs)), (t, bs)


def test_totals_match_memory_analysis(outer, rnn):
    for report, fn, args in (
        (outer, jax.grad(outer_loss), OUTER_ARGS),
        (rnn, jax.grad(rnn_loss), RNN_ARGS),
    ):
        stats = memory_analysis(fn, *args)
        assert report.temp_allocation_bytes == stats.temp_size_in_bytes
        assert report.argument_bytes == stats.argument_size_in_bytes
        assert report.output_bytes == stats.output_size_in_bytes
        assert report.alias_bytes == stats.alias_size_in_bytes == 0
        # The peak of live bytes is what the buffers need at once. The allocations hold more:
        # slices of the temp block not live at the peak (XLA's packing: alignment,
        # fragmentation; 0 B for outer_loss, 128 B of loop tuple tables for rnn_loss), output
        # slices not yet written, and the constants. Arguments are live throughout.
        allocated = (
            stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            + stats.temp_size_in_bytes
            + report.constant_bytes
        )
        assert max(b.bytes for b in report.buffers) <= report.peak_bytes <= allocated
        live_temp = sum(b.bytes for b in report.peak_buffers if b.kind == "temp")
        assert live_temp <= stats.temp_size_in_bytes


def test_buffer_fields(outer):
    by_kind = {k: [b for b in outer.buffers if b.kind == k] for k in KINDS}
    assert {b.shape for b in by_kind["argument"]} == {(1024, 4), (256,), (1024,)}
    assert {b.op_name for b in by_kind["argument"]} == {"w", "a", "b"}
    assert sum(b.bytes for b in by_kind["argument"]) == outer.argument_bytes
    assert all(b.memory_space == 0 for b in outer.buffers)
    assert all(b.start is not None and b.start <= b.end for b in by_kind["argument"])
    assert all(b.end == len(outer.program) for b in by_kind["argument"])  # live to the end
    assert all(b.instruction in outer.program for b in outer.buffers if b.start is not None)
    assert outer.module == "jit_outer_loss"
    assert outer.jax_version == jax.__version__
    assert "BufferReport: jit_outer_loss" in str(outer)


def test_scan_gradient_loop_state_and_op_names(rnn):
    stacked = [b for b in rnn.buffers if b.shape == (T, B, D) and b.kind == "temp"]
    assert any(b.loop_state for b in stacked)
    # The residuals a scan stacks are attributed to the step's line.
    step = line_of("STEP")
    assert any(b.loop_state and at_line(b, step) for b in stacked), stacked
    # Forward (jvp) and backward (transpose) values are told apart and grouped.
    assert any("transpose(" in b.op_name or "jvp(" in b.op_name for b in rnn.peak_buffers)
    groups = rnn.by_op_name(2)
    assert sum(g.bytes for g in groups) == rnn.peak_bytes
    assert all(g.backward == ("transpose(" in g.key) for g in groups if g.key.count("/"))
    assert any(g.key.startswith("jit(rnn_loss)/jvp(") for g in groups), groups
    assert [g.bytes for g in groups] == sorted((g.bytes for g in groups), reverse=True)
    backward = [b for b in rnn.buffers if b.backward]
    assert backward and all("transpose(" in b.op_name for b in backward)
    assert any(at_line(b, step) for b in backward)
    sources = rnn.by_source()
    assert sum(g.bytes for g in sources) == rnn.peak_bytes
    assert any(g.key.endswith("(rnn_loss.<locals>.step)") for g in sources), sources


def test_by_op_name_depth(rnn):
    assert {g.key for g in rnn.by_op_name(1)} <= {"jit(rnn_loss)", "w", "xs", "h0", ""}
    with pytest.raises(ValueError, match="depth"):
        rnn.by_op_name(0)


def test_lowered_and_jitted_inputs():
    lowered = jax.jit(jax.grad(outer_loss)).lower(*OUTER_ARGS)
    report = read_buffers(lowered)
    assert isinstance(report, BufferReport)
    assert report.peak_buffers[0].bytes == BIG_BYTES
    with pytest.raises(TypeError, match="no arguments"):
        read_buffers(lowered, *OUTER_ARGS)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in OUTER_ARGS]
    assert read_buffers(jax.jit(jax.grad(outer_loss)), *structs).peak_bytes == report.peak_bytes


def test_donated_argument_is_aliased():
    f = jax.jit(lambda x, y: (jnp.sin(x) + y, jnp.sum(y)), donate_argnums=0)
    x = jnp.ones((64, 64))
    lowered = f.lower(x, x)
    report = read_buffers(lowered)
    stats = lowered.compile().memory_analysis()
    assert report.alias_bytes == stats.alias_size_in_bytes == x.nbytes
    assert report.output_bytes + report.alias_bytes == stats.output_size_in_bytes
    assert report.argument_bytes == stats.argument_size_in_bytes


def test_tuple_output_and_thread_local_values():
    def f(x):
        return jnp.sum(x, axis=0), x.T * jnp.arange(8.0)[None, :]

    x = jnp.ones((8, 8))
    report = read_buffers(f, x)
    stats = memory_analysis(f, x)
    assert report.output_bytes == stats.output_size_in_bytes  # the tuple's index table included
    assert report.temp_allocation_bytes == stats.temp_size_in_bytes
    outputs = [b for b in report.buffers if b.kind == "output" and b.dtype != "tuple"]
    assert {b.shape for b in outputs} == {(8,), (8, 8)}
    assert any(b.dtype == "tuple" and b.kind == "output" for b in report.buffers)
    # XLA:CPU gives the reduction's scalar computation thread-local buffers: no live range,
    # not in the timeline.
    thread_local = [b for b in report.buffers if b.kind == "thread-local"]
    assert all(b.start is None and not b.live_at(0) for b in thread_local)


# --- sharded programs: the buffers of one device ----------------------------------------------


def test_sharded_program_is_per_device():
    mesh = jax.make_mesh((8,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    w = jax.device_put(jnp.ones((32, 64)) * 0.1, replicated)
    x = jax.device_put(jnp.ones((256, 32)), rows)

    def loss(w, x):
        h = jnp.tanh(x @ w)  # SHARDED
        return jnp.sum(jnp.sin(h) * h)

    report = read_buffers(jax.grad(loss), w, x)
    stats = memory_analysis(jax.grad(loss), w, x)
    args = {b.op_name: b for b in report.buffers if b.kind == "argument"}
    assert args["x"].shape == (256 // 8, 32)
    assert args["w"].shape == (32, 64)
    assert report.argument_bytes == stats.argument_size_in_bytes
    assert report.temp_allocation_bytes == stats.temp_size_in_bytes
    line = line_of("SHARDED")
    # h = tanh(x @ w) is (256, 64) in the program; each device holds its 32 rows.
    assert any(at_line(b, line) and b.shape == (256 // 8, 64) for b in report.buffers)
    assert not any(b.shape and b.shape[0] == 256 for b in report.buffers)
    # dL/dw sums over the rows of every device: an all-reduce of a w-sized buffer.
    (reduced,) = [b for b in report.buffers if b.instruction.startswith("all-reduce")]
    assert reduced.bytes == 32 * 64 * 4 and reduced.backward and at_line(reduced, line)
    assert max(b.bytes for b in report.buffers) <= report.peak_bytes


# --- reading defensively ----------------------------------------------------------------------


def dump(directory, fn, *args):
    with persistent_cache_off():  # the suite's cache may hold the program (it dumps nothing)
        jax.jit(fn).lower(*args).compile(
            compiler_options={"xla_dump_to": str(directory), "xla_dump_hlo_as_text": True}
        )


def test_missing_dump_names_the_file_and_jax_version(tmp_path):
    with pytest.raises(BufferDumpError, match=r"buffer-assignment\.txt") as e:
        read_dump(str(tmp_path))
    assert f"jax {jax.__version__}" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_missing_live_range_file(tmp_path):
    dump(tmp_path, jnp.sin, jnp.ones(8))
    assert read_dump(str(tmp_path)).argument_bytes == 32
    (live,) = tmp_path.glob("*-live-range.txt")
    live.unlink()
    with pytest.raises(BufferDumpError, match=re.escape(live.name)) as e:
        read_dump(str(tmp_path))
    assert jax.__version__ in str(e.value)


def test_unknown_line_names_the_file_and_line(tmp_path):
    dump(tmp_path, jnp.sin, jnp.ones(8))
    (assignment,) = tmp_path.glob("*-buffer-assignment.txt")
    text = assignment.read_text().splitlines()
    value = next(i for i, line in enumerate(text) if line.startswith(" value:"))
    text[value] = " value: something XLA never wrote"
    assignment.write_text("\n".join(text) + "\n")
    with pytest.raises(BufferDumpError, match=rf"{re.escape(assignment.name)}, line {value + 1}"):
        read_dump(str(tmp_path))


def test_unknown_module(tmp_path):
    dump(tmp_path, jnp.sin, jnp.ones(8))
    with pytest.raises(BufferDumpError, match="jit_nope"):
        read_dump(str(tmp_path), module="jit_nope")
    assert read_dump(str(tmp_path), module="jit_sin").module == "jit_sin"


def test_metadata_sources_both_forms():
    from jaxmem._src.frames import Frame  # noqa: PLC0415
    from jaxmem._src.profile.buffers import _op_name_parts  # noqa: PLC0415
    from jaxmem._src.profile.xla_dump import _frames, _metadata  # noqa: PLC0415

    chains = {3: (Frame("/a/f.py", 7, "loss"), Frame("/a/t.py", 2, "<module>"))}
    attrs = ', index=2, metadata={op_name="jit(f)/transpose(jvp())/sin" stack_frame_id=3}'
    meta = _metadata(attrs)
    assert meta["op_name"] == "jit(f)/transpose(jvp())/sin"
    assert [str(f) for f in _frames(meta, chains)] == ["/a/f.py:7 (loss)", "/a/t.py:2 (<module>)"]
    # The older inline form: the innermost user frame's file and line, no function.
    inline = _metadata(' metadata={op_name="a/b" source_file="/a/f.py" source_line=12}')
    assert [str(f) for f in _frames(inline, {})] == ["/a/f.py:12"]
    assert _frames(_metadata(""), chains) == ()
    assert _op_name_parts("jit(f)/transpose(jvp(g/h))/while/body") == [
        "jit(f)",
        "transpose(jvp(g/h))",
        "while",
        "body",
    ]
    assert _op_name_parts("") == []


def test_stack_frames_table_reads_each_frame_with_its_callers():
    # The dump prints a StackFrames row's parent as the parent's id + 1 (1: no parent).
    from jaxmem._src.profile.xla_dump import _frame_chains  # noqa: PLC0415

    tables = {
        "FileNames": {1: '"/u/m.py"'},
        "FunctionNames": {1: '"<module>"', 2: '"f"', 3: '"g"'},
        "FileLocations": {
            1: "{file_name_id=1 function_name_id=1 line=8}",
            2: "{file_name_id=1 function_name_id=2 line=7}",
            3: "{file_name_id=1 function_name_id=3 line=5}",
        },
        "StackFrames": {
            1: "{file_location_id=1 parent_frame_id=1}",
            2: "{file_location_id=2 parent_frame_id=2}",
            3: "{file_location_id=3 parent_frame_id=3}",
        },
    }
    chains = _frame_chains(tables, "dump.txt")
    assert [str(f) for f in chains[3]] == ["/u/m.py:5 (g)", "/u/m.py:7 (f)", "/u/m.py:8 (<module>)"]
    assert [f.function for f in chains[1]] == ["<module>"]


def test_frames_of_an_inner_jit_outside_its_function_are_dropped():
    # JAX reuses an inner jit's trace, tracebacks included: frames past the jitted function's own
    # are those of whichever call traced it first.
    from jaxmem._src.frames import Frame  # noqa: PLC0415
    from jaxmem._src.profile.xla_dump import _this_trace  # noqa: PLC0415

    frames = (Frame("/u/m.py", 3, "_ln"), Frame("/u/m.py", 9, "block"), Frame("/u/m.py", 20, "a"))
    assert _this_trace(frames, "jit(loss)/while/body/mul") == frames
    assert _this_trace(frames, "jit(loss)/jit(block)/mul") == frames[:2]
    assert _this_trace(frames, "jit(loss)/jit(dynamic_index_in_dim)/dynamic_slice") == ()
    assert _this_trace(frames, "jit(loss)/transpose(jvp(jit(block)))/mul") == frames[:2]


def test_timeline_counts_shared_slices_once():
    # Two values in one (allocation, offset) slice at once count as one; another slice adds.
    def buf(name, size, alloc, offset, start, end):
        return Buffer(name, size, (size // 4,), "f32", "temp", False, name, name, "", "",
                      start, end, 0, alloc, offset)  # fmt: skip

    from jaxmem._src.profile.buffers import _holders, _timeline

    bs = (buf("a", 64, 0, 0, 0, 2), buf("a_alias", 64, 0, 0, 1, 3), buf("b", 32, 0, 64, 2, 2))
    assert _timeline(bs, 5) == (64, 64, 96, 64, 0)
    assert [b.name for b in _holders(bs, 2)] == ["a_alias", "b"]
    assert np.sum([b.bytes for b in _holders(bs, 2)]) == 96


def test_host_memory_is_counted_apart(tmp_path):
    """An offloaded value (memory space 5, ``pinned_host`` on GPU/TPU; XLA:CPU colours
    everything 0, so the dump is recoloured here) leaves the device timeline and counts in
    ``host_peak_bytes``."""

    dump(tmp_path, jax.grad(outer_loss), *OUTER_ARGS)
    device = read_dump(str(tmp_path))
    (assignment,) = tmp_path.glob("*-buffer-assignment.txt")
    big = device.peak_buffers[0]
    assert big.bytes == BIG_BYTES
    text = assignment.read_text()
    tag = re.search(rf"<(\d+) {re.escape(big.name.split('{')[0])}(\{{[\d,]*\}})? @0>", text)
    assignment.write_text(text.replace(tag.group(0), tag.group(0).replace("@0>", "@5>")))
    split = read_dump(str(tmp_path))
    (moved,) = [b for b in split.buffers if b.name == big.name]
    assert moved.memory_space == 5
    assert split.host_peak_bytes == big.bytes
    assert moved not in split.peak_buffers
    assert split.peak_bytes <= device.peak_bytes


def test_reads_buffers_of_a_program_the_persistent_compilation_cache_holds(tmp_path):
    """With JAX's persistent cache on, a program compiled before is compiled again to dump its
    buffers (a cache hit dumps nothing), and the dump compile leaves the cache as it was. The
    process runs with MaxText's dump filter in ``XLA_FLAGS`` (only ``jit_train_step`` dumped),
    which the read overrides."""
    code = """
import os, sys, tempfile
import jax, jax.numpy as jnp
from jaxmem._src.profile.buffers import BufferDumpError, read_buffers, read_dump

cache = sys.argv[1]
f = jax.jit(lambda x: jnp.sin(x) * 2)
x = jnp.ones(4096)
f.lower(x).compile()
held = sorted(os.listdir(cache))
assert held, "the persistent cache holds nothing: the test would not test it"
first, second = read_buffers(f, x), read_buffers(f, x)
assert sorted(os.listdir(cache)) == held, "the dump compile wrote to the cache"
temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes
assert first.temp_allocation_bytes == second.temp_allocation_bytes == temp

def message(directory):
    try:
        read_dump(directory)
    except BufferDumpError as e:
        return str(e)
    raise AssertionError(f"read_dump({directory!r}) read something")

# An empty dump directory may be a compilation the cache served; no directory is a wrong path.
empty = tempfile.mkdtemp()
assert cache in message(empty), message(empty)
assert "cache" not in message(os.path.join(cache, "absent")), message(os.path.join(cache, "absent"))
print("peak", first.peak_bytes, second.peak_bytes)
"""
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=str(tmp_path),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_dump_hlo_module_re=jit_train_step"),
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    peaks = run.stdout.split()[1:]
    assert len(peaks) == 2 and peaks[0] == peaks[1] and int(peaks[0]) > 0, run.stdout
