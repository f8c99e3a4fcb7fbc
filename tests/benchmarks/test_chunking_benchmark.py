"""benchmarks.chunking runs end to end at tiny shapes and prints every table."""

import json

import pytest

from benchmarks import chunking

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_quick_run_prints_every_table(tmp_path, capsys):
    out = tmp_path / "chunking.json"
    assert chunking.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for header in ("at everyone's defaults", "Chunks of tokens only", "CE time", "MLP head"):
        assert header in text, header
    assert "GPT-2-small-shaped" in text
    res = json.loads(out.read_text())
    for row in res["cross_entropy_defaults"]:
        assert row["tiles"][1] < row["V"], row["report"]  # tiles of the vocabulary too
        assert row["autochunk"] < row["naive"] / 2
        # At the same tiles autochunk keeps what the hand-written loss keeps.
        assert row["autochunk_over_linear_cross_entropy_same_tiles"] <= 1.2
    for row in res["cross_entropy_rows"]["rows"]:
        assert row["autochunk"] < res["cross_entropy_rows"]["naive"]
        assert row["autochunk_over_lce_same_tiles"] <= 1.1
    times = res["cross_entropy_time"]["times"]
    assert all(t["rel_err"] < 1e-5 for t in times.values()), times
    assert res["mlp_head"]["autochunk_over_naive"] < 1 and res["mlp_head"]["rel_err"] < 1e-5
    gpt = res["gpt2"]
    assert gpt["temp"]["autochunk"] < gpt["temp"]["as written"]
    assert gpt["time"]["autochunk"]["rel_err"] < 1e-5
