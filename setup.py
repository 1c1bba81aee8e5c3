"""Build hook: two plain shared objects, the native replay library (native/replay.c) and the analysis
kernels (native/kernels/*.c).

Both are compiled with the system C compiler during the normal `pip install` / `pip install -e .` and
loaded with ctypes (kmesh_trace.native._lib, kmesh_trace.native.kernels), never imported as Python
modules. They need only glibc: io_uring is reached through raw syscalls and CUDA through
dlopen("libcuda.so.1") at run time, so no CUDA toolkit or liburing is needed to build them.
"""

from pathlib import Path

from setuptools import Extension, setup

#: Every C file of the kernels; each is a unit of its own over native/kernels/kernels.h.
KERNELS = sorted(str(p) for p in Path("native/kernels").glob("*.c"))

setup(
    ext_modules=[
        Extension(
            "kmesh_trace.native._kmesh_replay",
            sources=["native/replay.c"],
            depends=["native/layout_table.h"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
            libraries=["dl", "pthread"],
        ),
        Extension(
            "kmesh_trace.native._kmesh_kernels",
            sources=KERNELS,
            depends=sorted(str(p) for p in Path("native/kernels").glob("*.h")) + ["native/layout_table.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-fvisibility=hidden"],
        ),
    ],
)
