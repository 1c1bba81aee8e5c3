/* The tier model's replay (oracle/tiers/compiled.py, `TierReplay` of oracle/tiers/replay.py): the GPU pool
 * is pool_steps.h's steps, so it evolves exactly as the pool kernel's; between `kp_arrive` and the
 * allocation this kernel runs the lookup below the GPU in `TierReplay._looked_up`'s steps (restores in
 * flight, the lower-tier walk, settling, the restore wait, the write-through stores), and after it the
 * offloading of what the allocation evicted (`_allocated`).
 *
 * - every hash (prompt, output, preloaded chunk key) has a dense id; a tier's LRU is a ring of ids whose
 *   refreshed or dropped entries are blanked (kt_tiers below), in `TierStore`'s OrderedDict order;
 * - the chunks one request reads (it reads each once) in a small open-addressing table, cleared after it;
 *   per tier and id, with singleflight, the read in flight; per id, a restored block's completion while it
 *   is not yet usable (gr_*, timed), with a heap of completions to expire them;
 * - reads are kept as (request, tier, chunks, bytes, prepare) rows merged as `TierRead`s are;
 * - early preparation's schedule (`EarlyPrep`'s heap) as arrays sorted in its pop order, the staged
 *   blocks per id, and what each parent staged as a segment of one buffer.
 */
#include "pool_steps.h"

/* ids the stream keeps as int32 or int64 (one pointer NULL) */
typedef struct {
    const int32_t *p32;
    const int64_t *p64;
} kt_ids;

static inline int64_t kt_id(kt_ids v, int64_t t) { return v.p32 ? v.p32[t] : v.p64[t]; }

/* A hash list of one request as ids, in two runs: positions [0, n0) are s0[a0:], [n0, len) are s1[a1:]. */
typedef struct {
    kt_ids s0, s1;
    int64_t a0, n0, a1, len;
} kt_seq;

static inline int64_t kt_at(const kt_seq *s, int64_t j)
{
    return j < s->n0 ? kt_id(s->s0, s->a0 + j) : kt_id(s->s1, s->a1 + j - s->n0);
}

/* Request i's whole prompt hash list: the ones the pool reads (its listed hashes, obj[req_start[i]:]), then
 * those past its full blocks (tail[tstart[i]:tstart[i + 1]]). */
static inline kt_seq kt_prompt_seq(const kp_engine *e, kt_ids obj, kt_ids tail, const int64_t *tstart, int64_t i)
{
    kt_seq s = {obj, tail, e->req_start[i], e->listed[i], tstart[i], e->listed[i] + tstart[i + 1] - tstart[i]};
    return s;
}

/* The hashes request i holds when it finishes, the chain its write-through stores put (`TierReplay._held`):
 * its listed prompt hashes, then its output hashes, up to its cached blocks (n): prompt[:min(n, nf)], then
 * output[:n - nf], nf its full prompt blocks; both runs are the pool's obj. */
static inline kt_seq kt_held_seq(const kp_engine *e, kt_ids obj, int64_t i)
{
    int64_t nb, cached, a = e->req_start[i], nl = e->listed[i];
    kp_request_blocks(e, i, &nb, &cached);
    int64_t nf = e->prompt_tokens[i] / e->block_size, n_out = e->req_start[i + 1] - a - nl;
    int64_t hp = kp_min(cached, nl), ho = kp_min(kp_max(cached - nf, 0), n_out);
    kt_seq s = {obj, obj, a, hp, a + nl, hp + ho};
    return s;
}

/* The configuration, per tier (nt of them) */
typedef struct {
    int64_t nt, num_ids, n_on_evict;
    const int64_t *cap, *chunk, *below, *on_evict, *chunk_bytes, *lat_ns, *dur0, *dur1;
    const uint8_t *retain, *refresh_on_hit, *write_through, *has_cost;
} kt_config;

/* The lower tiers' state. A tier's LRU is a ring of ids, least recent first: qhead and qtail count
 * positions from the start (entries at pos & (qcap - 1), qcap a power of two), and an entry becomes -1
 * when its id is refreshed (appended again) or dropped, so taking the least recent reads the ring alone.
 * stamp[k * nt + ti] is 1 + the slot where k was last appended to tier ti's ring (0: never): the tier holds
 * k while that slot lies between the head and the tail and still holds k, so taking the least recent
 * (moving the head past it) writes no stamp. One id's stamps share a cache line. A full ring is rebuilt in
 * order, doubled when mostly live (it never shrinks, so a stamp always names a slot of it). Exactly
 * `TierStore`'s OrderedDict order. */
