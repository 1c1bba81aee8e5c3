/* Shared by the analysis kernels (the C files of native/kernels/), built by setup.py into one shared object,
 * kmesh_trace/native/_kmesh_kernels*.so, and called through ctypes (kmesh_trace.native.kernels).
 *
 * Conventions: every entry point is `KS_EXPORT`, named ks_<module>_<what>, takes plain pointers and
 * lengths (numpy arrays the Python side has checked for dtype and contiguity) and touches no Python
 * object, so ctypes releases the GIL around the call. An entry with more than a few parameters takes a
 * structure of inputs and one of outputs instead (boundary.h; their layouts are ks_layout's, layout.c).
 * Allocation failures return KS_ENOMEM (negative); a kernel never prints and never exits.
 */
#ifndef KMESH_KERNELS_H
#define KMESH_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "boundary.h"

#define KS_EXPORT __attribute__((visibility("default")))
#define KS_ENOMEM (-12)

/* The ids of a ks_access_stream as `T` values (T: the kernel's id type, int32_t or int64_t). */
#define KS_IDS(s, T) \
    ((const T *)(sizeof(T) == sizeof(int32_t) ? (const void *)(s)->obj32 : (const void *)(s)->obj64))

/* A kernel whose inner loops compare or take minima over a cache line of int32 values is also built for
 * AVX2, chosen at load time where the CPU has it (GCC and Clang function multi-versioning on x86-64). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KS_WIDE_VECTORS __attribute__((target_clones("avx2", "default")))
#else
#define KS_WIDE_VECTORS
#endif

#define KS_LIKELY(x) __builtin_expect(!!(x), 1)
#define KS_UNLIKELY(x) __builtin_expect(!!(x), 0)

#endif
