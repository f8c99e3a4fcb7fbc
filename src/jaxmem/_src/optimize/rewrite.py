"""The rewrite behind :func:`jaxmem.optimize`: a jaxpr evaluated equation by equation, each
``scan`` run as :func:`jaxmem.scan`.

The evaluator walks into the equations that hold a jaxpr a scan may sit in and re-emits them
with the same meaning: a call (``jit``) is inlined, ``jax.checkpoint`` (``remat2``, or the hijax
primitive of ``jax_remat3``) is applied again with its ``policy`` and ``prevent_cse``, ``cond``
becomes ``lax.switch`` over its branches, ``shard_map`` is applied again with its mesh and
specs. Everything else is bound as it is: a ``custom_vjp`` function (the user's own gradient), a
``custom_jvp`` function, a ``while`` loop.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from jaxmem._src import jax_compat as _jc
from jaxmem._src.chunking import tokens as _tokens
from jaxmem._src.frames import in_a_package
from jaxmem._src.scan import api as _scan_api

# The equations the evaluator walks into (Rewriter._eqn re-emits each); a scan under any other
# equation holding a jaxpr is left as it is (left_alone).
_ENTERED = frozenset({"scan", "remat2", "cond", "shard_map"}) | _jc.CALL_PRIMITIVES


@dataclasses.dataclass
class Found:
    """One ``scan`` equation the evaluator met (those it does not enter: :func:`left_alone`)."""

    source: str  # "file:line (function)" of the scan call, as the jaxpr records it
    called_from: str  # the innermost frame outside installed packages, when not ``source``
    length: int
    reverse: bool
    step: Callable | None = None  # the step, re-evaluated (for explain)
    unroll: int | bool = 1
    init: tuple = ()
    xs: tuple = ()


@dataclasses.dataclass
class Tokens:
    """What ``chunk_tokens=True`` shares between a trace and its evaluations: the lengths of
    the attentions swapped (:mod:`~jaxmem._src.optimize.swaps`: ``(T, S)`` each, and
    where), and what was chunked (``chunked``: one line per region, for ``explain``)."""

    attentions: list = dataclasses.field(default_factory=list)
    chunk_bytes: int = dataclasses.field(default_factory=lambda: _tokens.DEFAULT_CHUNK_BYTES)
    chunked: list = dataclasses.field(default_factory=list)
    _regions: dict = dataclasses.field(default_factory=dict)  # id(jaxpr) -> (jaxpr, regions)

    @property
    def lengths(self) -> set[int]:
        """The tokens' axis lengths: each attention's query and key lengths, and one less
        (a language model's loss reads ``logits[:, :-1]`` against ``tokens[:, 1:]``)."""
        return {n - k for t, s, _ in self.attentions for n in (t, s) for k in (0, 1) if n > k}

    def regions(self, jaxpr) -> list:
        key = id(jaxpr)
        if key not in self._regions or self._regions[key][0] is not jaxpr:
            found = _tokens.find_regions(jaxpr, sorted(self.lengths), self.chunk_bytes)
            self._regions[key] = (jaxpr, found)
            self.chunked.extend(_tokens.describe(jaxpr, r, self.chunk_bytes) for r in found)
        return self._regions[key][1]


@dataclasses.dataclass
class Rewriter:
    """Evaluates jaxprs with every reachable ``scan`` run as :func:`jaxmem.scan`.

    ``options(found) -> dict`` gives the keyword arguments of :func:`jaxmem.scan` for one scan
    (``recompute``, ``policy``, ``offload``, ``checkpoints``). ``found`` collects every scan met.
    ``only``: rewrite the scan of this index among those outside any scan's body (in the order
    met; the scans nested in it are rewritten with it), and bind the others as they are.
    """

    options: Callable[[Found], dict]
    found: list[Found] = dataclasses.field(default_factory=list)
    rewrite: bool = True
    only: int | None = None
    on_found: Callable[[Found], None] | None = None  # called with each scan outside any step
    # Name each value of a scan's step by its op kind (op_kind: "matmul_0", "norm_statistic_1",
    # ...), for a planner's choice of what to keep in a program that names none.
    op_names: bool = False
    # Per outermost scan: ``decide(found) -> (loop, step_remat, options)``; the scans nested in
    # its step follow its decision. ``loop``: how it runs, "jaxmem" (jaxmem.scan, the lean
    # residuals), "lax" (lax.scan over the re-evaluated step, under ``jax.checkpoint`` of the
    # options' policy) or "as written" (bound as it is). ``step_remat``: what its step does
    # with its own ``jax.checkpoint`` (a framework's remat), "keep" it or "drop" it (the step
    # runs without it; the options' ``policy``, if any, then decides what the gradient
    # recomputes). ``options(found)``: the keyword arguments of the loop. None: ("jaxmem",
    # "keep", ``options``) for every scan.
    decide: Callable[[Found], tuple[str, str, Callable]] | None = None
    # chunk_tokens=True: the token-wise regions of every jaxpr evaluated run in chunks of tokens.
    tokens: Tokens | None = None
    _kinds: dict = dataclasses.field(default_factory=dict)  # op kind -> values named so far
    _now: tuple | None = None  # the decision of the scan whose step is being evaluated
    _outer: int = 0  # scans met outside any scan's body so far
    _depth: int = 0  # scan bodies being evaluated

    def eval_closed(self, closed, args: Sequence) -> list:
        """Evaluates a closed jaxpr (0.10 ``ClosedJaxpr``, 0.12 ``Jaxpr``) on ``args``."""
        return self.eval(_jc.open_jaxpr(closed), _jc.jaxpr_consts(closed), args)

    def eval(self, jaxpr, consts: Sequence, args: Sequence, regions: bool = True) -> list:
        def apply(eqn, invals):
            with _jc.eqn_context(eqn):
                return self._eqn(eqn, invals)

        # A call's body (jit, inlined) is not chunked apart: its equation is row-wise as its
        # body is (rows.py walks into it) and joins a region of the jaxpr that calls it, where a
        # region of its own would hide the body from autochunk and from the caller's region.
        chunked = regions and self.tokens is not None and self.rewrite
        regions = self.tokens.regions(jaxpr) if chunked else []
        if regions:
            chunk_bytes = self.tokens.chunk_bytes
            run = lambda r, invals: _tokens.run_region(jaxpr, r, invals, chunk_bytes, "tokens")
            return _tokens.evaluate(jaxpr, consts, args, regions, apply, run)
        return _jc.eval_eqns(jaxpr, consts, args, apply)

    def _sub(self, jaxpr_like, regions: bool = True) -> Callable:
        """A function evaluating ``jaxpr_like`` (open or closed) with this rewriter."""
        if _jc.is_closed_jaxpr(jaxpr_like):
            consts = _jc.jaxpr_consts(jaxpr_like)
            return lambda *a: self.eval(_jc.open_jaxpr(jaxpr_like), consts, a, regions)
        return lambda *a: self.eval(jaxpr_like, [], a, regions)

    def _eqn(self, eqn, invals: list) -> list:
        name = eqn.primitive.name
        params = eqn.params
        if name == "scan" and not _made_by_jaxmem(eqn.source_info):
            return self._scan(eqn, invals)
        if name in _jc.CALL_PRIMITIVES:
            body = next(p for p in params.values() if _jc.is_jaxpr(p))
            return self._sub(body, regions=False)(*invals)
        if self.op_names and self._depth > 0 and _jc.rule_is_body_derivative(eqn):
            # jax 0.12's logsumexp / softmax (a custom_jvp call whose rule is its body's
            # derivative): evaluated as its body, as 0.10.2 writes it, so its values are named.
            return self._sub(params["call_jaxpr"])(*invals)
        remat3 = _jc.remat3_params(eqn)
        if name == "remat2" or remat3 is not None:
            jaxpr, policy, prevent_cse = remat3 or (
                params["jaxpr"],
                params["policy"],
                params["prevent_cse"],
            )
            if self._depth > 0 and self._now is not None and self._now[1] == "drop":
                return list(self._sub(jaxpr)(*invals))
            # jax.checkpoint takes one prevent_cse; remat3 may stage one per input (any: kept).
            prevent_cse = prevent_cse if isinstance(prevent_cse, bool) else any(prevent_cse)
            f = jax.checkpoint(self._sub(jaxpr), prevent_cse=prevent_cse, policy=policy)
            return list(f(*invals))
        if name == "cond":
            index, *ops = invals
            branches = [lambda *a, b=b: tuple(self._sub(b)(*a)) for b in params["branches"]]
            return list(jax.lax.switch(index, branches, *ops))
        if name == "shard_map":
            return _jc.rebind_shard_map(eqn, self._sub(params["jaxpr"]), invals)
        outs = _jc.bind_eqn(eqn, invals)
        kind = op_kind(eqn) if self.op_names and self._depth > 0 else None
        if kind is not None:
            i = self._kinds.get(kind, 0)
            self._kinds[kind] = i + 1
            outs = [checkpoint_name(o, f"{kind}_{i}") for o in outs]
        return outs

    def _scan(self, eqn, invals: list) -> list:
        return self.scan(eqn.params, eqn.source_info, invals, lambda: _jc.bind_eqn(eqn, invals))

    def scan(self, params: dict, source_info, invals: list, as_it_is: Callable) -> list:
        """A scan of these parameters (an equation's, or a bind's) on ``invals``: run as
        :func:`jaxmem.scan` unless left as it is (``as_it_is()``); recorded in ``found``."""
        n_consts, n_carry = _jc.scan_counts_of(params)
        consts, init, xs = (
            invals[:n_consts],
            invals[n_consts : n_consts + n_carry],
            invals[n_consts + n_carry :],
        )
        body = self._sub(params["jaxpr"])
        decision: list = []  # (loop, step_remat, options), once decided below

        def step(carry, x):
            if self._depth == 0:
                self._kinds.clear()  # each outermost step's values numbered from 0
            self._depth += 1
            outer, self._now = self._now, decision[0] if decision else self._now
            try:
                outs = body(*consts, *carry, *(x or ()))
            finally:
                self._depth -= 1
                self._now = outer
            return list(outs[:n_carry]), list(outs[n_carry:])

        found = Found(
            *_sources(source_info),
            length=params["length"],
            reverse=bool(params["reverse"]),
            step=step,
            unroll=params["unroll"],
            init=tuple(init),
            xs=tuple(xs),
        )
        self.found.append(found)
        skipped = False
        if self._depth == 0:
            if self.on_found is not None:
                self.on_found(found)
            skipped = self.only is not None and self._outer != self.only
            self._outer += 1
        if not self.rewrite or skipped:
            return as_it_is()
        if self._depth == 0 and self.decide is not None:
            decision.append(self.decide(found))
        elif self._now is not None:  # nested in a decided scan's step: its decision
            decision.append(self._now)
        else:
            decision.append(("jaxmem", "keep", self.options))
        loop, _, options_of = decision[0]
        if loop == "as written":
            return as_it_is()
        run = _scan_api.lax_scan if loop == "lax" else _scan_api.scan
        options = options_of(found)
        if loop == "lax":
            options = {"policy": options.get("policy")}
        carry, ys = run(
            step,
            list(init),
            list(xs) if xs else None,
            length=params["length"],
            reverse=bool(params["reverse"]),
            unroll=params["unroll"],
            **options,
        )
        return [*carry, *ys]


# Op kinds a planner chooses among (op_kind), by primitive.
_KINDS = {
    "rsqrt": "norm_statistic",
    "sqrt": "norm_statistic",
    "tanh": "activation",
    "logistic": "activation",
    "erf": "activation",
    "exp": "exponential",
}


def op_kind(eqn) -> str | None:
    """The kind of value an equation makes, for names a planner chooses among: a matmul
    ("matmul"; "batched_matmul" with batch dimensions: attention's ``q k^T`` and ``probs v``), a
    norm's statistic, an activation, an exponential (a softmax's); None for the rest."""
    name = eqn.primitive.name
    if name == "dot_general":
        (_, _), (batch, _) = eqn.params["dimension_numbers"]
        return "batched_matmul" if batch else "matmul"
    return _KINDS.get(name)


def _sources(source_info) -> tuple[str, str]:
    """The scan call's line, and the line outside installed packages (a library's: Flax's,
    Equinox's) that led to it when they differ."""
    source = _jc.summarize_source(source_info)
    frames = _jc.user_frames(source_info)
    caller = next((f for f in frames if not in_a_package(f.file_name)), None)
    if caller is None or caller is frames[0]:
        return source, ""
    return source, f"{caller.file_name}:{caller.start_line} ({caller.function_name})"


_JAXMEM = str(pathlib.Path(__file__).resolve().parents[2])  # the jaxmem package's folder


def _made_by_jaxmem(source_info) -> bool:
    """Whether a scan is one of jaxmem's own loops (a lean VJP's, of a scan that the function
    differentiates itself: :mod:`~jaxmem._src.optimize.intercept`), or one a rewriter bound
    already (a scan the function differentiates itself, run as its setting says), bound as it
    is."""
    frames = _jc.user_frames(source_info)
    if not frames:
        return False
    path = frames[0].file_name
    return jaxmem_own(path) or os.path.realpath(path) == _THIS_FILE


def jaxmem_own(path: str) -> bool:
    """Whether a source file is jaxmem's own, outside this subpackage: the scans its code binds
    are jaxmem's loops, not the optimized function's (this subpackage evaluates those)."""
    return path.startswith(_JAXMEM + os.sep) and not path.startswith(_OPTIMIZE + os.sep)


_OPTIMIZE = str(pathlib.Path(__file__).resolve().parent)
_THIS_FILE = os.path.realpath(__file__)


def left_alone(jaxpr) -> list[tuple[str, str]]:
    """``(source, why)`` of every scan under an equation the rewrite does not enter."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _ENTERED or _jc.remat3_params(eqn) is not None:
            for sub in _jc.subjaxprs(eqn):
                out += left_alone(sub)
            continue
        for sub in _jc.subjaxprs(eqn):
            for source in _scans(sub):
                out.append((source, f"inside {name} (left as it is)"))
    return out


def _scans(jaxpr) -> list[str]:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(_jc.summarize_source(eqn.source_info))
        for sub in _jc.subjaxprs(eqn):
            out += _scans(sub)
    return out
