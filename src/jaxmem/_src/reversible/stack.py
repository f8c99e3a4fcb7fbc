"""Reversible couplings and their scan: activation memory that does not grow with depth.

An additive coupling updates ``n >= 2`` streams one after the other, each from the current values
of the others::

    y1 = x1 + F1(p, x2, ..., xn)
    y2 = x2 + F2(p, y1, x3, ..., xn)
    ...
    yn = xn + Fn(p, y1, ..., y(n-1))

(two streams: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``, the RevNet / Reformer / RevViT block;
three or more: RevSilo-style multi-stream fusion). It is invertible whatever the ``F_i`` are: undo
the updates in reverse order, ``xn = yn - Fn(p, y1, ..., y(n-1))`` and so on. So a stack of such
layers needs no stored activations for its gradient: :meth:`Coupling.scan` runs the stack with
:func:`jax.lax.scan` and a custom VJP that keeps only the final streams, and its backward loop
reconstructs each layer's inputs from its outputs. The reconstruction and the layer's VJP share
one evaluation of each ``F_i`` (``jax.vjp`` of ``F_i`` at the reconstructed arguments gives both
the value to subtract and the pullback), so a gradient costs one forward of the stack more than
an unrematerialized one, as full remat does, with O(1) memory in depth instead of O(depth).

Reconstruction is exact in real arithmetic, not in floating point: each inverse step subtracts a
recomputed ``F_i`` and rounds, and the error grows with depth, fastest in bfloat16.
``anchor_every=k`` stores the exact streams every ``k`` layers (memory O(depth / k)) and restarts
the reconstruction from them, so the error spans at most ``k`` layers. ``compress=`` stores those
anchors in fewer bits (bf16, fp8 or int8, the formats of ``jaxmem.scan(compress=...)``,
docs/compress.md): the restart points are then rounded, and the gradient is an approximation.

Random numbers replay identically if they are functions of the layer's parameters: give each
layer its key in ``params`` (``params = {..., "key": jax.random.split(key, depth)}``), as with
:func:`jax.lax.scan`. Integer and key leaves of ``params`` get no gradient.

Every JAX transformation applies: reverse mode reconstructs the inputs, forward mode
(``jax.jvp``, ``jax.jacfwd``) differentiates the stack as written (the stack is one primitive,
:mod:`jaxmem._src.vjp_primitive`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import tree_flatten, tree_map, tree_structure, tree_unflatten

from jaxmem._src import checks
from jaxmem._src import jax_compat as _jc
from jaxmem._src import vjp_primitive as _vjp_primitive
from jaxmem._src.format import format_type
from jaxmem._src.scan import compress as _compress
from jaxmem._src.scan.options import ScanOptions, apply_policy


def _stream_name(i: int) -> str:
    return f"x{i + 1}"


def _fn_label(coupling: Coupling, i: int) -> str:
    if len(coupling.fns) == 2:
        args = ("p, x2", "p, y1")[i]
        return f"{'fg'[i]}({args})"
    args = ["p"] + [f"y{j + 1}" for j in range(i)]
    args += [f"x{j + 1}" for j in range(i + 1, len(coupling.fns))]
    return f"fns[{i}]({', '.join(args)})"


def _type_str(x: Any) -> str:
    dtype = jnp.dtype(x.dtype) if hasattr(x, "dtype") else jnp.result_type(x)
    return format_type(np.shape(x), dtype.name)


def tree_str(tree: Any) -> str:
    leaves, treedef = tree_flatten(tree)
    if treedef == tree_structure(0):
        return _type_str(leaves[0])
    return f"{treedef} of ({', '.join(_type_str(v) for v in leaves)})"


def _add(a, b):
    return tree_map(jnp.add, a, b)


def _sub(a, b):
    return tree_map(jnp.subtract, a, b)


@dataclasses.dataclass(frozen=True)
class Coupling:
    """An additive coupling of ``len(fns)`` streams; :func:`reversible` makes one.

    Stream ``i`` is updated by ``fns[i](params, *others)``, ``others`` being the current values
    of the other streams in stream order (those before ``i`` already updated). Calling the
    coupling runs one layer; :meth:`inverse` undoes it; :meth:`scan` runs a stack of layers with
    the reversible gradient.

    Attributes:
      fns: the update functions, one per stream.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> block = jaxmem.reversible(lambda p, x2: p * x2, lambda p, y1: -y1)
      >>> len(block.fns)
      2
      >>> [v.tolist() for v in block(3.0, (jnp.ones(2), jnp.ones(2)))]  # y1 = 1 + 3, y2 = 1 - 4
      [[4.0, 4.0], [-3.0, -3.0]]
    """

    fns: tuple[Callable[..., Any], ...]

    # -- one layer -------------------------------------------------------------------------

    def __call__(self, params: Any, streams: Sequence[Any]) -> tuple[Any, ...]:
        """One layer forward: the updated streams, as a tuple."""
        s = list(self._check_streams(streams, "jaxmem.Coupling"))
        for i, fn in enumerate(self.fns):
            s[i] = _add(s[i], fn(params, *(s[:i] + s[i + 1 :])))
        return tuple(s)

    def inverse(self, params: Any, streams: Sequence[Any]) -> tuple[Any, ...]:
        """One layer backward in value: the inputs whose :meth:`__call__` gives ``streams``.

        Examples:
          >>> import jax.numpy as jnp
          >>> import jaxmem
          >>> layer = jaxmem.reversible(lambda p, x2: jnp.tanh(p * x2), lambda p, y1: p * y1)
          >>> x = (jnp.ones(3), jnp.arange(3.0))
          >>> back = layer.inverse(2.0, layer(2.0, x))
          >>> [bool(jnp.allclose(a, b)) for a, b in zip(back, x)]
          [True, True]
        """
        s = list(self._check_streams(streams, "jaxmem.Coupling.inverse"))
        for i in reversed(range(len(self.fns))):
            s[i] = _sub(s[i], self.fns[i](params, *(s[:i] + s[i + 1 :])))
        return tuple(s)

    def _check_streams(self, streams: Any, fname: str) -> tuple[Any, ...]:
        n = len(self.fns)
        if not isinstance(streams, tuple | list) or len(streams) != n:
            names = ", ".join(_stream_name(i) for i in range(n))
            raise TypeError(
                f"{fname}: streams must be a tuple ({names}) of {n} pytrees of arrays, one per "
                f"function of the coupling; got {checks.describe(streams)}"
            )
        for i, s in enumerate(streams):
            checks.check_traceable(s, f"streams[{i}]", fname, allow_structs=False)
            for path, leaf in jax.tree_util.tree_flatten_with_path(s)[0]:
                dtype = jnp.result_type(leaf)
                if not jnp.issubdtype(dtype, jnp.inexact):
                    raise TypeError(
                        f"{fname}: streams[{i}]{jax.tree_util.keystr(path)} has dtype {dtype}; "
                        f"the streams of a reversible coupling must be floating point (they are "
                        f"differentiated and reconstructed by subtraction)"
                    )
        return tuple(tree_map(jnp.asarray, s) for s in streams)

    # -- a stack of layers -----------------------------------------------------------------

    def scan(
        self,
        streams: Sequence[Any],
        params: Any = None,
        *,
        length: int | None = None,
        anchor_every: int | None = None,
        policy: Callable | str | None = None,
        unroll: int | bool = 1,
        compress: str | None = None,
    ) -> tuple[Any, ...]:
        """Runs ``length`` layers of the coupling, with the reversible gradient.

        Layer ``l`` uses ``params`` sliced at ``l`` along the leading axis, like the ``xs`` of
        :func:`jax.lax.scan`. The gradient (``jax.grad``, ``jax.vjp``) is a custom VJP that keeps
        the final streams (and every ``anchor_every``-th layer's inputs) and, layer by layer from
        the last, reconstructs the inputs and applies the layer's VJP, with one evaluation of
        each function per layer. Arrays the functions close over get gradients too.

        Args:
          streams: the input streams, a tuple of ``len(fns)`` pytrees of floating-point arrays.
            Stream ``i`` may have any structure and shapes, as long as ``fns[i]`` returns that
            structure, shapes and dtypes.
          params: per-layer inputs, a pytree whose leaves all have the leading axis ``length``
            (weights, per-layer PRNG keys, ...), or None with ``length``.
          length: the number of layers; must agree with ``params``' leading axis.
          anchor_every: None (default) keeps no activations: the backward loop reconstructs
            every layer's inputs from the final outputs. An int ``k >= 1`` also keeps the inputs
            of every ``k``-th layer (``length // k`` copies of the streams) and restarts the
            reconstruction from them, bounding the floating-point drift to ``k`` layers.
          policy: a remat policy for the functions' VJP in the backward loop (a
            :mod:`jaxmem.policies` policy, one of ``jax.checkpoint_policies``, or a preset
            name such as ``"dots"``): it bounds the memory of one layer's backward step.
            ``"auto"`` takes the active :func:`jaxmem.use_plan`'s.
          unroll: loop unrolling passed to :func:`jax.lax.scan` (forward and backward loops).
          compress: None (default) keeps the anchors exact. ``"bf16"``, ``"fp8"`` or ``"int8"``
            stores each floating-point leaf of the anchors in that format (the formats and rules
            of ``jaxmem.scan(compress=...)``, docs/compress.md): encoded in the forward pass,
            decoded where the backward loop restarts from it. The forward output and the final
            streams the backward loop starts from stay exact; the gradient is approximate, as
            each segment's reconstruction restarts from rounded streams. With
            ``anchor_every=None`` nothing is kept and ``compress`` changes nothing.
            First-order reverse mode only: higher-order differentiation (``jax.hessian``, grad
            of grad) with anchors and a format raises.

        Returns:
          The output streams, a tuple like ``streams``.

        Raises:
          TypeError: streams that are not a tuple of ``len(fns)`` pytrees of floating-point
            arrays; a function whose result differs from its stream in structure, shape or
            dtype; ``params`` leaves without the common leading axis. Messages give the path.
          ValueError: a bad ``length``, ``anchor_every`` or ``compress``.
          NotImplementedError: ``compress`` with ``anchor_every`` under higher-order
            differentiation (no derivative flows through the encoded anchors).

        Examples:
          >>> import jax, jax.numpy as jnp
          >>> import jaxmem
          >>> layer = jaxmem.reversible(
          ...     lambda p, x2: jnp.tanh(x2 @ p["f"]), lambda p, y1: jnp.tanh(y1 @ p["g"]))
          >>> params = {"f": jnp.full((16, 4, 4), 0.1), "g": jnp.full((16, 4, 4), -0.1)}
          >>> x = (jnp.ones((2, 4)), jnp.zeros((2, 4)))
          >>> def loss(params, x):
          ...     y1, y2 = layer.scan(x, params)
          ...     return jnp.sum(y1 * y2)
          >>> grads = jax.grad(loss)(params, x)
          >>> jax.tree.map(jnp.shape, grads)
          {'f': (16, 4, 4), 'g': (16, 4, 4)}
        """
        fname = "jaxmem.reversible_scan" if len(self.fns) == 2 else "jaxmem.Coupling.scan"
        opts = ScanOptions.create(fname, policy=policy, unroll=unroll, compress=compress)
        streams = self._check_streams(streams, fname)
        n_layers = _check_params(params, length, fname)
        k = check_anchor(anchor_every, n_layers, fname)
        fns = tuple(apply_policy(fn, opts.policy, fname) for fn in self.fns)
        unroll = opts.unroll
        p0 = tree_map(lambda a: a[0], params)
        self._check_shapes(fns, p0, streams, fname)

        # Closed-over arrays that take part in differentiation become explicit inputs.
        converted, consts = [], []
        for i, fn in enumerate(fns):
            others = streams[:i] + streams[i + 1 :]
            c_fn, c_consts = jax.closure_convert(fn, p0, *others)
            converted.append(c_fn)
            consts.append(list(c_consts))

        p_leaves, p_tree = tree_flatten(params)
        diff = [jnp.issubdtype(jnp.result_type(v), jnp.inexact) for v in p_leaves]
        s_leaves, s_trees = zip(*(tree_flatten(s) for s in streams), strict=True)
        c_diff = [[jnp.issubdtype(jnp.result_type(c), jnp.inexact) for c in cs] for cs in consts]
        plan = _StackPlan(
            fns=tuple(converted), p_tree=p_tree, diff=tuple(diff), s_trees=tuple(s_trees),
            c_diff=tuple(tuple(d) for d in c_diff), n_layers=n_layers, k=k, unroll=unroll,
            compress=opts.compress, fname=fname,
        )  # fmt: skip
        run = _ReversibleStack(plan).primitive()
        out = run(
            [list(v) for v in s_leaves],
            [v for v, d in zip(p_leaves, diff, strict=True) if d],
            [v for v, d in zip(p_leaves, diff, strict=True) if not d],
            [
                [c for c, d in zip(cs, ds, strict=True) if d]
                for cs, ds in zip(consts, c_diff, strict=True)
            ],
            [
                [c for c, d in zip(cs, ds, strict=True) if not d]
                for cs, ds in zip(consts, c_diff, strict=True)
            ],
        )
        return tuple(tree_unflatten(t, v) for t, v in zip(s_trees, out, strict=True))

    def _check_shapes(self, fns, p0, streams, fname):
        for i, fn in enumerate(fns):
            others = streams[:i] + streams[i + 1 :]
            label = _fn_label(self, i)
            try:
                out = jax.eval_shape(fn, p0, *others)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{fname}: {label} failed on one layer's inputs: {e}") from e
            want = tree_map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), streams[i])
            got_tree, want_tree = tree_structure(out), tree_structure(want)
            if got_tree != want_tree:
                raise TypeError(
                    f"{fname}: {label} must return the structure of stream {_stream_name(i)} "
                    f"({tree_str(streams[i])}), since the coupling adds it to that stream; it "
                    f"returned {tree_str(out)}"
                )
            for (path, g), w in zip(
                jax.tree_util.tree_flatten_with_path(out)[0], tree_flatten(want)[0], strict=True
            ):
                if g.shape != w.shape or g.dtype != w.dtype:
                    where = f"{_stream_name(i)}{jax.tree_util.keystr(path)}"
                    raise TypeError(
                        f"{fname}: {label} must return arrays like stream {where} "
                        f"({_type_str(w)}), since the coupling adds its result to that stream "
                        f"(a reversible layer cannot change shapes or dtypes); it returned "
                        f"{_type_str(g)}"
                    )


def _check_params(params: Any, length: Any, fname: str) -> int:
    checks.check_traceable(params, "params", fname, allow_structs=False)
    if length is not None and (
        isinstance(length, bool) or not isinstance(length, int | np.integer)
    ):
        raise TypeError(f"{fname}: length must be an int, got {checks.describe(length)}")
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    n = None if length is None else int(length)
    first = None
    for path, leaf in leaves:
        shape = np.shape(leaf)
        where = f"params{jax.tree_util.keystr(path)}"
        if not shape:
            raise TypeError(
                f"{fname}: {where} is a scalar; every leaf of params needs a leading layer axis "
                f"(stack per-layer values, or close over values shared by all layers)"
            )
        if n is None:
            n, first = shape[0], where
        elif shape[0] != n:
            origin = f"{first} has {n}" if first else f"length is {n}"
            raise ValueError(
                f"{fname}: {where} has leading axis {shape[0]}, but {origin}; every leaf "
                f"of params is sliced per layer along its leading axis"
            )
        first = first or where
    if n is None:
        raise ValueError(f"{fname}: give length (the number of layers) when params has no leaves")
    if n < 1:
        raise ValueError(f"{fname}: the number of layers must be at least 1, got {n}")
    return n


def check_anchor(anchor_every: Any, n: int, fname: str) -> int | None:
    if anchor_every is None:
        return None
    if isinstance(anchor_every, bool) or not isinstance(anchor_every, int | np.integer):
        raise TypeError(
            f"{fname}: anchor_every must be None or an int >= 1, "
            f"got {checks.describe(anchor_every)}"
        )
    if anchor_every < 1:
        raise ValueError(f"{fname}: anchor_every must be >= 1, got {anchor_every}")
    return min(int(anchor_every), n)


# ------------------------------------------------------------------------------------------
# The custom VJP.


def _zeros_cotangent(x):
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


@dataclasses.dataclass(frozen=True)
class _StackPlan:
    """What a reversible stack runs, fixed before its custom VJP is built.

    Attributes:
      fns: the couplings' functions, closed-over arrays made explicit (``fns[i](p, *others,
        *consts_i)`` is stream ``i``'s update).
      p_tree: the layer parameters' tree; ``diff`` per leaf: differentiated (a float).
      s_trees: each stream's tree; ``c_diff`` per coupling, per constant: differentiated.
      n_layers: the stack's depth.
      k: layers per segment whose inputs (anchors) the forward keeps, or None (no anchors:
        the backward inverts every layer from the output).
      unroll: the layer loop's unroll.
      compress: how the anchors are stored (:mod:`jaxmem._src.scan.compress`), or None.
      fname: the caller's API, for errors.
    """

    fns: tuple
    p_tree: Any
    diff: tuple[bool, ...]
    s_trees: tuple
    c_diff: tuple[tuple[bool, ...], ...]
    n_layers: int
    k: int | None
    unroll: Any
    compress: str | None
    fname: str


class _ReversibleStack:
    """A reversible stack's custom VJP over flat leaves, in named steps:
    ``run(streams, p_diff, p_fixed, c_diff, c_fixed) -> streams`` (lists of leaves).

    :meth:`forward` runs the layers (keeping every ``k``-th layer's input, the anchors, for
    the backward pass), :meth:`backward` inverts the layers from the output one at a time and
    applies each one's VJP, restarting each segment from its anchor (:meth:`restart`). With
    ``compress``, each anchor leaf is stored as ``encode(leaf, choose(leaf, compress))``.
    """

    def __init__(self, plan: _StackPlan):
        self.plan = plan
        self.n = len(plan.fns)

    # -- the layer ---------------------------------------------------------------------------

    def _params(self, p_d, p_f):
        it_d, it_f = iter(p_d), iter(p_f)
        return tree_unflatten(
            self.plan.p_tree, [next(it_d) if d else next(it_f) for d in self.plan.diff]
        )

    def _consts(self, cd_i, cf_i, i: int):
        it_d, it_f = iter(cd_i), iter(cf_i)
        return [next(it_d) if d else next(it_f) for d in self.plan.c_diff[i]]

    def _update(self, i: int, s, p, consts):
        """Coupling ``i``'s update of stream ``i``, from the other streams."""
        trees = self.plan.s_trees
        others = [tree_unflatten(trees[j], s[j]) for j in range(self.n) if j != i]
        return tree_flatten(self.plan.fns[i](p, *others, *consts))[0]

    def _layer(self, s, p_d, p_f, cd, cf):
        s = [list(v) for v in s]
        p = self._params(p_d, p_f)
        for i in range(self.n):
            u = self._update(i, s, p, self._consts(cd[i], cf[i], i))
            s[i] = [a + b for a, b in zip(s[i], u, strict=True)]
        return s

    def _encodings(self, s):
        """The encoding of each leaf of the streams ``s`` (lists of leaves) in the anchors."""
        compress = self.plan.compress
        return [
            [_compress.choose(jax.ShapeDtypeStruct(v.shape, v.dtype), compress) for v in vs]
            for vs in s
        ]

    def _split(self, params):
        """The per-layer parameters as (the first ``n_layers % k`` layers, the rest as
        ``[n_layers // k, k, ...]`` segments)."""
        r, q, k = self.plan.n_layers % self.plan.k, self.plan.n_layers // self.plan.k, self.plan.k
        head = tree_map(lambda a: a[:r], params)
        tail = tree_map(lambda a: a[r:].reshape((q, k) + a.shape[1:]), params)
        return r, head, tail

    # -- forward -----------------------------------------------------------------------------

    def forward(self, s, p_d, p_f, cd, cf, keep: bool):
        """The stack; with ``keep`` also the anchors (inputs of the full segments)."""
        plan = self.plan

        def body(s, x):
            return self._layer(s, *x, cd, cf), None

        if plan.k is None:
            s, _ = _jc.lax_scan(body, s, (p_d, p_f), length=plan.n_layers, unroll=plan.unroll)
            return s, None
        r, head, tail = self._split((p_d, p_f))
        if r:
            s, _ = _jc.lax_scan(body, s, head, unroll=plan.unroll)
        encs = self._encodings(s)

        def segment(s, x):
            out, _ = _jc.lax_scan(body, s, x, unroll=plan.unroll)
            if not keep:
                return out, None
            kept = [
                [_compress.encode(v, e) for v, e in zip(vs, es, strict=True)]
                for vs, es in zip(s, encs, strict=True)
            ]
            return out, kept

        return _jc.lax_scan(segment, s, tail)

    # -- backward ----------------------------------------------------------------------------

    def _back_layer(self, carry, x, cd, cf):
        """Inverts one layer and applies its VJP: streams and their cotangents go back one layer."""
        s, ds, dcd = carry
        p_d, p_f = x
        s, ds = [list(v) for v in s], [list(v) for v in ds]
        dcd = [list(v) for v in dcd]
        dp = [jnp.zeros_like(v) for v in p_d]
        for i in reversed(range(self.n)):
            others_idx = [j for j in range(self.n) if j != i]

            def fi(p_d, others, cdi, i=i, others_idx=others_idx):
                full = list(s)
                for j, o in zip(others_idx, others, strict=True):
                    full[j] = o
                return self._update(i, full, self._params(p_d, p_f), self._consts(cdi, cf[i], i))

            u, pull = jax.vjp(fi, p_d, [s[j] for j in others_idx], cd[i])
            s[i] = [a - b for a, b in zip(s[i], u, strict=True)]
            g_p, g_o, g_c = pull(ds[i])
            dp = [a + b for a, b in zip(dp, g_p, strict=True)]
            for j, g in zip(others_idx, g_o, strict=True):
                ds[j] = [a + b for a, b in zip(ds[j], g, strict=True)]
            dcd[i] = [a + b for a, b in zip(dcd[i], g_c, strict=True)]
        return (s, ds, dcd), dp

    def restart(self, kept, encs):
        """A segment's input streams, decoded from its anchor."""
        return [
            [_compress.decode(v, e) for v, e in zip(vs, es, strict=True)]
            for vs, es in zip(kept, encs, strict=True)
        ]

    def backward(self, s, ds, p_d, p_f, cd, cf, anchors):
        plan = self.plan
        dcd = [[jnp.zeros_like(c) for c in cs] for cs in cd]

        def body(carry, x):
            return self._back_layer(carry, x, cd, cf)

        if plan.k is None:
            (s, ds, dcd), dp = _jc.lax_scan(
                body, (s, ds, dcd), (p_d, p_f), length=plan.n_layers, reverse=True,
                unroll=plan.unroll,
            )  # fmt: skip
            return ds, dp, dcd
        r, head, tail = self._split((p_d, p_f))
        encs = self._encodings(s)

        def segment(carry, x):
            kept, p = x
            (_, ds, dcd), dp = _jc.lax_scan(body, carry, p, reverse=True, unroll=plan.unroll)
            # Inverting further would compound rounding: restart from the segment's anchor.
            return (self.restart(kept, encs), ds, dcd), dp

        (s, ds, dcd), dp_tail = _jc.lax_scan(segment, (s, ds, dcd), (anchors, tail), reverse=True)
        q, k = plan.n_layers // plan.k, plan.k
        dp_tail = [v.reshape((q * k,) + v.shape[2:]) for v in dp_tail]
        if r:
            (s, ds, dcd), dp_head = _jc.lax_scan(
                body, (s, ds, dcd), head, reverse=True, unroll=plan.unroll
            )
            dp_tail = [jnp.concatenate([a, b]) for a, b in zip(dp_head, dp_tail, strict=True)]
        return ds, dp_tail, dcd

    # -- the custom VJP's rules --------------------------------------------------------------

    def run(self, s, p_d, p_f, cd, cf):
        return self.forward(s, p_d, p_f, cd, cf, keep=False)[0]

    def fwd(self, s, p_d, p_f, cd, cf):
        if self.plan.k is not None:
            _compress.check_first_order(
                self.plan.compress, (s, p_d, cd), self.plan.fname, "the anchors"
            )
        out, anchors = self.forward(s, p_d, p_f, cd, cf, keep=True)
        return out, (out, p_d, p_f, cd, cf, anchors)

    def bwd(self, res, ds):
        out, p_d, p_f, cd, cf, anchors = res
        ds = [
            [jnp.asarray(g, v.dtype) for g, v in zip(gs, vs, strict=True)]
            for gs, vs in zip(ds, out, strict=True)
        ]
        d_s, dp, dcd = self.backward(out, ds, p_d, p_f, cd, cf, anchors)
        return (
            d_s,
            dp,
            [_zeros_cotangent(v) for v in p_f],
            dcd,
            [[_zeros_cotangent(c) for c in cs] for cs in cf],
        )

    def primitive(self):
        """The stack as a function with this custom VJP (forward mode and vmap kept)."""
        return _vjp_primitive.custom_vjp(
            self.run, fwd=self.fwd, bwd=self.bwd, name="reversible_scan"
        )


