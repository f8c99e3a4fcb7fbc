"""The one door to Flax's internals: every private name of Flax that jaxmem uses is here.

jaxmem's Flax stacks run Flax's own code (the lifting of ``flax.core.lift``, the pipeline of
``flax.nnx.scan``) with :func:`jaxmem.scan` as the loop. Where that needs what Flax does not
export, it is taken here, once, and nowhere else: ``tests/flax/test_flax_compat.py`` fails if
another module reaches into Flax's internals, and checks that every linen and NNX path runs
jaxmem's loop, so a Flax release that changes them fails loudly instead of falling back to stock
scan.
Tested: flax 0.12.8 (jax 0.10.2) and 0.12.12 (jax 0.12); ``pyproject.toml`` allows ``<0.13``.

- linen: ``flax.core.lift``'s helpers (``_split_in_out_axes``, ``_unzip2``, ``tree_map_rngs``,
  ``pack``), ``flax.linen.transforms.lift_transform``, ``flax.core.axes_scan.broadcast`` and the
  scopes' ``rng_counters`` (:class:`RngPin`).
- NNX: ``flax.nnx.transforms.iteration``'s ``scan`` rebuilt over a copy of its module's globals
  in which ``jax.lax.scan`` is another loop (:func:`nnx_scan_with`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
from flax.core import axes_scan, lift
from flax.core.scope import Scope
from flax.nnx.transforms import iteration as _nnx_iteration

TESTED = "flax 0.12.8 to 0.12.12"

# ------------------------------------------------------------------------------------------
# linen: flax.core.lift.scan's helpers, for a lifted scan with another loop.

BROADCAST = axes_scan.broadcast
"""``nn.broadcast`` as ``flax.core.axes_scan`` compares axes with it."""
split_in_out_axes = lift._split_in_out_axes  # noqa: SLF001 - the one door
unzip2 = lift._unzip2  # noqa: SLF001 - the one door
tree_map_rngs = lift.tree_map_rngs
pack = lift.pack
lift_transform = nn.transforms.lift_transform


def scopes(scope_tree: Any) -> list[Scope]:
    return jax.tree_util.tree_leaves(scope_tree, is_leaf=lambda x: isinstance(x, Scope))


def _snapshot(counters: dict) -> dict:
    return {k: _snapshot(v) if isinstance(v, dict) else v for k, v in counters.items()}


def _restore(counters: dict, snap: dict):
    """Sets the (nested) counter dict ``counters`` back to ``snap``, in place."""
    for k in [k for k in counters if k not in snap]:
        del counters[k]
    for k, v in snap.items():
        if isinstance(v, dict):
            if not isinstance(counters.get(k), dict):
                counters[k] = {}
            _restore(counters[k], v)
        else:
            counters[k] = v


class RngPin:
    """Makes every trace of the loop body see the same RNG counters, as one lax.scan trace would.

    Each trace of the body advances the scopes' RNG counters (``make_rng``). ``nn.scan`` traces
    its body once for the broadcast outputs, then once in ``lax.scan``; :func:`jaxmem.scan` may
    trace it more than once. After :meth:`start_loop`, the first trace runs from the counters
    it finds and leaves them advanced; later traces start from the same counters and leave the
    advanced ones in place. So the random streams are nn.scan's.
    """

    def __init__(self):
        self.start: list[dict] | None = None

    def start_loop(self):
        self.start = None

    def __call__(self, scope_tree, run):
        live = [s.rng_counters for s in scopes(scope_tree)]
        if self.start is None:
            self.start = [_snapshot(d) for d in live]
            return run()
        after = [_snapshot(d) for d in live]
        for d, snap in zip(live, self.start, strict=True):
            _restore(d, snap)
        out = run()
        for d, snap in zip(live, after, strict=True):
            _restore(d, snap)
        return out


# ------------------------------------------------------------------------------------------
# NNX: flax.nnx.scan with another loop.
#
# Flax 0.12.8 and 0.12.12 have the same scan code: the
# pipeline of ``flax.nnx.scan`` (its in/out axes checks, the split of graph nodes into carried,
# scanned and broadcast state, ``StateAxes``, the write-back of updates, ``transform_metadata``)
# is flax's own, run unchanged: the functions ``scan``, ``_simple_scan`` and
# ``_graph_updates_scan`` of ``flax.nnx.transforms.iteration`` are rebuilt over a copy of their
# module's globals in which ``jax.lax.scan`` is the given loop (nothing of flax is modified).
# ``check_nnx_scan`` fails at first use, with an actionable message, if a flax release no
# longer calls ``jax.lax.scan`` from those functions.

_FLAX_SCAN_FUNCTIONS = ("scan", "_simple_scan", "_graph_updates_scan")


class _LaxWithLoop:
    """``jax.lax`` with ``scan`` replaced (every other attribute is jax.lax's)."""

    def __init__(self, loop):
        self.scan = loop

    def __getattr__(self, name):
        return getattr(jax.lax, name)


class _JaxWithLoop:
    """The ``jax`` module as flax's scan code sees it: ``jax.lax.scan`` is jaxmem's loop."""

    def __init__(self, loop):
        self.lax = _LaxWithLoop(loop)

    def __getattr__(self, name):
        return getattr(jax, name)


def _names_used(code) -> set[str]:
    """The global and attribute names a code object and its nested functions use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


@functools.cache
def check_nnx_scan():
    """Raises unless flax's scan code is the code :func:`nnx_scan_with` knows how to rebuild."""
    for name in _FLAX_SCAN_FUNCTIONS:
        code = getattr(getattr(_nnx_iteration, name, None), "__code__", None)
        names = set() if code is None else _names_used(code)
        needed = set(_FLAX_SCAN_FUNCTIONS[1:]) if name == "scan" else {"jax", "lax", "scan"}
        if not needed <= names:
            raise NotImplementedError(
                f"jaxmem.flax.nnx.scan does not support this flax version "
                f"({getattr(flax, '__version__', '?')}): flax.nnx.transforms.iteration.{name} "
                f"is not the scan code it rebuilds (tested: {TESTED}). Use "
                "flax.nnx.scan."
            )


def nnx_scan_with(loop) -> Callable:
    """``flax.nnx.scan`` whose loop is ``loop`` (flax's functions over substituted globals)."""
    check_nnx_scan()
    glb = dict(_nnx_iteration.__dict__)
    glb["jax"] = _JaxWithLoop(loop)
    for name in _FLAX_SCAN_FUNCTIONS:
        fn = getattr(_nnx_iteration, name)
        new = types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)
        new.__kwdefaults__ = fn.__kwdefaults__
        new.__dict__.update(fn.__dict__)
        glb[name] = new
    return glb["scan"]
