"""Token-wise regions of a jaxpr, run chunk by chunk over the sequence with a recomputing backward.

In a transformer layer everything but attention maps each position on its own: the norms, the
projections, the MLP, the residual adds. Such a *region* of equations can run on a chunk of the
tokens at a time, so that its intermediates (the MLP's ``[S, 4D]`` values) never exist for the
whole sequence, and its gradient can recompute each chunk from the region's inputs: what the
backward keeps of the region is its inputs alone.

:func:`find_regions` walks a jaxpr back from the values that must exist whole (its outputs, and
the inputs of every equation that is not row-wise: attention, a scan) with the row rules of
:mod:`.rows`; the sequence axis of a value is the one axis whose length is a sequence length
(``lengths``, the lengths of the attention calls met). The equations that join form regions
(connected by the values they pass each other); a region is kept when its largest intermediate
is over ``min_bytes``, so that chunking it saves memory. :func:`evaluate` runs a jaxpr with its
regions so, each as one primitive (:mod:`jaxmem._src.vjp_primitive`): forward mode and
``vmap`` keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive
from jaxmem._src.chunking import rows as _rows

DEFAULT_CHUNK_BYTES = 4 * 2**20  # a chunk's largest intermediate stays under this


@dataclasses.dataclass(frozen=True)
class Region:
    """Equations of a jaxpr that are row-wise along the tokens, run together in chunks.

    Attributes:
      eqns: the equations' indices, in order.
      split: ``(var, axis)`` of each input carrying the tokens.
      params: the inputs shared by every token (weights).
      outputs: ``(var, axis)`` of each value the region makes that is used after it.
      rows: the number of tokens.
      axes: per equation (by id, nested calls included): (input axes, output axes).
      largest: the bytes of the region's largest intermediate (not counting its outputs).
      inner_bytes: the bytes of all its intermediates (not counting its outputs).
      row_bytes: the bytes one token adds to it.
    """

    eqns: tuple[int, ...]
    split: tuple[tuple[Any, int], ...]
    params: tuple[Any, ...]
    outputs: tuple[tuple[Any, int], ...]
    rows: int
    axes: dict
    largest: int
    row_bytes: int
    inner_bytes: int = 0

    def chunk_rows(self, chunk_bytes: int) -> int:
        """Tokens per chunk: the most, a power of two, that keep the chunk's intermediates
        under ``chunk_bytes``."""
        size = max(1, min(self.rows, chunk_bytes // max(1, self.row_bytes)))
        return size if size == self.rows else 1 << (size.bit_length() - 1)


def _token_axis(v, lengths: frozenset) -> int | None:
    """The one axis of ``v`` whose length is a sequence length, or None (none, or several)."""
    found = [k for k, d in enumerate(_rows._shape(v)) if d in lengths]
    return found[0] if len(found) == 1 else None


_UNSET = object()


def _need_whole(walk: _rows._Walk, values, lengths: frozenset) -> None:
    """Values an equation outside any region reads: each needed on its token axis."""
    for v in values:
        if _jc.is_var(v):
            walk.required.setdefault(v, _token_axis(v, lengths))


def _visit(walk: _rows._Walk, i: int, eqn, lengths: frozenset) -> None:
    """Joins equation ``i`` to the regions where its outputs are needed on token axes and it
    is row-wise along them; else its inputs are needed whole."""
    outs = [walk.required.get(v, _UNSET) for v in eqn.outvars if not _jc.is_drop_var(v)]
    if not outs or all(o is _UNSET for o in outs):
        return  # dead
    if all(_rows._shape(v) == () for v in eqn.outvars):
        # A sum to a scalar (a loss): its tail is autochunk's (optimize runs it after), chunk by
        # chunk with the gradient in the forward pass, where a region would recompute it.
        return
    ins = _rows.in_axes(eqn, outs) if all(isinstance(o, int) for o in outs) else None
    if ins is not None and not walk._conflicts(eqn, ins):
        nested = _rows._nested(eqn, ins, outs)
        if nested is not None:
            walk._join(i, eqn, ins, outs, nested)
            return
    _need_whole(walk, eqn.invars, lengths)


def _components(jaxpr, members: dict) -> list[list[int]]:
    """The members grouped by the values they pass each other (union-find)."""
    parent = {i: i for i in members}

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = {v: i for i in members for v in jaxpr.eqns[i].outvars}
    for i in members:
        for v in jaxpr.eqns[i].invars:
            if _jc.is_var(v) and v in producer:
                parent[root(i)] = root(producer[v])
    groups: dict[int, list[int]] = {}
    for i in sorted(members):
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def _staged(jaxpr, walk: _rows._Walk) -> list[list[int]]:
    """The components of the walk's members, each split by stage: how many token-mixing
    equations (outside the regions, reading values that have a token axis: attention, a sum
    over the tokens) lie on the longest path to it, so that no region holds equations on both
    sides of a mixing (it would need its own output)."""
    members = walk.members
    stage: dict = {}
    at = {}
    for i, eqn in enumerate(jaxpr.eqns):
        ins = [v for v in eqn.invars if _jc.is_var(v)]
        s = max((stage.get(v, 0) for v in ins), default=0)
        at[i] = s
        mixing = i not in members and any(isinstance(walk.required.get(v), int) for v in ins)
        stage.update((v, s + 1 if mixing else s) for v in eqn.outvars)
    groups = []
    for group in _components(jaxpr, members):
        by_stage: dict = {}
        for i in group:
            by_stage.setdefault(at[i], []).append(i)
        groups += [by_stage[k] for k in sorted(by_stage)]
    return groups


def _region(jaxpr, group: list[int], walk: _rows._Walk, users: dict) -> Region | None:
    """The region of equations ``group``, or None where it cannot run as one (tokens of two
    lengths, or it would need its own output first)."""
    eqns = jaxpr.eqns
    inside = set(group)
    produced = {v for i in group for v in eqns[i].outvars if not _jc.is_drop_var(v)}
    outvars = {v for v in jaxpr.outvars if _jc.is_var(v)}
    split: dict = {}
    params: dict = {}
    for i in group:
        for v, k in zip(eqns[i].invars, walk.members[i][0], strict=True):
            if _jc.is_var(v) and v not in produced:
                (params.setdefault(v, None) if k is None else split.setdefault(v, k))
    outputs = [
        (v, walk.required[v])
        for i in group
        for v in eqns[i].outvars
        if not _jc.is_drop_var(v) and (v in outvars or users.get(v, set()) - inside)
    ]
    sizes = {_rows._shape(v)[k] for v, k in outputs}
    if len(sizes) != 1 or any(_rows._shape(v)[k] < min(sizes) for v, k in split.items()):
        return None
    (rows,) = sizes
    if _needs_itself(jaxpr, group, set(split) | set(params), {v for v, _ in outputs}):
        return None
    inner = [
        (v, k)
        for i in group
        for v, k in zip(eqns[i].outvars, walk.members[i][1], strict=True)
        if not _jc.is_drop_var(v) and k is not None
    ]
    for i in group:
        inner += _rows._body_values(eqns[i], walk.axes)
    escaping = {v for v, _ in outputs}
    inner_sizes = [_jc.nbytes(v.aval) for v, _ in inner if v not in escaping]
    largest = max(inner_sizes, default=0)
    row_bytes = sum(_jc.nbytes(v.aval) // max(1, _rows._shape(v)[k]) for v, k in inner)
    return Region(
        tuple(group), tuple(split.items()), tuple(params), tuple(outputs), rows,
        walk.axes, largest, row_bytes, sum(inner_sizes),
    )  # fmt: skip


def _needs_itself(jaxpr, group: list[int], inputs: set, outputs: set) -> bool:
    """Whether an input of the region is computed (outside it) from one of its outputs."""
    reach = set(outputs)
    inside = set(group)
    for i in range(min(group), len(jaxpr.eqns)):
        eqn = jaxpr.eqns[i]
        if i not in inside and any(_jc.is_var(v) and v in reach for v in eqn.invars):
            reach.update(eqn.outvars)
    return bool(reach & inputs)


def find_regions(jaxpr, lengths: Sequence[int], min_bytes: int) -> list[Region]:
    """The token-wise regions of ``jaxpr`` whose intermediates add up to over ``min_bytes`` and
    over each of their outputs (chunking them saves memory)."""
    lengths = frozenset(lengths)
    if not lengths:
        return []
    walk = _rows._Walk(required={}, axes={})
    _need_whole(walk, jaxpr.outvars, lengths)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        _visit(walk, i, jaxpr.eqns[i], lengths)
    # Dead equations' reads count: evaluate runs every equation, so a region's value a dead one
    # reads must exist outside it.
    users = _rows._users(jaxpr, dead_read=True)
    found = []
    for group in _staged(jaxpr, walk):
        region = _region(jaxpr, group, walk, users)
        biggest_output = max(_jc.nbytes(v.aval) for v, _ in region.outputs) if region else 0
        if region is not None and region.inner_bytes > max(min_bytes, biggest_output):
            found.append(region)
    return found


# ------------------------------------------------------------------------------------------
# Running a jaxpr with its regions in chunks.


def evaluate(jaxpr, consts, args, regions: Sequence[Region], apply: Callable, run: Callable):
    """``jaxpr`` evaluated with ``apply(eqn, invals)`` for each equation outside the regions and
    ``run(region, invals)`` for each region (its split inputs, then its parameters), each as
    soon as its inputs are computed, in the jaxpr's order otherwise."""
    env: dict = {}
    read = lambda v: env[v] if _jc.is_var(v) else v.val
    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    of = {i: r for r in regions for i in r.eqns}
    units: list = []
    for i, eqn in enumerate(jaxpr.eqns):
        if i not in of:
            units.append(eqn)
        elif of[i].eqns[0] == i:
            units.append(of[i])
    while units:
        k = next(k for k, u in enumerate(units) if all(v in env for v in _reads(u)))
        unit = units.pop(k)
        if isinstance(unit, Region):
            outs = run(unit, [read(v) for v in _reads(unit)])
            env.update(zip((v for v, _ in unit.outputs), outs, strict=True))
        else:
            outs = apply(unit, [read(v) for v in unit.invars])
            env.update(
                (v, x) for v, x in zip(unit.outvars, outs, strict=True) if not _jc.is_drop_var(v)
            )
    return [read(v) for v in jaxpr.outvars]


