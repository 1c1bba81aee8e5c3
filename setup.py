"""Build hook: the native replay library (native/replay.c) as a plain shared object.

It is compiled with the system C compiler during the normal `pip install` / `pip install -e .` and
loaded with ctypes (kmesh_trace.native._lib), never imported as a Python module. It needs only glibc:
io_uring is reached through raw syscalls and CUDA through dlopen("libcuda.so.1") at run time, so no
CUDA toolkit or liburing is needed to build it.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kmesh_trace.native._kmesh_replay",
            sources=["native/replay.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
            libraries=["dl", "pthread"],
        )
    ],
)
