"""benchmarks.compress: the stack is the issue's, the copy task is learnable, and the quick run
prints every table with its figures in the JSON (structure and orderings, not the full-size
bars: those are the benchmark's own output, docs/compress.md)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import compress

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_stack_is_the_issues_transformer():
    params, x = jax.eval_shape(lambda: compress.stack_args(compress.FULL, 4))
    assert x.shape == (8, 128, 256)
    assert params["qkv"].shape == (4, 256, 768) and params["w1"].shape == (4, 256, 1024)
    assert compress.FULL.heads == 4 and compress.FULL.layers == (4, 8)


def test_copy_batches_repeat_their_first_half():
    cfg = compress.QUICK_TRAIN
    tokens = compress.copy_batch(jax.random.key(0), cfg)
    half = cfg.seq // 2
    assert tokens.shape == (cfg.batch, cfg.seq)
    np.testing.assert_array_equal(tokens[:, :half], tokens[:, half:])
    assert int(jnp.max(tokens)) < cfg.vocab


def test_rel_err_is_the_global_norm():
    ref = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([4.0])}
    got = {"a": jnp.array([3.0, 1.0]), "b": jnp.array([4.0])}
    assert compress.rel_err(got, ref) == 0.2


# The design cases include loops whose loss reads all they keep (rnn_ys): compress encodes
# nothing there, and warns option_noop, as a user's loop would.
@pytest.mark.filterwarnings("ignore:option_noop. compress=:jaxmem.LintWarning")
def test_quick_run_prints_every_table(tmp_path, capsys):
    out, png = tmp_path / "compress.json", tmp_path / "training.png"
    assert compress.main(["--quick", "--json", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    for header in ("Transformer stack", "Design cases", "Training"):
        assert header in text, header
    res = json.loads(out.read_text())
    rows = res["stack"]["rows"]
    assert list(rows) == ["none", "bf16", "fp8", "int8"]
    for label in ("bf16", "fp8", "int8"):
        r = rows[label]
        assert r["forward_identical"], label
        assert 0 < r["grad_err"] <= compress.BARS[label]["grad_err"], label
        # Fewer bytes kept and less temp than compress=None at both depths.
        for depth in ("2", "4"):
            assert r["kept"][depth] < rows["none"]["kept"][depth], label
            assert r["temp"][depth] < rows["none"]["temp"][depth], label
        assert r["median_s"] > 0
    assert rows["bf16"]["kept"]["4"] > rows["fp8"]["kept"]["4"]
    assert set(res["cases"]["rnn_ys"]) == {"none", "bf16", "fp8", "int8"}
    train = res["training"]
    assert set(train["curves"]) == {"none", "bf16", "fp8", "int8"}
    assert all(len(c) == compress.QUICK_TRAIN.steps for c in train["curves"].values())
    assert all(np.isfinite(c).all() for c in train["curves"].values())
    assert png.stat().st_size > 1000
