"""Tests of selective differentiation: jaxmem._src.trainable.trainable / merge."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem._src.listing import saved_residuals
from jaxmem._src.trainable import merge, path_str, trainable

B = 4
WIDTHS = (3, 5, 6, 7, 9, 10, 2)  # 6 layers, distinct widths so residual shapes name the layer


def _mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "layers": [
            {
                "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
                "b": jnp.zeros((b,)),
            }
            for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True)
        ]
    }


def _mlp_loss(params, x):
    h = x
    for layer in params["layers"]:
        h = jnp.tanh(h @ layer["w"] + layer["b"][None, :])
    return jnp.sum(h**2)


def _loss(train, frozen, x):
    return _mlp_loss(merge(train, frozen), x)


X = jnp.linspace(-1.0, 1.0, B * WIDTHS[0]).reshape(B, WIDTHS[0])


def test_split_merge_round_trip_exact():
    params = _mlp_params()
    train, frozen = trainable(params, "layers/5/*")
    assert jax.tree.structure(merge(train, frozen)) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(merge(train, frozen)), jax.tree.leaves(params), strict=True):
        assert a is b
    assert len(jax.tree.leaves(train)) == 2 and len(jax.tree.leaves(frozen)) == 10


@pytest.mark.parametrize(
    "filt,expected",
    [
        ("layers/5/*", ["layers/5/b", "layers/5/w"]),
        ("layers/*/w", [f"layers/{i}/w" for i in range(6)]),
        ("**/b", [f"layers/{i}/b" for i in range(6)]),
        ("layers/[01]/w", ["layers/0/w", "layers/1/w"]),
        (re.compile(r"layers/(4|5)/w"), ["layers/4/w", "layers/5/w"]),
        (["layers/0/b", re.compile(r".*/3/w")], ["layers/0/b", "layers/3/w"]),
        (lambda path, leaf: leaf.ndim == 2 and path.endswith("2/w"), ["layers/2/w"]),
    ],
)
def test_filters(filt, expected):
    train, _ = trainable(_mlp_params(), filt)
    got = sorted(
        path_str(p) for p, leaf in jax.tree_util.tree_leaves_with_path(train) if leaf is not None
    )
    assert got == sorted(expected)


def test_glob_star_stays_within_one_component():
    with pytest.raises(ValueError, match="matched none"):
        trainable(_mlp_params(), "layers/*")


def test_gradients_equal_full_gradient_restricted():
    params = _mlp_params()
    train, frozen = trainable(params, ["layers/5/*", "layers/2/w"])

    @jax.jit
    def grads(params, train, frozen):
        return jax.grad(_mlp_loss)(params, X), jax.grad(_loss)(train, frozen, X)

    full, g = grads(params, train, frozen)
    expected, _ = trainable(full, ["layers/5/*", "layers/2/w"])
    assert jax.tree.structure(g) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_optax_step_updates_only_trainable():
    params = _mlp_params()
    train, frozen = trainable(params, "layers/5/*")
    opt = optax.adam(1e-2)
    state = opt.init(train)

    @jax.jit
    def step(train, frozen, state):
        g = jax.grad(_loss)(train, frozen, X)
        updates, state = opt.update(g, state, train)
        return optax.apply_updates(train, updates), state

    train2, _ = step(train, frozen, state)
    new = merge(train2, frozen)
    for i in range(5):
        assert new["layers"][i]["w"] is params["layers"][i]["w"]
    assert not np.allclose(new["layers"][5]["w"], params["layers"][5]["w"])


def _residual_shapes(f, *args):
    return [r.shape for r in saved_residuals(f, *args)]


def test_saved_residuals_exclude_frozen_layer_inputs():
    params = _mlp_params()
    train, frozen = trainable(params, "layers/5/*")
    frozen_inputs = [(B, WIDTHS[i]) for i in range(1, 5)]  # inputs of layers 1..4 (x is an arg)
    last_input = (B, WIDTHS[5])

    ours = _residual_shapes(lambda t: _loss(t, frozen, X), train)
    assert last_input in ours
    assert not any(s in ours for s in frozen_inputs), ours

    full = _residual_shapes(lambda p: _mlp_loss(p, X), params)  # the stock comparison
    assert all(s in full for s in frozen_inputs), full


def test_errors():
    params = _mlp_params()
    with pytest.raises(ValueError, match=r"matched none of the 12 leaves.*'layers/0/b'"):
        trainable(params, "blocks/*/mlp/*")
    with pytest.raises(TypeError, match="filter must be a glob string"):
        trainable(params, 3)
    with pytest.raises(TypeError, match=r"filter\[1\] must be a glob string"):
        trainable(params, ["layers/0/w", 1])
    with pytest.raises(ValueError, match="empty string"):
        trainable(params, "")
    with pytest.raises(ValueError, match="empty sequence"):
        trainable(params, [])
    with pytest.raises(TypeError, match=r"must return a bool; for path 'layers/0/b'"):
        trainable(params, lambda path, leaf: "yes")
    with pytest.raises(ValueError, match="params has no leaves"):
        trainable({}, "*")
    train, frozen = trainable(params, "layers/5/*")
    with pytest.raises(ValueError, match="same structure"):
        merge(train, {"layers": frozen["layers"][:3]})
