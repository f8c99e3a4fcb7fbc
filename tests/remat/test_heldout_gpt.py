"""The held-out NNX GPT (benchmarks/models/heldout_gpt.py): names, plans keep gradients, sane
loss."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from benchmarks.models.heldout_gpt import HeldoutConfig, HeldoutGPT, make_loss  # noqa: E402

CFG = HeldoutConfig(vocab_size=64, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=64)
NO_REMAT = jaxmem.RematPlan(save=frozenset(), no_remat=True)
USED = frozenset(
    {
        "decoder_layer_input",
        "query_proj",
        "key_proj",
        "value_proj",
        "attention_scores",
        "attention_probs",
        "attention_out",
        "out_proj",
        "mlp_in",
        "mlp_act",
        "mlp_out",
    }
)


@pytest.fixture(scope="module")
def auto():
    return make_loss(CFG, "auto", batch_size=2)


def test_every_name_occurs(auto):
    loss_fn, params, tokens = auto
    jaxmem.RematPlan(save=USED).validate(loss_fn, params, tokens)
    with pytest.raises(ValueError, match="'qkv_proj' not among"):
        jaxmem.RematPlan(save=frozenset({"qkv_proj"})).validate(loss_fn, params, tokens)


PLANS = {
    "nothing": jaxmem.RematPlan(save=frozenset()),
    "middle": jaxmem.RematPlan(save=frozenset({"decoder_layer_input", "attention_out", "mlp_in"})),
    "no_remat": NO_REMAT,
}


@pytest.fixture(scope="module")
def gradients(auto):
    """The gradient under each plan, that of the model with policy=None, the loss: one compile.

    The plan is resolved while tracing, so each ``jax.grad`` traced inside its ``use_plan``
    block gets that plan's policy; one jit holding all of them keeps the test fast.
    """
    loss_fn, params, tokens = auto
    ref_loss, ref_params, _ = make_loss(CFG, None, batch_size=2)

    @jax.jit
    def all_grads(params, ref_params, tokens):
        out = {"reference": jax.grad(ref_loss)(ref_params, tokens)}
        for key, plan in PLANS.items():
            with jaxmem.use_plan(plan):
                out[key] = jax.grad(loss_fn)(params, tokens)
        with jaxmem.use_plan(NO_REMAT):
            out["loss"] = loss_fn(params, tokens)
        return out

    return all_grads(params, ref_params, tokens)


@pytest.mark.parametrize("plan", list(PLANS))
def test_plans_keep_gradients(gradients, plan):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        gradients[plan],
        gradients["reference"],
    )


def test_initial_loss_near_uniform(gradients):
    loss = float(gradients["loss"])
    assert math.isfinite(loss)
    assert abs(loss - math.log(CFG.vocab_size)) < 0.2


def test_abstract_args_compile():
    loss_fn, params, tokens = make_loss(CFG, "auto", batch_size=2, abstract=True)
    assert isinstance(tokens, jax.ShapeDtypeStruct) and tokens.shape == (2, CFG.seq_len)
    leaves = jax.tree.leaves(params)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    with jaxmem.use_plan(jaxmem.RematPlan(save=frozenset({"mlp_in"}))):
        out = jax.eval_shape(jax.grad(loss_fn), params, tokens)
    assert jax.tree.structure(out) == jax.tree.structure(params)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(d_model=33), ValueError, "d_model=33 is not divisible by num_heads=2"),
        (dict(d_model=6, num_heads=2), ValueError, "head width .* = 3 is odd"),
        (dict(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
        (dict(seq_len=1), ValueError, "seq_len must be >= 2"),
        (dict(d_ff=64.0), TypeError, "d_ff must be an int, got float"),
        (dict(dtype=jnp.int32), TypeError, "dtype must be a floating dtype"),
    ],
)
def test_bad_config(kwargs, error, match):
    base = dict(vocab_size=64, seq_len=16, num_layers=2, d_model=32, num_heads=2, d_ff=64)
    with pytest.raises(error, match=match):
        HeldoutConfig(**{**base, **kwargs})


def test_bad_arguments():
    with pytest.raises(TypeError, match="config must be a HeldoutConfig"):
        make_loss({"vocab_size": 64}, batch_size=2)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        make_loss(CFG, batch_size=0)
    model = HeldoutGPT(CFG, rngs=nnx.Rngs(0), policy=None)
    with pytest.raises(ValueError, match="seq <= seq_len=16"):
        model(jnp.zeros((1, 17), jnp.int32))