typedef struct {
    kt_config c;
    bool timed, singleflight, failed;
    int32_t *stamp; /* num_ids x nt */
    int64_t **queue, *qhead, *qtail, *qcap;
    int64_t *count, *num_stores, *num_reads, *read_bytes;
    int64_t *rd, rd_cap, n_rd; /* read rows (request, tier, chunks, bytes, prepare) */
    uint8_t *clk_set;
    int64_t *busy0, *busy1, *clk0, *clk1;
    uint8_t *if_valid; /* nt x num_ids, singleflight: the read in flight */
    int64_t *if0, *if1;
} kt_tiers;

/* The most slots a ring may have: stamps are int32. */
#define KT_MAX_RING ((int64_t)1 << 30)

static inline int32_t *kt_stamp(const kt_tiers *T, int64_t ti, int64_t k) { return T->stamp + k * T->c.nt + ti; }

/* k's slot in tier ti's ring when the tier holds k, else -1 */
static inline int64_t kt_where(const kt_tiers *T, int64_t ti, int64_t k)
{
    int64_t slot = (int64_t)*kt_stamp(T, ti, k) - 1;
    if (slot < 0 || T->queue[ti][slot] != k)
        return -1;
    int64_t mask = T->qcap[ti] - 1;
    return ((slot - T->qhead[ti]) & mask) < T->qtail[ti] - T->qhead[ti] ? slot : -1;
}

static inline bool kt_held(const kt_tiers *T, int64_t ti, int64_t k) { return kt_where(T, ti, k) >= 0; }

static inline void kt_lru_unlink(kt_tiers *T, int64_t ti, int64_t slot) { T->queue[ti][slot] = -1; }

/* Tier ti's full ring rebuilt with its live entries in order from slot 0, doubled while they would fill
 * half of it. */
static bool kt_queue_room(kt_tiers *T, int64_t ti)
{
    int64_t *q = T->queue[ti], cap = T->qcap[ti], live = 0;
    for (int64_t pos = T->qhead[ti]; pos < T->qtail[ti]; pos++)
        live += q[pos & (cap - 1)] >= 0;
    int64_t ncap = cap > 0 ? cap : 16;
    while (2 * (live + 1) > ncap)
        ncap *= 2;
    int64_t *nq = ncap <= KT_MAX_RING ? malloc((size_t)ncap * sizeof(int64_t)) : NULL;
    if (!nq) {
        T->failed = true;
        return false;
    }
    int64_t w = 0;
    for (int64_t pos = T->qhead[ti]; pos < T->qtail[ti]; pos++) {
        int64_t k = q[pos & (cap - 1)];
        if (k >= 0) {
            nq[w] = k;
            *kt_stamp(T, ti, k) = (int32_t)++w;
        }
    }
    for (int64_t slot = w; slot < ncap; slot++) /* no stamp names a slot past the live ones as held */
        nq[slot] = -1;
    free(q);
    T->queue[ti] = nq;
    T->qcap[ti] = ncap;
    T->qhead[ti] = 0;
    T->qtail[ti] = w;
    return true;
}

static inline void kt_lru_append(kt_tiers *T, int64_t ti, int64_t k) /* k becomes the most recent */
{
    if (KS_UNLIKELY(T->qtail[ti] - T->qhead[ti] == T->qcap[ti]) && !kt_queue_room(T, ti))
        return;
    int64_t slot = T->qtail[ti]++ & (T->qcap[ti] - 1);
    T->queue[ti][slot] = k;
    *kt_stamp(T, ti, k) = (int32_t)(slot + 1);
}

static inline void kt_lru_refresh(kt_tiers *T, int64_t ti, int64_t k, int64_t slot) /* k is at `slot` */
{
    kt_lru_unlink(T, ti, slot);
    kt_lru_append(T, ti, k);
}

