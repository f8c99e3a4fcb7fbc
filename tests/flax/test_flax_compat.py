"""The one door to Flax's internals (src/jaxmem/_src/flax/compat.py), and what guards it.

jaxmem's Flax stacks run Flax's own code with jaxmem's loop inside. A Flax release that moves
that code could make them fall back to stock ``lax.scan`` silently (same values, no saving):
here every linen and NNX path is traced and its jaxpr must hold jaxmem's loop and no stock scan.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxmem._src import jax_compat as jc
from jaxmem._src.flax import compat
from jaxmem._src.flax import nnx as nnx_src
from jaxmem._src.scan.options import ScanOptions
from jaxmem.flax import linen as jl
from jaxmem.flax import nnx as jn

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "src" / "jaxmem" / "_src" / "flax" / "compat.py"
L, D = 3, 4
X = np.random.default_rng(0).normal(size=(2, D)).astype(np.float32)

# ------------------------------------------------------------------------------------------
# The boundary: Flax's internals are read in compat.py only.

# Flax modules jaxmem may import anywhere (Flax's public API); any other flax module is internal.
PUBLIC_FLAX = {
    "flax",
    "flax.linen",
    "flax.nnx",
    "flax.typing",
    "flax.core.meta",
    "flax.struct",
    "flax.serialization",
    "flax.training",
}
PUBLIC_FLAX_CORE = {"FrozenDict", "meta", "freeze", "unfreeze"}
# Attributes of Flax objects that are internal although their names are not private.
INTERNAL_ATTRS = {"rng_counters", "transforms"}


def flax_internals(source: str) -> list[str]:
    """What ``source`` takes from Flax's internals: imports of non-public Flax modules or names,
    private attributes (``_x``) of Flax modules, and internal attributes (``rng_counters``,
    ``nn.transforms``)."""
    found, flax_names = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flax":
                    flax_names.add(alias.asname or alias.name.split(".")[0])
                    if alias.name not in PUBLIC_FLAX:
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flax"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                flax_names.add(alias.asname or alias.name)
                public = node.module == "flax.core" and alias.name in PUBLIC_FLAX_CORE
                if not public and node.module not in PUBLIC_FLAX or alias.name.startswith("_"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                elif node.module == "flax" and full not in PUBLIC_FLAX:
                    found.append(f"{node.lineno}: from flax import {alias.name}")
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in INTERNAL_ATTRS and not (
            node.attr == "transforms" and not _rooted_in(node.value, flax_names)
        ):
            found.append(f"{node.lineno}: .{node.attr}")
        elif (
            node.attr.startswith("_")
            and not node.attr.startswith("__")
            and _rooted_in(node.value, flax_names)
        ):
            found.append(f"{node.lineno}: .{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def _rooted_in(node, names) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def test_only_compat_reaches_into_flax_internals():
    offenders = []
    for folder in ("src", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != COMPAT:
                found = flax_internals(path.read_text(encoding="utf-8"))
                offenders += [f"{path.relative_to(ROOT)}:{f}" for f in found]
    assert not offenders, offenders
    assert flax_internals(COMPAT.read_text(encoding="utf-8")), "compat.py reads no internal"


def test_the_boundary_check_sees_each_kind_of_internal():
    source = (
        "import flax.linen as nn\n"
        "from flax.core import lift, FrozenDict\n"
        "from flax.nnx.transforms import iteration\n"
        "from flax.linen import Module\n"
        "a = lift._unzip2\n"
        "b = scope.rng_counters\n"
        "c = nn.transforms.lift_transform\n"
        "d = nn._private\n"
        "e = other._private\n"
    )
    assert flax_internals(source) == [
        "2: from flax.core import lift",
        "3: from flax.nnx.transforms import iteration",
        "5: ._unzip2",
        "6: .rng_counters",
        "7: .transforms",
        "8: ._private",
    ]


# ------------------------------------------------------------------------------------------
# Every path runs jaxmem's loop.


def _unwrap(fn):
    for _ in range(16):
        nxt = (
            getattr(fn, "f", None) or getattr(fn, "func", None) or getattr(fn, "__wrapped__", None)
        )
        if nxt is None:
            break
        fn = nxt
    return getattr(fn, "__func__", fn)


def _is_jaxmem_vjp(eqn) -> bool:
    """A jaxmem loop: one of jaxmem's primitives (``jaxmem_scan``, the reversible stack's), or a
    custom VJP whose rules are jaxmem's."""
    if type(eqn.params.get("_prim")).__module__.startswith("jaxmem._src."):
        return True
    if not eqn.primitive.name.startswith("custom_vjp_call"):
        return False
    bwd = _unwrap(eqn.params.get("bwd"))
    return getattr(bwd, "__module__", "").startswith("jaxmem._src.")


def loops(jaxpr) -> tuple[int, int]:
    """(jaxmem loops, stock scans outside them) in ``jaxpr``, at any depth."""
    ours = stock = 0
    for eqn in jaxpr.eqns:
        if _is_jaxmem_vjp(eqn):
            ours += 1
            continue
        stock += eqn.primitive.name == "scan"
        for sub in jc.subjaxprs(eqn):
            o, s = loops(sub)
            ours, stock = ours + o, stock + s
    return ours, stock


def loops_of(fn, *args) -> tuple[int, int]:
    return loops(jc.open_jaxpr(jax.make_jaxpr(fn)(*args)))


