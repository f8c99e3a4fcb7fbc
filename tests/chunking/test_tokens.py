"""Token-wise regions (jaxmem._src.chunking.tokens): which equations of a jaxpr form a region,
what it reads and returns, and that running it in chunks of tokens (a recomputing backward)
gives the values and gradients of the jaxpr as written, with the region's intermediates never
whole in the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking import tokens as _tokens
from tests.helpers import assert_trees_close

S, D, F = 64, 8, 32


def _mlp(x, w1, w2):
    h = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + jnp.tanh(h @ w1) @ w2


def _args():
    keys = jax.random.split(jax.random.key(0), 3)
    return (
        jax.random.normal(keys[0], (2, S, D)),
        jax.random.normal(keys[1], (D, F)) * 0.3,
        jax.random.normal(keys[2], (F, D)) * 0.3,
    )


def _regions(f, args, lengths=(S,), min_bytes=0):
    closed = jax.make_jaxpr(f)(*args)
    jaxpr = _jc.open_jaxpr(closed)
    return closed, jaxpr, _tokens.find_regions(jaxpr, lengths, min_bytes)


def _run(closed, jaxpr, regions, chunk_bytes):
    def f(*args):
        consts = _jc.jaxpr_consts(closed)
        apply = lambda eqn, invals: _jc.bind_eqn(eqn, invals)
        run = lambda r, invals: _tokens.run_region(jaxpr, r, invals, chunk_bytes, "tokens")
        return _tokens.evaluate(jaxpr, consts, args, regions, apply, run)[0]

    return f


def test_an_mlp_block_is_one_region_split_along_the_tokens():
    closed, jaxpr, regions = _regions(_mlp, _args())
    (region,) = regions
    assert region.rows == S
    assert len(region.eqns) == len(jaxpr.eqns)  # every equation maps each token on its own
    assert [(v, k) for v, k in region.split] == [(jaxpr.invars[0], 1)]
    assert list(region.params) == jaxpr.invars[1:]
    assert [k for _, k in region.outputs] == [1]
    assert region.largest == 2 * S * F * 4  # the [2, S, F] hidden


def test_chunked_values_and_gradients_equal_the_jaxpr_as_written():
    args = _args()
    closed, jaxpr, regions = _regions(_mlp, args)
    chunk_bytes = regions[0].row_bytes * 16  # 16 tokens a chunk: 4 chunks
    assert regions[0].chunk_rows(chunk_bytes) == 16
    f = _run(closed, jaxpr, regions, chunk_bytes)
    loss = lambda g: lambda *a: jnp.sum(jnp.sin(g(*a)))
    assert_trees_close(f(*args), _mlp(*args), rtol=1e-6)
    assert_trees_close(
        jax.grad(loss(f), (0, 1, 2))(*args), jax.grad(loss(_mlp), (0, 1, 2))(*args), rtol=1e-5
    )
    # No [2, S, F] hidden in the chunked program's gradient: the chunks' are [2, 16, F].
    text = str(jax.make_jaxpr(jax.grad(loss(f), (0, 1, 2)))(*args))
    assert f"f32[2,{S},{F}]" not in text and f"f32[2,16,{F}]" in text


def test_chunks_that_do_not_divide_the_tokens():
    args = _args()
    closed, jaxpr, regions = _regions(_mlp, args)
    f = _run(closed, jaxpr, regions, regions[0].row_bytes * 24)  # 16 a chunk: 64 = 4 x 16
    g = _run(closed, jaxpr, regions, regions[0].row_bytes * 40)  # 32 a chunk, then 32 more
    h = _run(closed, jaxpr, regions, regions[0].row_bytes * 48)  # 32; 64 = 2 x 32
    want = jax.grad(lambda *a: jnp.sum(_mlp(*a) ** 2))(*args)
    for run in (f, g, h):
        got = jax.grad(lambda *a, run=run: jnp.sum(run(*a) ** 2))(*args)
        assert_trees_close(got, want, rtol=1e-5)
    odd = (jnp.ones((1, 50, D)), *args[1:])
    closed, jaxpr, regions = _regions(_mlp, odd, lengths=(50,))
    f = _run(closed, jaxpr, regions, regions[0].row_bytes * 16)  # 16, 16, 16, then 2
    assert_trees_close(f(*odd), _mlp(*odd), rtol=1e-6)


def test_token_mixing_splits_regions():
    """A cumulative sum over the tokens mixes them: the equations before and after it are two
    regions, it is neither's."""

    def f(x, w1, w2):
        a = jnp.tanh(x @ w1) @ w2
        b = jnp.cumsum(a, axis=1)
        return jnp.tanh(b @ w1) @ w2

    args = _args()
    closed, jaxpr, regions = _regions(f, args)
    assert len(regions) == 2
    cumsum = next(i for i, e in enumerate(jaxpr.eqns) if "cumsum" in str(e))
    assert all(cumsum not in r.eqns for r in regions)
    got = jax.grad(lambda *a: jnp.sum(_run(closed, jaxpr, regions, 1024)(*a) ** 2))(*args)
    assert_trees_close(got, jax.grad(lambda *a: jnp.sum(f(*a) ** 2))(*args), rtol=1e-5)


def test_no_lengths_no_regions_and_small_regions_left_alone():
    args = _args()
    assert _regions(_mlp, args, lengths=())[2] == []
    assert _regions(_mlp, args, lengths=(S + 1,))[2] == []  # no axis of that length
    assert _regions(_mlp, args, min_bytes=10**9)[2] == []


def test_a_region_that_would_need_its_own_output_is_refused():
    """x -> a (row-wise) -> s = a.sum over tokens (mixing) -> (a * s) @ w2 (row-wise): one
    region of both would need s, computed from a, before it runs; they run apart."""

    def f(x, w1, w2):
        a = jnp.tanh(x @ w1) @ w2 @ w1
        s = jnp.sum(a, axis=1, keepdims=True)
        return jnp.tanh(a * s) @ w2

    args = _args()
    closed, jaxpr, regions = _regions(f, args)
    reduce = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "reduce_sum")
    before = {i for i in range(reduce)}
    for r in regions:  # each region lies on one side of the sum
        assert set(r.eqns) <= before or not set(r.eqns) & before
    assert len(regions) == 2
    assert_trees_close(_run(closed, jaxpr, regions, 1024)(*args), f(*args), rtol=1e-6)
