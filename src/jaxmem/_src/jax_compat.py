"""The one door to JAX's internals: everything jaxmem needs beyond JAX's public API.

No other module of jaxmem imports ``jax._src`` (``tests/test_api.py`` fails if one does). What
can come from public or ``jax.extend`` APIs comes from there, through the names below, so that a
JAX release that moves something has exactly one place to land. Each name says where it comes
from, why, and in which versions it differs. Tested on jax 0.10.2 and 0.12.0.1.

Jaxprs: jax 0.12 merged ``ClosedJaxpr`` into ``Jaxpr`` (a jaxpr carries its constants; its
``.jaxpr`` is itself), and ``jax._src.core.ClosedJaxpr`` no longer exists. On 0.10.x a closed
jaxpr wraps an open one. :func:`closed_jaxpr`, :func:`open_jaxpr` and :func:`jaxpr_consts` hide
the difference: code here takes a closed jaxpr apart into ``(jaxpr, consts)`` and builds one
back, never touching either class directly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as _xcore
from jax.extend import source_info_util as _siu
from jax.extend.core import primitives as _prims

# --- public (jax.extend / jax.core) names, re-exported so that callers have one import ----------

Var = _xcore.Var  # jax.extend.core; constructor: 0.10 Var(aval, qdd...), 0.12 Var(aval).
jaxpr_as_fun = _xcore.jaxpr_as_fun  # jax.extend.core: runs a closed jaxpr with JAX's evaluator.
concrete_or_error = _xcore.concrete_or_error  # jax.extend.core
Tracer = jax.core.Tracer  # jax.core (public, stable)
ShapedArray = jax.core.ShapedArray  # jax.core (public, stable)
summarize_source = _siu.summarize  # jax.extend.source_info_util: "file:line:col (fn)"

device_put_p = _prims.device_put_p  # jax.extend.core.primitives
scan_p = _prims.scan_p  # jax.extend.core.primitives: lax.scan's primitive
current_source_info = _siu.current  # jax.extend.source_info_util: the caller's SourceInfo
register_source_exclusion = _siu.register_exclusion  # jax.extend.source_info_util
name_p = _prims.name_p  # jax.extend.core.primitives: checkpoint_name's primitive

# Primitive names that run a sub-jaxpr as a call: "jit" (0.10, 0.12; "pjit" before), 0.10's
# "closed_call"/"core_call", and 0.12's "eval_jaxpr" (which replaced them).
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call", "eval_jaxpr"})
# A ``jax.custom_jvp`` function (0.10.2 and 0.12): its body the ``call_jaxpr`` parameter, its
# rule :func:`custom_jvp_rule`. On 0.12 ``jax.nn.logsumexp`` and ``softmax`` are such functions.
CUSTOM_JVP_PRIMITIVES = frozenset({"custom_jvp_call"})
LOOP_PRIMITIVES = frozenset({"scan", "while"})


def is_float(x: Any) -> bool:
    """Whether ``x`` has an inexact (floating or complex) dtype: the values that have tangents.
    ``x`` is an array, a Python scalar, an aval, or a jaxpr variable or literal (its ``aval``);
    False for what has no dtype (tokens) and for extended dtypes (PRNG keys)."""
    aval = getattr(x, "aval", x)
    dtype = getattr(aval, "dtype", None)
    if dtype is None:
        if not isinstance(x, (bool, int, float, complex)):
            return False
        dtype = np.result_type(x)
    return bool(jax.dtypes.issubdtype(dtype, np.inexact))


# XLA:CPU assigns buffers and counts FLOPs on the optimized HLO, before LLVM compiles it, so
# memory_analysis() and cost_analysis() do not depend on LLVM's optimization level; level 0
# compiles faster (tests/optimize/test_optimize_budget.py and tests/scan/test_scan_unrolled.py
# check the figures against a default compile).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def compile_to_measure(lowered):
    """``lowered.compile()`` for its memory and cost analyses, not to run: at XLA:CPU's fast
    backend level on CPU (the same figures), the default elsewhere."""
    if jax.default_backend() == "cpu":
        return lowered.compile(FAST_COMPILE)
    return lowered.compile()


# ``jax.lax.scan`` as JAX defines it, for every loop jaxmem runs. Users swap a library's loops
# with ``jax.lax.scan = jaxmem.scan``; a loop of jaxmem's called through the public name would
# then call jaxmem.scan again, without end. Private: ``jax._src.lax.control_flow.loops.scan``
# (the function ``jax.lax.scan`` re-exports, 0.10.2 and 0.12).
from jax._src.lax.control_flow import loops as _loops  # noqa: E402

lax_scan = _loops.scan

# jax.nn.dot_product_attention's module: its XLA path calls the module's
# ``_dot_product_attention_xla`` by name (0.10.2, 0.12). Private: ``jax._src.nn.functions``.
from jax._src.nn import functions as nn_functions  # noqa: E402, F401


def without_source_traceback():
    """Context in which the equations traced carry an empty traceback (no source location).
    For the per-shard program a ``custom_partitioning`` callback returns. XLA 0.10.2 merges that
    program's stack frames into the caller's without renumbering them; when the caller's own
    Python stack was deep enough (about 30 user frames at the call: pytest-xdist's) the merged
    frame table had a cycle and the CPU compiler's WhileLoopSimplifier (CallInliner ->
    PropagateCallMetadata -> StackFrames::IsPrefix) walked it forever. Without frames in the
    callback's program there is nothing to merge. Private: ``jax._src.lib.xla_client.Traceback()``
    (an empty traceback, 0.10.2 and 0.12); ``user_context`` is public (``jax.extend``)."""
    from jax._src.lib import xla_client

    return _siu.user_context(xla_client.Traceback(), name_stack=_siu.current_name_stack())


def is_closed_jaxpr(x: Any) -> bool:
    """Whether ``x`` is a closed jaxpr (0.10: ``ClosedJaxpr``; 0.12: a ``Jaxpr``, always closed)."""
    return isinstance(x, _xcore.ClosedJaxpr)


def is_jaxpr(x: Any) -> bool:
    """Whether ``x`` is an (open or closed) jaxpr."""
    return isinstance(x, (_xcore.Jaxpr, _xcore.ClosedJaxpr))


def open_jaxpr(closed) -> Any:
    """The open jaxpr of a closed one (0.12: the jaxpr itself)."""
    return closed.jaxpr


def jaxpr_consts(closed) -> list:
    """The constant values of a closed jaxpr, in the order of its ``constvars``."""
    return list(closed.consts)


def closed_jaxpr(jaxpr, consts: Sequence) -> Any:
    """Closes ``jaxpr`` over ``consts`` (values of its ``constvars``, in order).
    0.10: ``ClosedJaxpr(jaxpr, consts)``. 0.12: ``ClosedJaxpr`` is ``Jaxpr`` and
    ``Jaxpr(jaxpr, consts)`` copies ``jaxpr`` with these constants."""
    return _xcore.ClosedJaxpr(jaxpr, list(consts))


def make_jaxpr(
    jaxpr_like, *, constvars=None, invars=None, outvars=None, eqns=None, effects=None
) -> Any:
    """A new open jaxpr from the parts of ``jaxpr_like``, with the given parts replaced.
    Built with the public ``jax.extend.core.Jaxpr`` constructor (both versions accept
    ``Jaxpr(constvars, invars, outvars, eqns, effects, debug_info)``; on 0.12 the result carries
    no constants, so close it with :func:`closed_jaxpr`)."""
    j = open_jaxpr(jaxpr_like) if is_closed_jaxpr(jaxpr_like) else jaxpr_like
    eqns = list(j.eqns if eqns is None else eqns)
    if effects is None:
        effects = frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset()
    invars = list(j.invars if invars is None else invars)
    outvars = list(j.outvars if outvars is None else outvars)
    debug_info = _xcore.DebugInfo(
        "jaxmem", "jaxmem plan", ("",) * len(invars), ("",) * len(outvars)
    )
    return _xcore.Jaxpr(
        list(j.constvars if constvars is None else constvars),
        invars,
        outvars,
        eqns,
        effects,
        debug_info,
    )


def new_var(aval) -> Any:
    """A fresh jaxpr variable of type ``aval`` (the constructor's extra 0.10 arguments default)."""
    return _xcore.Var(aval)


def is_var(v) -> bool:
    """Whether ``v`` is a jaxpr variable (not a literal)."""
    return isinstance(v, _xcore.Var)


def is_drop_var(v) -> bool:
    """Whether ``v`` is an equation output nothing reads (``_`` in a printed jaxpr)."""
    return type(v).__name__ == "DropVar"


def subjaxprs(eqn) -> list:
    """The open jaxprs in an equation's parameters (loop bodies, called functions, branches),
    those of a hijax primitive's parameters included (a ``jaxmem_scan``'s step)."""
    out = []
    params = list(eqn.params.values())
    hi = eqn.params.get("_prim")
    if isinstance(getattr(hi, "params", None), dict):
        params += list(hi.params.values())
    for param in params:
        for sub in param if isinstance(param, (tuple, list)) else (param,):
            if is_jaxpr(sub):
                out.append(open_jaxpr(sub) if is_closed_jaxpr(sub) else sub)
    return out


def remat3_params(eqn):
    """``(jaxpr, policy, prevent_cse)`` of a ``jax.checkpoint`` staged under ``jax_remat3``, else
    None.
    With ``jax_remat3`` on (0.10.2 and 0.12), ``jax.checkpoint`` stages a hijax primitive,
    ``call_hi_primitive[_prim=RematTraced]``, in place of ``remat2``; its ``jaxpr`` is the
    function checkpointed, ``prevent_cse`` a bool or one per input (0.10.2's has none: True, the
    default). Private: ``jax._src.ad_checkpoint.RematTraced`` (by class name and attributes)."""
    if eqn.primitive.name != "call_hi_primitive":
        return None
    prim = eqn.params.get("_prim")
    if type(prim).__name__ != "RematTraced":
        return None
    return prim.jaxpr, prim.policy, getattr(prim, "prevent_cse", True)


def eqn_checkpoint_name(eqn) -> str | None:
    """The name an equation gives its output with ``checkpoint_name``, or None.
    0.10 and 0.12: ``name_p`` with a ``name`` parameter. 0.12 can also stage the name as a
    higher-order call whose ``_prim`` parameter carries ``.name`` (``CheckpointName``)."""
    if eqn.primitive is name_p:
        return eqn.params["name"]
    prim = eqn.params.get("_prim")
    name = getattr(prim, "name", None)
    if type(prim).__name__.startswith("CheckpointName") and isinstance(name, str):
        return name
    return None


# --- types -----------------------------------------------------------------------------------


def struct(aval) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct`` of an abstract value to trace with.
    Keeps the shape, dtype, weak type, sharding (an Explicit mesh's sharding in types) and manual
    axis type (the varying manual axes inside ``shard_map``, "vma"), so that what is traced from
    it types like the value it stands for. The memory space is not kept (a body traced from
    host-resident inputs computes on device; offload is explicit). ``manual_axis_type`` is the
    name of both versions (0.10 and 0.12) for what ``jax.typeof(x).mat`` holds."""
    kwargs = {}
    sharding = getattr(aval, "sharding", None)
    if sharding is not None:
        kwargs["sharding"] = sharding
    mat = getattr(aval, "mat", None)
    if mat is not None:
        kwargs["manual_axis_type"] = mat
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False), **kwargs
    )


def unstacked(aval, length: int):
    """The type of one slice ``x[t]`` of a value of type ``aval`` (length ``length`` first axis),
    as ``lax.scan`` types its body's ``x``: sharding and manual axes kept, the leading axis's
    partition dropped.
    Private: ``jax._src.core.mapped_leading_aval`` (0.10 and 0.12)."""
    from jax._src import core

    return core.mapped_leading_aval(length, aval)


def stacked(aval, length: int):
    """The type of ``length`` values of type ``aval`` stacked on a new leading axis (as
    ``lax.scan`` types its ys): the leading axis unpartitioned.
    Private: ``jax._src.core.unmapped_aval`` (0.10 and 0.12)."""
    from jax._src import core

    return core.unmapped_aval(length, 0, aval)


def zeros(aval):
    """An array of zeros of type ``aval``: its sharding (Explicit meshes) and its varying manual
    axes (inside ``shard_map``) included, as a cotangent of a value of that type must be.
    Private: ``jax._src.ad_util.zeros_like_aval`` (0.10 and 0.12), what JAX's own AD
    instantiates symbolic zeros with."""
    from jax._src import ad_util

    return ad_util.zeros_like_aval(aval)


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``jax.shard_map`` (its "vma"); empty outside.
    ``jax.typeof(x).manual_axis_type.varying`` (0.10 and 0.12): an attribute of the public
    ``jax.typeof`` that JAX does not document. A custom VJP inside ``shard_map(check_vma=True)``
    needs it to return each cotangent varying over exactly the axes its input varies over."""
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def typematch(a, b) -> bool:
    """Same shape and dtype, weak type ignored (as ``jax._src.core.typematch`` for arrays)."""
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype


@functools.cache
def _extended_itemsize(dtype) -> int:
    # An extended dtype (a typed PRNG key) is stored as its physical representation; its
    # per-element size is what key_data gives (public API, both versions).
    phys = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return int(np.prod(phys.shape, dtype=np.int64)) * np.dtype(phys.dtype).itemsize


def nbytes(aval) -> int:
    """Bytes of an array value of type ``aval`` (0 for tokens and ``float0``)."""
    if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
        return 0
    size = int(np.prod(aval.shape, dtype=np.int64))
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
        return size * _extended_itemsize(aval.dtype)
    dtype = np.dtype(aval.dtype)
    if dtype == jax.dtypes.float0:
        return 0
    return size * dtype.itemsize


def is_host(aval) -> bool:
    """Whether an abstract value lives in host memory (``jax.memory.Space.Host``)."""
    return getattr(aval, "memory_space", None) == jax.memory.Space.Host


# --- private names, each with its reason ------------------------------------------------------


def user_frame(source_info):
    """The innermost user frame of an equation (``file_name``, ``start_line``, ``function_name``).
    Private: ``jax._src.source_info_util.user_frame`` (same in 0.10 and 0.12). The public
    ``summarize`` gives only a formatted string; this gives the parts without parsing it."""
    from jax._src import source_info_util

    return source_info_util.user_frame(source_info.traceback)


def user_frames(source_info) -> list:
    """The user frames of an equation's traceback, innermost first (JAX's own filtered out):
    each with ``file_name``, ``start_line``, ``function_name``.
    Private: ``jax._src.source_info_util.user_frames`` (same in 0.10 and 0.12)."""
    from jax._src import source_info_util

    return list(source_info_util.user_frames(source_info.traceback))


def reverse_mode_trace() -> bool:
    """Whether what is bound now is being differentiated in reverse mode (``jax.grad``,
    ``value_and_grad``, ``vjp``, ``linearize``), not under forward mode.
    Private: ``jax._src.core.trace_ctx.trace`` (the current trace), each trace's
    ``parent_trace``, ``jax._src.interpreters.ad.LinearizeTrace`` (what ``jax.vjp`` traces with,
    ``jax_use_direct_linearize`` on by default) and ``JVPTrace`` (``jax.jvp``, ``jacfwd``): the
    same on 0.10.2 and 0.12. A ``LinearizeTrace`` on the chain and no ``JVPTrace``."""
    from jax._src import core
    from jax._src.interpreters import ad

    trace, linearized = core.trace_ctx.trace, False
    while trace is not None:
        if isinstance(trace, ad.JVPTrace):
            return False
        linearized = linearized or isinstance(trace, ad.LinearizeTrace)
        trace = getattr(trace, "parent_trace", None)
    return linearized


def trace_state_clean() -> bool:
    """Whether no transformation is being traced (eager, outside jit/grad/vmap).
    Private: ``jax._src.core.trace_state_clean`` (same in 0.10 and 0.12); JAX has no public way to
    ask whether a call happens inside a trace."""
    from jax._src import core

    return core.trace_state_clean()


@contextlib.contextmanager
def persistent_cache_off() -> Iterator[None]:
    """Compilations inside skip JAX's persistent compilation cache (neither read nor written).

    XLA dumps only what it compiles, and JAX leaves the dump options out of the cache key: with the
    cache on, a compilation meant to dump can be served an executable compiled without them.
    Private: ``jax._src.compilation_cache``'s ``_cache_checked`` / ``_cache_used``, behind
    ``_cache_initialized_mutex`` (0.10 and 0.12): whether this process uses the cache, decided
    once and kept there; no public switch takes effect after the first compilation. Elsewhere
    (a JAX without these names) nothing changes, and a dump the cache skipped is reported by the
    reader.
    """
    try:
        from jax._src import compilation_cache as cc
    except ImportError:
        cc = None
    names = ("_cache_initialized_mutex", "_cache_checked", "_cache_used")
    if cc is None or not all(hasattr(cc, n) for n in names):
        yield
        return
    lock = cc._cache_initialized_mutex
    with lock:
        saved = cc._cache_checked, cc._cache_used
        cc._cache_checked, cc._cache_used = True, False
    try:
        yield
    finally:
        with lock:
            cc._cache_checked, cc._cache_used = saved


def scan_counts(eqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    0.10: the ``num_consts`` and ``num_carry`` parameters. 0.12: the ``ft_in`` parameter, a
    flat tree of the body's inputs grouped as ``(consts, carry, xs)``: a tuple of three trees
    where the user called ``lax.scan``, a pytree of three subtrees in the scans JAX builds (a
    transpose groups its consts as ``(residuals, cotangents)``), filtered where partial
    evaluation or DCE dropped inputs. ``FlatTree.unpack`` reads every form.
    """
    return scan_counts_of(eqn.params)


def scan_counts_of(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` by its parameters (:func:`scan_counts`)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))


def zero_cotangent(aval):
    """A symbolic zero cotangent for an output of type ``aval``, for the function ``jax.vjp``
    returns.
    Private: ``jax.interpreters.ad.Zero`` (0.10 and 0.12). ``jax.vjp``'s function accepts it in
    place of an array (``is_leaf=isinstance(x, ad.Zero)`` in its cotangent flattening) and its
    transpose then skips every equation whose output cotangents are all zero, so residuals only
    those equations read are not read. The public ``jax.custom_derivatives.SymbolicZero`` (what
    a ``symbolic_zeros=True`` custom VJP receives) is a different class and is rejected there."""
    from jax.interpreters import ad

    return ad.Zero(aval.to_ct_aval())


def trace_keyed_state(name: str, default: Any, help: str):
    """A context-manager state that JAX's jit and trace caches key on (its value must hash).

    ``jax._src.config.string_or_object_state(..., include_in_jit_key=True,
    include_in_trace_context=True)`` (same signature on 0.10.2 and 0.12.0.1): a value set with
    ``with state(value):`` is part of ``jax.jit``'s cache key and of the trace caches (e.g.
    ``lax.scan``'s body traces), so a function jitted under one value is traced again under
    another. No public API gives this; :mod:`jaxmem._src.remat.auto` needs it so that a plan applied
    with ``jaxmem.use_plan`` reaches functions jitted before the block.
    """
    from jax._src import config as _config

    return _config.string_or_object_state(
        name, default, help, include_in_jit_key=True, include_in_trace_context=True
    )


# --- hijax: jaxmem's loops as primitives ------------------------------------------------------

from jax.experimental import hijax as _hijax  # noqa: E402

# The base class of a primitive with its own rules (evaluation, VJP, JVP, batching, DCE, remat):
# ``HiPrim`` on jax 0.12, ``VJPHiPrimitive`` on 0.10.2 (JAX main has both names). The rules
# jaxmem defines (``expand``, ``vjp_fwd``, ``vjp_bwd_retval``, ``jvp``, ``lin``/``linearized``,
# ``batch``) have the same signatures on both; ``dce`` and ``remat`` (not overridden) differ.
HiPrimitive = getattr(_hijax, "HiPrim", None) or _hijax.VJPHiPrimitive

# jax 0.10.2's lowering of a hijax primitive (``partial_eval.lower_jaxpr``) checks for leaked
# tracers while its own frame still holds the last lowered values (``maybe_invals`` and the
# walrus ``t`` of its loop, reset in 0.11): under ``jax.check_tracer_leaks`` every primitive whose
# output feeds a later operation is reported as a leak. A false report, but it fails the lowering.
_LOWERING_REPORTS_LEAKS = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)


def hiprim_usable() -> bool:
    """Whether jaxmem's loops and losses bind as hijax primitives in this trace.

    Everywhere except on jax 0.10.2 with ``jax_check_tracer_leaks`` on (read when the function is
    traced), where the lowering above fails: there they are ``jax.custom_vjp`` functions (the same
    values and gradients; forward mode raises JAX's error).

    Private: ``jax._src.config.check_tracer_leaks`` (the value of the flag or of the
    ``jax.check_tracer_leaks`` context in effect; 0.10.2).
    """
    if not _LOWERING_REPORTS_LEAKS:
        return True
    from jax._src import config as _config

    return not _config.check_tracer_leaks.value


def _symbolic_zero_types() -> tuple:
    from jax.custom_derivatives import SymbolicZero
    from jax.interpreters import ad

    return (ad.Zero, SymbolicZero)


# Symbolic zeros: JAX's internal ``ad.Zero`` (what a hijax rule receives) and the public
# ``jax.custom_derivatives.SymbolicZero`` (what a ``symbolic_zeros=True`` custom VJP receives).
SymbolicZeroTypes = _symbolic_zero_types()


def is_differentiated(x) -> bool:
    """Whether ``x`` is a tracer of an enclosing differentiation (a JVP or linearize trace:
    ``jax.hessian``, grad of grad), not of ``jit``/``vmap`` alone. The tracer classes are
    private (``jax._src.interpreters.ad.JVPTracer`` and ``LinearizeTracer``, 0.10.2 and 0.12),
    so they are matched by name."""
    return type(x).__name__ in ("JVPTracer", "LinearizeTracer")


def is_symbolic_zero(t) -> bool:
    """Whether ``t`` is a symbolic zero (internal ``ad.Zero`` or public ``SymbolicZero``)."""
    return isinstance(t, SymbolicZeroTypes)


def zero_tangent_value(aval):
    """An array of zeros, the tangent of a primal of type ``aval``: its sharding and varying
    manual axes kept; float0 for an integer or boolean primal."""
    if jax.dtypes.issubdtype(aval.dtype, np.inexact):
        return zeros(aval.to_tangent_aval())
    return np.zeros(aval.shape, jax.dtypes.float0)


def instantiate_tangent(primal, tangent):
    """``tangent``, a symbolic zero made :func:`zero_tangent_value` of ``primal``'s type."""
    return zero_tangent_value(jax.typeof(primal)) if is_symbolic_zero(tangent) else tangent


def to_symbolic_zero(zero):
    """The public ``SymbolicZero`` for an internal ``ad.Zero`` (what jaxmem's VJP rules test)."""
    from jax.custom_derivatives import SymbolicZero

    if isinstance(zero, SymbolicZero):
        return zero
    return SymbolicZero(zero.aval)


def zero_tangent(aval):
    """A symbolic zero tangent (``ad.Zero``) for a primal of type ``aval``, for a JVP rule."""
    from jax.interpreters import ad

    return ad.Zero(aval.to_tangent_aval())


def vmap_axis_params(axis_data) -> dict:
    """``jax.vmap``'s keywords for the axis a batching rule batches over (``AxisData``: size,
    name, and the SPMD or Explicit mesh axis; 0.10.2 and 0.12 alike)."""
    return dict(
        axis_size=axis_data.size,
        axis_name=axis_data.name,
        spmd_axis_name=axis_data.spmd_name or getattr(axis_data, "explicit_mesh_axis", None),
    )


def _lin_by_jvp(self, nzs_in, *primals):
    del nzs_in
    return self(*primals), primals


def _linearized_by_jvp(self, primals, *tangents):
    return self.jvp(primals, tangents)[1]


# ``lin, linearized = LINEARIZE_FROM_JVP`` in a hijax primitive with a ``jvp`` rule:
# ``jax.experimental.hijax.linearize_from_jvp`` on jax 0.12 (the JVP partially evaluated: the
# linear map keeps what it needs); on 0.10.2, which has no such helper, the linear map runs the
# JVP again from the primals.
LINEARIZE_FROM_JVP = getattr(_hijax, "linearize_from_jvp", None) or (
    _lin_by_jvp,
    _linearized_by_jvp,
)


def _batching_markers():
    from jax._src.interpreters import batching

    return batching.infer, batching.sum_axis


# ``jax.vmap`` out_axes markers (private: ``jax._src.interpreters.batching``, 0.10.2 and 0.12):
# BATCH_INFER lets vmap choose an output's batch axis and return it (``(out, axes)``), as JAX's
# own hijax batching rules use it; BATCH_SUM sums a cotangent over the batch (with
# ``sum_match=True``), for an input that was not batched.
BATCH_INFER, BATCH_SUM = _batching_markers()


def in_forward_mode() -> bool:
    """Whether the current trace is under a user's forward-mode transformation (``jax.jvp``,
    ``jax.jacfwd``, ``jax.linearize``): JAX records it in the name stack as ``jvp(...)``
    (``jax.extend.source_info_util``; 0.10.2 and 0.12). A JVP rule that JAX calls to
    linearize by JVP and partial evaluation (inside ``jax.checkpoint``) is not under one."""
    return "jvp(" in str(_siu.current_name_stack())


def _grad_accum():
    from jax.interpreters import ad

    return (
        getattr(ad, "GradAccum", None)
        or __import__("jax._src.interpreters.ad", fromlist=["GradAccum"]).GradAccum
    )


# The accumulator a hijax transpose rule receives for each linear input (``accum(value)``);
# private: ``jax._src.interpreters.ad.GradAccum`` (0.10.2 and 0.12).
GradAccum = _grad_accum()


# --- re-evaluating jaxprs (the step plan, the chunked loss tails, jaxmem.optimize) ----------------


def eval_eqns(jaxpr, consts: Sequence, args: Sequence, apply: Callable) -> list:
    """Evaluates the open ``jaxpr`` on ``consts`` and ``args`` as ``jax.core.eval_jaxpr`` does,
    with ``apply(eqn, invals)`` giving each equation's outputs (a list).

    ``apply`` returning None skips the equation: its outputs stay unset, so nothing evaluated
    later may read them. The one loop under jaxmem's evaluators, which differ only in what they
    do with an equation (bind it, inline a call, rewrite a scan).
    """
    env: dict = {}

    def read(v):
        return env[v] if is_var(v) else v.val

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        outs = apply(eqn, [read(v) for v in eqn.invars])
        if outs is None:
            continue
        for v, x in zip(eqn.outvars, outs, strict=True):
            if not is_drop_var(v):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def bind_eqn(eqn, invals: Sequence, params: dict | None = None) -> list:
    """``eqn``'s primitive bound to ``invals`` (with ``params``, by default the equation's own
    bind parameters); its outputs as a list."""
    if params is None:
        params = eqn.primitive.get_bind_params(eqn.params)
    out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def custom_jvp_rule(eqn) -> tuple[Any, list, list]:
    """``(open jaxpr, consts, out_zeros)`` of a custom_jvp function's rule, no tangent zero: the
    primals (less the ``num_consts`` constants) then their tangents in, the primal outputs then
    the tangents not in ``out_zeros`` out. Private: ``jvp_jaxpr_fun``, a memoized
    ``WrappedFun`` of which tangents are zero (0.10.2 and 0.12)."""
    n = len(eqn.invars) - eqn.params["num_consts"]
    jaxpr, consts, out_zeros = eqn.params["jvp_jaxpr_fun"].call_wrapped(*[False] * n)
    return jaxpr, list(consts), list(out_zeros)


def rule_is_body_derivative(eqn) -> bool:
    """Whether ``eqn`` is a custom_jvp function of JAX's whose rule is its body's derivative as
    written wherever its value is finite: 0.12's ``logsumexp`` (``_logsumexp_impl``, whose body
    stops the gradient of its maximum) and ``softmax`` (``_softmax``, invariant to the maximum it
    subtracts), this one only without ``where`` (unchecked). Known by the source JAX records for
    the body, as private ``api_util.fun_sourceinfo`` writes it (``jax._src.ops.special``)."""
    if eqn.primitive.name not in CUSTOM_JVP_PRIMITIVES:
        return False
    info = getattr(open_jaxpr(eqn.params["call_jaxpr"]).debug_info, "func_src_info", None)
    most = _body_derivative_rules().get(info)  # the most inputs for which it holds
    return most is not None and len(eqn.invars) - eqn.params["num_consts"] <= most


@functools.cache
def _body_derivative_rules() -> dict[str, int]:
    from jax._src import api_util
    from jax._src.ops import special

    found = [(getattr(special, n, None), k) for n, k in (("_logsumexp_impl", 3), ("_softmax", 1))]
    return {api_util.fun_sourceinfo(f.fun): k for f, k in found if hasattr(f, "fun")}


def call_body(eqn) -> tuple[Any, list]:
    """The open jaxpr and the constants of a call's (``jit``'s) one body."""
    (body,) = [p for p in eqn.params.values() if is_jaxpr(p)]
    if is_closed_jaxpr(body):
        return open_jaxpr(body), jaxpr_consts(body)
    return body, []


# --- re-evaluating an equation (jaxmem.optimize) ---------------------------------------------


def eqn_context(eqn):
    """The context JAX evaluates ``eqn`` in (its source line and name stack, its own context
    manager), as ``jax.core.eval_jaxpr`` does (0.10.2 and 0.12)."""
    stack = contextlib.ExitStack()
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    stack.enter_context(_siu.user_context(eqn.source_info.traceback, name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def rebind_shard_map(eqn, body, invals):
    """A ``shard_map`` equation applied to ``invals`` with ``body`` (a function of the per-shard
    values) in place of its jaxpr: the same mesh, specs, ``check_vma`` and manual axes (the
    parameters are the same in 0.10.2 and 0.12)."""
    p = eqn.params
    f = jax.shard_map(
        lambda *a: tuple(body(*a)),
        mesh=p["mesh"],
        in_specs=p["in_specs"],
        out_specs=p["out_specs"],
        check_vma=p["check_vma"],
        axis_names=set(p["newly_manual_axes"]),
    )
    return list(f(*invals))
