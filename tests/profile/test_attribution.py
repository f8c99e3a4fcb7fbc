"""Every byte live at the peak attributed to the model's code or an argument's pytree path.

On the benchmark's models (:mod:`benchmarks.attribution`: a plain-JAX transformer, a Flax NNX
stack made by ``nnx.vmap`` and run by ``nnx.scan``), as written and through ``jaxmem.optimize``,
for the loss and its gradient: the bars of ``python -m benchmarks.attribution``, and the diff of
two compiles adding up to each peak.
"""

import inspect

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from benchmarks import attribution
from jaxmem._src.frames import Frame, is_model_file, model_chain

MODELS = {"transformer": attribution.transformer, "nnx": attribution.nnx_stack}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "gradient"])
@pytest.mark.parametrize("optimized", [False, True], ids=["as-written", "optimize"])
def test_the_peak_is_attributed_to_the_model(model, optimized, grad):
    row = attribution.measure(model, optimized=optimized, grad=grad)
    assert row["attributed"] >= attribution.BAR, row
    assert row["jaxmem_bytes"] == 0, row
    if grad:  # the gradient keeps loop-stacked residuals: the body's lines made them
        assert row["stacked_bytes"] > 0 and row["in_body"] >= attribution.BAR, row
    assert row["other"] < 0.1, row
    assert not attribution.failures([row])


def test_no_byte_is_attributed_to_a_library_internal(model):
    report = jaxmem.profile(jax.grad(jaxmem.optimize(model.loss)), *model.args)
    for b in report.peak_buffers:
        for frame in filter(None, (b.source, *b.chain)):
            path = frame.rsplit(":", 1)[0]
            assert is_model_file(path), (b.name, frame)
            assert "/flax/nnx/transforms/" not in frame and "/jaxmem/" not in frame


def test_arguments_and_their_slices_are_named_by_pytree_path(model):
    # As JAX names a parameter: the loss's argument name, then the path (params['qkv'],
    # state['blocks']['up']['kernel'].value), never XLA's mangled name (params__qkv__.1).
    names = tuple(inspect.signature(model.loss).parameters)
    report = jaxmem.profile(jax.grad(model.loss), *model.args)
    argument_bytes = 0
    for b in report.peak_buffers:
        if b.kind == "argument":
            assert b.attribution == b.argument, b
            argument_bytes += b.bytes
        if b.argument:
            assert b.argument.startswith(names) and "__" not in b.argument, b
            assert b.argument == names[1] or "[" in b.argument, b
    assert argument_bytes > 0
    # Slices of the stacked weights that the loop body reads are named by the weights' path.
    assert any(b.argument and b.kind == "temp" for b in report.peak_buffers)


def test_the_diff_of_two_compiles_adds_up_to_each_peak(model):
    cmp = jaxmem.compare(
        {"stock": jax.grad(model.loss), "optimize": jax.grad(jaxmem.optimize(model.loss))},
        *model.args,
    )
    d = cmp.diff()
    for side, label in (("a_bytes", "stock"), ("b_bytes", "optimize")):
        peak = cmp.reports[label].buffers.peak_bytes
        assert sum(getattr(r, side) for r in d.rows) == peak
    assert d.a_peak_bytes > d.b_peak_bytes  # optimize keeps less
    assert {r.status for r in d.rows} <= set(jaxmem._src.profile.diff.STATUSES)
    assert set(d.added + d.freed + d.common) == set(d.rows)
    text = str(d)
    assert "stock" in text and "optimize" in text


def test_diff_needs_two_named_reports():
    cmp = jaxmem.compare({"a": jnp.sin, "b": jnp.cos, "c": jnp.tanh}, jnp.ones(8))
    with pytest.raises(ValueError, match="name b"):
        cmp.diff()
    with pytest.raises(KeyError, match="'z'"):
        cmp.diff("a", "z")
    assert cmp.diff("a", "c").b == "c"
    with pytest.raises(ValueError, match="has one"):
        jaxmem.compare({"a": jnp.sin}, jnp.ones(8)).diff()


def test_folds_group_a_layers_lines_together(model):
    b = jaxmem.profile(jax.grad(model.loss), *model.args).buffers
    folds = ("line", "call", "function", "file")
    for fold in folds:
        assert sum(g.bytes for g in b.by_source(fold)) == b.peak_bytes
    counts = [len(b.by_source(fold)) for fold in folds]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[2] > counts[3], counts
    with pytest.raises(ValueError, match="fold"):
        b.by_source("module")


def test_model_chain_keeps_the_models_frames_once():
    jax_file = jax.numpy.__file__
    user = Frame("/home/me/model.py", 3, "f")
    assert model_chain([Frame(jax_file, 1, "sin"), user, user]) == (user,)
    assert is_model_file("<doctest profiling.md[3]>") and not is_model_file("<frozen os>")
