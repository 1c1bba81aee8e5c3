/* Flattening a workload into its access stream (oracle/stream.py: AccessStream.from_flat, from_arrays,
 * from_requests, through oracle/stream_index.py), and the `infinite` policy's one pass over it. */
#include "kernels.h"

#include <stdlib.h>

/* out[i] = 1 when access i is among the first n_first[r] accesses of its request r. */
KS_EXPORT void ks_stream_leading_flags(const int64_t *req_start, int64_t num_requests, const int64_t *n_first,
                                       uint8_t *out)
{
    for (int64_t r = 0; r < num_requests; r++) {
        int64_t a = req_start[r], b = req_start[r + 1], k = n_first[r];
        int64_t e = k < b - a ? a + (k > 0 ? k : 0) : b;
        for (int64_t i = a; i < b; i++)
            out[i] = i < e;
    }
}

/* ---- the whole stream in linear time: ks_stream_build ------------------------------------------------ */

/* A distinct hash and the id of its first access: what the ranking sorts. */
typedef struct {
    uint64_t key;
    int64_t id;
} pair_t;

/* How many accesses ahead the passes ask for the memory a later access will touch. */
#define PREFETCH_AHEAD 16

/* A 64-bit finaliser (murmur3's): the listed hashes are already mixed, but ids given as small integers are not. */
static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Open addressing (linear probing, at most half full) from a hash to its first-seen id: a slot holds id + 1
 * (0: empty), in 32 bits while every id fits, and keys[id] is the hash, so a slot costs 4 bytes and the
 * table can be rebuilt from keys alone when it doubles (the old one freed first). */
typedef struct {
    uint32_t *s32;
    uint64_t *s64;
    uint64_t *keys; /* room for capacity / 2 */
    uint64_t mask;  /* capacity - 1, capacity a power of two */
    int64_t count;
} table_t;

static inline uint64_t slot_get(const table_t *t, uint64_t j)
{
    return t->s32 ? t->s32[j] : t->s64[j];
}

static inline void slot_put(table_t *t, uint64_t j, uint64_t v)
{
    if (t->s32)
        t->s32[j] = (uint32_t)v;
    else
        t->s64[j] = v;
}

static inline const void *slot_at(const table_t *t, uint64_t j)
{
    return t->s32 ? (const void *)&t->s32[j] : (const void *)&t->s64[j];
}

static void table_free(table_t *t)
{
    free(t->s32);
    free(t->s64);
    free(t->keys);
    t->s32 = NULL;
    t->s64 = NULL;
    t->keys = NULL;
}

/* Empty slots for `capacity` (wide: 64-bit slots), the keys' room set aside by the caller. */
static int table_slots(table_t *t, uint64_t capacity, bool wide)
{
    if (wide)
        t->s64 = calloc((size_t)capacity, sizeof(uint64_t));
    else
        t->s32 = calloc((size_t)capacity, sizeof(uint32_t));
    if (!t->s32 && !t->s64)
        return KS_ENOMEM;
    t->mask = capacity - 1;
    return 0;
}

static int table_init(table_t *t, uint64_t capacity, bool wide)
{
    t->s32 = NULL;
    t->s64 = NULL;
    t->count = 0;
    t->keys = malloc((size_t)(capacity / 2) * sizeof(uint64_t));
    if (!t->keys || table_slots(t, capacity, wide)) {
        table_free(t);
        return KS_ENOMEM;
    }
    return 0;
}

/* Doubles the table, rebuilt from the keys; on KS_ENOMEM the caller frees it. */
static int table_grow(table_t *t)
{
    uint64_t capacity = (t->mask + 1) * 2;
    uint64_t *keys = realloc(t->keys, (size_t)(capacity / 2) * sizeof(uint64_t));
    if (!keys)
        return KS_ENOMEM;
    t->keys = keys;
    bool wide = t->s64 != NULL;
    free(t->s32);
    free(t->s64);
    t->s32 = NULL;
    t->s64 = NULL;
    if (table_slots(t, capacity, wide))
        return KS_ENOMEM;
    for (int64_t id = 0; id < t->count; id++) {
        uint64_t j = mix64(keys[id]) & t->mask;
        while (slot_get(t, j))
            j = (j + 1) & t->mask;
        slot_put(t, j, (uint64_t)id + 1);
    }
    return 0;
}

