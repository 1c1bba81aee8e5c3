"""Where a payload file lives on its block device: the device behind a path, and FIEMAP extents.

The `dmabuf_fixed` route reads chunks from the raw block device (the proposed io_uring DMA-BUF
interface targets raw NVMe devices opened O_DIRECT, not files), so a chunk's file range must become
device ranges. This module owns that translation (FS_IOC_FIEMAP) and naming the device that holds a
path (via /sys/dev/block). Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_HDR = struct.Struct("=QQIIII")  # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, fm_reserved
_EXT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
_EXTENT_LAST = 0x1
# Extents whose bytes are not plainly at fe_physical on the device (delayed, unwritten, inline, encoded...).
_EXTENT_UNSAFE = 0x2 | 0x4 | 0x8 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800


@dataclass(frozen=True)
class BlockDevice:
    name: str  # kernel name, e.g. nvme0n1p1 or vda
    path: Path  # /dev/<name>
    is_nvme: bool


def device_of(path: Path) -> BlockDevice | None:
    """The block device whose file system holds `path`, or None (tmpfs, overlay without a device...)."""
    st = os.stat(path)
    sys_dir = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        uevent = dict(line.split("=", 1) for line in (sys_dir / "uevent").read_text().split() if "=" in line)
    except OSError:
        return None
    name = uevent.get("DEVNAME")
    if not name:
        return None
    return BlockDevice(name, Path("/dev") / name, name.startswith("nvme"))


def extents(path: Path, offset: int, length: int) -> list[tuple[int, int, int]]:
    """(file_offset, device_offset, length) pieces covering [offset, offset+length) of `path`.

    Raises OSError when the file system cannot map the range to plain device blocks (holes, unwritten
    or delayed extents, inline data, compression): such a range cannot be read from the raw device.
    """
    out: list[tuple[int, int, int]] = []
    want_end = offset + length
    pos = offset
    with open(path, "rb") as f:
        while pos < want_end:
            count = 64
            buf = bytearray(_HDR.pack(pos, want_end - pos, _FIEMAP_FLAG_SYNC, 0, count, 0) + bytes(_EXT.size * count))
            fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf)
            mapped = _HDR.unpack_from(buf)[3]
            if mapped == 0:
                raise OSError(f"{path}: no extent maps bytes {pos}..{want_end} (a hole?)")
            last = False
            for i in range(mapped):
                lo, ph, ln, _, _, fl, *_ = _EXT.unpack_from(buf, _HDR.size + i * _EXT.size)
                if fl & _EXTENT_UNSAFE:
                    raise OSError(f"{path}: extent at {lo} has flags {fl:#x}; its bytes are not plain device blocks")
                a, b = max(lo, pos), min(lo + ln, want_end)
                if a > pos:
                    raise OSError(f"{path}: bytes {pos}..{a} are not mapped (a hole)")
                if b > a:
                    out.append((a, ph + (a - lo), b - a))
                    pos = b
                last = bool(fl & _EXTENT_LAST)
            if last and pos < want_end:
                raise OSError(f"{path}: the file's extents end at {pos}, before {want_end}")
    return out
