/* Compiles the kernel body named by KS_BODY (a header) once per id width: 32-bit ids (ID_T int32_t,
 * entry points suffixed _i32) and 64-bit ids (_i64). oracle/kernel_ids.py picks the width for a stream.
 * Include it after #define KS_BODY "file.h"; it may be included again with another KS_BODY. */
#define ID_T int32_t
#define KS_NAME(x) x##_i32
#include KS_BODY
#undef ID_T
#undef KS_NAME
#define ID_T int64_t
#define KS_NAME(x) x##_i64
#include KS_BODY
#undef ID_T
#undef KS_NAME
#undef KS_BODY
