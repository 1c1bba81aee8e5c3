/* The access stream built piece by piece, for a stream too long to hold (oracle/streamed_curve.py): dense ids
 * from a hash table that lives across pieces, and next uses from a backward pass over the pieces.
 *
 * - ks_idtable_new / ks_idtable_assign / ks_idtable_free: each hash gets the dense id of its first sighting
 *   (0, 1, ...), in the order the pieces come; ids are int32 (at most 2^31 - 1 distinct hashes). The table is
 *   open addressing with linear probing, at most half full, doubled when it would pass that.
 * - ks_streamed_next_uses: one piece of the stream, last access first, with `nxt` the next eligible access of
 *   each object after the piece (NEVER: none): next_use[t] = nxt[obj[t]], then nxt[obj[t]] = t when t is
 *   eligible, else NEVER. Pieces are passed from the stream's end to its start; the result is what
 *   oracle/stream.py's `next_uses` gives for the whole stream. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define KS_ETOOMANY (-75) /* more distinct hashes than int32 ids */

typedef struct {
    uint64_t *keys;
    int32_t *ids; /* -1: an empty slot */
    int64_t mask, used;
} idtable_t;

static inline uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static int table_alloc(idtable_t *t, int64_t slots)
{
    t->keys = malloc((size_t)slots * sizeof(uint64_t));
    t->ids = malloc((size_t)slots * sizeof(int32_t));
    if (!t->keys || !t->ids) {
        free(t->keys);
        free(t->ids);
        return KS_ENOMEM;
    }
    memset(t->ids, 0xff, (size_t)slots * sizeof(int32_t));
    t->mask = slots - 1;
    return 0;
}

KS_EXPORT void *ks_idtable_new(int64_t first_slots)
{
    idtable_t *t = calloc(1, sizeof(idtable_t));
    int64_t slots = 1024;
    while (slots < first_slots)
        slots *= 2;
    if (!t || table_alloc(t, slots) < 0) {
        free(t);
        return NULL;
    }
    return t;
}

KS_EXPORT void ks_idtable_free(void *p)
{
    idtable_t *t = p;
    if (t) {
        free(t->keys);
        free(t->ids);
        free(t);
    }
}

static int table_grow(idtable_t *t)
{
    idtable_t g;
    if (table_alloc(&g, 2 * (t->mask + 1)) < 0)
        return KS_ENOMEM;
    for (int64_t i = 0; i <= t->mask; i++) {
        if (t->ids[i] < 0)
            continue;
        int64_t j = (int64_t)(mix(t->keys[i]) & (uint64_t)g.mask);
        while (g.ids[j] >= 0)
            j = (j + 1) & g.mask;
        g.keys[j] = t->keys[i];
        g.ids[j] = t->ids[i];
    }
    free(t->keys);
    free(t->ids);
    t->keys = g.keys;
    t->ids = g.ids;
    t->mask = g.mask;
    return 0;
}

/* ids[i] = the dense id of hashes[i] (a new one, the next, at its first sighting). Returns the number of
 * distinct hashes seen so far, KS_ENOMEM or KS_ETOOMANY. */
KS_EXPORT int64_t ks_idtable_assign(void *p, const uint64_t *hashes, int64_t n, int32_t *ids)
{
    idtable_t *t = p;
    for (int64_t i = 0; i < n; i++) {
        uint64_t k = hashes[i];
        int64_t j = (int64_t)(mix(k) & (uint64_t)t->mask);
        for (;;) {
            int32_t id = t->ids[j];
            if (id < 0) {
                if (t->used == INT32_MAX)
                    return KS_ETOOMANY;
                if (2 * (t->used + 1) > t->mask + 1) {
                    if (table_grow(t) < 0)
                        return KS_ENOMEM;
                    j = (int64_t)(mix(k) & (uint64_t)t->mask);
                    while (t->ids[j] >= 0)
                        j = (j + 1) & t->mask;
                }
                t->keys[j] = k;
                t->ids[j] = (int32_t)t->used;
                ids[i] = (int32_t)t->used++;
                break;
            }
            if (t->keys[j] == k) {
                ids[i] = id;
                break;
            }
            j = (j + 1) & t->mask;
        }
    }
    return t->used;
}

/* The piece of accesses [first, first + n): obj, eligible in, next_use out; nxt updated (see the top). */
KS_EXPORT void ks_streamed_next_uses(const int32_t *obj, const uint8_t *eligible, int64_t n, int64_t first,
                                     int64_t *nxt, int64_t never, int64_t *next_use)
{
    for (int64_t i = n - 1; i >= 0; i--) {
        int32_t o = obj[i];
        next_use[i] = nxt[o];
        nxt[o] = eligible[i] ? first + i : never;
    }
}
