"""Tests of the checkpoint-name vocabulary (:mod:`jaxmem._src.remat.names`) and the model's tags."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem._src import jax_compat as jc
from jaxmem._src.remat.names import ATTENTION_CORE, NAMES, name
from jaxmem.demo import models


def test_every_name_has_a_one_line_meaning():
    assert {"decoder_layer_input", "qkv_proj", "attention_out", "out_proj"} <= set(NAMES)
    assert {"mlp_in", "mlp_act", "mlp_out", *ATTENTION_CORE} <= set(NAMES)
    for meaning in NAMES.values():
        assert meaning and "\n" not in meaning
    with pytest.raises(TypeError):
        NAMES["mine"] = "read-only"


def test_name_is_the_identity_with_a_checkpoint_name():
    x = {"a": jnp.arange(3.0), "b": jnp.ones((2,))}
    jaxpr = jax.make_jaxpr(lambda x: name(x, "mlp_act"))(x)
    assert [e.params["name"] for e in jaxpr.eqns] == ["mlp_act", "mlp_act"]
    out = name(x, "mlp_act")
    np.testing.assert_array_equal(out["a"], x["a"])


def test_a_named_value_records_the_line_that_names_it():
    def f(x):
        return jnp.sum(name(jnp.sin(x), "mlp_in"))

    (eqn,) = [e for e in jax.make_jaxpr(f)(jnp.ones(3)).eqns if e.primitive.name == "name"]
    frame = jc.user_frame(eqn.source_info)
    assert frame.file_name == __file__ and frame.function_name.endswith("<locals>.f")


def test_unknown_names_are_refused_with_the_vocabulary():
    with pytest.raises(ValueError, match="jaxmem.name: unknown checkpoint name 'mlpwi'") as info:
        name(jnp.ones(2), "mlpwi")
    assert all(n in str(info.value) for n in NAMES) and "allow_unknown=True" in str(info.value)
    jaxpr = jax.make_jaxpr(lambda x: name(x, "mine", allow_unknown=True))(jnp.ones(2))
    assert jaxpr.eqns[0].params["name"] == "mine"
    with pytest.raises(TypeError, match="name must be a str"):
        name(jnp.ones(2), 3)


def test_the_reference_block_is_tagged_with_the_vocabulary():
    block = models.Block(num_heads=2, d_ff=8)
    h = jax.ShapeDtypeStruct((1, 4, 6), jnp.float32)
    params = jax.eval_shape(block.init, jax.random.key(0), h)
    jaxpr = jax.make_jaxpr(block.apply)(params, h)
    tags = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "name"]
    assert tags == [
        "decoder_layer_input",
        "qkv_proj",
        "attention_scores",
        "attention_probs",
        "attention_out",
        "out_proj",
        "mlp_in",
        "mlp_act",
        "mlp_out",
    ]