# ------------------------------------------------------------------------------------------
# Public constructors.


def reversible(*fns: Callable[..., Any]) -> Coupling:
    """An additive coupling of ``len(fns)`` streams, invertible whatever the functions are.

    Two functions ``f, g`` give the RevNet block ``y1 = x1 + f(p, x2)``, ``y2 = x2 + g(p, y1)``;
    ``n`` functions give ``n`` streams, stream ``i`` updated by ``fns[i](p, *others)`` with the
    others' current values in stream order (RevSilo-style fusion). ``p`` is the layer's
    parameters. Use :meth:`Coupling.scan` (or :func:`reversible_scan`) to run a stack with
    activation memory independent of depth.

    Args:
      *fns: two or more functions ``fns[i](params, *other_streams) -> update of stream i``.

    Returns:
      A :class:`Coupling`.

    Raises:
      TypeError: fewer than two functions, or one that is not callable.

    Examples:
      >>> import jax.numpy as jnp
      >>> import jaxmem
      >>> fuse = jaxmem.reversible(  # three streams, each updated from the other two
      ...     lambda p, x2, x3: p * (x2 + x3),
      ...     lambda p, y1, x3: p * y1 * x3,
      ...     lambda p, y1, y2: jnp.sin(y1 + y2))
      >>> y = fuse(0.5, (jnp.ones(2), jnp.ones(2), jnp.zeros(2)))
      >>> [v.tolist() for v in y]
      [[1.5, 1.5], [1.0, 1.0], [0.5984721183776855, 0.5984721183776855]]
      >>> [v.tolist() for v in fuse.inverse(0.5, y)]
      [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]]
    """
    if len(fns) < 2:
        raise TypeError(
            f"jaxmem.reversible: a coupling needs at least two functions (two or more streams, "
            f"each updated from the others), got {len(fns)}"
        )
    for i, fn in enumerate(fns):
        checks.check_callable(fn, f"fns[{i}]", "jaxmem.reversible")
    return Coupling(tuple(fns))


