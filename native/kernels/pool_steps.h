/* The `vllm` block-pool model's steps (oracle/blockpool.py, `PoolReplay`), shared by the pool kernel
 * (pool.c) and the tier kernel (tiers.c), which observes a request between `kp_arrive` and
 * `kp_allocate_request` and after it. One source: every step is a static inline function here.
 *
 * The same rules as the Python model, applied in the same order, over arrays:
 * - the free queue is a doubly linked list over block ids (node 0, vLLM's null block, is its sentinel:
 *   nxt[0] is the head, the next block to be reused);
 * - the hash map keeps, per dense block-hash id, the blocks cached under it oldest first (a list through
 *   bnext/bprev), so a lookup returns the oldest surviving one and a duplicate is appended;
 * - a block's key is KP_NO_KEY (a partial tail), KP_PRIVATE_KEY (a generated block the stream does not
 *   identify) or the dense id of its hash;
 * - the per-block and per-hash arrays (ref counts, keys, both lists' links) are 32-bit (`kp_ix`): half the
 *   memory of a large pool; a pool or a stream past 2^31 - 1 blocks or hashes is refused as out of memory;
 * - timed replays keep the running requests in a binary heap ordered by (finish, index), as `heapq`
 *   orders the Python model's tuples;
 * - active holds form a list over parent indices, oldest first (the Python model's dict order), each
 *   parent's held blocks a segment of one buffer sized by the parents' full blocks; one record per hold,
 *   in the order they were asked for (`PoolReplay.records`).
 */
#ifndef KMESH_POOL_STEPS_H
#define KMESH_POOL_STEPS_H

#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define KP_NO_KEY (-1)
#define KP_PRIVATE_KEY (-2)

/* hold statuses and release reasons (oracle/blockpool_compiled.py STATUSES, REASONS) */
enum { KP_TAKEN, KP_REFUSED_BLOCKS, KP_REFUSED_FAMILIES, KP_EMPTY, KP_NOT_NEEDED };
enum { KP_CHILDREN, KP_EXPIRY, KP_PRESSURE, KP_CLOSE };
/* an admission's outcomes */
enum { KP_FITS, KP_STALLS, KP_REFUSED };

/* the hold records' rows in the caller's (KP_NUM_RECORD_ROWS, n_req) array */
enum { KP_REC_PARENT, KP_REC_STATUS, KP_REC_BLOCKS, KP_REC_SERVED, KP_REC_REASON, KP_REC_STEPS, KP_REC_TAKEN,
       KP_REC_RELEASED, KP_NUM_RECORD_ROWS };