/* The least recent id of tier ti (it holds one), taken out. */
static inline int64_t kt_lru_pop(kt_tiers *T, int64_t ti)
{
    const int64_t *q = T->queue[ti];
    int64_t pos = T->qhead[ti], mask = T->qcap[ti] - 1, k;
    while ((k = q[pos & mask]) < 0)
        pos++;
    T->qhead[ti] = pos + 1;
    return k;
}

/* k's slot in an open-addressing table of `mask + 1` slots (-1: empty) */
static inline int64_t kt_slot(const int64_t *tkey, int64_t mask, int64_t k)
{
    int64_t q = (k * 40503) & mask;
    while (tkey[q] != k && tkey[q] != -1)
        q = (q + 1) & mask;
    return q;
}

/* `TierStore.put` of keys[:n] into tier ti; the keys that leave go to `left` (which may be `keys`: the
 * q-th key is read before left[q] can be written); returns how many. */
static inline int64_t kt_put(kt_tiers *T, int64_t ti, const int64_t *keys, int64_t n, bool refresh, bool pass_through,
                             int64_t *left)
{
    int64_t c = T->c.cap[ti];
    if (c <= 0) {
        if (!pass_through)
            return 0;
        for (int64_t q = 0; q < n; q++)
            left[q] = keys[q];
        return n;
    }
    int64_t nl = 0, stored = 0;
    for (int64_t q = 0; q < n; q++) /* every key's stamp on its way: the misses overlap */
        __builtin_prefetch(kt_stamp(T, ti, keys[q]));
    for (int64_t q = 0; q < n; q++) {
        int64_t k = keys[q], slot = kt_where(T, ti, k);
        if (slot >= 0) {
            if (refresh)
                kt_lru_refresh(T, ti, k, slot);
            continue;
        }
        stored++;
        kt_lru_append(T, ti, k);
        if (T->count[ti] < c) {
            T->count[ti]++;
        } else {
            left[nl++] = kt_lru_pop(T, ti);
        }
    }
    T->num_stores[ti] += stored;
    return nl;
}

/* `TierReplay._offload` of keys[:n] down the on-evict tiers from position `start`, in place. */
static inline void kt_offload(kt_tiers *T, int64_t start, int64_t *keys, int64_t n)
{
    for (int64_t o = start; o < T->c.n_on_evict; o++) {
        if (n == 0)
            return;
        n = kt_put(T, T->c.on_evict[o], keys, n, true, true, keys);
    }
}

/* `TierReplay._find_below` for block j of the hash chain `chain`: the first tier holding the chunk (its key in
 * *key), or -1. */
static inline int64_t kt_find_below(const kt_tiers *T, const kt_seq *chain, int64_t j, int64_t *key)
{
    for (int64_t ti = 0; ti < T->c.nt; ti++) {
        int64_t c = T->c.chunk[ti], k;
        if (c == 1) {
            k = kt_at(chain, j);
        } else {
            int64_t end = (j / c + 1) * c - 1;
            k = end < chain->len ? kt_at(chain, end) : -1;
        }
        if (k >= 0 && kt_held(T, ti, k)) {
            *key = k;
            return ti;
        }
    }
    *key = -1;
    return -1;
}

/* `TierReplay._read` (and `ReadQueue.complete`): one chunk read on tier ti issued at t for request `req`;
 * its completions (p50, p95) in d0, d1. false: out of memory. */
static inline bool kt_read(kt_tiers *T, int64_t ti, int64_t key, int64_t t, int64_t req, int64_t prepare, int64_t *d0,
                           int64_t *d1)
{
    int64_t nbytes = T->c.chunk_bytes[ti];
    T->num_reads[ti]++;
    T->read_bytes[ti] += nbytes;
    int64_t *last = T->n_rd > 0 ? T->rd + 5 * (T->n_rd - 1) : NULL;
    if (last && last[0] == req && last[1] == ti && last[4] == prepare) {
        last[2]++;
        last[3] += nbytes;
    } else {
        if (!kp_grow(&T->rd, &T->rd_cap, T->n_rd, 5))
            return false;
        int64_t *row = T->rd + 5 * T->n_rd++;
        row[0] = req;
        row[1] = ti;
        row[2] = 1;
        row[3] = nbytes;
        row[4] = prepare;
    }
    if (T->c.has_cost[ti]) {
        if (!T->clk_set[ti]) {
            T->clk_set[ti] = 1;
            T->clk0[ti] = kp_max(t, T->busy0[ti]) + T->c.lat_ns[ti];
            T->clk1[ti] = kp_max(t, T->busy1[ti]) + T->c.lat_ns[ti];
        }
        T->clk0[ti] += T->c.dur0[ti];
        T->clk1[ti] += T->c.dur1[ti];
        *d0 = T->clk0[ti];
        *d1 = T->clk1[ti];
        if (T->timed) {
            T->busy0[ti] = *d0;
            T->busy1[ti] = *d1;
        }
    } else {
        *d0 = *d1 = t;
    }
    if (T->singleflight) {
        int64_t x = ti * T->c.num_ids + key;
        T->if_valid[x] = 1;
        T->if0[x] = *d0;
        T->if1[x] = *d1;
    }
    return true;
}