def _reads(unit) -> list:
    if isinstance(unit, Region):
        return [v for v, _ in unit.split] + list(unit.params)
    return [v for v in unit.invars if _jc.is_var(v)]


def run_region(jaxpr, region: Region, invals: Sequence, chunk_bytes: int, name: str) -> list:
    """The region's outputs from its inputs (split, then parameters), computed in chunks of
    tokens; its gradient recomputes each chunk (what it keeps: its inputs)."""
    sub = _jc.make_jaxpr(
        jaxpr,
        constvars=[],
        invars=[v for v, _ in region.split] + list(region.params),
        outvars=[v for v, _ in region.outputs],
        eqns=[jaxpr.eqns[i] for i in region.eqns],
    )
    n_split = len(region.split)
    in_axes = [k for _, k in region.split]
    out_axes = [k for _, k in region.outputs]
    size = region.chunk_rows(chunk_bytes)
    full, rem = divmod(region.rows, size)
    out_avals = [v.aval for v, _ in region.outputs]

    def local(start, length, args):
        """The chunk's inputs: the split ones' rows, the parameters whole."""
        pieces = [
            lax.dynamic_slice_in_dim(x, start, length, axis=k)
            for x, k in zip(args[:n_split], in_axes, strict=True)
        ]
        return [*pieces, *args[n_split:]]

    def chunk(start, length, args):
        return _rows._eval(sub, [], local(start, length, args), region.axes, length)

    def fun(*args):
        def put(start, length, bufs):
            outs = chunk(start, length, args)
            return [
                lax.dynamic_update_slice_in_dim(b, o.astype(b.dtype), start, axis=k)
                for b, o, k in zip(bufs, outs, out_axes, strict=True)
            ]

        bufs = [
            _vjp_primitive.zeros_sharded_like(a.shape, a.dtype, a, range(a.ndim)) for a in out_avals
        ]
        bufs = lax.fori_loop(0, full, lambda i, b: put(i * size, size, b), bufs)
        return put(full * size, rem, bufs) if rem else bufs

    def fwd(*args):
        return fun(*args), args

    def bwd(args, cts):
        diff = [_jc.is_float(x) for x in args]

        def back(start, length, grads):
            here = local(start, length, args)

            def f(*d):
                it = iter(d)
                ins = [next(it) if m else x for x, m in zip(here, diff, strict=True)]
                return _rows._eval(sub, [], ins, region.axes, length)

            _, vjp = jax.vjp(f, *(x for x, d in zip(here, diff, strict=True) if d))
            ct = [
                lax.dynamic_slice_in_dim(c, start, length, axis=k)
                for c, k in zip(cts, out_axes, strict=True)
            ]
            return _accumulate(grads, vjp(ct), start, length, diff, in_axes)

        grads = [
            _vjp_primitive.zeros_sharded_like(x.shape, _acc_dtype(x.dtype), x, range(x.ndim))
            for x, d in zip(args, diff, strict=True)
            if d
        ]
        grads = lax.fori_loop(0, full, lambda i, g: back(i * size, size, g), grads)
        if rem:
            grads = back(full * size, rem, grads)
        it = iter(grads)
        return tuple(
            next(it).astype(x.dtype) if d else None for x, d in zip(args, diff, strict=True)
        )

    core = _vjp_primitive.custom_vjp(fun, fwd=fwd, bwd=bwd, name=name)
    return list(core(*invals))


