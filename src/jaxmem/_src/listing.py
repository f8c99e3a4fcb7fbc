"""One structured listing of the residuals a gradient saves, built from the linearized jaxpr.

:func:`saved_residuals` traces ``jax.vjp`` of a function (nothing is compiled or run) and
returns, for every value the VJP closes over, a :class:`SavedResidual`: its type and bytes, where
it comes from (an argument, named by its pytree path; a constant; the output of an equation,
with the primitive, the checkpoint name if any, and the user's source line), and its origin class
(``argument``, ``constant``, ``loop-stacked``, ``other``). It sees what
``jax.ad_checkpoint.print_saved_residuals`` prints, as data: :func:`jaxmem.profile`, the scan
plans, the benchmarks and the tests all read this one listing.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxmem._src import jax_compat as jc

ORIGINS = ("argument", "constant", "loop-stacked", "other")
"""The residual origins, in the order tables and totals list them."""


@dataclasses.dataclass(frozen=True)
class SavedResidual:
    """One value the VJP of a function keeps for its backward pass (internal).

    Attributes:
      shape: the residual's shape.
      dtype: numpy dtype name (``str(dtype)`` for extended dtypes such as PRNG keys).
      bytes: its size in bytes.
      origin: ``"argument"``, ``"constant"`` (a constant or a literal), ``"loop-stacked"`` (an
        output of ``scan``/``while``: one slice per iteration) or ``"other"``.
      primitive: the primitive of the producing equation, None for arguments and constants.
      name: the checkpoint name (``jax.ad_checkpoint.checkpoint_name`` / ``jaxmem.name``) the
        producing equation gives it, or None.
      argument: the argument's path (``args[0]['w']``) for an argument residual, else None.
      source: ``"path/file.py:LINE"`` of the producing equation, ``""`` if unknown.
      function: the user function enclosing that line, ``""`` if unknown.
      memory_space: ``"device"`` or ``"host"``.
      aval: the abstract value.
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    origin: str
    primitive: str | None
    name: str | None
    argument: str | None
    source: str
    function: str
    memory_space: str
    aval: Any = dataclasses.field(compare=False, repr=False)

    @property
    def description(self) -> str:
        """The description JAX's ``print_saved_residuals`` gives this residual."""
        if self.origin == "argument":
            return f"from the argument {self.argument}"
        if self.origin == "constant":
            return "from a literal" if self.primitive == "literal" else "from a constant"
        where = f"{self.source} ({self.function})" if self.source else "unknown"
        if self.name is not None:
            return f"named '{self.name}' from {where}"
        return f"output of {self.primitive} from {where}"


def _dtype_name(dtype) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:  # extended dtypes, e.g. PRNG keys
        return str(dtype)


def _make(aval, origin, *, primitive=None, name=None, argument=None, eqn=None) -> SavedResidual:
    source = function = ""
    if eqn is not None:
        frame = jc.user_frame(eqn.source_info)
        if frame is not None:
            source = f"{frame.file_name}:{frame.start_line}"
            function = frame.function_name
    return SavedResidual(
        shape=tuple(int(d) for d in getattr(aval, "shape", ())),
        dtype=_dtype_name(aval.dtype) if hasattr(aval, "dtype") else "",
        bytes=jc.nbytes(aval),
        origin=origin,
        primitive=primitive,
        name=name,
        argument=argument,
        source=source,
        function=function,
        memory_space="host" if jc.is_host(aval) else "device",
        aval=aval,
    )


def residuals_of_jaxpr(jaxpr, res_outvars, arg_names) -> list[SavedResidual]:
    """Lists ``res_outvars`` (outputs of open ``jaxpr``) as :class:`SavedResidual` values.

    ``reduce_precision`` is looked through (as JAX does: it is where a residual is rounded, not
    where it is made). The order is JAX's: literals, constants, arguments, then equation outputs
    in program order.
    """
    subst = {
        e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive.name == "reduce_precision"
    }

    def look_through(v):
        while v in subst:
            v = subst[v]
        return v

    literals = [v for v in res_outvars if not jc.is_var(v)]
    wanted = {look_through(v) for v in res_outvars if jc.is_var(v)}
    out = [_make(v.aval, "constant", primitive="literal") for v in literals]
    out += [_make(v.aval, "constant") for v in jaxpr.constvars if v in wanted]
    out += [
        _make(v.aval, "argument", argument=arg_names[i])
        for i, v in enumerate(jaxpr.invars)
        if v in wanted
    ]
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if v in wanted:
                prim = eqn.primitive.name
                if prim in jc.CALL_PRIMITIVES and "name" in eqn.params:
                    prim = f"jitted function '{eqn.params['name']}'"
                origin = "loop-stacked" if eqn.primitive.name in jc.LOOP_PRIMITIVES else "other"
                name = jc.eqn_checkpoint_name(eqn)
                out.append(_make(v.aval, origin, primitive=prim, name=name, eqn=eqn))
    return out


def _argument_name(f, n_args: int, path) -> str:
    """``w`` or ``params['layer']`` (the parameter's name where the signature gives it)."""
    (group, *rest) = path
    is_args = getattr(group, "idx", None) == 0
    key = rest[0] if rest else None
    tail = jax.tree_util.keystr(tuple(rest[1:]))
    if not is_args:
        return f"{getattr(key, 'key', key)}{tail}"
    index = getattr(key, "idx", 0)
    try:
        params = [
            p
            for p in inspect.signature(f).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # builtins, some callables
        params = []
    if index < len(params):
        return params[index].name + tail
    return f"args[{index}]{tail}"


def saved_residuals(f: Callable, *args: Any, **kwargs: Any) -> list[SavedResidual]:
    """The residuals that ``jax.vjp(f, *args, **kwargs)`` saves, as structured records.

    Args:
      f: the function; differentiated with respect to every argument.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments.

    Returns:
      One :class:`SavedResidual` per residual, in JAX's order.

    Examples:
      >>> import jax.numpy as jnp
      >>> [(r.origin, r.primitive, r.bytes) for r in saved_residuals(
      ...     lambda w, x: jnp.sum(jnp.sin(x @ w)), jnp.ones((3, 3)), jnp.ones(3))]
      [('argument', None, 36), ('argument', None, 12), ('other', 'cos', 12)]
    """
    leaves_with_paths, in_tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    leaves = [x for _, x in leaves_with_paths]
    names = [_argument_name(f, len(args), path) for path, _ in leaves_with_paths]

    def flat(*leaves):
        a, kw = jax.tree_util.tree_unflatten(in_tree, leaves)
        return f(*a, **kw)

    closed, out_shape = jax.make_jaxpr(lambda *xs: jax.vjp(flat, *xs), return_shape=True)(*leaves)
    n_res = jax.tree_util.tree_structure(out_shape[1]).num_leaves
    jaxpr = jc.open_jaxpr(closed)
    res_outvars = jaxpr.outvars[len(jaxpr.outvars) - n_res :]
    return residuals_of_jaxpr(jaxpr, res_outvars, names)


def short_source(source: str) -> str:
    """``"/a/b/file.py:12"`` -> ``"file.py:12"``."""
    return os.path.basename(source) if source else ""


def loop_stacked_bytes(listing, length: int) -> int:
    """Bytes of the loop-stacked residuals with leading axis ``length`` (what a scan stacks)."""
    return sum(r.bytes for r in listing if r.origin == "loop-stacked" and r.shape[:1] == (length,))