static inline void kt_discard(kt_tiers *T, int64_t ti, int64_t key) /* `TierStore.discard` */
{
    int64_t slot = kt_where(T, ti, key);
    if (slot >= 0) {
        kt_lru_unlink(T, ti, slot);
        T->count[ti]--;
    }
}

static inline void kt_mark_needed(uint8_t *needed, int64_t h, int64_t *num_needed)
{
    if (!needed[h]) {
        needed[h] = 1;
        (*num_needed)++;
    }
}

/* Replay in->stream through the GPU pool and the tiers below it (struct ks_tiers_in in boundary.h: the
 * stream and its tails, the tiers' configuration, the preloaded ids, early preparation's schedule); writes
 * the pool's results, the hits per tier, the waits, the store marks, the per-tier counts and the read rows
 * (malloc'd: free with ks_tiers_free) into *res. Returns 0 or KS_ENOMEM. */
KS_EXPORT int64_t ks_tiers_replay(const ks_tiers_in *args, ks_tiers_out *res)
{
    const ks_tiers_in in = *args;
    const ks_pool_stream s = in.stream;
    const ks_pool_result r = res->pool;
    const ks_tiers_out o = *res;
    const int64_t n_req = s.n_req, nt = in.nt, num_ids = s.num_objects; /* every id: tails and preloads too */

    kp_engine e = {
        .obj32 = s.obj32, .obj64 = s.obj64, .req_start = s.req_start, .listed = s.listed,
        .prompt_tokens = s.prompt_tokens, .output_tokens = s.output_tokens, .finish_ns = s.finish_ns,
        .arrival = s.arrival, .n_req = n_req, .block_size = s.block_size, .timed = s.timed != 0, .has_holds = false,
        .expiry_ns = -1, .max_held = -1, .max_fam = -1,
    };
    kt_ids obj = {s.obj32, s.obj64}, tail = {in.tail32, in.tail64};
    kt_tiers T = {
        .c = {.nt = nt, .num_ids = num_ids, .n_on_evict = in.n_on_evict, .cap = in.cap, .chunk = in.chunk,
              .below = in.below, .on_evict = in.on_evict, .chunk_bytes = in.chunk_bytes, .lat_ns = in.lat_ns,
              .dur0 = in.dur0, .dur1 = in.dur1, .retain = in.retain, .refresh_on_hit = in.refresh_on_hit,
              .write_through = in.write_through, .has_cost = in.has_cost},
        .timed = s.timed != 0, .singleflight = in.singleflight != 0,
    };
    int64_t *rhk = NULL, *rhi = NULL, rh_cap = 0, rh_cap2 = 0, rh_size = 0; /* the ready heap: (completion, id) */
    int64_t *bp = NULL, bp_cap = 0, n_bp = 0;
    int64_t rc = KS_ENOMEM;
    res->reads = NULL;
    kp_arena *A = &e.arena;
    if (!kp_engine_init(&e, s.num_usable, num_ids, 1, NULL))
        goto done;
    int64_t longest = e.longest, ids1 = num_ids + 1;
    T.stamp = (int32_t *)kp_new(A, (nt * num_ids + 1) / 2, 0);
    T.queue = (int64_t **)kp_new(A, nt, 0);
    T.qhead = kp_new(A, nt, 0);
    T.qtail = kp_new(A, nt, 0);
    T.qcap = kp_new(A, nt, 0);
    T.count = kp_new(A, nt, 0);
    T.num_stores = o.num_stores;
    T.num_reads = o.num_reads;
    T.read_bytes = o.read_bytes;
    T.busy0 = kp_new(A, nt, 0);
    T.busy1 = kp_new(A, nt, 0);
    T.clk0 = kp_new(A, nt, 0);
    T.clk1 = kp_new(A, nt, 0);
    T.clk_set = (uint8_t *)kp_new(A, nt, 0);
    /* the chunks this request reads, (tier, id) -> completion: a table of twice the longest request's blocks */
    int64_t size = 1;
    while (size < 2 * longest + 2)
        size *= 2;
    int64_t mask = size - 1;
    int64_t *tkey = kp_new(A, size, -1), *t0 = kp_new(A, size, 0), *t1 = kp_new(A, size, 0);
    int64_t *used = kp_new(A, longest, 0);
    int64_t m_if = T.singleflight ? num_ids : 0;
    T.if_valid = (uint8_t *)kp_new(A, (nt * m_if + 7) / 8, 0);
    T.if0 = kp_new(A, nt * m_if, 0);
    T.if1 = kp_new(A, nt * m_if, 0);
    int64_t m_gr = e.timed ? num_ids : 0;
    uint8_t *gr_valid = (uint8_t *)kp_new(A, (m_gr + 7) / 8, 0);
    int64_t *gr0 = kp_new(A, m_gr, 0), *gr1 = kp_new(A, m_gr, 0), *gr_tier = kp_new(A, m_gr, 0);
    uint8_t *needed = (uint8_t *)kp_new(A, (num_ids + 7) / 8, 0);
    int64_t num_needed = 0, num_shared = 0;
    /* early preparation: the staged blocks (id -> completions, tier) and what each parent staged */
    int64_t m_st = in.early_prep ? num_ids : 0, m_bp = in.early_prep ? n_req : 0;
    uint8_t *st_valid = (uint8_t *)kp_new(A, (m_st + 7) / 8, 0);
    int64_t *st0 = kp_new(A, m_st, 0), *st1 = kp_new(A, m_st, 0), *st_tier = kp_new(A, m_st, 0);
    int64_t *bp_start = kp_new(A, m_bp, 0), *bp_len = kp_new(A, m_bp, 0);
    int64_t *children_left = kp_new(A, m_bp, 0);
    int64_t n_staged = 0, next_prep = 0;
    int64_t *counts = kp_new(A, nt, 0);
    int64_t *ro_tier = kp_new(A, longest, 0), *ro_key = kp_new(A, longest, 0);
    int64_t *ld_h = kp_new(A, longest, 0), *ld0 = kp_new(A, longest, 0), *ld1 = kp_new(A, longest, 0);
    int64_t *ld_tier = kp_new(A, longest, 0);
    int64_t *evicted = in.n_on_evict ? kp_new(A, longest, 0) : NULL;
    int64_t *keys = kp_new(A, longest, 0);
    int64_t longest_preload = 0;
    for (int64_t ti = 0; ti < nt; ti++)
        longest_preload = kp_max(longest_preload, in.pstart[ti + 1] - in.pstart[ti]);
    int64_t *gone = kp_new(A, longest_preload, 0);
    if (A->failed)
        goto done;
    if (in.early_prep)
        memcpy(children_left, in.children_of, (size_t)n_req * sizeof(int64_t));
    for (int64_t ti = 0; ti < nt; ti++)
        o.num_stores[ti] = o.num_reads[ti] = o.read_bytes[ti] = 0;
    for (int64_t i = 0; i < n_req; i++) {
        r.hit_blocks[i] = r.num_evictions[i] = 0;
        r.admitted[i] = r.stalled[i] = 0;
        o.wait0[i] = o.wait1[i] = 0.0;
        o.marks[i] = -1;
    }
    for (int64_t k = 0; k < (nt + 1) * n_req; k++)
        o.hit[k] = 0;
    for (int64_t ti = 0; ti < nt; ti++) {
        kt_put(&T, ti, in.preload + in.pstart[ti], in.pstart[ti + 1] - in.pstart[ti], true, false, gone);
        o.num_stores[ti] = 0;
    }
#define BIT(a, k) ((a)[k])
#define SET(a, k) ((a)[k] = 1)
#define CLR(a, k) ((a)[k] = 0)
    for (int64_t i = 0; i < n_req; i++) {
        if (KS_UNLIKELY(T.failed))
            goto done;
        kp_admission ad = kp_arrive(&e, i);
        if (ad.outcome == KP_REFUSED)
            continue;
        /* -- TierReplay._looked_up */
        int64_t t = e.timed ? e.now : 0;
        while (in.early_prep && next_prep < in.n_prep && in.prep_at[next_prep] <= (e.timed ? t : i)) { /* due */
            int64_t p = in.prep_p[next_prep], at = in.prep_at[next_prep];
            next_prep++;
            if (children_left[p] <= 0)
                continue;
            int64_t tp = e.timed ? at : 0; /* _prepare */
            memset(T.clk_set, 0, (size_t)nt);
            int64_t n_used = 0;
            kt_seq held = kt_held_seq(&e, obj, p);
            bp_start[p] = n_bp;
            for (int64_t j = 0; j < held.len; j++) {
                int64_t h = kt_at(&held, j), key, d0, d1;
                if (e.head[h] >= 0 || BIT(st_valid, h))
                    continue;
                int64_t ti = kt_find_below(&T, &held, j, &key);
                if (ti < 0)
                    break;
                int64_t q = kt_slot(tkey, mask, ti * ids1 + key);
                if (tkey[q] >= 0) {
                    d0 = t0[q];
                    d1 = t1[q];
                } else {
                    if (!kt_read(&T, ti, key, tp, p, 1, &d0, &d1))
                        goto done;
                    if (!in.retain[ti]) /* Tier.after_load */
                        kt_discard(&T, ti, key);
                    else if (in.refresh_on_hit[ti])
                        kt_lru_refresh(&T, ti, key, kt_where(&T, ti, key));
                    tkey[q] = ti * ids1 + key;
                    t0[q] = d0;
                    t1[q] = d1;
                    used[n_used++] = q;
                }
                if (!BIT(st_valid, h))
                    n_staged++;
                SET(st_valid, h);
                st0[h] = e.timed ? d0 : 0;
                st1[h] = e.timed ? d1 : 0;
                st_tier[h] = ti;
                if (!kp_grow(&bp, &bp_cap, n_bp, 1))
                    goto done;
                bp[n_bp++] = h;
            }
            bp_len[p] = n_bp - bp_start[p];
            for (int64_t q = 0; q < n_used; q++)
                tkey[used[q]] = -1;
        }
        if (e.timed) { /* _expire_ready */
            while (rh_size > 0 && rhk[0] < t) {
                int64_t finished = rhk[0];
                rh_size = kp_heap_pop(rhk, rhi, rh_size);
                int64_t h = rhi[rh_size];
                if (BIT(gr_valid, h) && gr0[h] == finished)
                    CLR(gr_valid, h);
            }
        }
        int64_t n_gpu = ad.nh;
        int64_t *hit0 = o.hit;
        hit0[i] = ad.nh;
        kt_seq chain = kt_prompt_seq(&e, obj, tail, in.tstart, i);
        int64_t max_hit = kp_min(kp_min(kp_max(s.prompt_tokens[i] - 1, 0) / s.block_size,
                                        s.prompt_tokens[i] / s.block_size), chain.len);
        if (nt > 0) {
            int64_t total = 0;
            for (int64_t ti = 0; ti < nt; ti++)
                total += o.num_stores[ti];
            o.marks[i] = total;
            int64_t w0 = t, w1 = t;
            memset(T.clk_set, 0, (size_t)nt);
            memset(counts, 0, (size_t)nt * sizeof(int64_t));
            int64_t n_ro = 0, n_ld = 0, n_used = 0;
            if (e.timed) { /* _restores_in_flight */
                for (int64_t j = 0; j < n_gpu; j++) {
                    int64_t h = kt_at(&chain, j);
                    if (!BIT(gr_valid, h))
                        continue;
                    if (T.singleflight) {
                        w0 = kp_max(w0, gr0[h]);
                        w1 = kp_max(w1, gr1[h]);
                        hit0[i]--;
                        o.hit[(1 + gr_tier[h]) * n_req + i]++;
                        num_shared++;
                        kt_mark_needed(needed, h, &num_needed);
                    } else {
                        hit0[i] = n_gpu = j;
                        break;
                    }
                }
            }
            int64_t j = n_gpu;
            while (j < max_hit) { /* _walk_below */
                int64_t h = kt_at(&chain, j), key, d0, d1;
                if (in.any_gpu && e.head[h] >= 0 && !(e.timed && BIT(gr_valid, h))) {
                    hit0[i]++;
                    j++;
                    continue;
                }
                if (n_staged > 0 && BIT(st_valid, h)) { /* staged by early preparation */
                    w0 = kp_max(w0, st0[h]);
                    w1 = kp_max(w1, st1[h]);
                    o.hit[(1 + st_tier[h]) * n_req + i]++;
                    kt_mark_needed(needed, h, &num_needed);
                    j++;
                    continue;
                }
                int64_t ti = kt_find_below(&T, &chain, j, &key);
                if (ti < 0)
                    break;
                int64_t q = kt_slot(tkey, mask, ti * ids1 + key);
                int64_t x = ti * num_ids + key;
                if (tkey[q] >= 0) { /* _load: a chunk this request already reads */
                    d0 = t0[q];
                    d1 = t1[q];
                } else if (T.singleflight && BIT(T.if_valid, x) && T.if0[x] >= t) {
                    d0 = T.if0[x];
                    d1 = T.if1[x];
                    num_shared++;
                } else {
                    if (!kt_read(&T, ti, key, t, i, 0, &d0, &d1))
                        goto done;
                    if (!in.retain[ti]) {
                        ro_tier[n_ro] = ti;
                        ro_key[n_ro++] = key;
                    } else if (in.refresh_on_hit[ti]) {
                        kt_lru_refresh(&T, ti, key, kt_where(&T, ti, key));
                    }
                }
                if (tkey[q] < 0) {
                    tkey[q] = ti * ids1 + key;
                    t0[q] = d0;
                    t1[q] = d1;
                    used[n_used++] = q;
                }
                w0 = kp_max(w0, d0);
                w1 = kp_max(w1, d1);
                counts[ti]++;
                kt_mark_needed(needed, h, &num_needed);
                if (e.timed) {
                    ld_h[n_ld] = h;
                    ld0[n_ld] = d0;
                    ld1[n_ld] = d1;
                    ld_tier[n_ld++] = ti;
                }
                j++;
            }
            for (int64_t q = 0; q < n_used; q++)
                tkey[used[q]] = -1;
            for (int64_t ti = 0; ti < nt; ti++) /* _settle */
                o.hit[(1 + ti) * n_req + i] += counts[ti];
            for (int64_t q = 0; q < n_ro; q++)
                kt_discard(&T, ro_tier[q], ro_key[q]);
            for (int64_t q = 0; q < n_ld; q++) {
                if (ld0[q] >= t) {
                    int64_t h = ld_h[q];
                    SET(gr_valid, h);
                    gr0[h] = ld0[q];
                    gr1[h] = ld1[q];
                    gr_tier[h] = ld_tier[q];
                    if (!kp_grow(&rhk, &rh_cap, rh_size, 1) || !kp_grow(&rhi, &rh_cap2, rh_size, 1))
                        goto done;
                    rh_size = kp_heap_push(rhk, rhi, rh_size, ld0[q], h);
                }
            }
            if (in.with_costs) { /* _restore_wait */
                if (e.timed) {
                    o.wait0[i] = (double)(w0 - t) / 1e9;
                    o.wait1[i] = (double)(w1 - t) / 1e9;
                } else {
                    o.wait0[i] = (double)w0 / 1e9;
                    o.wait1[i] = (double)w1 / 1e9;
                }
            }
            for (int64_t ti = 0; ti < nt; ti++) { /* _write_through */
                if (!in.write_through[ti])
                    continue;
                int64_t c = in.chunk[ti], nk = 0;
                kt_seq held = kt_held_seq(&e, obj, i);
                for (int64_t q = c - 1; q < held.len; q += c)
                    keys[nk++] = kt_at(&held, q);
                int64_t nl = kt_put(&T, ti, keys, nk, true, false, keys);
                if (nl > 0 && in.below[ti] >= 0)
                    kt_offload(&T, in.below[ti], keys, nl);
            }
            int64_t p = in.early_prep ? in.parent_of[i] : -1; /* parent_of: per request with early preparation */
            if (p >= 0) { /* EarlyPrep.child_admitted (a child's parent has declared children) */
                if (--children_left[p] <= 0) {
                    for (int64_t q = bp_start[p]; q < bp_start[p] + bp_len[p]; q++) {
                        if (BIT(st_valid, bp[q])) {
                            CLR(st_valid, bp[q]);
                            n_staged--;
                        }
                    }
                    bp_len[p] = 0;
                }
            }
        }
        int64_t nk;
        int64_t ne = kp_allocate_request(&e, i, &ad, evicted, &nk);
        if (nk > 0) { /* TierReplay._allocated */
            if (e.timed)
                for (int64_t q = 0; q < nk; q++)
                    CLR(gr_valid, evicted[q]);
            kt_offload(&T, 0, evicted, nk);
        }
        r.num_evictions[i] = ne;
        r.hit_blocks[i] = ad.nh;
        r.admitted[i] = 1;
        r.stalled[i] = ad.outcome == KP_STALLS;
        kp_end_admission(&e, i, &ad);
    }
#undef BIT
#undef SET
#undef CLR
    if (T.failed)
        goto done;
    kp_drain(&e);
    res->pool.free_queue_len = kp_free_queue(&e, r.free_queue);
    res->pool.num_deferred = e.num_deferred;
    res->num_read_rows = T.n_rd;
    res->num_needed = num_needed;
    res->num_shared = num_shared;
    res->reads = T.rd;
    T.rd = NULL;
    rc = 0;
done:
    for (int64_t ti = 0; T.queue && ti < nt; ti++)
        free(T.queue[ti]);
    free(T.rd);
    free(rhk);
    free(rhi);
    free(bp);
    kp_engine_free(&e);
    return rc;
}

