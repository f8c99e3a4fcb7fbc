"""Hooks into jaxmem's loops: step counters, plan collectors, and what :func:`jaxmem.lint` reads
and turns off (each loop's options by call site), scoped with contextvars (each thread and
context sees its own).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools

import jax

from jaxmem._src import jax_compat as _jc


class StepCounter:
    """Counts the steps :func:`scan` evaluates at run time (see :func:`step_counter`).

    Attributes:
      forward_steps: evaluations of scan bodies so far, forward sweeps and recomputation
        included (a step taped for its backward pass counts once; recomputation a remat policy
        does inside one step's backward pass does not count).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> with jaxmem.step_counter() as counter:
      ...   _ = jax.block_until_ready(
      ...       jaxmem.scan(lambda c, x: (c + x, None), 0.0, jnp.ones(5)))
      >>> counter
      StepCounter(forward_steps=5)
    """

    def __init__(self):
        self.forward_steps = 0

    def __repr__(self):
        return f"StepCounter(forward_steps={self.forward_steps})"


# The counters of the step_counter blocks active in this context (thread, task): a block in one
# thread does not count the scans another thread traces.
_STEP_COUNTERS: contextvars.ContextVar[tuple[StepCounter, ...]] = contextvars.ContextVar(
    "jaxmem_step_counters", default=()
)


@contextlib.contextmanager
def step_counter():
    """Counts, at run time, the forward steps of every :func:`scan` traced inside the block.

    Each evaluation of a scan's step (the forward sweep, each step recomputed from a checkpoint,
    and each step taped for its backward pass) reports to the counter through a host callback, so
    the count is what ran, not what was planned. Only scans *traced* inside the block count: a
    function compiled before (and cached by ``jax.jit``) is not re-traced. Meant for tests and
    for checking a schedule; the callbacks cost time.

    Yields:
      A :class:`StepCounter`; read ``forward_steps`` after the results are ready.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxmem
      >>> loss = lambda w: jaxmem.scan(lambda c, _: (jnp.sin(c * w), None), 1.0, None,
      ...                              length=10, checkpoints=2)[0]
      >>> with jaxmem.step_counter() as counter:
      ...   jax.block_until_ready(jax.grad(loss)(0.5))
      Array(...)
      >>> counter.forward_steps == jaxmem.scan_residuals(
      ...     lambda c, _: (jnp.sin(c * 0.5), None), 1.0, None, length=10,
      ...     checkpoints=2).schedule.forward_steps
      True
    """
    counter = StepCounter()
    token = _STEP_COUNTERS.set((*_STEP_COUNTERS.get(), counter))
    try:
        yield counter
    finally:
        _STEP_COUNTERS.reset(token)


def _tick(index):
    """Reports one step evaluation to the counters active at trace time (nothing if none)."""
    counters = _STEP_COUNTERS.get()
    if not counters:
        return

    def record(_):
        for counter in counters:
            counter.forward_steps += 1

    jax.debug.callback(record, index)


# The collectors of the collect_plans blocks active in this context (thread, task); analysis
# appends to each. The planner compiles in threads: a block collects what its own thread traces.
_PLAN_COLLECTORS: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "jaxmem_plan_collectors", default=()
)


@contextlib.contextmanager
def collect_plans():
    """Collects the :class:`ScanResiduals` of every :func:`scan` differentiated inside the block."""
    plans: list = []
    token = _PLAN_COLLECTORS.set((*_PLAN_COLLECTORS.get(), plans))
    try:
        yield plans
    finally:
        _PLAN_COLLECTORS.reset(token)


@contextlib.contextmanager
def quiet_plans():
    """A block whose scans report no plan (the candidates a loop is compiled as to choose its
    program: the program that runs reports its own)."""
    token = _PLAN_COLLECTORS.set(())
    try:
        yield
    finally:
        _PLAN_COLLECTORS.reset(token)


# What jaxmem.lint traces under: None, or (a number new for each trace, the (site, option) pairs
# it turns off). Part of jax.jit's cache key and of the trace caches, so that functions jitted
# before are traced again (their loops report their findings and options) and a loop's option is
# off in a function jitted with it on.
_LINT = _jc.trace_keyed_state(
    "jaxmem_lint",
    None,
    "What jaxmem.lint traces under: the loop options it turns off, by call site.",
)
_LINT_TRACES = itertools.count()
# The lists of the collect_calls blocks active in this context: each loop's (site, options).
_CALL_COLLECTORS: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "jaxmem_call_collectors", default=()
)

# The memory options lint can turn off, with the value that means "not given".
SWITCHABLE = {"policy": None, "offload": None, "checkpoints": None, "compress": None}


@contextlib.contextmanager
def linting(switched_off: frozenset = frozenset()):
    """A block traced afresh (functions jitted before are traced again) in which the loops
    called from a site run without an option, for each ``(site, option)`` pair of
    ``switched_off`` (``site`` the ``str`` of a :class:`jaxmem._src.findings.Site`, ``option``
    one of :data:`SWITCHABLE`)."""
    for _, option in switched_off:
        if option not in SWITCHABLE:
            raise ValueError(f"linting: {option!r} is not one of {sorted(SWITCHABLE)}")
    with _LINT((next(_LINT_TRACES), frozenset(switched_off))):
        yield


@contextlib.contextmanager
def collect_calls():
    """Collects ``(site, options)`` of every jaxmem loop traced inside the block (``site`` a
    string, ``options`` its :class:`~jaxmem._src.scan.options.ScanOptions` as given)."""
    calls: list = []
    token = _CALL_COLLECTORS.set((*_CALL_COLLECTORS.get(), calls))
    try:
        yield calls
    finally:
        _CALL_COLLECTORS.reset(token)


def called(site, opts):
    """A loop called from ``site`` with ``opts``: reported to the :func:`collect_calls` blocks,
    and returned with the options :func:`linting` turns off at that site reset."""
    if site is None:  # no line of the user's to name (a loop of jaxmem's own)
        return opts
    key = str(site)
    for calls in _CALL_COLLECTORS.get():
        calls.append((key, opts))
    state = _LINT.value
    switched = state[1] if state else ()
    off = {option: SWITCHABLE[option] for s, option in switched if s == key}
    return dataclasses.replace(opts, **off) if off else opts
