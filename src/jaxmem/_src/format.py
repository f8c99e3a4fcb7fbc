"""Text presentation shared by the reports: byte counts, ratios, aligned text tables and markdown
tables.
"""

from __future__ import annotations

import math


def format_type(shape: tuple[int, ...], dtype_name: str) -> str:
    """An array type as JAX prints it: ``"float32[2,4]"``.

    Examples:
        >>> format_type((2, 4), "float32"), format_type((), "int32")
        ('float32[2,4]', 'int32[]')
    """
    return f"{dtype_name}[{','.join(str(d) for d in shape)}]"


def format_bytes(n: int | None) -> str:
    """Human-readable size in binary units: ``"96 B"``, ``"1.50 KiB"``, ``"2.00 MiB"``.

    Args:
        n: a byte count, or None (shown as ``"n/a"``).

    Returns:
        The formatted size.

    Examples:
        >>> format_bytes(96), format_bytes(1536), format_bytes(3 * 2**30), format_bytes(None)
        ('96 B', '1.50 KiB', '3.00 GiB', 'n/a')
    """
    if n is None:
        return "n/a"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_ratio(r: float) -> str:
    return "×n/a" if math.isnan(r) else f"×{r:.2f}"


def text_table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  " + "  ".join(out).rstrip()

    sep = "  " + "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def md_table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    def esc(c: str) -> str:
        return c.replace("|", "\\|")

    align = ["---:" if i in right else "---" for i in range(len(header))]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(esc(c) for c in cells) + " |" for cells in lines)
