/* The layout table with which a native library describes the structures at its boundary (native/replay.c's
 * kr_layout, native/kernels/layout.c's ks_layout), read by kmesh_trace.native.binding and compared with the
 * Python mirrors: one row per structure (field NULL: the whole structure's size) and one per field, in
 * declaration order. */
#ifndef KMESH_LAYOUT_TABLE_H
#define KMESH_LAYOUT_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *type, *field;
    uint64_t offset, size;
} layout_row;

/* The row of the whole type T, named `name`; the row of its field F. */
#define LAYOUT_TYPE(name, T) {name, NULL, 0, sizeof(T)}
#define LAYOUT_FIELD(name, T, F) {name, #F, offsetof(T, F), sizeof(((T *)0)->F)}

/* Row i of the n `rows` into the outputs: 0, or -1 past the end. */
static inline int layout_row_at(const layout_row *rows, size_t n, uint64_t i, const char **type, const char **field,
                                uint64_t *offset, uint64_t *size)
{
    if (i >= n)
        return -1;
    *type = rows[i].type;
    *field = rows[i].field;
    *offset = rows[i].offset;
    *size = rows[i].size;
    return 0;
}

#endif
