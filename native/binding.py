"""The one way Python binds the shared objects built from native/ (the replay engine, native/replay.c,
through `kmesh_trace.native._lib`; the analysis kernels, native/kernels/*.c, through
`kmesh_trace.native.kernels`).

- Every entry point is given its C signature by name (`declare_all`); a library that lacks one was built
  from other sources, and the caller's error says so.
- A C structure that crosses the boundary is mirrored once in Python, as a numpy dtype (records in an
  array) or a `Struct` (one set of arguments), and the library describes its own structures in a layout
  table (each structure's size, each field's offset and size, in declaration order: `kr_layout` in
  native/replay.c, `ks_layout` in native/kernels/layout.c). The mirror and the table are compared
  (`check_layouts`) before the first call, so a stale build or an edit on one side only is a
  `LayoutMismatchError` naming every difference, never memory misread.
- An array crosses as the address of its data once its dtype and C-contiguity are checked (`ptr`): a
  wrong array is a `TypeError` here, never memory misread there.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np

from kmesh_trace.errors import KmeshTraceError


class LayoutMismatchError(KmeshTraceError):
    """A binding's mirror of a C structure disagrees with the structure the loaded library was compiled with."""


def declare_all(L: ctypes.CDLL, signatures: dict[str, tuple[list, object]], missing: Callable[[str], Exception]):
    """Give each entry point of `signatures` ({name: (argtypes, restype)}; restype None: void) its C
    signature; raises `missing(name)` for the first one the library lacks. Returns the last one declared."""
    fn = None
    for name, (argtypes, restype) in signatures.items():
        try:
            fn = getattr(L, name)
        except AttributeError:
            raise missing(name) from None
        fn.argtypes = argtypes
        fn.restype = restype
    return fn


def ptr(a: np.ndarray | None, dtype) -> int | None:
    """The address of `a`'s data for C code that reads it as `dtype` values (None stays NULL)."""
    if a is None:
        return None
    if a.dtype != np.dtype(dtype) or not a.flags.c_contiguous:
        raise TypeError(f"a kernel needs a C-contiguous {np.dtype(dtype)} array, not {a.dtype} "
                        f"({'contiguous' if a.flags.c_contiguous else 'strided'})")
    return a.ctypes.data


@functools.cache
def Ptr(dtype) -> type:
    """The field type of a pointer to C `dtype` values (`const int64_t *`: Ptr(np.int64)); `Struct.of`
    fills it with an array of exactly that dtype, or None (NULL)."""
    dt = np.dtype(dtype)
    return type(f"Ptr_{dt.name}", (ctypes.c_void_p,), {"dtype": dt})


class Struct(ctypes.Structure):
    """A C structure mirrored field by field (`_fields_`, in the C's order, with the C's names); `c_type`
    is its name in the library's layout table. Scalars are ctypes integers or doubles, pointers `Ptr`
    fields, nested structures `Struct` fields."""

    c_type: ClassVar[str]

    @classmethod
    def of(cls, **values) -> Struct:
        """The structure with every field set from `values` (each field named once): an array for a `Ptr`
        field (its dtype checked; the structure keeps the array alive), a `Struct` for a nested one, a number
        (a bool: 0 or 1) for a scalar."""
        s, keep = cls(), []
        for name, ftype in cls._fields_:
            try:
                v = values.pop(name)
            except KeyError:
                raise TypeError(f"struct {cls.c_type} needs its field {name}") from None
            if isinstance(ftype, type) and issubclass(ftype, ctypes.c_void_p) and hasattr(ftype, "dtype"):
                setattr(s, name, ptr(v, ftype.dtype))
                keep.append(v)
            else:
                setattr(s, name, v)
                keep.append(getattr(v, "_keep", None))
        if values:
            raise TypeError(f"struct {cls.c_type} has no field {', '.join(values)}")
        s._keep = keep
        return s


def structs_in(types) -> list[type[Struct]]:
    """The `Struct`s among `types` (ctypes argument types: a pointer to one counts) and those nested in them,
    each once, outermost first."""
    found: list[type[Struct]] = []

    def visit(t):
        t = getattr(t, "_type_", t) if isinstance(t, type) and issubclass(t, ctypes._Pointer) else t
        if isinstance(t, type) and issubclass(t, Struct) and t not in found:
            found.append(t)
            for _, ftype in t._fields_:
                visit(ftype)

    for t in types:
        visit(t)
    return found


def c_layouts(layout_row: Callable) -> dict[str, dict]:
    """What a library says of its structures, read through its layout function (`layout_row(i, &type,
    &field, &offset, &size)`, 0 while i is a row): {type: {"size": n, "fields": {field: (offset, size)}}}."""
    found: dict[str, dict] = {}
    t, f = ctypes.c_char_p(), ctypes.c_char_p()
    off, size = ctypes.c_uint64(), ctypes.c_uint64()
    i = 0
    while layout_row(i, ctypes.byref(t), ctypes.byref(f), ctypes.byref(off), ctypes.byref(size)) == 0:
        entry = found.setdefault(t.value.decode(), {"size": None, "fields": {}})
        if f.value is None:
            entry["size"] = size.value
        else:
            entry["fields"][f.value.decode()] = (off.value, size.value)
        i += 1
    return found


def mirror_layout(mirror) -> tuple[int, dict[str, tuple[int, int]]]:
    """(size, {field: (offset, size)}) of a mirror: a ctypes Structure, or anything np.dtype accepts."""
    if isinstance(mirror, type) and issubclass(mirror, ctypes.Structure):
        return ctypes.sizeof(mirror), {name: (getattr(mirror, name).offset, getattr(mirror, name).size)
                                       for name, *_ in mirror._fields_}
    dt = np.dtype(mirror)
    return dt.itemsize, {name: (dt.fields[name][1], dt.fields[name][0].itemsize) for name in dt.names or ()}


def layout_problems(c_type: str, c_layout: dict | None, mirror) -> list[str]:
    """How `mirror` (a numpy dtype, or a ctypes Structure) differs from the C structure `c_type` as the
    library describes it; empty when they agree field by field."""
    if c_layout is None:
        return [f"the library describes no struct {c_type}"]
    size, fields = mirror_layout(mirror)
    problems = []
    if size != c_layout["size"]:
        problems.append(f"sizeof(struct {c_type}) is {c_layout['size']} bytes in C, {size} in the binding")
    c_fields = list(c_layout["fields"])
    if list(fields) != c_fields:
        problems.append(f"struct {c_type} has fields {c_fields} in C, {list(fields)} in the binding")
    for name in c_fields:
        if name in fields:
            c_off, c_size = c_layout["fields"][name]
            f_off, f_size = fields[name]
            if (f_off, f_size) != (c_off, c_size):
                problems.append(f"{c_type}.{name} is {c_size} bytes at offset {c_off} in C, "
                                f"{f_size} at offset {f_off} in the binding")
    return problems


def check_layouts(c: dict[str, dict], mirrored: dict, path: Path | str, sources: str, binding: str) -> None:
    """Raise LayoutMismatchError naming every difference between the C structures `c` (`c_layouts`) and
    their mirrors ({c_type: mirror}); `sources` and `binding` name the two sides for the message."""
    problems = [p for c_type, mirror in mirrored.items() for p in layout_problems(c_type, c.get(c_type), mirror)]
    if problems:
        raise LayoutMismatchError(f"{path} was built from a {sources} whose structures do not match "
                                  f"{binding} ({'; '.join(problems)}); rebuild it "
                                  "(`pip install -e .`) from the same checkout")
