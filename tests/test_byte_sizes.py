"""Budgets as users type them (``checks.byte_count``): ints, floats and strings with units, in
``jaxmem.plan``, ``jaxmem.frontier`` and ``jaxmem.optimize``; bad ones refused before anything
is traced, naming the API and the argument."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem._src import checks


@pytest.mark.parametrize(
    ("given", "want"),
    [
        (65536, 65536),
        (np.int64(65536), 65536),
        (65536.0, 65536),
        (65536.9, 65536),  # a fractional float rounds down
        (0.3 * 1000, 300),  # 300.00000000000006
        (np.float32(2.5), 2),
        (0, 0),
        (-0.0, 0),
        ("123", 123),
        ("123B", 123),
        ("123 b", 123),
        ("64MiB", 64 * 2**20),
        ("64 mib", 64 * 2**20),
        ("40MB", 40 * 10**6),
        ("40 mb", 40 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("512KiB", 512 * 2**10),
        ("2GB", 2 * 10**9),
        ("100kB", 10**5),
        ("100KB", 10**5),  # any case: KB is kB
        ("1TB", 10**12),
        ("1TiB", 2**40),
        (" 7 MiB ", 7 * 2**20),
        ("1.001kB", 1001),  # read exactly (1.001 * 1000 is 1000.99... in floats)
        (".5kB", 500),
        ("1e3", 1000),
        ("2.5e-1kB", 250),
        ("0.7B", 0),
    ],
)
def test_byte_count_forms(given, want):
    got = checks.byte_count(given, "budget", "f")
    assert got == want and type(got) is int


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (-1, "jaxmem.optimize: budget=-1 is negative; a byte size is 0 or more"),
        (-0.5, "jaxmem.optimize: budget=-0.5 is negative"),
        ("-1GB", "jaxmem.optimize: budget='-1GB' is negative"),
        (float("nan"), "jaxmem.optimize: budget=nan is not a finite byte size; use an int"),
        (float("inf"), "jaxmem.optimize: budget=inf is not a finite byte size"),
        (np.float64("-inf"), "-inf) is not a finite byte size"),
        ("40 MBs", "jaxmem.optimize: budget='40 MBs' is not a byte size; use an int, a float or"),
        ("48 apples", "budget='48 apples' is not a byte size; use"),
        ("1.5.2GB", "budget='1.5.2GB' is not a byte size"),
        ("", "budget='' is not a byte size"),
        ("MB", "budget='MB' is not a byte size"),
        ("1,000", "budget='1,000' is not a byte size"),
        ("nan", "budget='nan' is not a byte size"),
        ("1M", "budget='1M' is not a byte size ('M' alone is ambiguous: write MB or MiB)"),
        ("8 g", "budget='8 g' is not a byte size ('g' alone is ambiguous: write GB or GiB)"),
        ("5K", "'K' alone is ambiguous: write kB or KiB"),
    ],
)
def test_bad_values_raise_value_error(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        jaxmem.optimize(jnp.sin, budget=given)


def test_malformed_names_the_forms_accepted():
    with pytest.raises(ValueError) as info:
        checks.byte_count("40 MBs", "budget", "jaxmem.optimize")
    assert str(info.value) == (
        "jaxmem.optimize: budget='40 MBs' is not a byte size; use an int, a float or a string "
        "such as '64MiB' or '40MB' (units B; kB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, "
        "TiB: powers of 1024; any case; a bare K, M or G is not accepted)"
    )


@pytest.mark.parametrize("given", [True, False, [10**6], b"1MB", 1 + 2j, {"budget": 1}])
def test_other_types_raise_type_error(given):
    with pytest.raises(TypeError, match="jaxmem.optimize: budget must be a byte size, an int, "):
        jaxmem.optimize(jnp.sin, budget=given)


def _rnn_loss(w, xs):
    def step(h, x):
        a = jaxmem.name(jnp.sin(h @ w + x), "mlp_act")
        return jnp.tanh(a @ w), None

    return jaxmem.scan(step, jnp.zeros((2, 8)), xs, policy="auto")[0].sum()


RNN = (jnp.eye(8) * 0.5, jnp.ones((16, 2, 8)))


@pytest.mark.parametrize("api", ["jaxmem.plan", "jaxmem.frontier"])
@pytest.mark.parametrize("given", [-1, "12 apples", "3M", float("nan")])
def test_planner_entry_points_refuse_bad_values(api, given):
    fn = {"jaxmem.plan": jaxmem.plan, "jaxmem.frontier": jaxmem.frontier}[api]
    with pytest.raises(ValueError, match=f"^{api}: budget="):
        fn(_rnn_loss, *RNN, budget=given)
    with pytest.raises(TypeError, match=f"^{api}: budget must be a byte size"):
        fn(_rnn_loss, *RNN, budget=True)


def test_frontier_budgets_list_takes_the_same_forms():
    with pytest.raises(ValueError, match="^jaxmem.frontier: budget='1 apple' is not a byte size"):
        jaxmem.frontier(_rnn_loss, *RNN, budgets=[10**6, "1 apple"])


def _decision(p: jaxmem.RematPlan) -> jaxmem.RematPlan:
    """The plan less how it was reached (its compiles and seconds: ``known`` saves compiles)."""
    return dataclasses.replace(p, compiles=0, seconds=0.0)


def test_equal_byte_counts_in_any_spelling_give_equal_plans():
    base = jaxmem.plan(_rnn_loss, *RNN, budget=6000)
    assert base.budget == 6000
    # The same 6000 bytes as a float, a fractional float, strings with and without units.
    for same in (6000.0, 6000.75, "6000", "6000B", "6kB", "6 KB", "0.006MB", "6e3 b"):
        again = jaxmem.plan(_rnn_loss, *RNN, budget=same, known=base.trials)
        assert _decision(again) == _decision(base), same
    # A binary unit is another byte count: 6 KiB is 6144 bytes, the same plan as 6144.
    kib = jaxmem.plan(_rnn_loss, *RNN, budget="6KiB", known=base.trials)
    assert kib.budget == 6144
    assert _decision(kib) == _decision(jaxmem.plan(_rnn_loss, *RNN, budget=6144, known=base.trials))


def _train_step(w, xs):
    value, grads = jax.value_and_grad(lambda w: _lax_loss(w, xs))(w)
    return w - 1e-2 * grads, value


def _lax_loss(w, xs):
    body = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x), None))
    h, _ = jax.lax.scan(body, jnp.zeros((2, 8)), xs)
    return jnp.sum(h**2)


def test_optimize_budget_spellings_give_equal_plans():
    w, xs = RNN
    base = jaxmem.optimize(_train_step, budget=2**20)
    want = base.budget_plan(w, xs)
    assert want.budget_bytes == 2**20
    for same in (float(2**20), 2**20 + 0.5, "1MiB", "1 mib", "1024KiB", "1048576B", "1.048576MB"):
        step = jaxmem.optimize(_train_step, budget=same)
        assert step.budget_plan(w, xs) == want, same
    # A fraction of a measured figure, as users write it.
    temp = want.chosen.peak_bytes
    step = jaxmem.optimize(_train_step, budget=1.5 * temp)
    assert step.budget_plan(w, xs).budget_bytes == int(1.5 * temp)
