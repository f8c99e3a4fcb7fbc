"""The demo's figure: temp per configuration, split into saved residuals and the rest.

Demo code (see :mod:`jaxmem.demo`), not library API. One horizontal bar per configuration (the
labels read on the y axis), the compiled temp of the gradient split into the residuals it saves
that are not arguments (what the forward pass keeps for the backward pass) and the other temp
(the backward pass's own buffers, cotangents, workspace); and, when the demo timed the
configurations, a second panel of temp against step time. Drawn with matplotlib's Agg renderer
directly (no pyplot, no global backend change).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jaxmem

MIB = 2**20
DPI = 100
WIDTH_IN = 9.0
BAR_ROW_IN = 0.45
SCATTER_IN = 4.5


def saved_residual_bytes(report: jaxmem.MemoryReport) -> int:
    """Bytes of the residuals the gradient saves that are not arguments (0 when none listed).

    Arguments are alive anyway; the other origins (loop-stacked, constant, other) are what the
    forward pass adds to the memory for the backward pass.
    """
    by_origin = report.residual_bytes_by_origin
    return sum(b for origin, b in by_origin.items() if origin != "argument")


def figure_size(num_configs: int, timed: bool) -> tuple[float, float]:
    """Inches (at :data:`DPI`): 9 wide, 0.45 a bar plus 1.5, and 4.5 more for the time panel."""
    height = 1.0 + BAR_ROW_IN * max(num_configs, 1) + 0.5
    return WIDTH_IN, height + (SCATTER_IN if timed else 0.0)


def plot(
    comparison: jaxmem.Comparison,
    path: str | os.PathLike[str],
    times: Mapping[str, float] | None = None,
) -> str | os.PathLike[str]:
    """Saves the demo figure of ``comparison`` to ``path`` (format from the suffix, e.g. .png).

    Args:
      comparison: The demo's comparison, baseline first.
      path: Where to write the image.
      times: Label -> step time in seconds; adds the temp-against-time panel.

    Returns:
      ``path``, as given.
    """
    try:  # matplotlib is only needed to draw: the jaxmem[plot] extra
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the demo's plots need matplotlib: pip install 'jaxmem[plot]'") from e

    labels = list(comparison.reports)
    timed = bool(times)
    fig = Figure(figsize=figure_size(len(labels), timed), dpi=DPI, layout="constrained")
    if timed:
        bars, scatter = fig.subplots(
            2, 1, height_ratios=[BAR_ROW_IN * len(labels) + 1.0, SCATTER_IN]
        )
    else:
        bars, scatter = fig.subplots(), None
    _draw_bars(bars, comparison, numbered=timed)
    if scatter is not None:
        _draw_scatter(scatter, comparison, times)
    fig.savefig(path)
    return path


def _draw_bars(ax: Any, comparison: jaxmem.Comparison, numbered: bool) -> None:
    reports = list(comparison.reports.values())
    labels = list(comparison.reports)
    temp = [r.temp_bytes / MIB for r in reports]
    # Residuals are listed from the jaxpr, temp is compiled: never draw more residual than temp.
    saved = [min(saved_residual_bytes(r) / MIB, t) for r, t in zip(reports, temp, strict=True)]
    other = [t - s for t, s in zip(temp, saved, strict=True)]
    ypos = list(range(len(labels)))
    ax.barh(ypos, saved, color="tab:orange", label="saved residuals (not arguments)")
    ax.barh(ypos, other, left=saved, color="tab:blue", label="other temp")
    if numbered:  # the time panel's points carry these numbers
        ax.set_yticks(ypos, [f"{label}  [{k}]" for k, label in enumerate(labels, start=1)])
    else:
        ax.set_yticks(ypos, labels)
    ax.invert_yaxis()  # baseline on top, in the table's order
    base = reports[0].temp_bytes
    for y, (label, t) in enumerate(zip(labels, temp, strict=True)):
        ratio = comparison.ratio(label, "temp_bytes") if base else float("nan")
        ax.annotate(
            f"{t:.1f} MiB ({ratio:.2f}x)",
            (t, y),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
        )
    ax.margins(x=0.18)
    ax.set_xlabel("temp of jax.jit(jax.grad(loss)), MiB")
    # The legend sits between the title and the axes: never over a bar or its label.
    ax.set_title(f"compiled temp per configuration (ratios to {comparison.baseline!r})", pad=24)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def _draw_scatter(ax: Any, comparison: jaxmem.Comparison, times: Mapping[str, float]) -> None:
    # Points are numbered as the bars are ("[k]" after each label): configurations with the
    # same temp (e.g. offload rows on CPU) sit side by side, where full labels would overlap.
    points = [
        (k, times[label] * 1e3, report.temp_bytes / MIB)
        for k, (label, report) in enumerate(comparison.reports.items(), start=1)
        if label in times
    ]
    ax.scatter([x for _, x, _ in points], [y for _, _, y in points], color="tab:blue")
    for (x, y), numbers in _nearby(points).items():
        ax.annotate(
            ", ".join(map(str, numbers)),
            (x, y),
            xytext=(5, 4),
            textcoords="offset points",
            fontsize=9,
        )
    ax.margins(x=0.15, y=0.15)
    ax.set_xlabel("step time (median of the timed runs), ms")
    ax.set_ylabel("temp, MiB")
    ax.set_title("memory against step time, numbered as the bars (lower left is better)")
    ax.grid(alpha=0.3)


def _nearby(
    points: list[tuple[int, float, float]], tol: float = 0.03
) -> dict[tuple[float, float], list[int]]:
    """Groups points closer than ``tol`` of the axis ranges: first point's position -> numbers."""
    xs, ys = [x for _, x, _ in points], [y for _, _, y in points]
    dx = (max(xs) - min(xs)) or 1.0
    dy = (max(ys) - min(ys)) or 1.0
    groups: dict[tuple[float, float], list[int]] = {}
    for k, x, y in points:
        for gx, gy in groups:
            if abs(x - gx) <= tol * dx and abs(y - gy) <= tol * dy:
                groups[gx, gy].append(k)
                break
        else:
            groups[x, y] = [k]
    return groups
