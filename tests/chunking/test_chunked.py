"""jaxmem.chunked: values and gradients equal the unchunked loss; nothing of a chunk is kept."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem import chunked
from tests import helpers

N, D, V = 10, 8, 16
KEYS = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(KEYS[0], (N, D))
W = jax.random.normal(KEYS[1], (D, V)) * 0.3
Y = jax.random.randint(KEYS[2], (N,), 0, V)


def _ce(reduction):
    def ce(x, w, y):
        losses = optax.softmax_cross_entropy_with_integer_labels(x @ w, y)
        return losses.sum() if reduction == "sum" else losses.mean()

    return ce


def _close(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(
    "chunks", [{"chunk_size": 3}, {"chunk_size": 5}, {"num_chunks": 4}, {"chunk_size": 100}]
)
def test_cross_entropy_values_and_gradients_equal_unchunked(reduction, chunks):
    ce = _ce(reduction)
    g = chunked(ce, split=(0, 2), reduction=reduction, **chunks)
    _close(g(X, W, Y), ce(X, W, Y))
    _close(jax.jit(g)(X, W, Y), ce(X, W, Y))
    # A cotangent other than 1 scales the gradients computed in the forward pass.
    got = jax.grad(lambda x, w: 3.0 * g(x, w, Y), argnums=(0, 1))(X, W)
    _close(got, jax.grad(lambda x, w: 3.0 * ce(x, w, Y), argnums=(0, 1))(X, W))


def test_rows_along_another_axis_and_pytree_arguments():
    def f(xs, w):
        return jnp.sum(jnp.tanh(w @ xs["a"]) ** 2) + jnp.sum(xs["b"] ** 2)

    xs = {"a": X.T, "b": jnp.ones((3, N))}
    g = chunked(f, axis=1, chunk_size=4)
    _close(
        jax.value_and_grad(g, argnums=(0, 1))(xs, W.T),
        jax.value_and_grad(f, argnums=(0, 1))(xs, W.T),
    )


def test_the_logits_are_not_kept_for_the_backward_pass():
    n, d, v = 512, 16, 2048
    x, w = jnp.ones((n, d)), jnp.ones((d, v)) * 0.01
    y = jnp.zeros((n,), jnp.int32)
    ce = _ce("sum")

    def temp(fn):
        grad = jax.jit(jax.grad(fn, argnums=(0, 1)))
        return grad.lower(x, w, y).compile().memory_analysis().temp_size_in_bytes

    naive, chunk = temp(ce), temp(chunked(ce, split=(0, 2), chunk_size=64))
    logits, block = n * v * 4, 64 * v * 4  # f32 [n, v] and [chunk, v]
    # Naive keeps the logits and their softmax; with jax 0.12's own derivative rule of
    # jax.nn.logsumexp (written out on 0.10.2), the softmax alone. Chunked: about two [chunk, v]
    # blocks.
    kept = 1 if helpers.JAX_VERSION >= (0, 12) else 2
    assert naive >= kept * logits and chunk <= 2 * block + 64 * 1024, (naive, chunk)


def test_bad_input():
    ce = _ce("sum")
    with pytest.raises(ValueError, match="exactly one of chunk_size and num_chunks"):
        chunked(ce)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunked(ce, chunk_size=0)
    with pytest.raises(ValueError, match="reduction must be one of"):
        chunked(ce, chunk_size=2, reduction="none")
    with pytest.raises(ValueError, match="differ along axis 0"):
        chunked(ce, chunk_size=2, split=(0, 2))(X, W, Y[:5])
    with pytest.raises(TypeError, match="split must be an int or a tuple of ints"):
        chunked(ce, chunk_size=2, split="x")
