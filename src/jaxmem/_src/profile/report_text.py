"""A memory report as text: ``str(report)`` and ``report.to_markdown()`` (the memory fields, the
residuals and their totals by origin, the scans' plans, what is live at the peak).

Reads a :class:`jaxmem.MemoryReport` through its public attributes.
"""

from __future__ import annotations

from typing import Any

from jaxmem._src import format as _fmt
from jaxmem._src.format import format_bytes
from jaxmem._src.listing import short_source
from jaxmem._src.profile.timeline import buffer_label, group_label

# (field name, short label) of the compiled memory figures, in display order.
MEMORY_FIELDS = (
    ("temp_bytes", "temp"),
    ("argument_bytes", "argument"),
    ("output_bytes", "output"),
    ("alias_bytes", "alias"),
    ("generated_code_bytes", "generated code"),
    ("host_temp_bytes", "host temp"),
    ("host_argument_bytes", "host argument"),
    ("host_output_bytes", "host output"),
    ("host_alias_bytes", "host alias"),
    ("host_generated_code_bytes", "host generated code"),
)

RESIDUAL_HEADER = ["shape", "dtype", "bytes", "size", "origin", "source", "function"]
TOP_RESIDUALS = 10
"""Residual rows shown, largest first; one more row counts the rest and their bytes."""

# The residuals are the saved values of a scalar loss's gradient: a function that returns
# anything else (its gradient, a train step's new parameters) has none to list.
_NO_RESIDUALS = (
    "Residuals: not listed, as the function does not return a scalar loss: profile the loss\n"
    "  itself, jaxmem.profile(loss, ...), to list what its gradient saves. The figures above are\n"
    "  this function's whole compiled program (for jax.grad(loss) or a train step: the forward\n"
    "  and the backward pass together)."
)
_NO_HOST = "host_*_bytes: 0 in every field (nothing placed in host memory); rows left out."


def _shown_fields(report: Any) -> list[str]:
    """The memory fields shown: the ``host_*`` ones only where one of them is not zero (host
    memory is used only by offload, on a backend that has it; ``to_dict`` keeps them all)."""
    host = [name for name, _ in MEMORY_FIELDS if name.startswith("host_")]
    hidden = host if not any(getattr(report, name) for name in host) else []
    return [name for name, _ in MEMORY_FIELDS if name not in hidden]


def _memory_rows(report: Any) -> list[list[str]]:
    rows = [
        [name, f"{getattr(report, name):,}", format_bytes(getattr(report, name))]
        for name in _shown_fields(report)
    ]
    peak = report.peak_bytes
    rows.append(["peak_bytes", "n/a" if peak is None else f"{peak:,}", format_bytes(peak)])
    return rows


def _host_note(report: Any) -> list[str]:
    return [] if len(_shown_fields(report)) == len(MEMORY_FIELDS) else [_NO_HOST]


def _residual_rows(report: Any) -> list[list[str]]:
    residuals = report.residuals or ()
    rows = [
        [
            str(r.shape),
            r.dtype,
            f"{r.bytes:,}",
            format_bytes(r.bytes),
            r.origin,
            short_source(r.source),
            r.function,
        ]
        for r in residuals[:TOP_RESIDUALS]
    ]
    rest = residuals[TOP_RESIDUALS:]
    if rest:
        left = sum(r.bytes for r in rest)
        rows.append([f"... {len(rest)} more", "", f"{left:,}", format_bytes(left), "", "", ""])
    return rows


def _residual_title(report: Any) -> str:
    n = len(report.residuals)
    shown = f"; the {TOP_RESIDUALS} largest shown" if n > TOP_RESIDUALS else ""
    return f"Residuals saved for the gradient ({n}, largest first{shown}):"


def _totals_rows(report: Any) -> list[list[str]]:
    rows = [[o, f"{b:,}", format_bytes(b)] for o, b in report.residual_bytes_by_origin.items()]
    total = report.residual_bytes or 0
    rows.append(["total", f"{total:,}", format_bytes(total)])
    return rows


def _title(report: Any) -> str:
    note = f" ({report.per_device_note})" if report.per_device_note else ""
    return f"MemoryReport: {report.name}{note}"


def text(report: Any) -> str:
    """``str(report)``: memory fields, residuals and their totals, scans, the peak."""
    parts = [
        _title(report),
        _fmt.text_table(["field", "bytes", "size"], _memory_rows(report), {1, 2}),
        *_host_note(report),
    ]
    if report.residuals is None:
        parts.append(_NO_RESIDUALS)
    else:
        parts.append(_residual_title(report))
        if report.residuals:
            parts.append(_fmt.text_table(RESIDUAL_HEADER, _residual_rows(report), {2, 3}))
        parts.append("Residual totals by origin:")
        parts.append(_fmt.text_table(["origin", "bytes", "size"], _totals_rows(report), {1, 2}))
    parts += [f"jaxmem.scan #{i}: {plan}" for i, plan in enumerate(report.scan_plans)]
    parts += _peak_lines(report)
    return "\n".join(parts)


def _peak_lines(report: Any, top: int = 8) -> list[str]:
    if report.buffers is None:
        return [f"Live at the peak: n/a ({report.buffer_error})"]
    b = report.buffers
    lines = [
        f"Live at the peak: {format_bytes(b.peak_bytes)} at program point {b.peak_index} of "
        f"{len(b.program)} ({b.peak_instruction}); by source line:"
    ]
    for g in report.top_contributors(top):
        lines.append(f"  {format_bytes(g.bytes):>11}  {group_label(g)}")
    lines.append("largest buffers:")
    for buf in b.peak_buffers[:top]:
        kind = buf.kind + (" (loop state)" if buf.loop_state else "")
        where = buffer_label(buf)
        shape = f"{buf.dtype}{list(buf.shape)}"
        lines.append(f"  {format_bytes(buf.bytes):>11}  {shape:<22} {kind:<20} {where}")
    if b.host_peak_bytes:
        lines.append(f"host memory (offloaded values): peak {format_bytes(b.host_peak_bytes)}")
    return lines


def markdown(report: Any) -> str:
    """``report.to_markdown()``: the memory and residual tables of :func:`text`, in Markdown."""
    parts = [
        f"### {_title(report)}",
        "",
        _fmt.md_table(["field", "bytes", "size"], _memory_rows(report), {1, 2}),
        "",
        *(line for note in _host_note(report) for line in (note, "")),
    ]
    if report.residuals is None:
        parts.append(_NO_RESIDUALS)
    else:
        parts += [
            _residual_title(report),
            "",
            _fmt.md_table(RESIDUAL_HEADER, _residual_rows(report), {2, 3}),
            "",
            _fmt.md_table(["origin", "bytes", "size"], _totals_rows(report), {1, 2}),
        ]
    return "\n".join(parts) + "\n"
