"""The memory viewer: one self-contained HTML page for a memory report or a comparison.

:meth:`jaxmem.MemoryReport.to_html` and :meth:`jaxmem.Comparison.to_html` write it. The page
loads nothing: its data is a JSON block (``<script type="application/json"
id="jaxmem-data">``), its style (``assets/viewer.css``) and its scripts (vanilla JavaScript
drawing inline SVG, ``assets/viewer.js``; ``assets/boot.js`` shows the viewer's errors) are inline,
and a Content-Security-Policy forbids any other source, so it opens offline, from a file or an
attachment.

It shows the live bytes of device memory over the compiled program stacked by source (the
bands of :meth:`jaxmem.MemoryReport.plot_timeline`, at the fold the legend names), the peak, the
live ranges of the largest buffers live at the peak, the top contributors and every buffer in a
table; hovering a band or a bar shows what is live there, clicking one (or a table row) opens
the buffer's details, its call chain among them. A comparison adds what each peak holds, source
by source (:meth:`jaxmem.Comparison.diff` of the baseline and each other report). A buffer is
named everywhere by :func:`buffer_label`, what it is attributed to as the legend spells it; XLA's
name of the value is secondary. The address ``page.html#buffer=NAME`` opens buffer ``NAME``'s
(XLA's name) details on load (``#report=LABEL&buffer=NAME`` picks the report of a comparison).

The view data is built here from a report, read through its public attributes (this module is
below :mod:`jaxmem._src.profile.report`, which imports it).
"""

from __future__ import annotations

import functools
import html
import importlib.resources
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxmem._src.listing import short_source
from jaxmem._src.profile.buffers import Buffer, BufferReport
from jaxmem._src.profile.timeline import buffer_label, group_label, spelled, stack_by_source

__all__ = ["comparison_page", "comparison_view", "page", "report_page", "report_view", "write"]

DATA_ID = "jaxmem-data"

# The page's script and style, files of this package (checked by ``node --check`` and run in
# headless Chromium by tests/profile/test_html.py); none holds "</script" or "</style".
ASSETS = ("boot.js", "viewer.js", "viewer.css")


@functools.cache
def asset(name: str) -> str:
    """The text of one of the viewer's :data:`ASSETS`."""
    if name not in ASSETS:
        raise ValueError(f"unknown viewer asset {name!r}; known: {', '.join(ASSETS)}")
    return importlib.resources.files(__package__).joinpath("assets", name).read_text("utf-8")


"""The ``id`` of the page's JSON data block."""

# The page may run its inline script and style, and show inline (data:) images; nothing else.
CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"

# Memory figures the page shows (MemoryReport attributes), in order; host figures when nonzero.
FIGURES = (
    "temp_bytes",
    "argument_bytes",
    "output_bytes",
    "alias_bytes",
    "host_temp_bytes",
    "host_argument_bytes",
    "host_output_bytes",
)

TOP_CONTRIBUTORS = 10

# What the timeline's bands group by, at each fold of BufferReport.by_source (the legend says it).
FOLD_NOTES = {
    "line": "bands by the model's line",
    "call": "bands by your line that called a framework's layer",
    "function": "bands by function (arguments by their first two keys)",
    "file": "bands by file (arguments by their first key)",
}


def _buffer(b: Buffer, band: int | None) -> dict[str, Any]:
    return {
        "name": b.name,
        "label": buffer_label(b),
        "chain": [spelled(c) for c in b.chain],
        "chain_paths": list(b.chain),
        "argument": b.argument,
        "bytes": b.bytes,
        "shape": list(b.shape),
        "dtype": b.dtype,
        "kind": b.kind,
        "loop_state": b.loop_state,
        "instruction": b.instruction,
        "origin": b.origin,
        "op_name": b.op_name,
        "source": b.source,
        "short_source": short_source(b.source),
        "backward": b.backward,
        "start": b.start,
        "end": b.end,
        "memory_space": b.memory_space,
        "allocation": b.allocation,
        "offset": b.offset,
        "band": band,
    }


def _group(g: Any, band: int | None = None) -> dict[str, Any]:
    return {
        "key": g.key,
        "label": group_label(g),
        "bytes": g.bytes,
        "count": g.count,
        "backward": g.backward,
        "names": list(g.names),
        "band": band,
    }