class Layer(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + jnp.tanh(nn.Dense(D)(h))


class Cell(nn.Module):
    @nn.compact
    def __call__(self, c, x):
        c = jnp.tanh(nn.Dense(D)(c) + x)
        return c, c


class Half(nn.Module):
    @nn.compact
    def __call__(self, h):
        return jnp.tanh(nn.Dense(D)(h))


def _linen(module, *inputs):
    variables = module.init(jax.random.key(0), *inputs)
    return lambda v: jax.tree.leaves(module.apply(v, *inputs))[0].sum(), variables


def _cell_fn(cell, c, x):
    return cell(c, x)


LINEN = {
    "scan_layers": lambda: _linen(jl.scan_layers(Layer, L)(), X),
    "scan class": lambda: _linen(
        jl.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True})(),
        X,
        np.ones((L, 2, D), np.float32),
    ),
    "scan function": lambda: _linen(_LinenFunctionScan(), X),
    "scan_layers checkpoints": lambda: _linen(jl.scan_layers(Layer, L, checkpoints=2)(), X),
    "reversible_layers": lambda: _linen(jl.reversible_layers(Half, Half, L)(), (X, X)),
}


class _LinenFunctionScan(nn.Module):
    @nn.compact
    def __call__(self, c):
        scan = jl.scan(
            _cell_fn, variable_broadcast="params", split_rngs={"params": False}, length=L
        )
        return scan(Cell(), c, np.ones((L, 2, D), np.float32))[0]


@pytest.mark.parametrize("path", sorted(LINEN))
def test_every_linen_path_runs_jaxmems_loop(path):
    loss, variables = LINEN[path]()
    assert loops_of(loss, variables) == (1, 0)


def test_stock_scans_count_as_stock():
    # The check itself: nn.scan and nnx.scan are stock loops, not jaxmem's.
    stock_scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True})
    loss, variables = _linen(stock_scan(), X, np.ones((L, 2, D), np.float32))
    ours, stock = loops_of(lambda v: loss(v), variables)
    assert ours == 0 and stock >= 1
    ours, stock = loops_of(
        lambda x: nnx.scan(lambda c, _: (jnp.tanh(c), None), length=L)(x, None)[0].sum(), X
    )
    assert ours == 0 and stock >= 1


def _make_block(rngs):
    return nnx.Linear(D, D, rngs=rngs)


def _stack_loss(stack):
    graphdef, state = nnx.split(stack)
    return lambda s: nnx.merge(graphdef, s)(jnp.asarray(X)).sum(), state


def _nnx_scan(graph, graph_updates):
    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
        return _make_block(rngs)

    layers = create(nnx.Rngs(0))

    @jn.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, graph=graph, graph_updates=graph_updates)
    def forward(layer, x):
        return jnp.tanh(layer(x))

    graphdef, state = nnx.split(layers)
    return lambda s: forward(nnx.merge(graphdef, s), jnp.asarray(X)).sum(), state


def _nnx_reversible():
    stack = jn.ReversibleLayers(_make_block, _make_block, L, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(stack)
    x = jnp.asarray(X)
    return lambda s: jax.tree.leaves(nnx.merge(graphdef, s)((x, x)))[0].sum(), state


NNX = {
    "ScanLayers": lambda: _stack_loss(jn.ScanLayers(_make_block, L, rngs=nnx.Rngs(0))),
    "scan_layers": lambda: _stack_loss(jn.scan_layers(_make_block, L, rngs=nnx.Rngs(0))),
    "ScanLayers checkpoints": lambda: _stack_loss(
        jn.ScanLayers(_make_block, L, rngs=nnx.Rngs(0), checkpoints=2)
    ),
    "scan graph": lambda: _nnx_scan(True, True),
    "scan graph no updates": lambda: _nnx_scan(True, False),
    "scan tree": lambda: _nnx_scan(False, False),
    "ReversibleLayers": _nnx_reversible,
}


@pytest.mark.parametrize("path", sorted(NNX))
def test_every_nnx_path_runs_jaxmems_loop(path):
    loss, state = NNX[path]()
    assert loops_of(loss, state) == (1, 0)


def test_the_nnx_rebuild_is_made_once_per_options():
    make = functools.partial(ScanOptions.create, "jaxmem.flax.nnx.scan")
    options = make()
    assert nnx_src._flax_scan(options) is nnx_src._flax_scan(make(recompute="auto"))
    assert nnx_src._flax_scan(options) is not nnx_src._flax_scan(make(recompute="cheap"))
    # Two stacks with the same options share one rebuilt scan (no rebuild per call).
    before = nnx_src._flax_scan_cached.cache_info().misses
    for _ in range(2):
        loss, state = _stack_loss(jn.ScanLayers(_make_block, L, rngs=nnx.Rngs(0)))
        loss(state)
    assert nnx_src._flax_scan_cached.cache_info().misses - before <= 1


def test_a_flax_scan_without_lax_scan_is_refused(monkeypatch):
    # A Flax release whose scan no longer calls jax.lax.scan in the rebuilt functions.
    def moved(*args, **kwargs):
        return helper(*args, **kwargs)  # noqa: F821 - never called

    compat.check_nnx_scan.cache_clear()
    monkeypatch.setattr(compat._nnx_iteration, "_simple_scan", moved)
    try:
        with pytest.raises(NotImplementedError, match="does not support this flax version"):
            compat.nnx_scan_with(functools.partial(lambda *a, **k: None))
    finally:
        monkeypatch.undo()
        compat.check_nnx_scan.cache_clear()
    compat.check_nnx_scan()
