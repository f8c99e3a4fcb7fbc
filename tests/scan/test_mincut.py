"""The min-cut that picks what a scan stacks, against brute force on random small graphs."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem._src.scan import mincut as mincut
from jaxmem._src.scan.mincut import Op, is_feasible, min_cut


def brute_force(costs, ops, free, unavailable, targets):
    """The cheapest feasible store set, by enumerating every subset of storable values."""
    storable = [v for v in costs if v not in free and v not in unavailable]
    best = None
    for k in range(len(storable) + 1):
        for stored in itertools.combinations(storable, k):
            if is_feasible(stored, ops, free, targets):
                cost = sum(costs[v] for v in stored)
                if best is None or cost < best:
                    best = cost
    return best


@st.composite
def graphs(draw):
    """A random DAG: a few inputs, then ops in topological order, each reading earlier values."""
    n_inputs = draw(st.integers(1, 3))
    n_ops = draw(st.integers(0, 6))
    values = [f"in{i}" for i in range(n_inputs)]
    ops = []
    for j in range(n_ops):
        k = draw(st.integers(1, min(2, len(values))))
        inputs = tuple(draw(st.lists(st.sampled_from(values), min_size=k, max_size=k)))
        outputs = tuple(f"v{j}_{m}" for m in range(draw(st.integers(1, 2))))
        ops.append(Op(inputs, outputs, draw(st.booleans())))
        values.extend(outputs)
    costs = {v: draw(st.integers(0, 9)) for v in values}
    roles = {v: draw(st.sampled_from(["free", "unavailable", "plain"])) for v in values}
    free = {v for v, r in roles.items() if r == "free"}
    # Only inputs can be unavailable (a carry-in the backward step does not have).
    unavailable = {v for v in values[:n_inputs] if roles[v] == "unavailable"}
    targets = draw(st.lists(st.sampled_from(values), min_size=1, max_size=4))
    return costs, ops, free, unavailable, targets


@settings(max_examples=300, deadline=None, derandomize=True)
@given(graphs())
def test_min_cut_equals_brute_force(graph):
    costs, ops, free, unavailable, targets = graph
    cost, stored = min_cut(costs, ops, free, unavailable, targets)
    expected = brute_force(costs, ops, free, unavailable, targets)
    if expected is None:
        assert cost is None and stored == frozenset()
        return
    assert cost == expected
    assert sum(costs[v] for v in stored) == cost
    assert not stored & (set(free) | set(unavailable))
    assert is_feasible(stored, ops, free, targets)


def test_recomputes_through_cheap_ops_only():
    # x (free) -> a = dot(x) [expensive] -> b = tanh(a) [cheap] -> c = cos(b) [cheap]
    ops = [Op(("x",), ("a",), False), Op(("a",), ("b",), True), Op(("b",), ("c",), True)]
    costs = {"x": 4, "a": 8, "b": 8, "c": 8}
    # Both b and c are needed: store a (8 bytes) and recompute b and c from it.
    assert min_cut(costs, ops, {"x"}, (), ["b", "c"]) == (8, frozenset({"a"}))
    # With no cheap ops, both must be stored.
    hard = [Op(o.inputs, o.outputs, False) for o in ops]
    assert min_cut(costs, hard, {"x"}, (), ["b", "c"]) == (16, frozenset({"b", "c"}))


def test_unavailable_values_cannot_be_used():
    # h is the carry-in the backward step does not have; t = tanh(h) can still be stored.
    ops = [Op(("h",), ("t",), True)]
    assert min_cut({"h": 1, "t": 5}, ops, (), {"h"}, ["t"]) == (5, frozenset({"t"}))
    # A target that *is* unavailable cannot be made available at all.
    assert min_cut({"h": 1}, [], (), {"h"}, ["h"]) == (None, frozenset())


@pytest.mark.parametrize("n", [50, 400])
def test_long_chains_are_fast_and_exact(n):
    # A chain of cheap ops off one expensive value: storing that one value covers every target.
    ops = [Op(("x",), ("v0",), False)] + [Op((f"v{i}",), (f"v{i + 1}",), True) for i in range(n)]
    costs = {"x": 1, **{f"v{i}": 10 for i in range(n + 1)}}
    assert min_cut(costs, ops, {"x"}, (), [f"v{i}" for i in range(0, n + 1, 7)]) == (
        10,
        frozenset({"v0"}),
    )
    assert mincut.is_feasible({"v0"}, ops, {"x"}, [f"v{n}"])
