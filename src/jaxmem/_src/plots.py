"""Figures of jaxmem's reports, drawn from plain data (numbers and labels, no report objects).

Every function returns a bare :class:`matplotlib.figure.Figure`: no pyplot, no global backend or
state, so it works headless and in notebooks alike (``fig.savefig(path)`` renders with Agg).
matplotlib is the ``jaxmem[plot]`` extra; without it a function raises an ``ImportError`` that
names the extra.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxmem._src import optional
from jaxmem._src.format import format_bytes

MiB = 2**20


def unit_for(largest: float) -> tuple[float, str]:
    """The binary unit to draw values up to ``largest`` bytes in, and its size.

    Examples:
        >>> unit_for(3 * 2**20), unit_for(100)
        ((1048576.0, 'MiB'), (1.0, 'bytes'))
    """
    for power, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024**power:
            return float(1024**power), unit
    return 1.0, "bytes"


def new_figure(figsize: tuple[float, float], feature: str, dpi: int = 100) -> Any:
    """A bare matplotlib Figure (the ``jaxmem[plot]`` extra, named in the error for ``feature``)."""
    figure = optional.require("matplotlib.figure", "plot", feature)
    return figure.Figure(figsize=figsize, dpi=dpi)


def bytes_bars(
    labels: Sequence[str], values: Sequence[int], colors: Sequence[str], title: str, feature: str
) -> Any:
    """Horizontal bars of byte counts, one per label, each annotated with its size."""
    scale, unit = unit_for(max(values, default=0))
    fig = new_figure((7, 0.45 * len(labels) + 1.2), feature)
    ax = fig.add_subplot()
    ypos = np.arange(len(labels))
    ax.barh(ypos, [v / scale for v in values], color=list(colors))
    ax.set_yticks(ypos, list(labels))
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(title)
    for y, v in zip(ypos, values, strict=True):
        ax.annotate(
            format_bytes(v), (v / scale, y), xytext=(3, 0), textcoords="offset points", va="center",
            fontsize=8,
        )  # fmt: skip
    ax.margins(x=0.2)
    fig.tight_layout()
    return fig


def grouped_bytes_bars(
    columns: Sequence[str], table: Mapping[str, Sequence[int | None]], title: str, feature: str
) -> Any:
    """Grouped bars: one group per column, one bar per row of ``table`` (None left out)."""
    largest = max((v for vals in table.values() for v in vals if v is not None), default=0)
    scale, unit = unit_for(largest)
    n = len(table)
    width = 0.8 / max(n, 1)
    fig = new_figure((max(6.0, 1.2 * len(columns) * max(1, n / 2)), 4), feature)
    ax = fig.add_subplot()
    x = np.arange(len(columns))
    bars = []
    for i, vals in enumerate(table.values()):
        heights = [math.nan if v is None else v / scale for v in vals]
        bars.append(ax.bar(x + (i - (n - 1) / 2) * width, heights, width))
        # Each bar's size on it; "" where the value is missing.
        ax.bar_label(
            bars[-1], ["" if v is None else format_bytes(v) for v in vals], fontsize=7,
            rotation=90, padding=2,
        )  # fmt: skip
    ax.set_xticks(x, list(columns))
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.margins(y=0.25)  # room for the value labels above the tallest bar
    _legend_outside(ax, bars, list(table))
    fig.tight_layout()
    return fig


def _legend_outside(ax: Any, handles: Sequence[Any], labels: Sequence[str], **kwargs: Any) -> Any:
    """A legend right of the axes (off the data), every label shown: given explicitly, a label
    starting with ``_`` (a module such as optax's ``_classification.py``) is kept, where
    matplotlib's automatic legend drops it."""
    return ax.legend(
        list(handles), list(labels), loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
        **kwargs,
    )  # fmt: skip


def live_timeline(
    layers: np.ndarray, labels: Sequence[str], peak_index: int, peak_bytes: int, title: str,
    feature: str,
) -> Any:  # fmt: skip
    """Live bytes over program points, stacked by group (``layers``: [groups, points]), with the
    peak (``peak_bytes`` at ``peak_index``) marked."""
    points = layers.shape[1]
    scale, unit = unit_for(peak_bytes)
    fig = new_figure((9, 4.5), feature)
    ax = fig.add_subplot()
    bands = ax.stackplot(np.arange(points), layers / scale, alpha=0.85)
    ax.axvline(peak_index, color="black", linestyle="--", linewidth=1)
    late = peak_index > 0.7 * points  # label on the left of a late peak, inside the axes
    ax.annotate(
        f"peak {format_bytes(peak_bytes)}",
        (peak_index, peak_bytes / scale),
        xytext=(-5 if late else 5, 5),
        textcoords="offset points",
        ha="right" if late else "left",
        fontsize=9,
    )
    ax.set_xlabel("program point (XLA's schedule)")
    ax.set_ylabel(unit)
    ax.set_title(title)
    _legend_outside(ax, bands, labels, fontsize=8)
    fig.tight_layout()
    return fig


def frontier(
    points: Sequence[Mapping[str, Any]],
    *,
    ylabel: str,
    title: str,
    budget: int | None = None,
    feature: str = "Frontier.plot",
) -> Any:
    """Memory (x, MiB) against a cost (y) of candidate plans.

    Each point is a mapping with ``temp`` (bytes), ``y``, ``label`` (shown for presets, else
    None), ``kind`` (``"preset"``, ``"candidate"``), and flags ``pareto``, ``picked``,
    ``chosen``. ``budget`` (bytes) draws a vertical line.
    """
    fig = new_figure((8, 5), feature, dpi=110)
    ax = fig.subplots()

    def xy(ps):
        return [p["temp"] / MiB for p in ps], [p["y"] for p in ps]

    trial = [p for p in points if p["kind"] != "preset"]
    ax.scatter(*xy(trial), s=14, color="0.7", label="other candidates compiled", zorder=2)
    front = sorted((p for p in points if p["pareto"]), key=lambda p: p["temp"])
    ax.step(*xy(front), where="post", color="tab:green", lw=1.2, label="Pareto frontier", zorder=1)
    for p in points:
        if p["kind"] == "preset":
            x, y = p["temp"] / MiB, p["y"]
            ax.scatter(x, y, s=40, marker="s", color="tab:orange", zorder=3)
            ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.scatter(
        *xy([p for p in points if p["picked"]]),
        s=50,
        facecolors="none",
        edgecolors="tab:blue",
        linewidths=1.5,
        label="planner's picks (sweep budgets)",
        zorder=4,
    )
    for p in points:
        if p["chosen"]:
            ax.scatter(
                p["temp"] / MiB, p["y"], s=180, marker="*", color="tab:red", label="chosen plan",
                zorder=5,
            )  # fmt: skip
    if budget is not None:
        ax.axvline(budget / MiB, color="tab:red", ls=":", lw=1, label="budget")
    ax.set_xlabel("gradient temp memory (MiB, compiled)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
