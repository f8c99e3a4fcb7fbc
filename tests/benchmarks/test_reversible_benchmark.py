"""benchmarks.reversible: the stack's four variants compute the same gradient as the direct
loop, and the quick run prints every table with the issue's memory criteria holding."""

import json

import jax
import numpy as np
import pytest

from benchmarks import reversible

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_variants_equal_the_direct_loop():
    shape, depth = reversible.QUICK, 3
    params, streams = reversible.make_params(depth, shape.d), reversible.make_streams(shape)
    want = jax.grad(reversible.direct_loss(shape.heads, depth))(params, streams)
    for name, loss in reversible.losses(shape.heads).items():
        got = jax.jit(jax.grad(loss))(params, streams)
        assert reversible._rel_err(got, want) < 1e-5, name
    assert set(params) == {"ln1", "qkv", "proj", "ln2", "fc", "out"}
    assert params["qkv"].shape == (depth, shape.d, 3 * shape.d)


def test_quick_run_prints_every_table(tmp_path, capsys):
    out = tmp_path / "reversible.json"
    assert reversible.main(["--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for header in ("Gradient temp", "Step time", "Drift"):
        assert header in text, header
    res = json.loads(out.read_text())
    rows = res["memory"]["rows"]
    assert [r["depth"] for r in rows] == [2, 6]
    deep = rows[-1]["temp"]
    assert rows[-1]["reversible_over_shallowest"] <= 1.15
    assert deep["reversible_scan"] <= deep["full remat"] < deep["lax.scan"]
    variants = res["time"]["variants"]
    assert set(variants) == {"reversible_scan", "jaxmem.scan", "full remat", "lax.scan"}
    assert all(v["rel_err"] < 1e-5 and v["median_s"] > 0 for v in variants.values())
    assert [(r["init"], r["depth"]) for r in res["drift"]["rows"]] == [("gpt2", 2), ("unit", 2)]
    drift = res["drift"]["rows"][0]
    assert drift["float32 anchor_every=None"] < 1e-5
    assert np.isfinite(drift["bfloat16 anchor_every=1"]) and drift["bfloat16 direct"] > 0
