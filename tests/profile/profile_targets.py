"""Targets of ``python -m jaxmem profile`` for test_cli_profile.py: good ones and bad ones.

A target is a function of no arguments returning ``(fn, args)`` or ``(fn, args, kwargs)``.
"""

import jax
import jax.numpy as jnp

NOT_CALLABLE = {"fn": None}


def _mlp_loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum((h @ params["w2"]) ** 2)


def mlp():
    """The gradient of a small MLP's loss, from shapes alone."""
    params = {
        "w1": jax.ShapeDtypeStruct((32, 64), jnp.float32),
        "w2": jax.ShapeDtypeStruct((64, 8), jnp.float32),
    }
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    return jax.grad(_mlp_loss), (params, x)


def mlp_remat():
    """The same gradient with the MLP's hidden layer recomputed (``jax.checkpoint``)."""
    fn, args = mlp()
    return jax.grad(jax.checkpoint(_mlp_loss)), args


def scaled_loss(x, *, scale):
    return jnp.sum(jnp.sin(x) * scale)


def with_kwargs():
    """``(fn, args, kwargs)``, with concrete arrays."""
    return scaled_loss, [jnp.ones((4, 8))], {"scale": 2.0}


def returns_list():
    return [1, 2, 3]


def returns_none():
    return None


def returns_fn_only():
    return scaled_loss


def returns_bare_array():
    return jnp.sin, jnp.ones(3)


def needs_argument(n):
    return jnp.sin, (jnp.ones(n),)


def raises():
    raise ValueError("no checkpoint at /nonexistent")


def returns_four():
    return scaled_loss, (), {}, None


def bad_argument():
    return scaled_loss, ("not an array",), {"scale": 1.0}


def fails_to_compile():
    return (lambda x: x @ x), (jnp.ones((2, 3)),)
