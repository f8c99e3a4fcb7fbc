"""Memory profiles of JAX functions: compiled memory figures plus the residuals of the gradient.

:func:`profile` compiles a function on example arguments (arrays, Python scalars, or
``jax.ShapeDtypeStruct`` placeholders, which allocate nothing) and reads XLA's compile-time
memory analysis, ``jax.jit(fn).lower(...).compile().memory_analysis()``. When the function
returns a scalar loss it also lists the residuals that ``jax.grad`` with respect to every argument
would save between the forward and the backward pass, read from the linearized jaxpr (what
``jax.ad_checkpoint.print_saved_residuals`` prints, as data), each classified by where it comes
from.
:func:`jaxmem.compare` (:mod:`jaxmem._src.profile.compare`) profiles several functions on the
same arguments and reports ratios against the first one.

The figure of merit is ``temp_bytes`` (deterministic, known at compile time). On CPU, XLA may
upcast bf16 loop buffers to f32, so compare like with like.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxmem._src import checks
from jaxmem._src import plots as _plots
from jaxmem._src.format import format_bytes
from jaxmem._src.listing import ORIGINS, SavedResidual, saved_residuals
from jaxmem._src.profile import html as _html
from jaxmem._src.profile import report_text as _text
from jaxmem._src.profile.buffers import (
    Buffer,
    BufferDumpError,
    BufferGroup,
    BufferReport,
    compile_with_buffers,
)
from jaxmem._src.profile.report_text import MEMORY_FIELDS as _MEMORY_FIELDS
from jaxmem._src.profile.timeline import group_label, stack_by_source
from jaxmem._src.scan.hooks import collect_plans
from jaxmem._src.scan.summary import ScanResiduals

__all__ = ["MemoryReport", "ProfileError", "Residual", "profile"]

# Field of jax's CompiledMemoryStats for each MemoryReport field.
_STATS_NAMES = {name: name.replace("_bytes", "_size_in_bytes") for name, _ in _MEMORY_FIELDS}


class ProfileError(RuntimeError):
    """A function could not be traced, lowered or compiled for profiling.

    The message names the function; the original exception is chained as ``__cause__``.

    Examples:
        >>> import jaxmem
        >>> from jaxmem._src.profile.report import ProfileError
        >>> import jax.numpy as jnp
        >>> def bad(x):
        ...     return x @ x  # (2, 3) @ (2, 3): shapes do not match
        >>> try:
        ...     jaxmem.profile(bad, jnp.ones((2, 3)))
        ... except ProfileError as e:
        ...     print(str(e).splitlines()[0])
        ...     print(type(e.__cause__).__name__)
        profile: could not trace or compile function 'bad': TypeError: ...
        TypeError
    """


# --------------------------------------------------------------------------------------------
# Data classes


@dataclasses.dataclass(frozen=True)
class Residual:
    """One residual that the gradient of a function would save for its backward pass.

    Attributes:
        shape: the residual's shape.
        dtype: numpy dtype name, e.g. ``"float32"`` or ``"bfloat16"``.
        bytes: ``size * itemsize``.
        origin: ``"argument"`` (an argument of the function, kept alive anyway),
            ``"constant"`` (a constant or literal), ``"loop-stacked"`` (an output of a loop
            primitive, ``scan`` or ``while``: one slice per iteration, stacked) or ``"other"``.
        source: ``"path/file.py:LINE"`` of the equation that produced it, ``""`` if unknown
            (arguments and constants have none).
        function: name of the user function enclosing that equation, ``""`` if unknown.
        description: the description ``jax.ad_checkpoint.print_saved_residuals`` gives it, e.g.
            ``"output of scan from f.py:11 (loss)"``.

    Examples:
        >>> r = Residual((2, 4), "float32", 32, "other", "f.py:3", "loss", "output of tanh")
        >>> r.bytes
        32
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    origin: str
    source: str
    function: str
    description: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of the fields (``shape`` as a list).

        Examples:
            >>> Residual((2,), "float32", 8, "argument", "", "", "from the argument x").to_dict()[
            ...     "shape"
            ... ]
            [2]
        """
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Compiled memory figures of one function, and the residuals its gradient would save.

    The ``*_bytes`` fields are XLA's compile-time ``memory_analysis()`` of the function
    (``CompiledMemoryStats``): ``temp`` is scratch memory (activations, residuals of a fused
    forward+backward, loop buffers), ``argument``/``output`` the inputs and outputs, ``alias``
    output bytes that reuse donated argument buffers, ``generated_code`` the executable; the
    ``host_*`` twins count buffers placed in host memory.

    For a sharded program (``num_devices > 1``: inputs or outputs sharded over a mesh) the
    compiled figures are **per device**: what one device of the mesh holds, as XLA compiles one
    SPMD program for every device. The residual listing is of the program as written, with
    global (logical) shapes: a residual sharded over ``n`` devices takes ``1/n`` of its listed
    bytes on each.

    Attributes:
        name: the function's name (the label, when made by :func:`compare`).
        temp_bytes: device scratch bytes.
        argument_bytes: device argument bytes.
        output_bytes: device output bytes.
        alias_bytes: output bytes aliased to (donated) arguments.
        generated_code_bytes: generated code bytes.
        host_temp_bytes: host-memory scratch bytes.
        host_argument_bytes: host-memory argument bytes.
        host_output_bytes: host-memory output bytes.
        host_alias_bytes: host-memory aliased bytes.
        host_generated_code_bytes: host generated code bytes.
        peak_bytes: the most bytes live at once on a device: the backend's estimate
            (``peak_memory_in_bytes``) where it counts the temp, else (XLA:CPU reports arguments,
            outputs and constants only) the peak of the live-range timeline of XLA's buffer
            assignment (:attr:`timeline`); ``peak_source`` says which. None where neither is
            known.
        residuals: residuals of the gradient with respect to all arguments, largest first;
            None when the function does not return a scalar.
        scan_plans: for each :func:`jaxmem.scan` the gradient goes through, its
            :class:`jaxmem.ScanResiduals` (what it keeps, next to what ``lax.scan`` would stack).
        num_devices: the devices the compiled program runs on (1 unless it is sharded); the
            memory figures are per device.
        buffers: XLA's buffer assignment of the compiled function, read back
            (:class:`jaxmem.BufferReport`: every buffer with its live range, kind, HLO
            instruction, JAX ``op_name`` and source line); None when XLA wrote no dump this
            version can read (``buffer_error`` says why).
        buffer_error: why ``buffers`` is None, else None.
        peak_source: ``"backend"`` or ``"live ranges"``: where ``peak_bytes`` comes from.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> report = jaxmem.profile(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(256))
        >>> report.argument_bytes, report.residual_bytes_by_origin["other"]
        (1024, 1024)
        >>> print(str(report).splitlines()[0])
        MemoryReport: <lambda>
    """

    name: str
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    host_temp_bytes: int
    host_argument_bytes: int
    host_output_bytes: int
    host_alias_bytes: int
    host_generated_code_bytes: int
    peak_bytes: int | None
    residuals: tuple[Residual, ...] | None
    scan_plans: tuple[ScanResiduals, ...] = ()
    num_devices: int = 1
    buffers: BufferReport | None = dataclasses.field(default=None, repr=False)
    buffer_error: str | None = None
    peak_source: str = "backend"

    def _buffer_report(self) -> BufferReport:
        if self.buffers is None:
            raise ProfileError(
                f"no buffer-level view of {self.name!r}: {self.buffer_error or 'not computed'}"
            )
        return self.buffers

    @property
    def peak_buffers(self) -> tuple[Buffer, ...]:
        """The buffers live (on a device) at the peak program point, largest first, with bytes,
        shape, dtype, kind (``argument``/``output``/``temp``/``constant``, ``loop_state`` for
        loop-carried values such as a scan's stacked residuals), HLO instruction, JAX
        ``op_name`` (``transpose(...)`` marks the backward pass) and ``source`` (``file:line
        (function)`` of the user's code, where the metadata has it). Their bytes add up to the
        timeline's peak.

        Raises:
            ProfileError: no buffer-level view (``buffer_error`` says why).

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> def loss(x):
            ...     big = jnp.outer(x, x)  # kept for the backward pass
            ...     return jnp.sum(jnp.sin(big))
            >>> top = jaxmem.profile(jax.grad(loss), jnp.ones(512)).peak_buffers[0]
            >>> top.bytes, top.shape
            (1048576, (512, 512))
        """
        return self._buffer_report().peak_buffers

    @property
    def timeline(self) -> tuple[int, ...]:
        """Live bytes of device memory at each point of the compiled program (XLA's schedule),
        from XLA's buffer assignment; its maximum is the live-range peak.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> t = jaxmem.profile(lambda x: jnp.sum(jnp.sin(x) * 2), jnp.ones(256)).timeline
            >>> max(t) >= 1024  # x, 256 floats, is live from the start
            True
        """
        return self._buffer_report().timeline

    def top_contributors(self, n: int = 3, by: str = "source") -> tuple[BufferGroup, ...]:
        """The largest groups of :attr:`peak_buffers`: by source line (``by="source"``,
        buffers without one grouped by ``op_name``) or by ``op_name`` prefix (``"op_name"``);
        forward and backward (``transpose(...)``) buffers of a group apart.

        Args:
            n: how many groups.
            by: ``"source"`` or ``"op_name"``.

        Returns:
            Up to ``n`` :class:`jaxmem.BufferGroup` (``key``, ``bytes``, ``count``,
            ``backward``), largest first.

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> def loss(x):
            ...     return jnp.sum(jnp.sin(jnp.outer(x, x)))
            >>> top = jaxmem.profile(jax.grad(loss), jnp.ones(512)).top_contributors(1)[0]
            >>> top.bytes >= 512 * 512 * 4, top.key.endswith("(loss)")  # outer, sin, cos
            (True, True)
        """
        report = self._buffer_report()
        if by == "source":
            groups = report.by_source()
        elif by == "op_name":
            groups = report.by_op_name()
        else:
            raise ValueError(f"top_contributors: by={by!r}; expected 'source' or 'op_name'")
        return tuple(sorted(groups, key=lambda g: -g.bytes)[:n])

    def plot_timeline(self, path: str | os.PathLike[str], groups: int = 6):
        """Save a plot of live device bytes over the compiled program, stacked by the largest
        groups at the peak (source lines), the peak marked with its top contributors.

        Args:
            path: where to write the image (format from the suffix, e.g. ``.png``).
            groups: how many source groups to colour; the rest is "other".

        Returns:
            ``path``, as given.

        Examples:
            >>> import tempfile, pathlib
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> report = jaxmem.profile(jax.grad(lambda x: jnp.sum(jnp.sin(x))), jnp.ones(64))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     print(report.plot_timeline(pathlib.Path(d) / "t.png").read_bytes()[:4])
            b'\x89PNG'
        """
        return _plot_timeline(self, path, groups)

    def to_html(self, path: str | os.PathLike[str], groups: int = 6) -> str | os.PathLike[str]:
        """Write an interactive memory viewer of this report: one self-contained HTML file.

        The page needs no network (data, style and script are inline): it shows the totals,
        the live bytes over the compiled program stacked by source line as :meth:`plot_timeline`
        draws them, the peak, the live ranges of the largest buffers at the peak, the top
        contributors and every buffer. Hovering shows what is live at a point; clicking a band,
        a bar or a row opens a buffer's shape, dtype, kind, ``op_name``, source line and live
        range. ``page.html#buffer=NAME`` opens buffer ``NAME`` on load.

        Args:
            path: where to write the page (e.g. ``"memory.html"``).
            groups: how many source lines get a band of their own; the rest is "other".

        Returns:
            ``path``, as given.

        Examples:
            >>> import tempfile, pathlib
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> report = jaxmem.profile(jax.grad(lambda x: jnp.sum(jnp.sin(x))), jnp.ones(64))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     page = report.to_html(pathlib.Path(d) / "memory.html").read_text()
            >>> page.startswith("<!DOCTYPE html>"), report.peak_buffers[0].name in page
            (True, True)
        """
        _html.write(path, _html.report_page(self, groups))
        return path

    @property
    def per_device_note(self) -> str:
        """``""`` for a one-device program, else a note that the figures are per device.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> jaxmem.profile(jnp.sin, jnp.ones(4)).per_device_note
            ''
        """
        if self.num_devices <= 1:
            return ""
        return f"per device, sharded over {self.num_devices} devices; residuals: global shapes"

    @property
    def residual_bytes(self) -> int | None:
        """Total bytes of all residuals, None when there is no residual listing.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> jaxmem.profile(lambda x: jnp.sum(x**3), jnp.ones(8)).residual_bytes
            32
        """
        if self.residuals is None:
            return None
        return sum(r.bytes for r in self.residuals)

    @property
    def residual_bytes_by_origin(self) -> dict[str, int]:
        """Residual bytes per origin, every origin present (zeros included); ``{}`` if none listed.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> jaxmem.profile(lambda x: jnp.sum(x * x), jnp.ones(8)).residual_bytes_by_origin
            {'argument': 32, 'constant': 0, 'loop-stacked': 0, 'other': 0}
        """
        if self.residuals is None:
            return {}
        totals = dict.fromkeys(ORIGINS, 0)
        for r in self.residuals:
            totals[r.origin] = totals.get(r.origin, 0) + r.bytes
        return totals

    def peak_summary(self, n: int = 3) -> str:
        """One line: the peak, where its figure comes from, and its top ``n`` contributors.

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> def loss(x):
            ...     return jnp.sum(jnp.sin(jnp.outer(x, x)))
            >>> jaxmem.profile(jax.grad(loss), jnp.ones(512)).peak_summary(1)
            'peak ... MiB (live ranges); ...:... (loss) ... MiB'
        """
        peak = "n/a" if self.peak_bytes is None else format_bytes(self.peak_bytes)
        head = f"peak {peak} ({self.peak_source})"
        if self.buffers is None:
            return head
        tops = "; ".join(
            f"{group_label(g)} {format_bytes(g.bytes)}" for g in self.top_contributors(n)
        )
        return f"{head}; {tops}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: every field, plus ``residual_bytes`` and ``residual_bytes_by_origin``.

        Examples:
            >>> import json
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> d = jaxmem.profile(lambda x: x * 2, jnp.ones(4)).to_dict()
            >>> d["argument_bytes"], d["residuals"], json.loads(json.dumps(d)) == d
            (16, None, True)
        """
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["residuals"] = None if self.residuals is None else [r.to_dict() for r in self.residuals]
        d["scan_plans"] = [p.to_dict() for p in self.scan_plans]
        d["residual_bytes"] = self.residual_bytes
        d["residual_bytes_by_origin"] = self.residual_bytes_by_origin
        d["buffers"] = None
        if self.buffers is not None:
            d["buffers"] = _jsonable(
                {
                    "peak_bytes": self.buffers.peak_bytes,
                    "peak_index": self.buffers.peak_index,
                    "host_peak_bytes": self.buffers.host_peak_bytes,
                    "timeline": list(self.buffers.timeline),
                    "peak_buffers": [dataclasses.asdict(b) for b in self.buffers.peak_buffers],
                    "top_contributors": [dataclasses.asdict(g) for g in self.top_contributors(10)],
                }
            )
        return d

    def to_json(self, **json_kw: Any) -> str:
        """:meth:`to_dict` as a JSON string; ``json_kw`` is passed to :func:`json.dumps`.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> jaxmem.profile(lambda x: x * 2, jnp.ones(4)).to_json().startswith('{"name"')
            True
        """
        return json.dumps(self.to_dict(), **json_kw)

    def __str__(self) -> str:
        """Readable text tables: memory fields, then residuals and their totals."""
        return _text.text(self)

    def to_markdown(self) -> str:
        """The same tables as ``str(report)``, in Markdown.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> md = jaxmem.profile(lambda x: jnp.sum(x**3), jnp.ones(8)).to_markdown()
            >>> md.splitlines()[0]
            '### MemoryReport: <lambda>'
        """
        return _text.markdown(self)

    def plot(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """Save a bar chart of where the memory goes (compiled figures, residuals by origin).

        Uses matplotlib's Agg renderer directly (no pyplot, no change to the global backend), so
        it works headless and in notebooks alike. The format follows the file suffix (``.png``).

        Args:
            path: where to write the image.

        Returns:
            ``path``, as given.

        Examples:
            >>> import tempfile, pathlib
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> report = jaxmem.profile(lambda x: jnp.sum(jnp.sin(x)), jnp.ones(64))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     out = report.plot(pathlib.Path(d) / "mem.png")
            ...     print(out.read_bytes()[:4])
            b'\\x89PNG'
        """
        labels, values, colors = [], [], []
        for name, label in _MEMORY_FIELDS:
            value = getattr(self, name)
            if value or not name.startswith(("host_", "generated", "alias")):
                labels.append(label)
                values.append(value)
                colors.append("tab:blue")
        for origin, value in self.residual_bytes_by_origin.items():
            labels.append(f"residual: {origin}")
            values.append(value)
            colors.append("tab:orange")
        title = f"{self.name}: compiled memory (XLA's memory_analysis)"
        if self.residual_bytes_by_origin:
            title += ", the gradient's saved residuals by origin"
        fig = _plots.bytes_bars(labels, values, colors, title, "MemoryReport.plot")
        fig.savefig(path)
        return path


# --------------------------------------------------------------------------------------------
# Residuals, from the structured listing


def _residual(r: SavedResidual) -> Residual:
    return Residual(r.shape, r.dtype, r.bytes, r.origin, r.source, r.function, r.description)


def _is_scalar_loss(out_info: Any) -> bool:
    leaves, treedef = jax.tree_util.tree_flatten(out_info)
    if len(leaves) != 1 or treedef.num_nodes != 1:
        return False
    (out,) = leaves
    return tuple(out.shape) == () and bool(jnp.issubdtype(out.dtype, jnp.inexact))


# --------------------------------------------------------------------------------------------
# Public functions


def _sorted_residuals(listing) -> tuple[Residual, ...]:
    return tuple(sorted((_residual(r) for r in listing), key=lambda r: -r.bytes))


def residuals_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Residual, ...]:
    """The saved-residual listing of a scalar loss, as :attr:`MemoryReport.residuals` holds it.

    Traces only (no compile): :func:`profile`'s listing without its compiled figures. Public as
    ``jaxmem.residuals``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> [(r.shape, r.origin) for r in jaxmem.residuals(lambda x: jnp.sin(x).sum(), jnp.ones(3))]
        [((3,), 'other')]
    """
    return _sorted_residuals(saved_residuals(fn, *args, **kwargs))


def profile(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> MemoryReport:
    """Compile ``fn`` on the given arguments and report its memory, with gradient residuals.

    The memory figures are ``jax.jit(fn).lower(*args, **kwargs).compile().memory_analysis()``
    (when ``fn`` is already jitted, its own ``lower`` is used, so its donation, sharding and
    static-argument settings apply). Arguments may be arrays, Python scalars, or
    ``jax.ShapeDtypeStruct`` placeholders: nothing is allocated or run, so big models can be
    profiled from shapes alone.

    If ``fn`` returns a scalar of an inexact dtype (decided from the lowered output shape), the
    report also lists the residuals that the gradient with respect to all arguments would save,
    as ``jax.ad_checkpoint.print_saved_residuals`` would print them, largest
    first. That listing traces every argument, so static arguments of a jitted ``fn`` are not
    supported there: bind them with :func:`functools.partial` instead.

    Args:
        fn: the function to profile (jitted or not).
        *args: positional arguments of ``fn``: pytrees of arrays, scalars or
            ``jax.ShapeDtypeStruct``.
        **kwargs: keyword arguments of ``fn``, same kinds.

    Returns:
        A :class:`MemoryReport` named after ``fn``.

    Raises:
        TypeError: ``fn`` is not callable, or an argument leaf cannot be traced (the message gives
            its pytree path, e.g. ``args[1]['w']``).
        ProfileError: tracing, lowering or compiling ``fn`` failed, or the backend reports no
            memory analysis; the original exception is chained.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> def loss(w, x):
        ...     return jnp.sum(jnp.sin(x @ w))
        >>> report = jaxmem.profile(loss, jnp.ones((3, 4)), jnp.ones((2, 3)))
        >>> report.argument_bytes, report.output_bytes
        (72, 4)
        >>> [(r.shape, r.origin) for r in report.residuals]  # w, cos(x @ w), x
        [((3, 4), 'argument'), ((2, 4), 'other'), ((2, 3), 'argument')]
        >>> report.residual_bytes
        104

        Shapes only, nothing allocated:

        >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        >>> jaxmem.profile(lambda w: jnp.sum(w @ w), w).argument_bytes
        33554432
    """
    checks.check_callable(fn, "fn", "profile")
    _check_args(args, kwargs, "profile")
    return _profile(fn, args, kwargs, name=checks.fn_name(fn), caller="profile")


def _check_args(args: tuple[Any, ...], kwargs: dict[str, Any], caller: str) -> None:
    checks.check_traceable(args, "args", caller)
    checks.check_traceable(kwargs, "kwargs", caller)


def _profile(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str, caller: str
) -> MemoryReport:
    fname = checks.fn_name(fn)
    what = f"function {fname!r}" if name == fname else f"{name!r} (function {fname!r})"
    jitted = isinstance(fn, jax.stages.Wrapped) and callable(getattr(fn, "__wrapped__", None))

    def fail(stage: str, e: Exception, hint: str = "") -> ProfileError:
        return ProfileError(f"{caller}: could not {stage} {what}: {type(e).__name__}: {e}{hint}")

    try:
        lowered = (fn if jitted else jax.jit(fn)).lower(*args, **kwargs)
        compiled, buffers = compile_with_buffers(lowered)
    except Exception as e:
        raise fail("trace or compile", e) from e
    buffer_error = None
    if isinstance(buffers, BufferDumpError):
        buffer_error, buffers = str(buffers), None
    stats = compiled.memory_analysis()
    if stats is None:
        raise ProfileError(
            f"{caller}: the {jax.default_backend()!r} backend reports no memory analysis for {what}"
        )
    figures = {name_: int(getattr(stats, stats_name)) for name_, stats_name in _STATS_NAMES.items()}
    peak = getattr(stats, "peak_memory_in_bytes", None)

    residuals = None
    plans: list[ScanResiduals] = []
    if _is_scalar_loss(lowered.out_info):
        # The listing traces every argument; for a jitted fn, look inside the jit so residuals
        # are attributed to the equations that produce them, not to one opaque jit call.
        inner = fn.__wrapped__ if jitted else fn
        try:
            with collect_plans() as plans:
                listing = saved_residuals(inner, *args, **kwargs)
        except Exception as e:
            hint = (
                " (the residual listing traces every argument; bind static arguments with "
                "functools.partial)"
            )
            raise fail("list the gradient residuals of", e, hint) from e
        residuals = _sorted_residuals(listing)

    # The backend's peak, unless it is missing or below what the live ranges show (XLA:CPU's
    # counts arguments, outputs and constants only).
    peak_source = "backend"
    if buffers is not None and (peak is None or int(peak) < buffers.peak_bytes):
        peak, peak_source = buffers.peak_bytes, "live ranges"
    return MemoryReport(
        name=name,
        **figures,
        peak_bytes=None if peak is None else int(peak),
        residuals=residuals,
        scan_plans=tuple(plans) if residuals is not None else (),
        num_devices=_num_devices(compiled),
        buffers=buffers,
        buffer_error=buffer_error,
        peak_source=peak_source,
    )


def _num_devices(compiled: Any) -> int:
    """The devices a compiled program runs on: those of its input and output shardings."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    devices = set()
    for s in shardings:
        devices |= set(getattr(s, "device_set", ()))
    return max(len(devices), 1)


# --------------------------------------------------------------------------------------------
# The buffer-level view: labels and the timeline plot


def _jsonable(x: Any) -> Any:
    """``x`` as JSON reads it back (tuples as lists)."""
    return json.loads(json.dumps(x))


def _plot_timeline(report: MemoryReport, path: Any, n_groups: int) -> Any:
    b = report._buffer_report()
    stacked = stack_by_source(b, n_groups)
    note = f", {report.per_device_note}" if report.per_device_note else ""
    fig = _plots.live_timeline(
        stacked.layers, stacked.labels, b.peak_index, b.peak_bytes,
        f"live memory of {report.name}{note}", "MemoryReport.plot_timeline",
    )  # fmt: skip
    fig.savefig(path)
    return path
