"""``python -m benchmarks.budget --quick``: runs, and its figures hold the budget's bars."""

import json

from benchmarks import budget


def test_quick_run(tmp_path, capsys):
    out, png = tmp_path / "budget.json", tmp_path / "frontier.png"
    assert budget.main(["--quick", "--json", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert set(result["policies"]) == set(budget.POLICIES)
    assert len(result["plans"]) >= 4
    for p in result["plans"]:
        assert p["peak"] <= p["budget"], p
        assert p["flops"] <= 1.01 * p["least_policy_flops"], p
        assert p["error"] <= 1e-5, p
    assert result["time"]["peak"] <= result["time"]["budget"]
    assert png.stat().st_size > 0
    assert 'objective="time"' in capsys.readouterr().out