/* The id of `key`: its first-seen number, a new one (count) when unseen; KS_ENOMEM when growing failed. */
static inline int64_t table_id(table_t *t, uint64_t key)
{
    uint64_t j = mix64(key) & t->mask, v;
    while ((v = slot_get(t, j)) != 0) {
        if (t->keys[v - 1] == key)
            return (int64_t)v - 1;
        j = (j + 1) & t->mask;
    }
    if (KS_UNLIKELY((uint64_t)(t->count + 1) * 2 > t->mask + 1)) {
        if (table_grow(t))
            return KS_ENOMEM;
        j = mix64(key) & t->mask;
        while (slot_get(t, j))
            j = (j + 1) & t->mask;
    }
    t->keys[t->count] = key;
    slot_put(t, j, (uint64_t)t->count + 1);
    return t->count++;
}

/* Sorts a[0:n] by key ^ key_xor (LSD radix, 8 bits a pass; a pass whose digit is constant is skipped), with
 * tmp[0:n] as scratch; the sorted pairs end in a or tmp, returned. Keys are distinct, so stability is moot. */
static pair_t *radix_sort(pair_t *a, pair_t *tmp, int64_t n, uint64_t key_xor)
{
    int64_t count[256];
    for (int shift = 0; shift < 64; shift += 8) {
        for (int b = 0; b < 256; b++)
            count[b] = 0;
        for (int64_t i = 0; i < n; i++)
            count[((a[i].key ^ key_xor) >> shift) & 0xff]++;
        if (count[((a[0].key ^ key_xor) >> shift) & 0xff] == n)
            continue;
        int64_t sum = 0;
        for (int b = 0; b < 256; b++) {
            int64_t c = count[b];
            count[b] = sum;
            sum += c;
        }
        for (int64_t i = 0; i < n; i++)
            tmp[count[((a[i].key ^ key_xor) >> shift) & 0xff]++] = a[i];
        pair_t *swap = a;
        a = tmp;
        tmp = swap;
    }
    return a;
}

static inline int64_t obj_get(const int32_t *obj32, const int64_t *obj64, int64_t t)
{
    return obj32 ? (int64_t)obj32[t] : obj64[t];
}

static inline void obj_put(int32_t *obj32, int64_t *obj64, int64_t t, int64_t v)
{
    if (obj32)
        obj32[t] = (int32_t)v;
    else
        obj64[t] = v;
}

/* The access stream of in->num_requests requests (struct ks_stream_build_in, boundary.h). Request r's
 * accesses are flat[starts[r] + j] for j < n_keep[r] (n_keep[r] <= 0: none), back to back in request
 * order; `n` is their total. With n_elig, out->eligible[t] is written (the first n_elig[r] accesses of
 * request r); without it (NULL), it is read.
 *
 * wide_table: 64-bit table slots even when 32 bits hold every id (they do below 2^32 - 1 accesses).
 *
 * Outputs (*out), as AccessStream.from_arrays gave them from a stable sort: obj[t] = the rank of the access's hash
 * among the distinct hashes, compared as hash ^ key_xor (1 << 63 orders them as signed int64, 0 as
 * uint64), in obj32 or else obj64; next_use[t] = the position of the next access of the same hash when that
 * access is eligible, else `never`. Returns the number of distinct hashes, or KS_ENOMEM.
 *
 * Linear in the stream: a hash table gives each access the id of its hash's first access; only the
 * distinct hashes are sorted, to turn first-seen ids into ranks; one backward pass with the next eligible
 * access per id gives the next uses and writes the ranks. */
