"""benchmarks.losses --tiled runs end to end at tiny shapes, the tiled loss equal to naive."""

import json

import pytest

from benchmarks import losses

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_tiled_quick_run(tmp_path, capsys):
    out = tmp_path / "tiled.json"
    assert losses.main(["--tiled", "--small", "--time", "--json", str(out)]) == 0
    assert "token-tiled CE N=512" in capsys.readouterr().out
    rows = json.loads(out.read_text())["cross_entropy_tiled"]["rows"]
    assert {"naive", "jaxmem tiled (default)", "jaxmem vocab-only"} <= set(rows)
    for row in rows.values():
        assert row["max_rel_err"] < 1e-5 and row["temp"] > 0
