/* The access stream built piece by piece, for a stream too long to hold (oracle/streamed_curve.py): dense ids
 * from a hash table that lives across pieces, and next uses from a backward pass over the pieces.
 *
 * - ks_idtable_new / ks_idtable_assign / ks_idtable_free: each hash gets the dense id of its first sighting
 *   (0, 1, ...), in the order the pieces come; ids are int32 (at most 2^31 - 1 distinct hashes). The table is
 *   open addressing with linear probing, at most half full, doubled when it would pass that: about 16 bytes
 *   a distinct hash, 24 while it doubles.
 * - ks_streamed_next_uses: one piece of the stream, last access first, with `nxt` the next eligible access of
 *   each object after the piece (NEVER: none): next_use[t] = nxt[obj[t]], then nxt[obj[t]] = t when t is
 *   eligible, else NEVER (in nxt, -1: 4 bytes an object). Pieces are passed from the stream's end to its start; the result is what
 *   oracle/stream.py's `next_uses` gives for the whole stream. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define KS_ETOOMANY (-75) /* more distinct hashes than int32 ids */
#define AHEAD 16            /* accesses ahead whose memory is asked for */

/* A slot holds id + 1 (0: empty) and keys[id] the hash: 4 bytes a slot, 8 a distinct hash. */
typedef struct {
    uint32_t *slots;
    uint64_t *keys;
    int64_t mask, used, room; /* room: keys allocated */
} idtable_t;

static inline uint64_t spread(uint64_t x) /* splitmix64's finaliser */
{
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

KS_EXPORT void *ks_idtable_new(int64_t first_slots)
{
    idtable_t *t = calloc(1, sizeof(idtable_t));
    int64_t slots = 1024;
    while (slots < first_slots)
        slots *= 2;
    if (t) {
        t->slots = calloc((size_t)slots, sizeof(uint32_t));
        t->room = slots / 2;
        t->keys = malloc((size_t)t->room * sizeof(uint64_t));
        t->mask = slots - 1;
    }
    if (!t || !t->slots || !t->keys) {
        if (t) {
            free(t->slots);
            free(t->keys);
        }
        free(t);
        return NULL;
    }
    return t;
}

KS_EXPORT void ks_idtable_free(void *p)
{
    idtable_t *t = p;
    if (t) {
        free(t->slots);
        free(t->keys);
        free(t);
    }
}

/* Twice the slots, rebuilt from keys alone (the old slots freed first), and room for twice the keys. */
static int table_grow(idtable_t *t)
{
    int64_t slots = 2 * (t->mask + 1);
    uint64_t *keys = realloc(t->keys, (size_t)(slots / 2) * sizeof(uint64_t));
    if (!keys)
        return KS_ENOMEM;
    t->keys = keys;
    t->room = slots / 2;
    free(t->slots);
    t->slots = calloc((size_t)slots, sizeof(uint32_t));
    if (!t->slots)
        return KS_ENOMEM;
    t->mask = slots - 1;
    for (int64_t id = 0; id < t->used; id++) {
        int64_t j = (int64_t)(spread(keys[id]) & (uint64_t)t->mask);
        while (t->slots[j])
            j = (j + 1) & t->mask;
        t->slots[j] = (uint32_t)(id + 1);
    }
    return 0;
}

/* ids[i] = the dense id of hashes[i] (a new one, the next, at its first sighting). Returns the number of
 * distinct hashes seen so far, KS_ENOMEM or KS_ETOOMANY. */
KS_EXPORT int64_t ks_idtable_assign(void *p, const uint64_t *hashes, int64_t n, int32_t *ids)
{
    idtable_t *t = p;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) /* the slot a later hash reads: the table is far larger than the caches */
            __builtin_prefetch(&t->slots[spread(hashes[i + AHEAD]) & (uint64_t)t->mask]);
        uint64_t k = hashes[i];
        int64_t j = (int64_t)(spread(k) & (uint64_t)t->mask);
        uint32_t s;
        while ((s = t->slots[j]) && t->keys[s - 1] != k)
            j = (j + 1) & t->mask;
        if (s) {
            ids[i] = (int32_t)(s - 1);
            continue;
        }
        if (t->used == INT32_MAX)
            return KS_ETOOMANY;
        if (t->used == t->room) { /* half full: doubled, and the free slot found again */
            if (table_grow(t) < 0)
                return KS_ENOMEM;
            j = (int64_t)(spread(k) & (uint64_t)t->mask);
            while (t->slots[j])
                j = (j + 1) & t->mask;
        }
        t->keys[t->used] = k;
        t->slots[j] = (uint32_t)(t->used + 1);
        ids[i] = (int32_t)t->used++;
    }
    return t->used;
}

/* The piece of accesses [first, first + n): obj, eligible in, next_use out; nxt (-1: none, else a position
 * under 2^31) updated (see the top). */
KS_EXPORT void ks_streamed_next_uses(const int32_t *obj, const uint8_t *eligible, int64_t n, int64_t first,
                                     int32_t *nxt, int64_t never, int64_t *next_use)
{
    for (int64_t i = n - 1; i >= 0; i--) {
        if (i >= AHEAD)
            __builtin_prefetch(&nxt[obj[i - AHEAD]], 1);
        int32_t o = obj[i];
        next_use[i] = nxt[o] < 0 ? never : nxt[o];
        nxt[o] = eligible[i] ? (int32_t)(first + i) : -1;
    }
}