def reversible_scan(
    f: Callable[..., Any],
    g: Callable[..., Any],
    streams: Sequence[Any],
    params: Any = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """A stack of RevNet layers ``y1 = x1 + f(p, x2)``, ``y2 = x2 + g(p, y1)`` (memory O(1)).

    ``reversible(f, g).scan(streams, params, **kwargs)``: see :meth:`Coupling.scan` for the
    arguments (``length``, ``anchor_every``, ``policy``, ``unroll``,
    ``compress``).

    Args:
      f: ``f(p, x2) -> array(s) like x1``, ``p`` the layer's slice of ``params``.
      g: ``g(p, y1) -> array(s) like x2``.
      streams: ``(x1, x2)``.
      params: per-layer inputs stacked along a leading layer axis.
      **kwargs: options of :meth:`Coupling.scan`.

    Returns:
      ``(y1, y2)`` after all layers.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> w = 0.1 * jnp.ones((8, 3, 3))  # 8 layers
      >>> def f(w, x2):
      ...     return jnp.tanh(x2 @ w)
      >>> def g(w, y1):
      ...     return jnp.tanh(y1 @ w.T)
      >>> def loss(w, x):
      ...     return jnp.sum(jaxmem.reversible_scan(f, g, x, w)[1] ** 2)
      >>> x = (jnp.ones((2, 3)), jnp.ones((2, 3)))
      >>> def direct(w, x):
      ...     x1, x2 = x
      ...     for l in range(8):
      ...         x1 = x1 + f(w[l], x2)
      ...         x2 = x2 + g(w[l], x1)
      ...     return jnp.sum(x2 ** 2)
      >>> bool(jnp.allclose(jax.grad(loss)(w, x), jax.grad(direct)(w, x), rtol=1e-5))
      True
    """
    checks.check_callable(f, "f", "jaxmem.reversible_scan")
    checks.check_callable(g, "g", "jaxmem.reversible_scan")
    return reversible(f, g).scan(streams, params, **kwargs)
