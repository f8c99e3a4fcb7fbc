"""Tests of the benchmark harness (``python -m benchmarks.run``) and its cases."""

import ast
import json
import re
import time
from pathlib import Path

import jax
import pytest

from benchmarks import cases, harness, run

# The structured saved-residual listing (what jax.ad_checkpoint.print_saved_residuals prints);
# tracing only, nothing compiled.
from jaxmem._src.listing import saved_residuals

DESIGN_CASES = (
    "rnn_ys",
    "rnn",
    "cast_weights",
    "transposed_weights",
    "prelm_block",
    "prelm_block_dots",
)


def traced_residual_bytes(name: str) -> int:
    """Total bytes of the stock loss's saved-residual listing, from shapes alone."""
    case = cases.CASES[name]
    listing = saved_residuals(case.make_loss(jax.lax.scan), *case.abstract_args())
    return sum(r.bytes for r in listing)


def test_registry_has_the_design_cases():
    assert set(DESIGN_CASES) <= set(cases.CASES)
    for name in DESIGN_CASES:
        case = cases.CASES[name]
        assert case.name == name
        assert case.description
        assert callable(case.make_loss(jax.lax.scan))


def test_registering_a_name_twice_fails():
    with pytest.raises(ValueError, match="already registered"):
        cases.case(cases._rnn_args, name="rnn_ys")(lambda scan: None)


# docs/design.md §1's stock figures (MB = 1e6 bytes there): the listing of every jax up to 0.11.1
# holds the first row, of every jax from 0.11.2 on (a residual that is a ys output stored once,
# one residual for tanh instead of two) the second (measured on 0.10.2, 0.11.1, 0.11.2 and
# 0.12.0.1). Every version pyproject allows is on one side or the other.
DESIGN_STOCK_BYTES = (
    ((0, 10, 2), {"rnn_ys": 16.8e6, "transposed_weights": 80.0e6}),
    ((0, 11, 2), {"rnn_ys": 12.6e6, "transposed_weights": 75.5e6}),
)


def design_figures(version: tuple) -> dict:
    """The stock figures for a jax version (the newest row from a version at most ``version``)."""
    rows = [figures for since, figures in DESIGN_STOCK_BYTES if version >= since]
    assert rows, f"jax {version} is older than every figure of docs/design.md §1"
    return rows[-1]


def test_design_figures_cover_every_version():
    assert design_figures((0, 10, 2)) is design_figures((0, 11, 1)) is DESIGN_STOCK_BYTES[0][1]
    assert design_figures((0, 11, 2)) is design_figures((0, 12, 0, 1)) is DESIGN_STOCK_BYTES[1][1]
    with pytest.raises(AssertionError):
        design_figures((0, 10, 1))


@pytest.mark.parametrize("name", ["rnn_ys", "transposed_weights"])
def test_stock_residual_bytes_match_design(name):
    figures = design_figures(tuple(jax.__version_info__))
    # The listing also holds the argument residuals (e.g. W of rnn_ys).
    assert traced_residual_bytes(name) == pytest.approx(figures[name], rel=0.05)


def test_losses_are_scalars_with_gradients_for_every_argument():
    case = cases.CASES["rnn"]
    args = case.make_args()
    loss = case.make_loss(jax.lax.scan)
    assert loss(*args).shape == ()
    grads = jax.grad(loss, argnums=case.argnums())(*args)
    assert len(grads) == len(args)


