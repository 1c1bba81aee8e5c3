"""Bounded row buffers between the engine thread and the background writer.

The engine thread appends one tuple per event; the writer thread takes everything appended so far
(`drain`). Neither side takes a lock: under CPython's GIL `list.append`, a slice copy and a slice
deletion are each atomic, and the writer removes exactly the rows it copied, so a row appended
while it drains stays for the next drain. The buffer is bounded: a row that finds it full is not
stored but counted (`num_dropped`), and the count goes into the trace metadata, so memory stays
bounded under any event rate and nothing is lost silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kmesh_trace import schema


class RowBuffer:
    """Rows of one table, as tuples in the table's column order (`columns`)."""

    __slots__ = ("capacity", "columns", "num_dropped", "rows", "table")

    def __init__(self, table: str, capacity: int, columns: Sequence[str] | None = None):
        self.table = table
        self.columns = tuple(columns or schema.table(table).column_names)
        self.capacity = capacity
        self.rows: list[tuple] = []
        self.num_dropped = 0

    def append(self, row: tuple) -> None:
        if len(self.rows) < self.capacity:
            self.rows.append(row)
        else:
            self.num_dropped += 1

    def drain(self) -> list[tuple]:
        rows = self.rows
        n = len(rows)
        if not n:
            return []
        batch = rows[:n]
        del rows[:n]
        return batch

    def to_columns(self, batch: list[tuple]) -> dict[str, Any]:
        """Transpose drained rows into {column: values} for `TraceWriter.write`. Rows may stop before the
        table's last columns (nullable ones a later schema added); the writer fills those with nulls."""
        width = min(len(row) for row in batch) if batch else 0
        # One comprehension per column: several times faster than zip(*batch) on large batches.
        return {c: [row[i] for row in batch] for i, c in enumerate(self.columns[:width])}
