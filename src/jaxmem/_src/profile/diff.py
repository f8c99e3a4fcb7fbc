"""What two compiled programs hold at their peaks, source by source: ``Comparison.diff``.

Each side's buffers live at its peak are grouped as a profile groups them (the model's line that
made them, else the argument's pytree path: :meth:`jaxmem.BufferReport.by_source`, the forward
and backward pass of a line apart); a row gives a group's bytes in each, 0 where the other side
has none. Each side's rows add up to its peak-live bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmem._src import format as _fmt
from jaxmem._src.format import format_bytes
from jaxmem._src.profile.buffers import BufferReport
from jaxmem._src.profile.timeline import group_label

__all__ = ["DiffRow", "PeakDiff", "peak_diff"]

STATUSES = ("added", "freed", "grown", "shrunk", "same")


@dataclasses.dataclass(frozen=True)
class DiffRow:
    """One source's bytes live at the peak of each side.

    Attributes:
        source: the group's label: ``file.py:LINE (function)`` of the model's line, the
            argument's pytree path, ``" (backward)"`` marking the backward pass.
        a_bytes: its bytes at the first side's peak (0: none there).
        b_bytes: its bytes at the second side's peak (0: none there).
        key: the group's full key (the file with its directory).

    Examples:
        >>> row = DiffRow("model.py:3 (mlp)", 0, 1024, "/src/model.py:3 (mlp)")
        >>> row.status, row.change
        ('added', 1024)
    """

    source: str
    a_bytes: int
    b_bytes: int
    key: str = ""

    @property
    def change(self) -> int:
        """``b_bytes - a_bytes``."""
        return self.b_bytes - self.a_bytes

    @property
    def status(self) -> str:
        """``"added"`` (only in b), ``"freed"`` (only in a), else ``"grown"``, ``"shrunk"`` or
        ``"same"``: common to both."""
        if not self.a_bytes:
            return "added"
        if not self.b_bytes:
            return "freed"
        return "grown" if self.change > 0 else "shrunk" if self.change < 0 else "same"


@dataclasses.dataclass(frozen=True)
class PeakDiff:
    """What is live at each of two programs' peaks, source by source.

    Attributes:
        a: the first side's label.
        b: the second side's label.
        rows: one per source at either peak, the largest change first.
        a_peak_bytes: the first side's peak-live bytes (its rows' ``a_bytes`` add up to it).
        b_peak_bytes: the second side's.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmem
        >>> def loss(x):
        ...     return jnp.sum(jnp.sin(jnp.sin(x)))
        >>> cmp = jaxmem.compare({"stock": loss, "remat": jax.checkpoint(loss)}, jnp.ones(4096))
        >>> d = cmp.diff()
        >>> sum(r.a_bytes for r in d.rows) == d.a_peak_bytes, (d.a, d.b)
        (True, ('stock', 'remat'))
    """

    a: str
    b: str
    rows: tuple[DiffRow, ...]
    a_peak_bytes: int
    b_peak_bytes: int

    def _with(self, *statuses: str) -> tuple[DiffRow, ...]:
        return tuple(r for r in self.rows if r.status in statuses)

    @property
    def added(self) -> tuple[DiffRow, ...]:
        """Rows only at the second side's peak."""
        return self._with("added")

    @property
    def freed(self) -> tuple[DiffRow, ...]:
        """Rows only at the first side's peak."""
        return self._with("freed")

    @property
    def common(self) -> tuple[DiffRow, ...]:
        """Rows at both peaks (grown, shrunk or the same)."""
        return self._with("grown", "shrunk", "same")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: the labels, the peaks and the rows (each with its status).

        Examples:
            >>> PeakDiff("a", "b", (DiffRow("x", 8, 0),), 8, 0).to_dict()["rows"][0]["status"]
            'freed'
        """
        rows = [{**dataclasses.asdict(r), "status": r.status} for r in self.rows]
        return {
            "a": self.a,
            "b": self.b,
            "a_peak_bytes": self.a_peak_bytes,
            "b_peak_bytes": self.b_peak_bytes,
            "rows": rows,
        }

    def _table(self, n: int | None) -> tuple[list[str], list[list[str]]]:
        header = ["source", self.a, self.b, "change", ""]
        shown = self.rows if n is None else self.rows[:n]
        rows = [
            [r.source, format_bytes(r.a_bytes), format_bytes(r.b_bytes), _signed(r.change),
             r.status]
            for r in shown
        ]  # fmt: skip
        rest = self.rows[len(shown) :]
        if rest:
            a, b = sum(r.a_bytes for r in rest), sum(r.b_bytes for r in rest)
            rows.append([f"{len(rest)} more", format_bytes(a), format_bytes(b), _signed(b - a), ""])
        rows.append(
            ["peak (live bytes)", format_bytes(self.a_peak_bytes), format_bytes(self.b_peak_bytes),
             _signed(self.b_peak_bytes - self.a_peak_bytes), ""]
        )  # fmt: skip
        return header, rows

    def to_text(self, n: int | None = 20) -> str:
        """A table of the ``n`` largest changes (all with ``n=None``), one row for the rest and
        one for the peaks.

        Examples:
            >>> d = PeakDiff("a", "b", (DiffRow("m.py:3 (f)", 0, 2048),), 0, 2048)
            >>> print(d.to_text().splitlines()[0])
            What is live at each peak, by source: 'a' -> 'b'
        """
        header, rows = self._table(n)
        title = f"What is live at each peak, by source: {self.a!r} -> {self.b!r}"
        return f"{title}\n" + _fmt.text_table(header, rows, {1, 2, 3})

    def __str__(self) -> str:
        return self.to_text()

    def to_markdown(self, n: int | None = 20) -> str:
        """:meth:`to_text`'s table in Markdown."""
        header, rows = self._table(n)
        return _fmt.md_table(header, rows, {1, 2, 3})


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "") + format_bytes(abs(n))


def peak_diff(a: str, b: str, a_buffers: BufferReport, b_buffers: BufferReport) -> PeakDiff:
    """The :class:`PeakDiff` of two buffer reports, labelled ``a`` and ``b``."""
    keys: dict[tuple[str, bool], str] = {}
    sizes: dict[tuple[str, bool], list[int]] = {}
    for side, report in enumerate((a_buffers, b_buffers)):
        for g in report.by_source():
            key = (g.key, g.backward)
            keys[key] = group_label(g)
            sizes.setdefault(key, [0, 0])[side] += g.bytes
    rows = [DiffRow(keys[k], a_, b_, k[0]) for k, (a_, b_) in sizes.items()]
    rows.sort(key=lambda r: (-abs(r.change), -max(r.a_bytes, r.b_bytes), r.source))
    return PeakDiff(a, b, tuple(rows), a_buffers.peak_bytes, b_buffers.peak_bytes)
