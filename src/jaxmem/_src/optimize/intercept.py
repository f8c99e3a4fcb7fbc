"""Scans the optimized function differentiates itself (a train step's ``value_and_grad``):
caught where ``lax.scan`` binds its primitive, before JAX's own rules differentiate them.

Once the function is traced, its jaxpr holds the scans JAX differentiated (a forward loop and a
transposed one, their residuals already chosen by JAX), too late to make lean. So while
:func:`jaxmem.optimize` traces the function, ``scan``'s primitive binds through :func:`_bind`
(an attribute of that one primitive object, set for the trace and removed after it): a bind
that reverse mode differentiates (:func:`jaxmem._src.jax_compat.reverse_mode_trace`) and that
does not come from jaxmem's own loops runs as :func:`jaxmem.scan` on the scan's own step
(:meth:`jaxmem._src.optimize.rewrite.Rewriter.scan`), so the function's own ``grad`` meets
jaxmem's rules. Every ``lax.scan`` binds the one primitive, so this reaches a scan called from
any module (a library that imported ``lax`` or ``scan`` itself), ``lax.map`` and a
``fori_loop`` with static bounds. A scan under forward mode (``jax.jvp``, ``jacfwd``, a
Hessian) is left to JAX, as is one traced where nothing differentiates it (the equation-level
rewrite reaches those).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import jax
import jaxlib

from jaxmem._src import jax_compat as _jc
from jaxmem._src.optimize import patching
from jaxmem._src.optimize import rewrite as _rw

# The scans bound here are the caller's: JAX's source lines skip this file, as its own.
_jc.register_source_exclusion(__file__)


@contextlib.contextmanager
def catching(rewriter) -> Iterator[None]:
    """Within: every reverse-differentiated ``lax.scan`` bound in this thread runs through
    ``rewriter`` (:meth:`~jaxmem._src.optimize.rewrite.Rewriter.scan`)."""
    # The instance's attribute shadows Primitive.bind; removed again after the last trace.
    with patching.replaced(_jc.scan_p, "bind", _bind, rewriter):
        yield


def _bind(*args, **params):
    def as_it_is():
        return type(_jc.scan_p).bind(_jc.scan_p, *args, **params)

    rewriter = patching.top(_jc.scan_p, "bind")
    if rewriter is None:
        return as_it_is()
    if not _jc.reverse_mode_trace() or _from_jaxmem(sys._getframe(1)):
        return as_it_is()
    # What running it binds (its step's scans: the rewriter's) passes.
    with patching.passing(_jc.scan_p, "bind"):
        return rewriter.scan(params, _jc.current_source_info(), list(args), as_it_is)


def _folder(module) -> str:
    return os.path.dirname(module.__file__) + os.sep


_PASSED = (_folder(jax), _folder(jaxlib), os.path.dirname(contextlib.__file__) + os.sep)


def _from_jaxmem(frame) -> bool:
    """Whether the first frame up from ``frame`` outside JAX and the standard library is
    jaxmem's own (its loops' ``lax.scan``), not the optimized function's
    (:func:`~jaxmem._src.optimize.rewrite.jaxmem_own`)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(_PASSED) or name.startswith("<frozen")):
            return _rw.jaxmem_own(name)
        frame = frame.f_back
    return False
