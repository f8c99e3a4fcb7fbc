"""Which values to store so that the others can be recomputed: a minimum cut.

The problem, on a dataflow graph of *values* (variables) and *operations* that produce them:
some values are *free* (available in the backward pass at no cost: xs slices, constants, ys),
some are *unavailable* (neither stored nor recomputable from anything), and every other value
may be *stored* at its cost. A value is available when it is free, stored, or the output of a
*cheap* operation all of whose inputs are available. Find the cheapest set of values to store so
that every *target* is available.

This is a minimum s-t cut (Jain et al., Checkmate, 2020; the functorch min-cut partitioner):
each value ``v`` becomes an edge ``v_in -> v_out`` of capacity ``cost(v)``; the source feeds
``v_in`` of every value that cannot be recomputed (an expensive operation's output, an input
that is not free) and ``v_out`` of every unavailable value; a cheap operation links
``u_out -> v_in`` for each of its inputs ``u`` with infinite capacity; ``v_out -> sink`` for each
target. A finite cut is a set of value edges whose removal disconnects every target from the
source, i.e. a set of values to store from which, through cheap operations, all targets follow.

Examples:
  >>> ops = [Op(inputs=("x",), outputs=("a",), cheap=False),  # a = x @ w: expensive
  ...        Op(inputs=("a",), outputs=("b",), cheap=True)]   # b = tanh(a): cheap
  >>> min_cut({"x": 4, "a": 4, "b": 4}, ops, free={"x"}, unavailable=(), targets=["b"])
  (4, frozenset({'a'}))
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of the graph: ``outputs`` computed from ``inputs``.

    Attributes:
      inputs: the values it reads (variables only: literals are always available).
      outputs: the values it writes.
      cheap: whether it may be re-run in the backward pass.
    """

    inputs: tuple[Hashable, ...]
    outputs: tuple[Hashable, ...]
    cheap: bool


class _FlowGraph:
    """A flow network with integer capacities (adjacency lists of paired residual edges)."""

    def __init__(self):
        self.adj: list[list[int]] = []
        self.to: list[int] = []
        self.cap: list[int] = []

    def node(self) -> int:
        self.adj.append([])
        return len(self.adj) - 1

    def edge(self, u: int, v: int, c: int) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0)

    def max_flow(self, s: int, t: int) -> int:
        """Edmonds-Karp: shortest augmenting paths, iterative (no recursion limit)."""
        flow = 0
        n = len(self.adj)
        while True:
            parent_edge = [-1] * n
            parent_edge[s] = -2
            q = collections.deque([s])
            while q and parent_edge[t] == -1:
                u = q.popleft()
                for e in self.adj[u]:
                    v = self.to[e]
                    if self.cap[e] > 0 and parent_edge[v] == -1:
                        parent_edge[v] = e
                        q.append(v)
            if parent_edge[t] == -1:
                return flow
            bottleneck, v = None, t
            while v != s:
                e = parent_edge[v]
                bottleneck = self.cap[e] if bottleneck is None else min(bottleneck, self.cap[e])
                v = self.to[e ^ 1]
            v = t
            while v != s:
                e = parent_edge[v]
                self.cap[e] -= bottleneck
                self.cap[e ^ 1] += bottleneck
                v = self.to[e ^ 1]
            flow += bottleneck

    def source_side(self, s: int) -> set[int]:
        """Nodes reachable from ``s`` in the residual network (after :meth:`max_flow`)."""
        seen = {s}
        q = collections.deque([s])
        while q:
            u = q.popleft()
            for e in self.adj[u]:
                if self.cap[e] > 0 and self.to[e] not in seen:
                    seen.add(self.to[e])
                    q.append(self.to[e])
        return seen


def min_cut(
    costs: Mapping[Hashable, int],
    ops: Sequence[Op],
    free: Collection[Hashable],
    unavailable: Collection[Hashable],
    targets: Iterable[Hashable],
) -> tuple[int | None, frozenset]:
    """The cheapest set of values to store so that every target is available (module doc).

    Args:
      costs: every value of the graph and the cost of storing it (non-negative ints).
      ops: the operations, each value produced by at most one; a value produced by none is an
        input of the graph.
      free: values available at no cost.
      unavailable: inputs that can be neither stored nor recomputed (unless also free).
      targets: the values that must be available.

    Returns:
      ``(cost, stored)``: the total cost and the values to store; ``(None, frozenset())`` when no
      choice makes every target available (a target depends on an unavailable value through
      cheap operations only, and cannot be stored either: it is unavailable itself).
    """
    free = set(free)
    g = _FlowGraph()
    src, sink = g.node(), g.node()
    inf = 2 * sum(costs.values()) + len(costs) + 1
    # Each value is an edge (in -> out) of its storing cost: cut, it is stored.
    nodes: dict[Hashable, tuple[int, int]] = {v: (g.node(), g.node()) for v in costs}
    produced = _add_ops(g, nodes, costs, ops, free, src, inf)
    _add_inputs(g, nodes, costs, produced | free, unavailable, src, inf)
    for v in targets:
        if v in nodes:
            g.edge(nodes[v][1], sink, inf)
    cost = g.max_flow(src, sink)
    if cost >= inf:
        return None, frozenset()
    side = g.source_side(src)
    stored = frozenset(v for v, (vin, vout) in nodes.items() if vin in side and vout not in side)
    return cost, stored


def _add_ops(g, nodes, costs, ops, free, src, inf: int) -> set:
    """The operations' edges: a cheap op's value can be recomputed from its inputs' (an
    uncuttable edge from each), any other op's only stored (its value fed by the source).
    Returns the values some operation produces."""
    produced = set()
    for op in ops:
        for v in op.outputs:
            produced.add(v)
            if v in free:
                continue
            vin, vout = nodes[v]
            g.edge(vin, vout, costs[v])
            if op.cheap:
                for u in op.inputs:
                    g.edge(nodes[u][1], vin, inf)
            else:
                g.edge(src, vin, inf)
    return produced


def _add_inputs(g, nodes, costs, skip, unavailable, src, inf: int) -> None:
    """The graph's inputs' edges (values neither produced nor free, ``skip``): an unavailable
    input is never available; any other is stored, or nothing reads it."""
    for v, (vin, vout) in nodes.items():
        if v in skip:
            continue
        if v in unavailable:
            g.edge(src, vout, inf)
        else:
            g.edge(vin, vout, costs[v])
            g.edge(src, vin, inf)


def is_feasible(
    stored: Collection[Hashable],
    ops: Sequence[Op],
    free: Collection[Hashable],
    targets: Iterable[Hashable],
) -> bool:
    """Whether every target is available from ``stored`` and ``free`` through cheap operations."""
    available = set(stored) | set(free)
    changed = True
    while changed:
        changed = False
        for op in ops:
            if op.cheap and all(u in available for u in op.inputs):
                new = [v for v in op.outputs if v not in available]
                if new:
                    available.update(new)
                    changed = True
    return all(v in available for v in targets)