static inline int64_t kp_max(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t kp_min(int64_t a, int64_t b) { return a < b ? a : b; }

/* ------------------------------------------------------------------------------------------------ */
/* Working memory: every array of one replay, freed together                                         */
/* ------------------------------------------------------------------------------------------------ */

#define KP_ARENA_SLOTS 96

typedef struct {
    void *slot[KP_ARENA_SLOTS];
    int n;
    bool failed;
} kp_arena;

/* n values of `size` bytes (zeroed when `zero`), kept by the arena; NULL (and the arena marked failed) when
 * out of memory. */
static inline void *kp_alloc(kp_arena *A, int64_t n, size_t size, bool zero)
{
    if (A->failed || A->n == KP_ARENA_SLOTS) {
        A->failed = true;
        return NULL;
    }
    size_t m = (size_t)(n > 0 ? n : 1);
    void *p = zero ? calloc(m, size) : malloc(m * size);
    if (!p) {
        A->failed = true;
        return NULL;
    }
    A->slot[A->n++] = p;
    return p;
}

/* n int64 values, each `fill` (0 is calloc's); NULL when out of memory. */
static inline int64_t *kp_new(kp_arena *A, int64_t n, int64_t fill)
{
    int64_t *p = kp_alloc(A, n, sizeof(int64_t), fill == 0);
    if (p && fill != 0)
        for (int64_t k = 0; k < n; k++)
            p[k] = fill;
    return p;
}

static inline void kp_arena_free(kp_arena *A)
{
    for (int k = 0; k < A->n; k++)
        free(A->slot[k]);
    A->n = 0;
}

typedef int32_t kp_ix; /* a block id, a hash id or a ref count in the pool's arrays */
#define KP_IX_MAX INT32_MAX

/* n kp_ix values, each `fill` (0 is calloc's); NULL when out of memory. */
static inline kp_ix *kp_new_ix(kp_arena *A, int64_t n, kp_ix fill)
{
    kp_ix *p = kp_alloc(A, n, sizeof(kp_ix), fill == 0);
    if (p && fill != 0)
        for (int64_t k = 0; k < n; k++)
            p[k] = fill;
    return p;
}

/* a[] (int64, *cap values) with room for index n, doubling; false when out of memory */
static inline bool kp_grow(int64_t **a, int64_t *cap, int64_t n, int64_t width)
{
    if (n < *cap)
        return true;
    int64_t c = 2 * *cap + 16;
    while (c <= n)
        c *= 2;
    int64_t *b = realloc(*a, (size_t)(c * width) * sizeof(int64_t));
    if (!b)
        return false;
    *a = b;
    *cap = c;
    return true;
}

/* ------------------------------------------------------------------------------------------------ */
/* The state                                                                                         */
/* ------------------------------------------------------------------------------------------------ */

typedef struct {
    /* the stream, per request: accesses obj[req_start[i]:req_start[i + 1]] (listed prompt hashes, then
     * output hashes), the prompt hashes it lists, its tokens, its times */
    const int32_t *obj32;
    const int64_t *obj64;
    const int64_t *req_start, *listed, *prompt_tokens, *output_tokens, *finish_ns, *arrival;
    int64_t n_req, block_size;
    bool timed, has_holds;
    /* the pool */
    int64_t num_usable;
    kp_ix *ref, *key, *prv, *nxt, *bprev, *bnext, *head, *tail;
    /* the replay: seq holds the request being admitted (hits, then new blocks), store[off[i]:off[i] +
     * cnt[i]] a running request's blocks (timed), hk/hi the running requests' heap */
    int64_t longest;
    int64_t *seq, *store, *off, *cnt, *scratch, *hk, *hi, *num_full_of;
    int64_t now, num_free, heap_size, num_deferred;
    /* the holds: aprev/anext the active ones, oldest first, a list over parents with sentinel n_req */
    const uint8_t *is_parent;
    const int64_t *release_after, *parent_of, *fam;
    int64_t *aprev, *anext, *remaining, *taken_step, *hoff, *hstore, *fam_refs, *children, *rec_of;
    int64_t *rec[KP_NUM_RECORD_ROWS];
    int64_t n_active, held_refs, fam_active, boundaries, n_records, expiry_ns, max_held, max_fam;
    kp_arena arena;
} kp_engine;

static inline int64_t kp_obj(const kp_engine *e, int64_t t) { return e->obj32 ? e->obj32[t] : e->obj64[t]; }

/* (blocks, full blocks) request i holds when it finishes (`PoolReplay._needs`) */
static inline void kp_request_blocks(const kp_engine *e, int64_t i, int64_t *nb, int64_t *nfull)
{
    int64_t computed = e->prompt_tokens[i] + kp_max(e->output_tokens[i] - 1, 0);
    *nb = (computed + e->block_size - 1) / e->block_size;
    *nfull = computed / e->block_size;
}

/* A fresh pool (the free queue in block-id order over `num_objects` hashes), the replay's buffers and the
 * holds' state; e's stream fields, timed, has_holds and the holds' inputs are set by the caller. `records`
 * (KP_NUM_RECORD_ROWS x n_req, may be NULL without holds) receives the hold records. false: out of memory
 * (call kp_engine_free all the same). */
static inline bool kp_engine_init(kp_engine *e, int64_t num_usable, int64_t num_objects, int64_t num_families,
                                  int64_t *records)
{
    kp_arena *A = &e->arena;
    int64_t n = num_usable + 1, n_req = e->n_req;
    e->num_usable = num_usable;
    if (num_usable >= KP_IX_MAX || num_objects >= KP_IX_MAX) { /* beyond kp_ix: as much as memory holds */
        A->failed = true;
        return false;
    }
    e->ref = kp_new_ix(A, n, 0);
    e->key = kp_new_ix(A, n, KP_NO_KEY);
    e->prv = kp_new_ix(A, n, -1); /* -1: not in the free queue */
    e->nxt = kp_new_ix(A, n, -1);
    e->bprev = kp_new_ix(A, n, -1);
    e->bnext = kp_new_ix(A, n, -1);
    e->head = kp_new_ix(A, num_objects, -1);
    e->tail = kp_new_ix(A, num_objects, -1);
    e->off = kp_new(A, n_req + 1, 0);
    e->num_full_of = kp_new(A, n_req, 0);
    e->cnt = kp_new(A, n_req, 0);
    if (A->failed)
        return false;
    e->prv[0] = num_usable;
    e->nxt[0] = num_usable > 0 ? 1 : 0;
    for (int64_t b = 1; b < n; b++) {
        e->prv[b] = b - 1;
        e->nxt[b] = b + 1 < n ? b + 1 : 0;
    }
    int64_t longest = 1;
    for (int64_t i = 0; i < n_req; i++) {
        int64_t nb, nfull;
        kp_request_blocks(e, i, &nb, &nfull);
        e->off[i + 1] = e->off[i] + (e->timed ? nb : 0);
        e->num_full_of[i] = nfull;
        longest = kp_max(longest, nb);
    }
    e->longest = longest;
    int64_t m = e->timed ? n_req : 1;
    e->seq = kp_new(A, longest, 0);
    e->scratch = kp_new(A, longest, 0);
    e->store = kp_new(A, e->off[n_req], 0);
    e->hk = kp_new(A, m, 0);
    e->hi = kp_new(A, m, 0);
    e->now = e->heap_size = e->num_deferred = 0;
    e->num_free = num_usable;
    e->n_active = e->held_refs = e->fam_active = e->boundaries = e->n_records = 0;
    if (e->has_holds) {
        e->hoff = kp_new(A, n_req + 1, 0);
        e->aprev = kp_new(A, n_req + 1, n_req);
        e->anext = kp_new(A, n_req + 1, n_req);
        e->remaining = kp_new(A, n_req, 0);
        e->taken_step = kp_new(A, n_req, 0);
        e->children = kp_new(A, n_req, 0);
        e->rec_of = kp_new(A, n_req, -1);
        e->fam_refs = kp_new(A, num_families, 0);
        if (A->failed)
            return false;
        for (int64_t p = 0; p < n_req; p++)
            e->hoff[p + 1] = e->hoff[p] + (e->is_parent[p] ? e->num_full_of[p] : 0);
        e->hstore = kp_new(A, e->hoff[n_req], 0);
        for (int r = 0; r < KP_NUM_RECORD_ROWS; r++) {
            e->rec[r] = records + (int64_t)r * n_req;
            int64_t v = r == KP_REC_REASON ? -1 : 0;
            for (int64_t k = 0; k < n_req; k++)
                e->rec[r][k] = v;
        }
    }
    return !A->failed;
}

static inline void kp_engine_free(kp_engine *e) { kp_arena_free(&e->arena); }

/* ------------------------------------------------------------------------------------------------ */
/* The running requests' heap, ordered by (key, index) as heapq orders tuples                        */
/* ------------------------------------------------------------------------------------------------ */

static inline bool kp_before(int64_t k1, int64_t i1, int64_t k2, int64_t i2)
{
    return k1 < k2 || (k1 == k2 && i1 < i2);
}

static inline int64_t kp_heap_push(int64_t *hk, int64_t *hi, int64_t size, int64_t k, int64_t i)
{
    int64_t j = size, p = (j - 1) >> 1;
    while (j > 0 && !kp_before(hk[p], hi[p], k, i)) {
        hk[j] = hk[p];
        hi[j] = hi[p];
        j = p;
        p = (j - 1) >> 1;
    }
    hk[j] = k;
    hi[j] = i;
    return size + 1;
}

/* returns the new size; the popped index lands in hi[size] */
static inline int64_t kp_heap_pop(int64_t *hk, int64_t *hi, int64_t size)
{
    int64_t top = hi[0];
    size -= 1;
    int64_t k = hk[size], i = hi[size], j = 0;
    while (2 * j + 1 < size) {
        int64_t c = 2 * j + 1;
        if (c + 1 < size && kp_before(hk[c + 1], hi[c + 1], hk[c], hi[c]))
            c += 1;
        if (kp_before(k, i, hk[c], hi[c]))
            break;
        hk[j] = hk[c];
        hi[j] = hi[c];
        j = c;
    }
    hk[j] = k;
    hi[j] = i;
    hi[size] = top;
    return size;
}

/* ------------------------------------------------------------------------------------------------ */
/* The pool                                                                                          */
/* ------------------------------------------------------------------------------------------------ */

/* a doubly linked list over block ids (nxt / prv): blk goes right after left; blk leaves its list */
static inline void kp_list_link_after(kp_ix *nxt, kp_ix *prv, int64_t left, int64_t blk)
{
    int64_t right = nxt[left];
    prv[blk] = left;
    nxt[blk] = right;
    nxt[left] = blk;
    prv[right] = blk;
}

static inline void kp_list_unlink(kp_ix *nxt, kp_ix *prv, int64_t blk)
{
    nxt[prv[blk]] = nxt[blk];
    prv[nxt[blk]] = prv[blk];
    prv[blk] = -1;
    nxt[blk] = -1;
}

static inline void kp_link_after(kp_engine *e, int64_t left, int64_t blk) { kp_list_link_after(e->nxt, e->prv, left, blk); }

static inline void kp_unlink(kp_engine *e, int64_t blk) { kp_list_unlink(e->nxt, e->prv, blk); }

/* The prefix lookup of hashes obj[a:a + max_hit]: hit blocks into seq[:nh]; returns nh, *ev how many of
 * them sit in the free queue. */
static inline int64_t kp_lookup(const kp_engine *e, int64_t a, int64_t max_hit, int64_t *seq, int64_t *ev)
{
    int64_t nh = 0, n_ev = 0;
    for (int64_t j = 0; j < max_hit; j++) {
        int64_t blk = e->head[kp_obj(e, a + j)];
        if (blk < 0)
            break;
        seq[nh++] = blk;
        n_ev += e->ref[blk] == 0;
    }
    *ev = n_ev;
    return nh;
}

/* `PoolModel.touch` of blocks[a:b]; returns how many left the free queue. */
static inline int64_t kp_touch(kp_engine *e, const int64_t *blocks, int64_t a, int64_t b)
{
    int64_t n = 0;
    for (int64_t j = a; j < b; j++) {
        int64_t blk = blocks[j];
        if (e->ref[blk] == 0) {
            kp_unlink(e, blk);
            n++;
        }
        e->ref[blk] += 1;
    }
    return n;
}

/* The key of a request's block j (its hashes are obj[a:], n_listed prompt ones then n_out output ones): a
 * prompt hash, a generated one (private when unknown), or none for the partial tail. */
static inline int64_t kp_new_block_key(const kp_engine *e, int64_t a, int64_t n_listed, int64_t n_out,
                                       int64_t n_prompt_full, int64_t num_full, int64_t j)
{
    if (j >= num_full)
        return KP_NO_KEY;
    if (j < n_prompt_full && j < n_listed)
        return kp_obj(e, a + j);
    int64_t o = j - n_prompt_full;
    return 0 <= o && o < n_out ? kp_obj(e, a + n_listed + o) : KP_PRIVATE_KEY;
}

/* `PoolModel.allocate` of the request's blocks start..num_blocks into seq[start:num_blocks]: pop the
 * head, drop its old hash, cache the new key. `evicted` (NULL: not kept) receives the evicted hash ids,
 * private keys excepted, in order, their number in *nk. Returns the cached blocks evicted. */
static inline int64_t kp_allocate(kp_engine *e, int64_t a, int64_t n_listed, int64_t n_out, int64_t n_prompt_full,
                                  int64_t num_full, int64_t start, int64_t num_blocks, int64_t *seq, int64_t *evicted,
                                  int64_t *nk)
{
    kp_ix *ref = e->ref, *key = e->key, *prv = e->prv, *nxt = e->nxt;
    kp_ix *bprev = e->bprev, *bnext = e->bnext, *head = e->head, *tail = e->tail;
    int64_t ne = 0, n_kept = 0;
    for (int64_t j = start; j < num_blocks; j++) {
        int64_t k = kp_new_block_key(e, a, n_listed, n_out, n_prompt_full, num_full, j);
        int64_t blk = nxt[0];
        nxt[0] = nxt[blk];
        prv[nxt[blk]] = 0;
        prv[blk] = -1;
        nxt[blk] = -1;
        int64_t old = key[blk];
        if (old != KP_NO_KEY) {
            ne++;
            if (old >= 0) {
                if (evicted)
                    evicted[n_kept++] = old;
                int64_t p = bprev[blk], q = bnext[blk];
                if (p >= 0)
                    bnext[p] = q;
                else
                    head[old] = q;
                if (q >= 0)
                    bprev[q] = p;
                else
                    tail[old] = p;
                bprev[blk] = -1;
                bnext[blk] = -1;
            }
        }
        ref[blk] = 1;
        key[blk] = (kp_ix)k;
        if (k >= 0) {
            int64_t t = tail[k];
            bprev[blk] = t;
            bnext[blk] = -1;
            if (t >= 0)
                bnext[t] = blk;
            else
                head[k] = blk;
            tail[k] = blk;
        }
        seq[j] = blk;
    }
    *nk = n_kept;
    return ne;
}

/* `PoolModel.free_blocks` over blocks[a], blocks[a + step], ... (b excluded): unhashed blocks whose count
 * reaches 0 go to the head (keeping their order), hashed ones to the tail, each in the order their count
 * reached 0. Returns how many blocks joined the free queue. */
static inline int64_t kp_free_blocks(kp_engine *e, const int64_t *blocks, int64_t a, int64_t b, int64_t step)
{
    int64_t *scratch = e->scratch, len = e->longest;
    int64_t nf = 0, nl = len; /* hashed ones fill scratch from the end */
    for (int64_t j = a; j != b; j += step) {
        int64_t blk = blocks[j];
        if (--e->ref[blk] == 0) {
            if (e->key[blk] == KP_NO_KEY)
                scratch[nf++] = blk;
            else
                scratch[--nl] = blk;
        }
    }
    for (int64_t q = nf - 1; q >= 0; q--) /* prepend in reverse: the first of them ends at the head */
        kp_link_after(e, 0, scratch[q]);
    for (int64_t q = len - 1; q >= nl; q--)
        kp_link_after(e, e->prv[0], scratch[q]);
    return nf + len - nl;
}

/* The free queue's block ids, head first, into out; returns how many. */
static inline int64_t kp_free_queue(const kp_engine *e, int64_t *out)
{
    int64_t nq = 0;
    for (int64_t blk = e->nxt[0]; blk != 0; blk = e->nxt[blk])
        out[nq++] = blk;
    return nq;
}

/* ------------------------------------------------------------------------------------------------ */
/* Holds                                                                                             */
/* ------------------------------------------------------------------------------------------------ */

/* `PoolReplay._take`: parent p finishing with full blocks blocks[a:a + nblk], before its own references
 * are freed. Returns how many blocks left the free queue (none: p references them). */
static inline int64_t kp_take_hold(kp_engine *e, int64_t p, const int64_t *blocks, int64_t a, int64_t nblk)
{
    int64_t f = e->fam[p];
    int64_t left = e->release_after[p] - e->children[p];
    int64_t r = e->n_records++, status;
    e->rec_of[p] = r;
    e->rec[KP_REC_PARENT][r] = p;
    e->rec[KP_REC_BLOCKS][r] = nblk;
    if (left <= 0)
        status = KP_NOT_NEEDED;
    else if (nblk == 0)
        status = KP_EMPTY;
    else if (e->max_held >= 0 && e->held_refs + nblk > e->max_held)
        status = KP_REFUSED_BLOCKS;
    else if (e->max_fam >= 0 && e->fam_refs[f] == 0 && e->fam_active + 1 > e->max_fam)
        status = KP_REFUSED_FAMILIES;
    else
        status = KP_TAKEN;
    e->rec[KP_REC_STATUS][r] = status;
    if (status != KP_TAKEN)
        return 0;
    e->rec[KP_REC_TAKEN][r] = e->timed ? e->now : 0;
    int64_t o = e->hoff[p];
    memcpy(e->hstore + o, blocks + a, (size_t)nblk * sizeof(int64_t));
    int64_t out = kp_touch(e, e->hstore, o, o + nblk);
    int64_t sentinel = e->n_req, last = e->aprev[sentinel];
    e->aprev[p] = last;
    e->anext[p] = sentinel;
    e->anext[last] = p;
    e->aprev[sentinel] = p;
    e->n_active++;
    e->remaining[p] = left;
    e->taken_step[p] = e->boundaries;
    e->held_refs += nblk;
    if (e->fam_refs[f] == 0)
        e->fam_active++;
    e->fam_refs[f]++;
    return out;
}

/* `PoolReplay._release` of p's active hold; returns how many blocks joined the free queue. */
static inline int64_t kp_release_hold(kp_engine *e, int64_t p, int64_t reason)
{
    e->anext[e->aprev[p]] = e->anext[p];
    e->aprev[e->anext[p]] = e->aprev[p];
    e->n_active--;
    int64_t r = e->rec_of[p], nblk = e->rec[KP_REC_BLOCKS][r];
    e->rec[KP_REC_REASON][r] = reason;
    e->rec[KP_REC_RELEASED][r] = e->timed ? e->now : 0;
    e->rec[KP_REC_STEPS][r] = nblk * (e->boundaries - e->taken_step[p]);
    e->held_refs -= nblk;
    int64_t f = e->fam[p];
    if (--e->fam_refs[f] == 0)
        e->fam_active--;
    int64_t o = e->hoff[p];
    return kp_free_blocks(e, e->hstore, o + nblk - 1, o - 1, -1);
}

static inline int64_t kp_oldest_hold(const kp_engine *e) { return e->anext[e->n_req]; }

/* `PoolReplay._child_admitted`; returns how many blocks joined the free queue. */
static inline int64_t kp_child_admitted(kp_engine *e, int64_t i)
{
    int64_t p = e->parent_of[i];
    if (p < 0)
        return 0;
    e->children[p]++;
    int64_t r = e->rec_of[p];
    if (r < 0 || e->rec[KP_REC_STATUS][r] != KP_TAKEN || e->rec[KP_REC_REASON][r] >= 0) /* no active hold */
        return 0;
    e->rec[KP_REC_SERVED][r]++;
    if (--e->remaining[p] <= 0)
        return kp_release_hold(e, p, KP_CHILDREN);
    return 0;
}

/* `PoolReplay._boundary`: expire holds, oldest first, then count the boundary. Returns blocks freed. */
static inline int64_t kp_boundary(kp_engine *e)
{
    int64_t out = 0;
    if (e->expiry_ns >= 0) {
        while (e->n_active > 0) {
            int64_t p = kp_oldest_hold(e);
            if (e->rec[KP_REC_TAKEN][e->rec_of[p]] + e->expiry_ns > e->now)
                break;
            out += kp_release_hold(e, p, KP_EXPIRY);
        }
    }
    e->boundaries++;
    return out;
}

static inline void kp_close_holds(kp_engine *e)
{
    while (e->n_active > 0)
        kp_release_hold(e, kp_oldest_hold(e), KP_CLOSE);
}

/* ------------------------------------------------------------------------------------------------ */
/* A request's admission and finish                                                                  */
/* ------------------------------------------------------------------------------------------------ */

/* `PoolReplay._finish` of request f, whose blocks are blocks[a:a + n]: the clock, its hold, then its
 * blocks freed tail first. */
static inline void kp_finish(kp_engine *e, int64_t f, const int64_t *blocks, int64_t a, int64_t n, int64_t finish_ns)
{
    if (e->timed)
        e->now = kp_max(e->now, finish_ns);
    if (e->has_holds && e->is_parent[f])
        e->num_free -= kp_take_hold(e, f, blocks, a, e->num_full_of[f]);
    e->num_free += kp_free_blocks(e, blocks, a + n - 1, a - 1, -1);
}

/* Finish the running request that finishes first (timed). */
static inline void kp_finish_earliest(kp_engine *e)
{
    e->heap_size = kp_heap_pop(e->hk, e->hi, e->heap_size);
    int64_t f = e->hi[e->heap_size];
    kp_finish(e, f, e->store, e->off[f], e->cnt[f], e->finish_ns[f]);
}

/* Request i's first hash, listed prompt hashes, output hashes, full prompt blocks and max hit blocks. */
typedef struct {
    int64_t a, n_listed, n_out, n_prompt_full, max_hit;
} kp_geometry;

static inline kp_geometry kp_geometry_of(const kp_engine *e, int64_t i)
{
    int64_t p = e->prompt_tokens[i], bs = e->block_size;
    kp_geometry g;
    g.a = e->req_start[i];
    g.n_listed = e->listed[i]; /* prompt hashes in the stream (<= n_prompt_full) */
    g.n_out = e->req_start[i + 1] - g.a - g.n_listed;
    g.n_prompt_full = p / bs;
    g.max_hit = kp_min(kp_min(kp_max(p - 1, 0) / bs, g.n_prompt_full), g.n_listed);
    return g;
}

/* An admission: its outcome, hits in e->seq[:nh], blocks and full blocks. */
typedef struct {
    int64_t outcome, nh, num_blocks, num_full;
} kp_admission;

/* `PoolReplay._arrive` up to the allocation: finishes due (timed), the boundary, then `admit`'s loop: look
 * the prompt up until its blocks fit, releasing the oldest hold under pressure, else waiting for the
 * earliest finish (timed), else stalling or refusing it. */
static inline kp_admission kp_arrive(kp_engine *e, int64_t i)
{
    if (e->timed) {
        while (e->heap_size > 0 && e->hk[0] <= e->arrival[i])
            kp_finish_earliest(e);
        e->now = kp_max(e->now, e->arrival[i]);
    }
    if (e->has_holds)
        e->num_free += kp_boundary(e);
    kp_geometry g = kp_geometry_of(e, i);
    kp_admission ad;
    kp_request_blocks(e, i, &ad.num_blocks, &ad.num_full);
    int64_t prompt_blocks = (e->prompt_tokens[i] + e->block_size - 1) / e->block_size;
    bool deferred = false;
    for (;;) {
        int64_t ev;
        ad.nh = kp_lookup(e, g.a, g.max_hit, e->seq, &ev);
        if (ad.num_blocks - ad.nh + ev <= e->num_free) {
            ad.outcome = KP_FITS;
            break;
        }
        if (e->has_holds && e->n_active > 0) { /* a hold never blocks an admission */
            e->num_free += kp_release_hold(e, kp_oldest_hold(e), KP_PRESSURE);
        } else if (e->timed && e->heap_size > 0) {
            deferred = true;
            kp_finish_earliest(e);
        } else if (prompt_blocks - ad.nh + ev <= e->num_free) {
            ad.outcome = KP_STALLS; /* vLLM admits on the prompt alone; its output then outgrows the pool */
            ad.num_blocks = ad.num_full = ad.nh + e->num_free - ev;
            break;
        } else {
            ad.outcome = KP_REFUSED;
            return ad;
        }
    }
    e->num_deferred += deferred;
    return ad;
}

/* Touch request i's hits e->seq[:nh] and allocate its new blocks after them; returns the cached blocks
 * evicted, their hash ids into `evicted` (NULL: not kept), *nk of them. */
static inline int64_t kp_allocate_request(kp_engine *e, int64_t i, const kp_admission *ad, int64_t *evicted,
                                          int64_t *nk)
{
    kp_geometry g = kp_geometry_of(e, i);
    e->num_free -= kp_touch(e, e->seq, 0, ad->nh) + ad->num_blocks - ad->nh;
    return kp_allocate(e, g.a, g.n_listed, g.n_out, g.n_prompt_full, ad->num_full, ad->nh, ad->num_blocks, e->seq,
                       evicted, nk);
}

/* After the allocation: a stalled request is freed at once; a timed one runs until its finish, a
 * sequential one finishes now (a child's admission counts toward its parent's hold first). */
static inline void kp_end_admission(kp_engine *e, int64_t i, const kp_admission *ad)
{
    int64_t nb = ad->num_blocks;
    if (ad->outcome == KP_STALLS) { /* it filled every block, all full and cached, then was preempted for good */
        e->num_free += kp_free_blocks(e, e->seq, nb - 1, -1, -1);
        return;
    }
    if (e->timed) {
        memcpy(e->store + e->off[i], e->seq, (size_t)nb * sizeof(int64_t));
        e->cnt[i] = nb;
    }
    if (e->has_holds)
        e->num_free += kp_child_admitted(e, i);
    if (e->timed)
        e->heap_size = kp_heap_push(e->hk, e->hi, e->heap_size, kp_max(e->finish_ns[i], e->arrival[i]), i);
    else
        kp_finish(e, i, e->seq, 0, nb, 0);
}

/* `PoolReplay.close`: finish what is running, then release the holds. */
static inline void kp_drain(kp_engine *e)
{
    while (e->heap_size > 0)
        kp_finish_earliest(e);
    if (e->has_holds)
        kp_close_holds(e);
}

#endif