def test_json_has_the_figures(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert run.main(["--case", "rnn_ys", "--json", str(out)], variants={}) == 0
    data = json.loads(out.read_text())
    for key in ("jax_version", "backend", "date", "cases"):
        assert data[key]
    assert data["jax_version"] == jax.__version__
    assert list(data["cases"]) == ["rnn_ys"]
    stock = data["cases"]["rnn_ys"]["columns"]["stock"]
    assert list(data["cases"]["rnn_ys"]["columns"]) == ["stock"]
    assert stock["temp_bytes"] > 0
    assert stock["residual_bytes"] == traced_residual_bytes("rnn_ys")
    w_bytes = 256 * 256 * 4  # W is listed as an argument residual
    assert stock["residual_bytes_by_origin"]["argument"] == w_bytes
    assert stock["residual_bytes_non_argument"] == stock["residual_bytes"] - w_bytes
    printed = capsys.readouterr().out
    assert "rnn_ys" in printed and "stock" in printed and str(out) in printed


def test_variant_column_appears_with_ratios_and_times(tmp_path, capsys):
    out = tmp_path / "out.json"
    argv = ["--case", "rnn", "--time", "--repeats", "7", "--json", str(out)]
    assert run.main(argv, variants={"dummy": jax.lax.scan}) == 0
    printed = capsys.readouterr().out
    assert "dummy" in printed
    columns = json.loads(out.read_text())["cases"]["rnn"]["columns"]
    assert list(columns) == ["stock", "dummy"]
    dummy = columns["dummy"]
    assert dummy["temp_bytes"] == columns["stock"]["temp_bytes"]
    assert dummy["ratios"]["temp_bytes"] == 1.0
    assert dummy["ratios"]["residual_bytes"] == 1.0
    assert dummy["time_min_s"] > 0 and dummy["ratios"]["time_median_s"] > 0
    assert dummy["grad_rel_err"] == 0.0


def test_failing_variant_is_reported_not_fatal(capsys):
    def broken_scan(*args, **kwargs):
        raise RuntimeError("broken on purpose")

    assert run.main(["--case", "rnn"], variants={"broken": broken_scan}) == 1
    assert "broken on purpose" in capsys.readouterr().out


def test_stock_label_is_reserved():
    with pytest.raises(ValueError, match="reserved"):
        harness.run_case(cases.CASES["rnn"], {"stock": jax.lax.scan})


def test_too_few_repeats_are_rejected(capsys):
    with pytest.raises(SystemExit):
        run.main(["--case", "rnn", "--time", "--repeats", "3"], variants={})
    assert ">= 7" in capsys.readouterr().err


def test_default_variants_follow_jaxmem():
    import jaxmem

    assert ("jaxmem" in cases.variants()) == hasattr(jaxmem, "scan")


def test_one_bytes_unit_mib():
    assert harness.MIB == 2**20
    assert harness.format_mib(48 * 2**20) == "48.0 MiB"
    assert harness.format_mib(16.8e6) == "16.0 MiB"  # docs/design.md's 16.8 MB
    assert harness.format_mib(512 * 2**10) == "0.500 MiB"
    assert harness.format_mib(None) == "-"


def test_table_bytes_are_mib(capsys):
    assert run.main(["--case", "rnn"], variants={}) == 0
    printed = capsys.readouterr().out
    assert " MiB" in printed and " MB" not in printed


def test_timing_is_warm_and_interleaved():
    calls = []

    def fn(label):
        def f(x):
            calls.append(label)
            return x

        return f

    times = harness.time_interleaved({"a": fn("a"), "b": fn("b")}, 1.0, repeats=7)
    # One warm-up run each, then rounds in which each timed run follows a run of itself.
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 7
    assert list(times) == ["a", "b"]
    for t in times.values():
        assert len(t.samples_s) == 7 and t.output == 1.0
        assert t.min_s == min(t.samples_s) <= t.median_s <= max(t.samples_s)
    calls.clear()
    harness.time_interleaved({"a": fn("a"), "b": fn("b")}, 1.0, repeats=2, settle=0)
    assert calls == ["a", "b"] + ["a", "b"] * 2


def test_a_timed_run_does_not_pay_for_the_run_before_it():
    # One function leaves work behind it (a tail that the next run, of any function, waits
    # for); each timed run follows a run of itself, so the tail is charged to its maker.
    pending = [0.0]

    def wait_then_leave(seconds):
        def f(x):
            time.sleep(pending[0])
            pending[0] = seconds
            return x

        return f

    fns = {"tail": wait_then_leave(0.05), "quick": wait_then_leave(0.0)}
    times = harness.time_interleaved(fns, 1.0, repeats=3)
    assert max(times["quick"].samples_s) < 0.04 and min(times["tail"].samples_s) >= 0.05
    plain = harness.time_interleaved(fns, 1.0, repeats=3, settle=0)
    assert min(plain["quick"].samples_s) >= 0.05  # A B A B: quick would pay for tail's
    with pytest.raises(ValueError, match="settle"):
        harness.time_interleaved(fns, 1.0, settle=-1)


def test_setup_gives_each_run_its_arguments_untimed():
    calls = []

    def setup(label):
        time.sleep(0.05)  # untimed: not in the samples
        calls.append(("setup", label))
        return (len(calls),)  # this run's argument: 1, 3, 5, ...

    def fn(label):
        def f(x):
            calls.append((label, x))
            return x

        return f

    times = harness.time_interleaved({"a": fn("a"), "b": fn("b")}, setup=setup, repeats=2)
    setups, runs = calls[::2], calls[1::2]
    # Warm-up runs, then rounds of A A B B; every run right after a setup for its own label,
    # with the arguments that setup returned.
    assert [label for label, _ in runs] == ["a", "b"] + ["a", "a", "b", "b"] * 2
    assert setups == [("setup", label) for label, _ in runs]
    assert [x for _, x in runs] == list(range(1, 2 * len(runs), 2))
    assert times["a"].output == 1 and times["b"].output == 3
    assert max(t for timing in times.values() for t in timing.samples_s) < 0.04


def test_wall_seconds_times_one_call():
    result, seconds = harness.wall_seconds(lambda s: time.sleep(s) or "done", 0.02)
    assert result == "done" and 0.02 <= seconds < 1.0


def test_table_aligns_plain_and_markdown():
    rows = [["rnn", "1.0 MiB"], "a section line", ["long name", "12.0 MiB", "extra"], ["x"]]
    assert harness.table(["case", "temp", "note"], rows).splitlines() == [
        "case           temp   note",
        "---------  --------  -----",
        "rnn         1.0 MiB",
        "a section line",
        "long name  12.0 MiB  extra",
        "x",
    ]
    assert harness.table(["a", "b"], [["x", "1"]], align="lr", markdown=True).splitlines() == [
        "| a | b |",
        "|---|--:|",
        "| x | 1 |",
    ]
    assert harness.table(None, [["PASS", "a"], ["SKIPPED", "bb"]], align="ll") == (
        "PASS     a\nSKIPPED  bb"
    )
    grouped = harness.table(["case", "t", "t"], [["rnn", "1", "2"]], groups=[("", 1), ("ab", 2)])
    assert grouped.splitlines()[0] == "      -ab-"
    with pytest.raises(ValueError, match="align"):
        harness.table(["a"], [], align="c")


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

# A str joining table cells (" | ", "|", two spaces or more, "-+-"), not a list's ", ".
_CELL_JOINER = re.compile(r"\s*\|\s*|\s{2,}|-\+-")
# A format spec with a width (``:>12``, ``:<26``, ``:8.1f``, ``:34s``): a hand-aligned column.
_WIDTH_SPEC = re.compile(r"(.?[<>=^])?[+\- ]?z?#?0?[1-9]")


def _own_timing_or_tables(path: Path) -> list[str]:
    """What in a benchmark module times steps or aligns a table itself ("line: what")."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        what = None
        if isinstance(node, ast.Attribute) and node.attr == "perf_counter":
            what = "time.perf_counter"
        elif isinstance(node, ast.Name) and node.id == "perf_counter":
            what = "perf_counter"
        elif isinstance(node, ast.ImportFrom) and any(a.name == "perf_counter" for a in node.names):
            what = "imports perf_counter"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in ("ljust", "rjust", "center"):
                what = f".{f.attr}()"
            elif (
                f.attr == "join"
                and isinstance(f.value, ast.Constant)
                and isinstance(f.value.value, str)
                and _CELL_JOINER.fullmatch(f.value.value)
            ):
                what = f"{f.value.value!r}.join"
        elif isinstance(node, ast.FormattedValue) and isinstance(node.format_spec, ast.JoinedStr):
            # A nested field ({x:<{w}}) counts as a width.
            spec = "".join(
                v.value if isinstance(v, ast.Constant) else "9" for v in node.format_spec.values
            )
            if _WIDTH_SPEC.match(spec):
                what = f"format spec {spec!r}"
        if what:
            found.append((node.lineno, what))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_only_the_harness_times_steps_and_formats_tables():
    """Every benchmark times steps with ``harness.time_interleaved`` (one-shot planning times:
    ``harness.wall_seconds``) and renders its tables with ``harness.table``: only harness.py may
    read ``time.perf_counter``, join table cells or pad columns (``ljust``, ``:>12``).

    Why: a step time is only comparable with another when both were measured the same way
    (same process, warm, interleaved rounds in which each timed run follows an untimed run of
    its own, docs/design.md §3); a module's own ``perf_counter`` loop silently measures
    something else (cold runs, another function's tail). One table formatter keeps every
    benchmark's output alike, and a fix to the rendering lands once instead of in fifteen
    hand-aligned copies.
    """
    found = {
        str(path.relative_to(BENCHMARKS)): hits
        for path in sorted(BENCHMARKS.rglob("*.py"))
        if path.name != "harness.py" and (hits := _own_timing_or_tables(path))
    }
    assert not found, found


def test_the_timing_and_table_check_finds_each_kind(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import time\n"
        "from time import perf_counter\n"
        "for _ in range(3):\n"
        "    t = time.perf_counter()\n"
        "def f(rows, w, x):\n"
        '    a = " | ".join(rows)\n'
        '    b = "  ".join(rows)\n'
        '    c = "-+-".join(rows)\n'
        "    d = rows[0].ljust(w)\n"
        '    e = f"{x:>12} {x:<{w}} {x:8.1f} {x:.3f} {x:34s}"\n'
        '    return ", ".join(rows), "".join(rows), " > ".join(rows)\n'
    )
    assert _own_timing_or_tables(path) == [
        "2: imports perf_counter",
        "4: time.perf_counter",
        "6: ' | '.join",
        "7: '  '.join",
        "8: '-+-'.join",
        "9: .ljust()",
        "10: format spec '34s'",
        "10: format spec '8.1f'",
        "10: format spec '<9'",
        "10: format spec '>12'",
    ]