def _timeline_view(b: BufferReport, top: Sequence[Any], groups: int) -> dict[str, Any]:
    stacked = stack_by_source(b, groups)
    bands = [_group(g, i) for i, g in enumerate(stacked.groups)]
    by_name = {buf.name: buf for buf in b.peak_buffers}
    other = stacked.layers[-1, b.peak_index]
    bands.append(
        {"key": "", "label": stacked.labels[-1], "bytes": int(other), "names": [],
         "band": len(bands), "backward": False}
    )  # fmt: skip
    return {
        "module": b.module,
        "jax_version": b.jax_version,
        "program": list(b.program),
        "timeline": list(b.timeline),
        "peak_index": b.peak_index,
        "peak_bytes": b.peak_bytes,
        "peak_instruction": b.peak_instruction,
        "host_peak_bytes": b.host_peak_bytes,
        "fold": stacked.fold,
        "fold_note": FOLD_NOTES[stacked.fold],
        "bands": bands,
        "layers": stacked.layers.tolist(),
        "buffers": [
            _buffer(buf, stacked.band_of(buf) if _on_device(buf) else None) for buf in b.buffers
        ],
        "peak_buffers": [buf.name for buf in b.peak_buffers],
        # A contributor (a source line) is coloured as the band holding its largest buffer.
        "top_contributors": [_group(g, stacked.band_of(by_name[g.names[0]])) for g in top],
    }


def _on_device(b: Buffer) -> bool:
    return b.memory_space == 0 and b.start is not None


def report_view(report: Any, groups: int = 6) -> dict[str, Any]:
    """The data the viewer draws for one :class:`jaxmem.MemoryReport` (JSON-able).

    Args:
        report: a :class:`jaxmem.MemoryReport`.
        groups: how many source lines get a band of their own in the timeline; the rest is
            "other".

    Returns:
        A dict: ``name``, ``note`` (the per-device note), ``figures`` (the memory figures by
        field name), ``peak_bytes``, ``peak_source``, ``residual_bytes``, ``buffer_error`` and
        ``timeline``: None without a buffer-level view, else the program, the live bytes at
        each point, the peak, the bands (``label``, ``bytes`` at the peak, ...) and their
        ``layers`` (live bytes per band and point), every buffer (``name``, ``bytes``,
        ``shape``, ``dtype``, ``kind``, ``op_name``, ``source``, live range ``start``-``end``,
        ``band``, ...), the names of the buffers live at the peak and the top contributors.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmem
        >>> report = jaxmem.profile(jax.grad(lambda x: jnp.sum(jnp.sin(x))), jnp.ones(64))
        >>> view = report_view(report)
        >>> view["timeline"]["peak_bytes"] == report.buffers.peak_bytes
        True
    """
    b = report.buffers
    return {
        "name": report.name,
        "note": report.per_device_note,
        "num_devices": report.num_devices,
        "figures": {f: getattr(report, f) for f in FIGURES},
        "peak_bytes": report.peak_bytes,
        "peak_source": report.peak_source,
        "residual_bytes": report.residual_bytes,
        "buffer_error": report.buffer_error,
        "timeline": None
        if b is None
        else _timeline_view(b, report.top_contributors(TOP_CONTRIBUTORS), groups),
    }


def comparison_view(
    comparison: Any, columns: Sequence[tuple[str, str]], groups: int = 6
) -> dict[str, Any]:
    """The data the viewer draws for a :class:`jaxmem.Comparison` (JSON-able).

    Args:
        comparison: a :class:`jaxmem.Comparison`.
        columns: ``(MemoryReport attribute, label)`` of the comparison table's columns.
        groups: bands of each report's timeline (see :func:`report_view`).

    Returns:
        A dict: ``baseline``, ``columns`` (labels), ``rows`` (``label``, ``values`` and
        ``ratios`` to the baseline, None where not finite), ``reports``, one
        :func:`report_view` per label, in order, and ``diffs``: what is live at the peaks of
        the baseline and of each other report, source by source (:meth:`PeakDiff.to_dict
        <jaxmem._src.profile.diff.PeakDiff.to_dict>` of :meth:`jaxmem.Comparison.diff`; reports
        without a buffer-level view left out).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> cmp = jaxmem.compare({"a": jnp.sin, "b": jnp.cos}, jnp.ones(8))
        >>> view = comparison_view(cmp, [("temp_bytes", "temp")])
        >>> [r["label"] for r in view["rows"]], view["columns"]
        (['a', 'b'], ['temp'])
    """
    rows = [
        {
            "label": label,
            "values": [getattr(rep, field) for field, _ in columns],
            "ratios": [_finite(comparison.ratio(label, field)) for field, _ in columns],
        }
        for label, rep in comparison.reports.items()
    ]
    return {
        "kind": "comparison",
        "baseline": comparison.baseline,
        "columns": [label for _, label in columns],
        "rows": rows,
        "reports": [report_view(rep, groups) for rep in comparison.reports.values()],
        "diffs": _diffs(comparison),
    }


