"""``python -m benchmarks.optimize --quick``: runs, and its figures are consistent."""

import json

import pytest

from benchmarks import optimize

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_quick_run(tmp_path, capsys):
    out = tmp_path / "optimize.json"
    assert optimize.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = {"stock", "explicit jaxmem.scan", "jaxmem.optimize"}
    assert set(result["temp"]) == set(result["trace_s"]) == set(result["step_s"]) == names
    temp = result["temp"]
    assert temp["jaxmem.optimize"] <= 1.02 * temp["explicit jaxmem.scan"] + 16 * 1024
    assert temp["jaxmem.optimize"] < temp["stock"]
    assert "jaxmem.optimize" in capsys.readouterr().out
