"""The capture's bounded row buffers: a full buffer drops rows and counts them."""

from __future__ import annotations

from kmesh_trace.capture.buffers import RowBuffer


def test_row_buffer_is_bounded_and_counts_drops():
    buf = RowBuffer("transfers", capacity=3)
    for i in range(5):
        buf.append((f"r{i}",))
    assert buf.num_dropped == 2
    assert buf.drain() == [("r0",), ("r1",), ("r2",)]
    assert buf.drain() == []
    buf.append(("r5",))
    assert buf.drain() == [("r5",)] and buf.num_dropped == 2