def _diffs(comparison: Any) -> list[dict[str, Any]]:
    """The baseline's :meth:`jaxmem.Comparison.diff` with each other report, as dicts."""
    base, reports = comparison.baseline, comparison.reports
    if reports[base].buffers is None:
        return []
    return [
        comparison.diff(base, label).to_dict()
        for label, rep in reports.items()
        if label != base and rep.buffers is not None
    ]


def _finite(r: float) -> float | None:
    return r if math.isfinite(r) else None


def _json_for_html(data: Any) -> str:
    """``data`` as JSON that can sit in a ``<script>`` block: ``<``, ``>``, ``&`` and the two
    JavaScript line separators escaped (``json.loads`` reads them back unchanged)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    for ch in "<>&\u2028\u2029":
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text


def page(view: Mapping[str, Any], title: str) -> str:
    """The HTML page of the viewer's data: style, data and script inline.

    Args:
        view: ``{"kind": "report", "reports": [report_view(...)]}`` or a
            :func:`comparison_view` (``"kind": "comparison"``).
        title: the document's title.

    Returns:
        The page's text.

    Examples:
        >>> text = page({"kind": "report", "reports": []}, "Memory of f")
        >>> text.startswith("<!DOCTYPE html>"), "<title>Memory of f</title>" in text
        (True, True)
    """
    data = {**view, "generator": f"jaxmem (jax {jax.__version__})"}
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            '<meta name="generator" content="jaxmem">',
            f"<title>{html.escape(title)}</title>",
            f"<style>{asset('viewer.css')}</style>",
            f"<script>{asset('boot.js')}</script>",
            "</head>",
            "<body>",
            '<main id="app" aria-live="polite"></main>',
            '<noscript><p class="noscript">This memory viewer draws its charts and tables with '
            "JavaScript; enable it to see them.</p></noscript>",
            f'<script type="application/json" id="{DATA_ID}">{_json_for_html(data)}</script>',
            f"<script>{asset('viewer.js')}</script>",
            "</body>",
            "</html>",
            "",
        ]
    )


def report_page(report: Any, groups: int = 6) -> str:
    """The viewer's page of one :class:`jaxmem.MemoryReport` (see :func:`report_view`).

    Args:
        report: a :class:`jaxmem.MemoryReport`.
        groups: how many source lines get a band of their own in the timeline.

    Returns:
        The page's text, titled "Memory of NAME".

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> text = report_page(jaxmem.profile(jnp.sin, jnp.ones(8)))
        >>> "<title>Memory of sin" in text
        True
    """
    data = {"kind": "report", "reports": [report_view(report, groups)]}
    return page(data, f"Memory of {report.name} \u00b7 jaxmem")


def comparison_page(comparison: Any, columns: Sequence[tuple[str, str]], groups: int = 6) -> str:
    """The viewer's page of a :class:`jaxmem.Comparison`: its table, then the reports side by
    side on one scale of bytes (see :func:`comparison_view`).

    Args:
        comparison: a :class:`jaxmem.Comparison`.
        columns: ``(MemoryReport attribute, label)`` of the comparison table's columns.
        groups: how many source lines get a band of their own in each timeline.

    Returns:
        The page's text, titled "Memory comparison: A vs B".

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> cmp = jaxmem.compare({"a": jnp.sin, "b": jnp.cos}, jnp.ones(8))
        >>> "<title>Memory comparison: a vs b" in comparison_page(cmp, [("temp_bytes", "temp")])
        True
    """
    title = "Memory comparison: " + " vs ".join(map(str, comparison.reports))
    return page(comparison_view(comparison, columns, groups), f"{title} \u00b7 jaxmem")


def write(path: str | os.PathLike[str], text: str) -> None:
    """Writes the page ``text`` to ``path`` (UTF-8)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