def _acc_dtype(dtype):
    return jnp.float32 if jnp.finfo(dtype).bits < 32 else dtype


def _accumulate(grads, got, start, length, diff, in_axes):
    """``grads`` plus one chunk's cotangents: a split input's at its rows, a parameter's whole."""
    out = []
    it = iter(got)
    for j, d in enumerate(diff):
        if not d:
            continue
        g = next(it)
        acc = grads[len(out)]
        if j < len(in_axes):
            k = in_axes[j]
            old = lax.dynamic_slice_in_dim(acc, start, length, axis=k)
            acc = lax.dynamic_update_slice_in_dim(acc, old + g.astype(acc.dtype), start, axis=k)
        else:
            acc = acc + g.astype(acc.dtype)
        out.append(acc)
    return out


def describe(jaxpr, region: Region, chunk_bytes: int) -> str:
    """One line saying what a region is and how it runs."""
    eqns = [jaxpr.eqns[i] for i in region.eqns]
    lines = list(dict.fromkeys(s for e in eqns if (s := _jc.summarize_source(e.source_info))))
    where = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}" if lines else "?"
    size = region.chunk_rows(chunk_bytes)
    return (
        f"{len(eqns)} token-wise equations ({where}) in chunks of {size} of {region.rows} tokens:"
        f" largest intermediate {region.largest / 2**20:.1f} MiB whole"
    )
