"""benchmarks.frameworks: a framework that is not installed is skipped with a line saying so (the
suite's venv has none of them: ``make bench-frameworks`` makes one venv each); one that is
installed gives a stock and a jaxmem row per case, jaxmem's value and gradients equal to stock's."""

import contextlib
import io
import json

import pytest

from benchmarks import frameworks, peers


def test_status_line_names_every_framework():
    line = frameworks.status_line()
    for module, dist in frameworks.FRAMEWORKS.items():
        assert dist in line
        if not frameworks.installed()[module]:
            assert f"{dist} not installed" in line
    assert line in peers.header(peers.QUICK)


def test_absent_frameworks_add_no_peers_case():
    absent = [m for m, ok in frameworks.installed().items() if not ok]
    if len(absent) < len(frameworks.FRAMEWORKS):
        pytest.skip("a framework is installed here")
    assert frameworks.cases(quick=True) == []


def test_quick_run(tmp_path):
    out = tmp_path / "frameworks.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = frameworks.main(["--quick", "--no-time", "--json", str(out)])
    text = buf.getvalue()
    assert status == 0, text
    assert frameworks.status_line() in text
    data = json.loads(out.read_text())
    installed = [m for m, ok in frameworks.installed().items() if ok]
    assert {name.split()[0] for name in data["cases"]} == set(installed)
    for name, case in data["cases"].items():
        stock, ours = case["rows"]
        assert (stock["role"], ours["role"]) == (peers.STOCK, peers.JAXMEM), name
        assert stock["temp_bytes"] > 0 and ours["temp_bytes"] > 0, name
        assert ours["grad_rel_err"] <= 1e-5, name
        assert case["explain"]["rewritten"] >= 1, name
