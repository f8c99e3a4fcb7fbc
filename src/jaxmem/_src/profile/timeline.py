"""Live device bytes over a compiled program, stacked by the source lines that hold the peak.

One computation for every view of the timeline: :meth:`jaxmem.MemoryReport.plot_timeline` (a
PNG) and the HTML viewer (:mod:`jaxmem._src.profile.html`) draw the same bands.

Memory is coloured, not values: each ``(allocation, offset)`` slice of device memory takes the
group of the buffer holding it at the peak, over the slice's whole life (a scan's stack is filled
by the forward loop and read by the backward one through different values), and is counted once
per program point at its largest live value, as :attr:`jaxmem.BufferReport.timeline` counts it.
Slices that no top group holds at the peak make the last band, "other".
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from jaxmem._src.listing import short_source
from jaxmem._src.profile.buffers import FOLDS, Buffer, BufferGroup, BufferReport, _source_key

__all__ = ["StackedTimeline", "buffer_label", "group_label", "spelled", "stack_by_source"]

OTHER = "other"


def group_label(g: BufferGroup) -> str:
    """A group's label in reports and plots: its source line as ``file.py:LINE (function)``
    (the file without its directory), ``" (backward)"`` added for a backward group.

    Examples:
        >>> group_label(BufferGroup("/src/model.py:12 (mlp)", 64, 1, True, ("add.1",)))
        'model.py:12 (mlp) (backward)'
        >>> group_label(BufferGroup("params['w']", 64, 1, False, ("p.0",)))
        "params['w']"
    """
    path = g.key.split(" (", 1)[0].rsplit(":", 1)[0]
    key = short_source(g.key) if os.path.isabs(path) else g.key
    return f"{key}{' (backward)' if g.backward else ''}"


def spelled(key: str, backward: bool = False) -> str:
    """``key`` (a source line ``/dir/file.py:LINE (function)``, an argument's pytree path, a
    group's key) spelled as the legend spells it: :func:`~jaxmem._src.profile.timeline.group_label`.

    Examples:
        >>> spelled("/src/model.py:12 (mlp)", backward=True)
        'model.py:12 (mlp) (backward)'
        >>> spelled("params['layers']['w1']")
        "params['layers']['w1']"
    """
    return group_label(BufferGroup(key, 0, 0, backward, ()))


def buffer_label(b: Buffer) -> str:
    """What the page calls buffer ``b``: what it is attributed to (the model's line, else the
    argument's pytree path, else its kind), as the legend spells a group of such buffers; never
    XLA's name of the value.

    Examples:
        >>> b = Buffer("params__w__.1", 64, (16,), "f32", "argument", False, "p", "p", "", "",
        ...            0, 9, 0, 0, 0, argument="params['w']")
        >>> buffer_label(b)
        "params['w']"
    """
    return spelled(_source_key(b, "line"), b.backward)


@dataclasses.dataclass(frozen=True, eq=False)
class StackedTimeline:
    """The live bytes of a :class:`BufferReport`, one band per top source group plus "other".

    Attributes:
        groups: the top groups of the peak buffers (:meth:`BufferReport.by_source`), largest
            first; band ``i < len(groups)`` is ``groups[i]``, the last band is "other".
        labels: one label per band (:func:`group_label`, then ``"other"``).
        layers: ``[bands, points]`` int64 live bytes; the bands add up to the timeline.
        band_of_slice: ``(allocation, offset)`` -> band, for the slices the top groups hold at
            the peak; every other slice is in the last band.
        fold: how finely the groups were made (:meth:`BufferReport.by_source`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxmem._src.profile.buffers import read_buffers
        >>> report = read_buffers(lambda x: jnp.sin(x) * 2, jnp.ones(64))
        >>> stacked = stack_by_source(report, 2)
        >>> stacked.layers.sum(axis=0).tolist() == list(report.timeline)
        True
        >>> stacked.labels[-1]
        'other'
    """

    groups: tuple[BufferGroup, ...]
    labels: tuple[str, ...]
    layers: np.ndarray
    band_of_slice: dict[tuple[int, int], int]
    fold: str = "line"

    def band_of(self, buffer: Buffer) -> int:
        """The band of ``buffer``: that of its slice of memory.

        Examples:
            >>> import jax.numpy as jnp
            >>> from jaxmem._src.profile.buffers import read_buffers
            >>> report = read_buffers(lambda x: jnp.sin(x) * 2, jnp.ones(64))
            >>> stacked = stack_by_source(report, 1)
            >>> stacked.band_of(report.peak_buffers[0]) in (0, 1)
            True
        """
        return self.band_of_slice.get((buffer.allocation, buffer.offset), len(self.groups))


def stack_by_source(
    report: BufferReport, n_groups: int, fold: str | None = None, other_below: float = 0.1
) -> StackedTimeline:
    """Splits the live-bytes timeline of ``report`` into bands by source.

    Args:
        report: a buffer assignment, read back.
        n_groups: how many of the largest groups at the peak get a band of their own.
        fold: how finely to group (:meth:`BufferReport.by_source`: ``"line"``, ``"call"``,
            ``"function"``, ``"file"``); by default the finest whose "other" band holds less than
            ``other_below`` of the peak (the coarsest where none does).
        other_below: the share of the peak the "other" band should stay below.

    Returns:
        A :class:`StackedTimeline`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from jaxmem._src.profile.buffers import read_buffers
        >>> report = read_buffers(lambda x: jnp.sum(jnp.sin(x) * 2), jnp.ones(64))
        >>> stacked = stack_by_source(report, 3)
        >>> int(stacked.layers[:, report.peak_index].sum()) == report.peak_bytes
        True
    """
    if fold is None:
        fold = next((f for f in FOLDS if _other(report, n_groups, f) < other_below), FOLDS[-1])
    top = tuple(sorted(report.by_source(fold), key=lambda g: -g.bytes)[:n_groups])
    held = {b.name: i for i, g in enumerate(top) for b in report.peak_buffers if b.name in g.names}
    band_of_slice = {
        (b.allocation, b.offset): held[b.name] for b in report.peak_buffers if b.name in held
    }
    points = len(report.timeline)
    slices: dict[tuple[int, int], np.ndarray] = {}
    for buf in report.buffers:
        if buf.start is None or buf.memory_space != 0:
            continue
        live = slices.setdefault((buf.allocation, buf.offset), np.zeros(points, dtype=np.int64))
        span = slice(max(buf.start, 0), min(buf.end, points - 1) + 1)
        live[span] = np.maximum(live[span], buf.bytes)
    layers = np.zeros((len(top) + 1, points), dtype=np.int64)
    for key, live in slices.items():
        layers[band_of_slice.get(key, len(top))] += live
    labels = tuple(group_label(g) for g in top) + (OTHER,)
    return StackedTimeline(top, labels, layers, band_of_slice, fold)


def _other(report: BufferReport, n_groups: int, fold: str) -> float:
    """The share of the peak outside the ``n_groups`` largest groups at ``fold``."""
    groups = sorted((g.bytes for g in report.by_source(fold)), reverse=True)
    return sum(groups[n_groups:]) / max(report.peak_bytes, 1)
