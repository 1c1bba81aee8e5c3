"""Bounded row buffers between the engine thread and the background writer.

The engine thread appends one tuple per event; the writer thread takes everything appended so far
(`drain`). Neither side takes a lock: under CPython's GIL `list.append`, a slice copy and a slice
deletion are each atomic, and the writer removes exactly the rows it copied, so a row appended
while it drains stays for the next drain. The buffer is bounded: a row that finds it full is not
stored but counted (`num_dropped`), and the count goes into the trace metadata, so memory stays
bounded under any event rate and nothing is lost silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kmesh_trace import schema


class RowBuffer:
    """Rows of one table, as tuples in the table's column order (`columns`).

    The block-event buffer also holds *batch records* (`rows.BlockEventExpander`): one per vLLM pool
    call, expanded into rows by the writer thread. Its capacity counts events, not records:
    `num_events_in` (written by the engine thread only) minus `num_events_out` (the writer's only)
    is what is buffered, so neither side needs a lock.
    """

    __slots__ = ("capacity", "columns", "conversions", "num_dropped", "num_events_in", "num_events_out", "rows",
                 "table")

    def __init__(self, table: str, capacity: int, columns: Sequence[str] | None = None,
                 conversions: Mapping[str, Callable[[list], list]] | None = None):
        self.table = table
        self.columns = tuple(columns or schema.table(table).column_names)
        self.conversions = dict(conversions or {})  # column -> values converter, run by the writer thread
        self.capacity = capacity
        self.rows: list[tuple] = []
        self.num_dropped = 0
        self.num_events_in = 0
        self.num_events_out = 0

    def append(self, row: tuple) -> None:
        if self.num_events_in - self.num_events_out < self.capacity:
            self.rows.append(row)
            self.num_events_in += 1
        else:
            self.num_dropped += 1

    def drain(self) -> list[tuple]:
        """Everything buffered so far (each entry counted as one event; a caller that buffers batch
        records adds the rest to `num_events_out`)."""
        rows = self.rows
        n = len(rows)
        if not n:
            return []
        batch = rows[:n]
        del rows[:n]
        self.num_events_out += n
        return batch

    def to_columns(self, batch: list[tuple]) -> dict[str, Any]:
        """Transpose drained rows into {column: values} for `TraceWriter.write`. `columns` may stop before
        the table's last columns (nullable ones the capture never fills); the writer fills those with nulls."""
        # One comprehension per column: several times faster than zip(*batch) on large batches.
        cols = {c: [row[i] for row in batch] for i, c in enumerate(self.columns)}
        for c, convert in self.conversions.items():
            cols[c] = convert(cols[c])
        return cols