/* The read rows ks_tiers_replay handed over. */
KS_EXPORT void ks_tiers_free(int64_t *reads) { free(reads); }

/* out = values[starts[k]:starts[k] + lens[k]] for k < n, concatenated; `width`-byte values. */
KS_EXPORT void ks_tiers_gather(const uint8_t *values, int64_t width, const int64_t *starts, const int64_t *lens,
                               int64_t n, uint8_t *out)
{
    int64_t o = 0;
    for (int64_t k = 0; k < n; k++) {
        memcpy(out + o * width, values + starts[k] * width, (size_t)(lens[k] * width));
        o += lens[k];
    }
}

/* For each of the distinct `keys` not found yet (found[k] < 0), the id of an equal hash among hashes[:n]
 * (their ids ids32 or ids64), through an open-addressing table of the keys: one pass over the hashes.
 * Returns 0 or KS_ENOMEM. */
KS_EXPORT int64_t ks_tiers_find(const uint64_t *keys, int64_t nk, const uint64_t *hashes, const int32_t *ids32,
                                const int64_t *ids64, int64_t n, int64_t *found)
{
    int64_t size = 16, shift = 60;
    while (size < 2 * nk) {
        size *= 2;
        shift--;
    }
    int64_t *slot = malloc((size_t)size * sizeof(int64_t)); /* index into keys, -1: empty */
    if (!slot)
        return KS_ENOMEM;
    for (int64_t q = 0; q < size; q++)
        slot[q] = -1;
    const uint64_t mult = 0x9E3779B97F4A7C15ull;
    for (int64_t k = 0; k < nk; k++) {
        int64_t q = (int64_t)((keys[k] * mult) >> shift);
        while (slot[q] >= 0)
            q = (q + 1) & (size - 1);
        slot[q] = k;
    }
    for (int64_t t = 0; t < n; t++) {
        uint64_t h = hashes[t];
        int64_t q = (int64_t)((h * mult) >> shift), k;
        while ((k = slot[q]) >= 0 && keys[k] != h)
            q = (q + 1) & (size - 1);
        if (k >= 0 && found[k] < 0)
            found[k] = ids32 ? ids32[t] : ids64[t];
    }
    free(slot);
    return 0;
}
