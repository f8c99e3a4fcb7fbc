""":func:`jaxmem.plan` for unmodified code too: a loss that names no value has its scans run as
``policy="auto"`` stacks with each step's values named by op kind
(:func:`~jaxmem._src.optimize.api.by_op_kind`), and the planner
(:func:`jaxmem._src.remat.planner.plan`) chooses among those names; ``RematPlan.op_names`` records
it, and ``jaxmem.optimize(loss, plan=p)`` names the values the same way."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from jaxmem._src.optimize import api as _api
from jaxmem._src.remat import flops as _flops
from jaxmem._src.remat import planner as _planner
from jaxmem._src.remat.remat_plan import RematPlan


@functools.wraps(_planner.plan)
def plan(loss_fn: Callable, *args: Any, **kwargs: Any) -> RematPlan:
    if callable(loss_fn) and not _flops.discover(loss_fn, args):
        named = _api.by_op_kind(loss_fn)
        if _flops.discover(named, args):
            return dataclasses.replace(_planner.plan(named, *args, **kwargs), op_names=True)
    return _planner.plan(loss_fn, *args, **kwargs)
