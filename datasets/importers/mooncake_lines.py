"""Mooncake JSONL in the plain shape read straight into numpy columns, in compiled passes over chunks of the file
(native/kernels/mooncake_lines.c): the first fast path of `read_mooncake` (datasets/importers/mooncake.py). The
hashes come as one array('Q'), as from the importer's other readers; the per-row columns as int64 arrays.

The file is read twice through one reused buffer, never whole: a first pass counts the bytes that bound the
columns (rows <= '{'s, hashes <= runs of digits: a line padded with commas sizes nothing) and stops at once on a byte no plain line holds (non-ASCII, a
backslash); the columns are then allocated once and the second pass parses whole lines into them. A line
the kernel is not certain about -- anything but the four fields as plain decimal integers and a flat list
(its header comment says exactly what it takes) -- makes `read_lines` return None for the WHOLE file, and
the importer's msgspec and plain readers decide as they always did. Whatever it accepts, those read alike
(tests/test_mooncake_lines.py compares the three)."""

from __future__ import annotations

import mmap
from array import array
from pathlib import Path

import numpy as np

from kmesh_trace.native.kernels import I32, I64, P, check, declare, ptr

#: Bytes per read: the buffer grows (doubling) only for a line longer than it.
CHUNK_BYTES = 4 << 20

_GIVE_UP, _ROOM = -1, -2  # native/kernels/mooncake_lines.c's MC_GIVE_UP, MC_ROOM
_ROWS, _HASHES, _LINES, _BLANK = range(4)  # its counts' slots
_BRACES, _NUMBERS, _ODD = range(3)  # its bounds' slots

_bounds = declare("ks_mooncake_bounds", [P, I64, I32, P])
_parse = declare("ks_mooncake_parse", [P, I64, I32, I32, P, P, P, P, P, P, I64, I64, P], I64)


class LineColumns:
    """The columns of a file read here (row i is the i-th non-blank line), and its line counts."""

    def __init__(self, num_rows: int, num_hashes: int) -> None:
        self.lineno = np.empty(num_rows, np.int64)
        self.arrival_ns = np.empty(num_rows, np.int64)
        self.num_prompt_tokens = np.empty(num_rows, np.int64)
        self.num_output_tokens = np.empty(num_rows, np.int64)
        self.offsets = np.zeros(num_rows + 1, np.int64)
        # The hashes as the importer's other readers give them, an array('Q'), written through a numpy view
        # (zero-filled once: the bound is within three per row of the count, and a run split by a chunk's end).
        self.hashes = array("Q", [0]) * num_hashes
        self._hash_view = np.frombuffer(self.hashes, np.uint64) if num_hashes else np.zeros(1, np.uint64)
        self.counts = np.zeros(4, np.int64)

    @property
    def num_lines(self) -> int:
        return int(self.counts[_LINES])

    @property
    def num_blank_lines(self) -> int:
        return int(self.counts[_BLANK])

    def parse(self, buf: np.ndarray, length: int, at_start: bool, at_end: bool) -> int:
        """Bytes of buf[:length] consumed (whole lines), or a negative code."""
        return check(_parse(ptr(buf, np.uint8), length, at_start, at_end, ptr(self.lineno, np.int64),
                            ptr(self.arrival_ns, np.int64), ptr(self.num_prompt_tokens, np.int64),
                            ptr(self.num_output_tokens, np.int64), ptr(self.offsets, np.int64),
                            ptr(self._hash_view, np.uint64), len(self.arrival_ns), len(self.hashes),
                            ptr(self.counts, np.int64)), "mooncake lines")

    def trimmed(self) -> "LineColumns":
        """The columns cut to what was stored (the bounds are upper bounds)."""
        rows = int(self.counts[_ROWS])
        for name in ("lineno", "arrival_ns", "num_prompt_tokens", "num_output_tokens"):
            setattr(self, name, getattr(self, name)[:rows])
        self.offsets = self.offsets[:rows + 1]
        del self._hash_view  # the array may shrink (in place) once no view holds it
        del self.hashes[int(self.counts[_HASHES]):]
        return self


def read_lines(src: Path, chunk_bytes: int = CHUNK_BYTES) -> LineColumns | None:
    """The columns of Mooncake JSONL file `src` when every line is blank or in the plain shape, else None (also
    when reading fails: the plain reader says how)."""
    try:
        return _read(src, chunk_bytes)
    except OSError:
        return None


def _read(src: Path, chunk_bytes: int) -> LineColumns | None:
    with open(src, "rb") as f, _Buffer(chunk_bytes) as buf:
        sizes = _column_sizes(f, buf)
        if sizes is None:
            return None
        cols = LineColumns(*sizes)
        f.seek(0)
        have, at_start = 0, True
        while True:
            if have == buf.size:  # one line longer than the buffer
                buf.grow()
            n = f.readinto(buf.view[have:])
            length, at_end = have + n, n == 0
            used = cols.parse(buf.array, length, at_start, at_end)
            if used < 0:  # _GIVE_UP, or _ROOM (the file changed between the passes)
                return None
            if at_end:
                return cols.trimmed()
            buf.array[:length - used] = buf.array[used:length]
            have, at_start = length - used, at_start and used == 0


def _column_sizes(f, buf: "_Buffer") -> tuple[int, int] | None:
    """(rows, hashes) that bound the columns of the file `f` reads (the first pass), or None at a byte no plain
    line holds."""
    bounds = np.zeros(3, np.int64)
    at_start = True
    while n := f.readinto(buf.view):
        _bounds(ptr(buf.array, np.uint8), n, at_start, ptr(bounds, np.int64))
        if bounds[_ODD]:
            return None
        at_start = False
    return int(bounds[_BRACES]), int(bounds[_NUMBERS])


class _Buffer:
    """The reused read buffer, an anonymous mapping of its own: a malloc'd one would raise the allocator's
    mmap threshold to its size when freed, and every later allocation below it would stay on the heap
    (~15 MB more resident over a whole analysis at 16 MB)."""

    def __init__(self, size: int) -> None:
        self.size = 0
        self._map(max(size, mmap.PAGESIZE))

    def _map(self, size: int, keep: int = 0) -> None:
        m = mmap.mmap(-1, size)
        if keep:
            m[:keep] = self.array[:keep]
        self.close()
        self.mm, self.size = m, size
        self.array = np.frombuffer(m, np.uint8)
        self.view = memoryview(m)

    def grow(self) -> None:
        """Twice the room, the bytes held kept."""
        self._map(2 * self.size, self.size)

    def close(self) -> None:
        if self.size:
            self.view.release()
            del self.array
            self.mm.close()
            self.size = 0

    def __enter__(self) -> "_Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
