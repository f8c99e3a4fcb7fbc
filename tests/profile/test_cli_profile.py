"""Tests of ``python -m jaxmem profile TARGET`` (src/jaxmem/_src/profile/cli.py).

The targets are in tests/profile/profile_targets.py.
"""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import pytest

import jaxmem
from jaxmem import __main__ as cli
from jaxmem._src.format import format_bytes
from jaxmem._src.profile import cli as cli_profile
from tests.profile import profile_targets

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS_FILE = pathlib.Path(__file__).resolve().parent / "profile_targets.py"
TARGETS = "tests.profile.profile_targets"  # the same file, as a module
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch):
    # The command puts the current directory (or the target file's) on sys.path.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(ROOT)


def _run(capsys, *argv):
    status = cli.main(["profile", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_help_documents_the_target_contract(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", "--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "TARGET" in printed and "(fn, args) or (fn, args, kwargs)" in printed
    assert "python -m jaxmem profile mymodel:make_step" in printed
    assert "path/to/file.py:function" in printed
    for option in ("--out", "--top", "--json", "--against", "--traceback"):
        assert option in printed
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "profile" in capsys.readouterr().out


def test_module_target_prints_the_report_and_writes_the_plots(tmp_path, capsys):
    out_dir = tmp_path / "plots"  # created by the command
    json_path = tmp_path / "report.json"
    status, out, err = _run(
        capsys, "tests.profile.profile_targets:mlp", "--out", str(out_dir), "--json", str(json_path)
    )
    assert status == 0, err
    assert "MemoryReport: _mlp_loss" in out and "Live at the peak:" in out
    assert "Top 6 of 6 buffers live at the peak:" in out
    assert "profile_targets.py:13 (_mlp_loss)" in out  # the source line of the largest
    assert "tests.profile.profile_targets:mlp: peak " in out
    for name in ("mlp_memory.png", "mlp_timeline.png"):
        path = out_dir / name
        assert path.read_bytes().startswith(PNG), name
        assert f"wrote {path}" in out
    report = json.loads(json_path.read_text())
    assert report["argument_bytes"] == (32 * 64 + 64 * 8 + 16 * 32) * 4


def test_against_prints_the_diff_of_the_two_peaks(tmp_path, capsys):
    a, b = "tests.profile.profile_targets:mlp", "tests.profile.profile_targets:mlp_remat"
    status, out, err = _run(capsys, a, "--against", b, "--out", str(tmp_path), "--html")
    assert status == 0, err
    assert f"What is live at each peak, by source: '{a}' -> '{b}'" in out
    loss = profile_targets._mlp_loss
    grads = {a: jax.grad(loss), b: jax.grad(jax.checkpoint(loss))}
    cmp = jaxmem.compare(grads, *profile_targets.mlp()[1])
    d = cmp.diff()
    table = out[out.index("What is live at each peak") :]
    for row in d.rows:  # every row, bytes as the table writes them
        assert any(row.source in line and row.status in line for line in table.splitlines()), row
    peak_line = next(
        line for line in table.splitlines() if line.strip().startswith("peak (live bytes)")
    )
    assert format_bytes(d.a_peak_bytes) in peak_line and format_bytes(d.b_peak_bytes) in peak_line
    page = tmp_path / "mlp_comparison.html"
    assert f"wrote {page}" in out and page.read_text().startswith("<!DOCTYPE html>")


def test_file_target_with_kwargs(tmp_path, capsys):
    target = f"{TARGETS_FILE}:with_kwargs"
    status, out, err = _run(capsys, target, "--out", str(tmp_path), "--top", "1")
    assert status == 0, err
    assert "MemoryReport: scaled_loss" in out and "Top 1 of " in out
    for name in ("with_kwargs_memory.png", "with_kwargs_timeline.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG), name


def test_without_a_buffer_view_the_timeline_is_left_out(tmp_path, capsys, monkeypatch):
    def profile(fn, *args, **kwargs):
        report = jaxmem.profile(fn, *args, **kwargs)
        return dataclasses.replace(report, buffers=None, buffer_error="no dump (a test)")

    monkeypatch.setattr(cli_profile, "profile", profile)
    status, out, err = _run(capsys, "tests.profile.profile_targets:mlp", "--out", str(tmp_path))
    assert status == 0, err
    assert "Live at the peak: n/a (no dump (a test))" in out
    assert "no timeline plot: no buffer-level view (no dump (a test))" in out
    assert (tmp_path / "mlp_memory.png").exists()
    assert not (tmp_path / "mlp_timeline.png").exists()


@pytest.mark.parametrize(
    "target, expected",
    [
        ("tests.profile.profile_targets", "must be MODULE:FUNCTION or FILE.py:FUNCTION"),
        ("no_such_module_xyz:make", "no module named 'no_such_module_xyz'"),
        ("tests.no_such_module:make", "no module named 'tests.no_such_module'"),
        ("tests/no_such_file.py:make", "tests/no_such_file.py: no such file"),
        (f"{TARGETS}:mpl", "has no attribute 'mpl'; callables there: mlp,"),
        (f"{TARGETS}:NOT_CALLABLE", "is a dict ({'fn': None}), not a function"),
        (f"{TARGETS}:needs_argument", "must take no arguments (it has n)"),
        (
            "tests.profile.profile_targets:raises",
            "raised ValueError: no checkpoint at /nonexistent",
        ),
        (f"{TARGETS}:returns_list", "returned fn = int (1), not callable"),
        (f"{TARGETS}:returns_none", "returned None; expected (fn, args) or"),
        (
            "tests.profile.profile_targets:returns_fn_only",
            "returned the function scaled_loss alone",
        ),
        (
            "tests.profile.profile_targets:returns_four",
            "returned a tuple of 4; expected (fn, args) or",
        ),
        (f"{TARGETS}:returns_bare_array", "args = ArrayImpl"),
        (
            "tests.profile.profile_targets:bad_argument",
            "argument args[0] is a str ('not an array')",
        ),
        (
            "tests.profile.profile_targets:fails_to_compile",
            "compile function '<lambda>': TypeError: dot",
        ),
    ],
)
def test_bad_targets_are_one_line_errors(target, expected, capsys):
    status, out, err = _run(capsys, target)
    assert status == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m jaxmem profile: error: ")
    assert expected in lines[0]
    assert out == ""


def test_traceback_option_shows_the_cause(capsys):
    status, _, err = _run(capsys, "tests.profile.profile_targets:raises", "--traceback")
    assert status == 2
    assert "Traceback (most recent call last)" in err and "in raises" in err
    assert err.strip().splitlines()[-1].startswith("python -m jaxmem profile: error: ")


def test_bad_options_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile", "tests.profile.profile_targets:mlp", "--top", "-1"])
    assert exit_info.value.code == 2
    assert "--top must be 0 or more" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["profile"])
    assert exit_info.value.code == 2
    assert "TARGET" in capsys.readouterr().err


def test_python_m_jaxmem_profile(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "jaxmem", "profile", "tests.profile.profile_targets:mlp"]
        + ["--out", str(tmp_path), "--top", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "MemoryReport: " in result.stdout
    assert (tmp_path / "mlp_memory.png").read_bytes().startswith(PNG)
