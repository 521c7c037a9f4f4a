"""Markdown tables built from cells, so the header, the separator and every row have the same number of cells."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["markdown_table"]


def _cell(x) -> str:
    return str(x).replace("|", "\\|")  # a literal pipe would split the cell


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Lines of a markdown table; a ValueError if a row does not have one cell per header cell."""
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(f"table row {i} has {len(row)} cells for {len(header)} header cells")
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