KS_EXPORT int64_t ks_stream_build(const ks_stream_build_in *in, const ks_stream_build_out *out)
{
    const uint64_t *flat = in->flat, key_xor = in->key_xor;
    const int64_t *starts = in->starts, *n_keep = in->n_keep, *n_elig = in->n_elig;
    const int64_t num_requests = in->num_requests, n = in->n, wide_table = in->wide_table, never = in->never;
    uint8_t *eligible = out->eligible;
    int32_t *obj32 = out->obj32;
    int64_t *obj64 = out->obj64, *next_use = out->next_use;
    if (n <= 0)
        return 0;
    /* Sized for one distinct hash in 16 accesses (at most 1 byte an access with 32-bit slots). */
    uint64_t capacity = 1024;
    while (capacity < (uint64_t)n / 8)
        capacity *= 2;
    table_t table;
    if (table_init(&table, capacity, wide_table || n >= (int64_t)UINT32_MAX))
        return KS_ENOMEM;
    int64_t t = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        const uint64_t *h = flat + starts[r];
        int64_t keep = n_keep[r];
        for (int64_t j = 0; j < keep; j++, t++) {
            if (j + PREFETCH_AHEAD < keep)  /* the table is far larger than the caches: ask for the slot early */
                __builtin_prefetch(slot_at(&table, mix64(h[j + PREFETCH_AHEAD]) & table.mask));
            int64_t id = table_id(&table, h[j]);
            if (KS_UNLIKELY(id < 0)) {
                table_free(&table);
                return KS_ENOMEM;
            }
            obj_put(obj32, obj64, t, id);
            if (n_elig)
                eligible[t] = j < n_elig[r];
        }
    }
    int64_t d = table.count;
    /* The distinct hashes with their first-seen ids, sorted (the table gone first). */
    free(table.s32);
    free(table.s64);
    pair_t *pairs = malloc((size_t)d * sizeof(pair_t));
    if (!pairs) {
        free(table.keys);
        return KS_ENOMEM;
    }
    for (int64_t i = 0; i < d; i++) {
        pairs[i].key = table.keys[i];
        pairs[i].id = i;
    }
    free(table.keys);
    pair_t *tmp = malloc((size_t)d * sizeof(pair_t));
    if (!tmp) {
        free(pairs);
        return KS_ENOMEM;
    }
    pair_t *sorted = radix_sort(pairs, tmp, d, key_xor);
    free(sorted == pairs ? tmp : pairs);
    /* Per first-seen id: its rank, and the next eligible access of it seen so far going backward (side by
     * side: one cache line per access). */
    int64_t (*per_id)[2] = malloc((size_t)d * sizeof *per_id);
    if (!per_id) {
        free(sorted);
        return KS_ENOMEM;
    }
    for (int64_t i = 0; i < d; i++) {
        per_id[sorted[i].id][0] = i;
        per_id[sorted[i].id][1] = never;
    }
    free(sorted);
    for (t = n - 1; t >= 0; t--) {
        if (t >= PREFETCH_AHEAD)
            __builtin_prefetch(per_id[obj_get(obj32, obj64, t - PREFETCH_AHEAD)], 1);
        int64_t *p = per_id[obj_get(obj32, obj64, t)];
        next_use[t] = p[1];
        p[1] = eligible[t] ? t : never;
        obj_put(obj32, obj64, t, p[0]);
    }
    free(per_id);
    return d;
}

/* The `infinite` policy (oracle/policies/infinite.py): hits[r] = the eligible accesses of request r (accesses
 * req_start[r] to req_start[r + 1]) whose object was accessed before, anywhere earlier in the stream. One
 * pass with a seen flag per object. Returns 0, or KS_ENOMEM. */
KS_EXPORT int64_t ks_stream_infinite_hits(const int32_t *obj32, const int64_t *obj64, const uint8_t *eligible,
                                          const int64_t *req_start, int64_t num_requests, int64_t num_objects,
                                          int64_t *hits)
{
    uint8_t *seen = calloc((size_t)(num_objects > 0 ? num_objects : 1), 1);
    if (!seen)
        return KS_ENOMEM;
    int64_t t = 0;
    for (int64_t r = 0; r < num_requests; r++) {
        for (; t < req_start[r]; t++)  /* accesses before the request (none in an AccessStream) */
            seen[obj_get(obj32, obj64, t)] = 1;
        int64_t h = 0;
        for (; t < req_start[r + 1]; t++) {
            int64_t o = obj_get(obj32, obj64, t);
            h += eligible[t] & seen[o];
            seen[o] = 1;
        }
        hits[r] = h;
    }
    free(seen);
    return 0;
}
