"""Memory reports of several functions on the same arguments, side by side, each figure as a ratio
to the first (the baseline): jaxmem.compare.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxmem._src import checks
from jaxmem._src import format as _fmt
from jaxmem._src import plots as _plots
from jaxmem._src.format import format_bytes
from jaxmem._src.profile import html as _html
from jaxmem._src.profile.diff import PeakDiff, peak_diff
from jaxmem._src.profile.report import _MEMORY_FIELDS, MemoryReport, _check_args, _profile

__all__ = ["Comparison", "compare"]

# Columns of Comparison tables and plots: (MemoryReport attribute, label).
_COMPARE_COLUMNS = (
    ("temp_bytes", "temp"),
    ("argument_bytes", "argument"),
    ("output_bytes", "output"),
    ("peak_bytes", "peak"),
    ("residual_bytes", "residual"),
)


_RATIO_FIELDS = tuple(name for name, _ in _MEMORY_FIELDS) + ("peak_bytes", "residual_bytes")


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Memory reports of several functions on the same arguments; the first is the baseline.

    Attributes:
        reports: label -> :class:`MemoryReport`, in insertion order; the first entry is the
            baseline every ratio is taken against.

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> def loss(x):
        ...     return jnp.sum(jnp.sin(jnp.sin(x)))
        >>> cmp = jaxmem.compare({"stock": loss, "remat": jax.checkpoint(loss)}, jnp.ones(64))
        >>> cmp.ratio("stock", "residual_bytes"), cmp.ratio("remat", "residual_bytes")
        (1.0, 0.5)
    """

    reports: dict[str, MemoryReport]

    def __post_init__(self) -> None:
        if not self.reports:
            raise ValueError("Comparison needs at least one report")

    @property
    def baseline(self) -> str:
        """Label of the first report, the one ratios are taken against.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> jaxmem.compare({"a": jnp.sin, "b": jnp.cos}, jnp.ones(2)).baseline
            'a'
        """
        return next(iter(self.reports))

    def ratio(self, label: str, field: str = "temp_bytes") -> float:
        """``reports[label].<field> / reports[first].<field>``.

        Args:
            label: a label of :attr:`reports`.
            field: a byte-count attribute of :class:`MemoryReport`: one of the ``*_bytes`` fields,
                ``"peak_bytes"`` or ``"residual_bytes"``.

        Returns:
            The ratio. When the baseline is 0 it is ``inf`` if the value is positive and ``nan``
            if it is 0 too; it is ``nan`` when either figure is None (no peak or no residual
            listing).

        Raises:
            KeyError: unknown label.
            ValueError: unknown field.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> cmp = jaxmem.compare({"a": jnp.sin, "b": jnp.cos}, jnp.ones(2))
            >>> cmp.ratio("b", "argument_bytes")
            1.0
            >>> cmp.ratio("a", "alias_bytes")  # 0 / 0
            nan
        """
        if field not in _RATIO_FIELDS:
            raise ValueError(
                f"Comparison.ratio: unknown field {field!r}; use one of {_RATIO_FIELDS}"
            )
        if label not in self.reports:
            raise KeyError(
                f"Comparison.ratio: no report labelled {label!r}; labels: {list(self.reports)}"
            )
        value = getattr(self.reports[label], field)
        base = getattr(self.reports[self.baseline], field)
        if value is None or base is None:
            return math.nan
        if base == 0:
            return math.inf if value > 0 else math.nan
        return value / base

    def diff(self, a: str | None = None, b: str | None = None) -> PeakDiff:
        """What is live at the peaks of ``a`` and ``b``, source by source.

        Rows of (source, bytes at ``a``'s peak, bytes at ``b``'s peak) grouped as
        :meth:`MemoryReport.top_contributors` groups (the model's line, else the argument's
        pytree path); each side's rows add up to its peak-live bytes.

        Args:
            a: a label; default the baseline.
            b: a label; default the one other label (required with three reports or more).

        Returns:
            A :class:`jaxmem.PeakDiff` (``.rows``, ``.added``, ``.freed``,
            ``.common``; ``print`` it for a table).

        Raises:
            KeyError: an unknown label.
            ValueError: ``b`` not given with three reports or more, or only one report.
            ProfileError: a report has no buffer-level view (``buffer_error`` says why).

        Examples:
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> def loss(x):
            ...     return jnp.sum(jnp.sin(jnp.sin(x)))
            >>> cmp = jaxmem.compare({"stock": loss, "remat": jax.checkpoint(loss)}, jnp.ones(64))
            >>> d = cmp.diff()
            >>> sum(r.b_bytes for r in d.rows) == cmp.reports["remat"].buffers.peak_bytes
            True
        """
        labels = list(self.reports)
        a = self.baseline if a is None else a
        if b is None:
            others = [label for label in labels if label != a]
            if len(others) != 1:
                raise ValueError(
                    f"Comparison.diff: name b, one of {others}"
                    if others
                    else "Comparison.diff: needs two reports; this comparison has one"
                )
            b = others[0]
        for label in (a, b):
            if label not in self.reports:
                raise KeyError(f"Comparison.diff: no report labelled {label!r}; labels: {labels}")
        return peak_diff(a, b, self.reports[a]._buffer_report(), self.reports[b]._buffer_report())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: ``baseline``, ``reports`` (each :meth:`MemoryReport.to_dict`) and
        ``ratios`` (label -> field -> ratio; non-finite ratios are written as None).

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> d = jaxmem.compare({"a": jnp.sin, "b": jnp.cos}, jnp.ones(2)).to_dict()
            >>> list(d["reports"]), d["ratios"]["b"]["argument_bytes"]
            (['a', 'b'], 1.0)
        """

        def finite(r: float) -> float | None:
            return r if math.isfinite(r) else None

        return {
            "baseline": self.baseline,
            "reports": {label: rep.to_dict() for label, rep in self.reports.items()},
            "ratios": {
                label: {f: finite(self.ratio(label, f)) for f in _RATIO_FIELDS}
                for label in self.reports
            },
        }

    def to_json(self, **json_kw: Any) -> str:
        """:meth:`to_dict` as a JSON string; ``json_kw`` is passed to :func:`json.dumps`.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> jaxmem.compare({"a": jnp.sin}, jnp.ones(2)).to_json().startswith('{"baseline"')
            True
        """
        return json.dumps(self.to_dict(), **json_kw)

    def _rows(self) -> list[list[str]]:
        rows = []
        for label, rep in self.reports.items():
            row = [label]
            for field, _ in _COMPARE_COLUMNS:
                value = getattr(rep, field)
                cell = format_bytes(value)
                if value is not None:
                    cell += f" ({_fmt.format_ratio(self.ratio(label, field))})"
                row.append(cell)
            rows.append(row)
        return rows

    def _header(self) -> list[str]:
        return ["label"] + [label for _, label in _COMPARE_COLUMNS]

    def _title(self) -> str:
        devices = max(rep.num_devices for rep in self.reports.values())
        note = f"; per device, {devices} devices" if devices > 1 else ""
        return f"Comparison (ratios against {self.baseline!r}{note})"

    def __str__(self) -> str:
        """One row per label, each figure with its ratio to the baseline; then each label's
        peak and its top three contributors (source lines, backward marked)."""
        lines = [
            f"{self._title()}:",
            _fmt.text_table(self._header(), self._rows(), set(range(1, 6))),
        ]
        lines.append("Peak and its top three contributors:")
        for label, rep in self.reports.items():
            lines.append(f"  {label}: {rep.peak_summary()}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The ``str(comparison)`` table, in Markdown.

        Examples:
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> print(jaxmem.compare({"a": jnp.sin}, jnp.ones(2)).to_markdown().splitlines()[2])
            | label | temp | argument | output | peak | residual |
        """
        return (
            f"### {self._title()}\n\n"
            + _fmt.md_table(self._header(), self._rows(), set(range(1, 6)))
            + "\n"
        )

    def plot(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """Save a grouped bar chart: temp/argument/output/peak/residual bytes, one bar per label.

        Missing figures (no peak, no residual listing) are left out. Uses matplotlib's Agg
        renderer directly, without pyplot.

        Args:
            path: where to write the image (format from the suffix, e.g. ``.png``).

        Returns:
            ``path``, as given.

        Examples:
            >>> import tempfile, os
            >>> import jax.numpy as jnp
            >>> import jaxmem
            >>> cmp = jaxmem.compare({"a": jnp.sin, "b": jnp.cos}, jnp.ones(2))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     out = cmp.plot(os.path.join(d, "cmp.png"))
            ...     print(os.path.getsize(out) > 0)
            True
        """
        columns = [label for _, label in _COMPARE_COLUMNS]
        table = {
            label: [getattr(rep, f) for f, _ in _COMPARE_COLUMNS]
            for label, rep in self.reports.items()
        }
        title = f"memory, baseline {self.baseline!r}"
        _plots.grouped_bytes_bars(columns, table, title, "Comparison.plot").savefig(path)
        return path

    def to_html(self, path: str | os.PathLike[str], groups: int = 6) -> str | os.PathLike[str]:
        """Write an interactive memory viewer of the comparison: one self-contained HTML file.

        The comparison table (each figure with its ratio to the baseline) on top, then every
        report side by side as :meth:`MemoryReport.to_html` shows it, their timelines on one
        scale of bytes. ``page.html#report=LABEL&buffer=NAME`` opens buffer ``NAME`` of report
        ``LABEL`` on load (``#buffer=NAME``: of the first report that has one so named).

        Args:
            path: where to write the page (e.g. ``"comparison.html"``).
            groups: how many source lines get a band of their own in each timeline.

        Returns:
            ``path``, as given.

        Examples:
            >>> import tempfile, os
            >>> import jax, jax.numpy as jnp
            >>> import jaxmem
            >>> def loss(x):
            ...     return jnp.sum(jnp.sin(jnp.sin(x)))
            >>> cmp = jaxmem.compare({"stock": loss, "remat": jax.checkpoint(loss)}, jnp.ones(64))
            >>> with tempfile.TemporaryDirectory() as d:
            ...     with open(cmp.to_html(os.path.join(d, "cmp.html")), encoding="utf-8") as f:
            ...         page = f.read()
            >>> "Memory comparison: stock vs remat" in page
            True
        """
        _html.write(path, _html.comparison_page(self, _COMPARE_COLUMNS, groups))
        return path


def compare(fns: Mapping[str, Callable[..., Any]], *args: Any, **kwargs: Any) -> Comparison:
    """Profile several functions on the same arguments; ratios are against the first.

    Args:
        fns: label -> function, e.g. ``{"stock": loss, "jaxmem": lean_loss}``. The first entry is
            the baseline.
        *args: positional arguments passed to every function (see :func:`profile`).
        **kwargs: keyword arguments passed to every function.

    Returns:
        A :class:`Comparison` whose reports are named by their labels.

    Raises:
        TypeError: ``fns`` is not a mapping, a value is not callable (the message names its
            label), or an argument leaf cannot be traced.
        ValueError: ``fns`` is empty.
        ProfileError: a function failed to trace or compile (the message names label and
            function).

    Examples:
        >>> import jax
        >>> import jax.numpy as jnp
        >>> import jaxmem
        >>> def loss(x):
        ...     return jnp.sum(jnp.sin(jnp.sin(x)))
        >>> cmp = jaxmem.compare({"stock": loss, "remat": jax.checkpoint(loss)}, jnp.ones(64))
        >>> cmp.reports["stock"].residual_bytes, cmp.reports["remat"].residual_bytes
        (512, 256)
        >>> print(str(cmp).splitlines()[0])
        Comparison (ratios against 'stock'):
    """
    if not isinstance(fns, Mapping):
        raise TypeError(
            "compare: fns must be a mapping {label: function}, got " + checks.describe(fns)
        )
    if not fns:
        raise ValueError("compare: fns is empty; pass at least one {label: function}")
    for label, fn in fns.items():
        checks.check_callable(fn, f"fns[{label!r}]", "compare")
    _check_args(args, kwargs, "compare")
    reports = {
        label: _profile(fn, args, kwargs, name=str(label), caller="compare")
        for label, fn in fns.items()
    }
    return Comparison(reports)
