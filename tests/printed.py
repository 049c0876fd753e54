"""What a command printed, read back: a rich table's cells (stdout is not a terminal in tests, so nothing wraps)."""

from __future__ import annotations


def table_cells(lines: list[str]) -> tuple[list[str], list[list[str]]]:
    """The header's cells and each row's cells of the one rich table among `lines`."""
    header = next(line for line in lines if line.startswith("┃"))
    rows = [line for line in lines if line.startswith("│")]
    return [c.strip() for c in header.split("┃")[1:-1]], [[c.strip() for c in r.split("│")[1:-1]] for r in rows]
