"""``python -m benchmarks.budget --quick``: runs, and its figures hold the budget's bars."""

import json

import jax
import pytest

import jaxmem
from benchmarks import budget

# A script's test: it runs on the newest set-up only (CI time; conftest.py).
pytestmark = pytest.mark.newest


def test_quick_run(tmp_path, capsys):
    out, png = tmp_path / "budget.json", tmp_path / "frontier.png"
    argv = ["--quick", "--sizes", "seq=16,batch=2", "--json", str(out), "--plot", str(png)]
    assert budget.main(argv) == 0
    result = json.loads(out.read_text())
    assert (result["sizes"]["seq"], result["sizes"]["batch"]) == (16, 2)
    assert set(result["policies"]) == set(budget.POLICIES)
    assert len(result["plans"]) >= 4
    for p in result["plans"]:
        assert p["peak"] <= p["budget"], p
        assert p["flops"] <= 1.01 * p["least_policy_flops"], p
        assert p["error"] <= 1e-5, p
    assert result["time"]["peak"] <= result["time"]["budget"]
    assert png.stat().st_size > 0
    assert 'objective="time"' in capsys.readouterr().out


def test_bad_sizes_are_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        budget.main(["--quick", "--sizes", "width=3"])
    assert "--sizes 'width=3'" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["nnx", "equinox"])
def test_framework_models_step_as_the_plain_one(model):
    """The NNX and Equinox steps (``--model``): each policy's step gives the default's outputs,
    and full remat's peak is below no remat's (the remat is applied)."""
    pytest.importorskip({"nnx": "flax", "equinox": "equinox"}[model])
    sizes = budget.QUICK
    args = budget.make_args(sizes, model=model)
    default = budget.compiled_figures(budget.make_step(sizes, model=model), args)
    none = budget.compiled_figures(budget.make_step(sizes, remat=False, model=model), args)
    assert default[0] < none[0] and none[1] < default[1]
    assert budget.largest_error(none[2](*args), default[2](*args)) <= 1e-5
    assert float(default[2](*args)[0]) > 1.0  # the cross-entropy of random tokens


@pytest.mark.parametrize("model", ["gpt", "nnx", "equinox"])
def test_optimize_step_is_the_step_around_optimize_loss(model):
    """``jaxmem.optimize(step)`` without a budget compiles to the temp of the same step written
    around ``jaxmem.optimize(loss)`` (1.02x + 16 KiB), outputs the step's."""
    pytest.importorskip({"gpt": "jax", "nnx": "flax", "equinox": "equinox"}[model])
    sizes = budget.QUICK
    args = budget.make_args(sizes, model=model)
    step = budget.make_step(sizes, model=model)
    temp = lambda f: jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
    ours = temp(jaxmem.optimize(step))
    lean = temp(budget.make_step(sizes, model=model, wrap=jaxmem.optimize))
    assert ours <= 1.02 * lean + 16 * 1024, (ours, lean)
    got, want = jax.jit(jaxmem.optimize(step))(*args), jax.jit(step)(*args)
    assert budget.largest_error(got, want) <= 1e-5
