"""benchmarks.chunking runs end to end at tiny shapes and prints every table."""

import json

from benchmarks import chunking


def test_quick_run_prints_every_table(tmp_path, capsys):
    out = tmp_path / "chunking.json"
    assert chunking.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for header in ("Cross-entropy N=256", "CE time", "MLP head", "GPT-2-small-shaped"):
        assert header in text, header
    res = json.loads(out.read_text())
    for row in res["cross_entropy"]["rows"]:
        assert row["autochunk"] < res["cross_entropy"]["naive"]
        # At the same chunking autochunk keeps what the hand-written loss keeps (issue 15).
        assert row["autochunk_over_lce_same_tiles"] <= 1.1
    times = res["cross_entropy_time"]
    assert all(times[k]["rel_err"] < 1e-5 for k in ("autochunk", "linear_cross_entropy"))
    assert res["mlp_head"]["autochunk_over_naive"] < 1 and res["mlp_head"]["rel_err"] < 1e-5
    gpt = res["gpt2"]
    assert gpt["temp"]["autochunk"] < gpt["temp"]["as written"]
    assert gpt["time"]["autochunk"]["rel_err"] < 1e-5
