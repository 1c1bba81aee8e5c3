/* The `vllm` pool model for hybrid KV cache groups, compiled (oracle/hybrid_pool_compiled.py): the rules of
 * oracle/hybrid_pool.py (`HybridPoolReplay`, the reference it is tested equal to), in the same order, over
 * arrays. One shared pool: the free queue a doubly linked list over block ids with block 0 (vLLM's null
 * block, never queued) as its sentinel; a cached block's key is group * num_ids + hash id, and the blocks
 * cached under one key are a list oldest first (duplicates). Each request has one block table per group
 * (0: a null block the window skipped), in one array at offsets the caller gives. */
#include "pool_steps.h" /* the single-group pool's list and heap steps, kp_min / kp_max */

enum { HP_FULL = 0, HP_WINDOW = 1, HP_CHUNKED = 2 };
enum { HP_NONE = -1, HP_PRIVATE = -2 }; /* block_key: not cached; cached under a key no lookup matches */
enum { HP_REFUSED, HP_STALLED, HP_DONE };

typedef struct {
    /* inputs */
    int64_t G, K, bs, n_req, N;
    const int64_t *kind, *span;                    /* per group */
    int64_t n_sg;
    const int64_t *sg_kind, *sg_span, *sg_start, *sg_gid; /* spec groups, full attention first */
    const int64_t *P, *Gout, *ph_off, *n_ph, *ph, *oh_off, *n_oh, *oh;
    const int64_t *tab_cap; /* per request: the most blocks a table of it holds */
    /* the pool */
    kp_ix *fnext, *fprev;
    int64_t *ref, *key, *dnext, *dprev, *kfirst, *klast;
    int64_t n_free;
    /* per request * group */
    int64_t *tlen, *ncached, **table; /* a running request's tables, made at its start, freed at its end */
    bool failed;                       /* a table could not be made */
    /* scratch: a lookup's hits per group (G x maxb), their lengths */
    int64_t *hits, *hlen, maxb;
    int64_t *freed_first, *freed_last;
    int64_t *evictions;
    int64_t retention;              /* prefix_cache_retention_interval; -1: none (every block cached) */
    int64_t *junction, last_junction; /* per request: the shared-prefix junction its lookup found */
} hp;

static inline int64_t hp_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
#define hp_max kp_max
#define hp_min kp_min

static inline int64_t hp_skip(const hp *h, int64_t g, int64_t n)
{
    if (h->kind[g] == HP_WINDOW)
        return hp_max(0, n - h->span[g] + 1);
    if (h->kind[g] == HP_CHUNKED)
        return n / h->span[g] * h->span[g];
    return 0;
}

/* -- the free queue and the hash map ------------------------------------------------------------------ */

static inline void hp_unlink(hp *h, int64_t b)
{
    kp_list_unlink(h->fnext, h->fprev, b);
    h->n_free--;
}

static inline void hp_insert_after(hp *h, int64_t left, int64_t b)
{
    kp_list_link_after(h->fnext, h->fprev, left, b);
    h->n_free++;
}

static inline void hp_cache(hp *h, int64_t b, int64_t k)
{
    h->key[b] = k;
    if (k < 0)
        return;
    h->dnext[b] = -1;
    h->dprev[b] = h->klast[k];
    if (h->klast[k] >= 0)
        h->dnext[h->klast[k]] = b;
    else
        h->kfirst[k] = b;
    h->klast[k] = b;
}

static inline void hp_uncache(hp *h, int64_t b)
{
    int64_t k = h->key[b];
    if (k >= 0) {
        if (h->dprev[b] >= 0)
            h->dnext[h->dprev[b]] = h->dnext[b];
        else
            h->kfirst[k] = h->dnext[b];
        if (h->dnext[b] >= 0)
            h->dprev[h->dnext[b]] = h->dprev[b];
        else
            h->klast[k] = h->dprev[b];
    }
    h->key[b] = HP_NONE;
}

/* `BlockPool.free_blocks(blocks)`: eviction order; unhashed blocks reaching 0 go first (in order), hashed last */
static void hp_free_blocks(hp *h, const int64_t *blocks, int64_t n)
{
    int64_t nf = 0, nl = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t b = blocks[k];
        if (--h->ref[b] == 0) {
            if (h->key[b] == HP_NONE)
                h->freed_first[nf++] = b;
            else
                h->freed_last[nl++] = b;
        }
    }
    for (int64_t k = nf - 1; k >= 0; k--)
        hp_insert_after(h, 0, h->freed_first[k]);
    for (int64_t k = 0; k < nl; k++)
        hp_insert_after(h, h->fprev[0], h->freed_last[k]);
}

/* -- the lookup --------------------------------------------------------------------------------------- */

static inline int64_t hp_ph(const hp *h, int64_t i, int64_t j) { return h->ph[h->ph_off[i] + j]; }

/* every group of spec group s has hash j cached: their oldest blocks into hits[g][pos]; false if one misses */
static inline bool hp_cached(hp *h, int64_t s, int64_t i, int64_t j, int64_t pos)
{
    int64_t id = hp_ph(h, i, j);
    for (int64_t t = h->sg_start[s]; t < h->sg_start[s + 1]; t++)
        if (h->kfirst[h->sg_gid[t] * h->K + id] < 0)
            return false;
    for (int64_t t = h->sg_start[s]; t < h->sg_start[s + 1]; t++) {
        int64_t g = h->sg_gid[t];
        h->hits[g * h->maxb + pos] = h->kfirst[g * h->K + id];
    }
    return true;
}

static int64_t hp_find(hp *h, int64_t s, int64_t i, int64_t max_length)
{
    int64_t bs = h->bs, max_blocks = max_length / bs, len = 0;
    if (h->sg_kind[s] == HP_FULL) {
        while (len < max_blocks && hp_cached(h, s, i, len, len))
            len++;
    } else if (h->sg_kind[s] == HP_WINDOW) {
        int64_t need = hp_cdiv(h->sg_span[s] - 1, bs), run = 0;
        bool found = false;
        for (int64_t t = h->sg_start[s]; t < h->sg_start[s + 1]; t++)
            memset(h->hits + h->sg_gid[t] * h->maxb, 0, (size_t)max_blocks * sizeof(int64_t));
        for (int64_t j = max_blocks - 1; j >= 0; j--) {
            if (!hp_cached(h, s, i, j, j)) {
                run = 0;
                continue;
            }
            if (++run >= need) {
                len = j + run;
                found = true;
                break;
            }
        }
        if (!found)
            len = run;
    } else {
        int64_t start = max_length > 0 ? max_length / h->sg_span[s] * h->sg_span[s] / bs : 0;
        for (int64_t t = h->sg_start[s]; t < h->sg_start[s + 1]; t++)
            memset(h->hits + h->sg_gid[t] * h->maxb, 0, (size_t)start * sizeof(int64_t));
        len = start;
        while (len < max_blocks && hp_cached(h, s, i, len, len))
            len++;
    }
    for (int64_t t = h->sg_start[s]; t < h->sg_start[s + 1]; t++)
        h->hlen[h->sg_gid[t]] = len;
    return len * bs;
}

/* `find_longest_cache_hit`: hits[g] / hlen[g] per group; returns the hit tokens */
static int64_t hp_lookup(hp *h, int64_t i)
{
    int64_t hit = hp_max(hp_min(h->P[i] - 1, h->n_ph[i] * h->bs), 0);
    bool simple = h->n_sg == 2 && h->sg_kind[0] == HP_FULL;
    bool fa_done = false; /* full-attention groups looked up (they are first) */
    int64_t longest = 0;
    for (int64_t g = 0; g < h->G; g++)
        h->hlen[g] = 0;
    for (;;) {
        int64_t curr = hit;
        for (int64_t s = 0; s < h->n_sg; s++) {
            if (h->sg_kind[s] == HP_FULL && fa_done) {
                curr = hp_min(curr, h->hlen[h->sg_gid[h->sg_start[s]]] * h->bs);
                continue;
            }
            curr = hp_find(h, s, i, curr);
            longest = hp_max(longest, curr);
        }
        fa_done = true;
        if (curr >= hit)
            break;
        hit = curr;
        if (simple)
            break;
    }
    h->last_junction = longest > hit ? longest : 0;
    for (int64_t s = 0; s < h->n_sg; s++)
        if (h->sg_kind[s] == HP_FULL)
            for (int64_t t = h->sg_start[s]; t < h->sg_start[s + 1]; t++)
                h->hlen[h->sg_gid[t]] = hp_min(h->hlen[h->sg_gid[t]], hp_cdiv(hit, h->bs));
    return hit;
}

/* -- a request's steps -------------------------------------------------------------------------------- */

static int64_t hp_need(const hp *h, int64_t hit, int64_t num_tokens)
{
    int64_t total = 0, required = hp_cdiv(num_tokens, h->bs);
    for (int64_t g = 0; g < h->G; g++) {
        int64_t skipped = hp_skip(h, g, hit) / h->bs, n = h->hlen[g];
        total += hp_max(required - hp_max(skipped, n), 0);
        for (int64_t j = skipped; j < n; j++) {
            int64_t b = h->hits[g * h->maxb + j];
            total += b != 0 && h->ref[b] == 0;
        }
    }
    return total;
}

/* `SlidingWindowManager.reachable_block_mask`: whether group g caches request i's full block j */
static inline bool hp_retained(const hp *h, int64_t i, int64_t g, int64_t j)
{
    if (h->kind[g] != HP_WINDOW)
        return true;
    int64_t bs = h->bs, R = h->retention, need = hp_cdiv(h->span[g] - 1, bs);
    if (R < 0)
        return need >= 1;
    if (R > 0) {
        int64_t per = R / bs;
        if (need >= per || j % per >= per - need)
            return true;
    }
    int64_t bounds[2] = {h->P[i] - 1, h->junction[i]};
    for (int k = 0; k < 2; k++) {
        int64_t end = bounds[k] / bs;
        if (bounds[k] && end - need <= j && j < end)
            return true;
    }
    return false;
}

static inline int64_t hp_key_of(const hp *h, int64_t i, int64_t g, int64_t j)
{
    if (!hp_retained(h, i, g, j))
        return HP_NONE;
    int64_t n_full = h->P[i] / h->bs;
    if (j < n_full)
        return j < h->n_ph[i] ? g * h->K + hp_ph(h, i, j) : HP_PRIVATE;
    int64_t o = j - n_full;
    if (o < h->n_oh[i] && h->oh[h->oh_off[i] + o] >= 0)
        return g * h->K + h->oh[h->oh_off[i] + o];
    return HP_PRIVATE;
}

static void hp_allocate(hp *h, int64_t i, int64_t num_tokens, int64_t num_full)
{
    for (int64_t g = 0; g < h->G; g++) {
        int64_t r = i * h->G + g, *table = h->table[r];
        int64_t len = h->tlen[r], upto = hp_min(num_full, len);
        for (int64_t j = h->ncached[r]; j < upto; j++)
            if (table[j] != 0)
                hp_cache(h, table[j], hp_key_of(h, i, g, j));
        int64_t want = hp_cdiv(num_tokens, h->bs);
        for (int64_t j = len; j < want; j++) {
            int64_t b = h->fnext[0];
            hp_unlink(h, b);
            if (h->key[b] != HP_NONE) {
                h->evictions[i]++;
                hp_uncache(h, b);
            }
            h->ref[b] = 1;
            if (j < num_full)
                hp_cache(h, b, hp_key_of(h, i, g, j));
            table[j] = b;
        }
        h->tlen[r] = len = hp_max(len, want);
        h->ncached[r] = hp_max(h->ncached[r], hp_min(num_full, len));
    }
}

/* false (h->failed) when its tables could not be made: nothing changed */
static bool hp_start(hp *h, int64_t i, int64_t hit, int64_t num_tokens, int64_t num_full)
{
    for (int64_t g = 0; g < h->G; g++) {
        int64_t r = i * h->G + g;
        h->table[r] = malloc((size_t)(h->tab_cap[i] > 0 ? h->tab_cap[i] : 1) * sizeof(int64_t));
        if (!h->table[r]) {
            for (int64_t k = i * h->G; k <= r; k++) {
                free(h->table[k]);
                h->table[k] = NULL;
            }
            h->failed = true;
            return false;
        }
    }
    h->junction[i] = h->last_junction;
    for (int64_t g = 0; g < h->G; g++) {
        int64_t r = i * h->G + g, *table = h->table[r];
        int64_t skipped = hp_skip(h, g, hit) / h->bs, n = h->hlen[g];
        for (int64_t j = 0; j < n; j++) {
            int64_t b = j < skipped ? 0 : h->hits[g * h->maxb + j];
            table[j] = b;
            if (b != 0) {
                if (h->ref[b] == 0)
                    hp_unlink(h, b);
                h->ref[b]++;
            }
        }
        h->tlen[r] = h->ncached[r] = n;
    }
    hp_allocate(h, i, num_tokens, num_full);
    return true;
}

static void hp_remove_skipped(hp *h, int64_t i, int64_t computed)
{
    for (int64_t g = 0; g < h->G; g++) {
        int64_t r = i * h->G + g, *table = h->table[r];
        int64_t n = hp_min(hp_skip(h, g, computed) / h->bs, h->tlen[r]), nf = 0;
        for (int64_t j = n - 1; j >= 0 && table[j] != 0; j--) {
            h->freed_last[nf++] = table[j]; /* borrowed as the list of freed blocks, tail first */
            table[j] = 0;
        }
        if (nf) { /* hp_free_blocks sorts into freed_first / freed_last: the list moves to the lookup's
                   * scratch, unused between a request's start and its next lookup */
            memcpy(h->hits, h->freed_last, (size_t)nf * sizeof(int64_t));
            hp_free_blocks(h, h->hits, nf);
        }
    }
}

static void hp_free_request(hp *h, int64_t i)
{
    for (int64_t g = 0; g < h->G; g++) {
        int64_t r = i * h->G + g, *table = h->table[r], n = 0;
        int64_t *list = h->hits; /* the lookup's scratch (G x maxb + N values): room for every block held */
        for (int64_t j = h->tlen[r] - 1; j >= 0; j--)
            if (table[j] != 0)
                list[n++] = table[j];
        hp_free_blocks(h, list, n);
        free(table);
        h->table[r] = NULL;
    }
}

static int hp_steps(hp *h, int64_t i, int64_t hit, uint8_t *stalled)
{
    int64_t P = h->P[i], bs = h->bs;
    if (hp_need(h, hit, P) > h->n_free)
        return HP_REFUSED;
    if (!hp_start(h, i, hit, P, P / bs))
        return HP_REFUSED;
    int64_t c = P;
    for (int64_t k = 0; k < h->Gout[i] - 1; k++) {
        hp_remove_skipped(h, i, c);
        int64_t need = 0;
        for (int64_t g = 0; g < h->G; g++)
            need += hp_max(hp_cdiv(c + 1, bs) - h->tlen[i * h->G + g], 0);
        if (need > h->n_free) {
            stalled[i] = 1;
            hp_free_request(h, i);
            return HP_STALLED;
        }
        c++;
        hp_allocate(h, i, c, c / bs);
    }
    return HP_DONE;
}

/* the running requests: a binary heap ordered by (finish, index), as heapq orders the reference's tuples */
static inline void hp_finish_earliest(hp *h, int64_t *hk, int64_t *hi, int64_t *nrun)
{
    *nrun = kp_heap_pop(hk, hi, *nrun);
    hp_free_request(h, hi[*nrun]);
}

/* Replay in->n_req requests through a pool of in->N usable blocks shared by in->G groups (struct
 * ks_hybrid_pool_in in boundary.h); a request's tables are made when it starts, freed when it ends. Writes
 * hit_tokens, num_evictions, admitted and stalled per request, the final free queue and its length, and the
 * deferrals into *out. Returns 0 or KS_ENOMEM. */
KS_EXPORT int64_t ks_hybrid_pool_replay(const ks_hybrid_pool_in *in, ks_hybrid_pool_out *out)
{
    const int64_t G = in->G, K = in->K, N = in->N, n_req = in->n_req, bs = in->bs;
    const int64_t *arrival = in->arrival, *finish = in->finish, *P = in->P, *Gout = in->Gout;
    const ks_hybrid_pool_out o = *out;
    hp h = {.G = G, .K = K, .bs = bs, .n_req = n_req, .N = N, .kind = in->kind, .span = in->span, .n_sg = in->n_sg,
            .sg_kind = in->sg_kind, .sg_span = in->sg_span, .sg_start = in->sg_start, .sg_gid = in->sg_gid, .P = P,
            .Gout = Gout, .ph_off = in->ph_off, .n_ph = in->n_ph, .ph = in->ph, .oh_off = in->oh_off,
            .n_oh = in->n_oh, .oh = in->oh, .tab_cap = in->tab_cap, .maxb = in->maxb > 0 ? in->maxb : 1,
            .evictions = o.num_evictions, .retention = in->retention};
    void *mem[24];
    int nm = 0;
#define HP_NEW(ptr, n) (mem[nm++] = (ptr) = malloc((size_t)((n) > 0 ? (n) : 1) * sizeof(int64_t)))
    int64_t *hk, *hi;
    bool ok = N < KP_IX_MAX && HP_NEW(h.fnext, N + 1) && HP_NEW(h.fprev, N + 1) && HP_NEW(h.ref, N + 1)
              && HP_NEW(h.key, N + 1)
              && HP_NEW(h.dnext, N + 1) && HP_NEW(h.dprev, N + 1) && HP_NEW(h.kfirst, G * K)
              && HP_NEW(h.klast, G * K) && HP_NEW(h.tlen, n_req * G) && HP_NEW(h.ncached, n_req * G)
              && (mem[nm++] = h.table = calloc((size_t)(n_req * G > 0 ? n_req * G : 1), sizeof(int64_t *)))
              && HP_NEW(h.hits, G * h.maxb + N) && HP_NEW(h.hlen, G)
              && HP_NEW(h.freed_first, N + 1) && HP_NEW(h.freed_last, N + 1) && HP_NEW(hk, n_req) && HP_NEW(hi, n_req)
              && HP_NEW(h.junction, n_req);
#undef HP_NEW
    if (!ok) {
        for (int k = 0; k < nm; k++)
            free(mem[k]);
        return KS_ENOMEM;
    }
    for (int64_t b = 0; b <= N; b++) { /* the queue starts in block-id order */
        h.fnext[b] = b == N ? 0 : b + 1;
        h.fprev[b] = b == 0 ? N : b - 1;
        h.ref[b] = 0;
        h.key[b] = HP_NONE;
        h.dnext[b] = h.dprev[b] = -1;
    }
    h.n_free = N;
    for (int64_t k = 0; k < G * K; k++)
        h.kfirst[k] = h.klast[k] = -1;
    int64_t nrun = 0, deferred = 0;
    for (int64_t i = 0; i < n_req; i++) {
        o.hit_tokens[i] = o.num_evictions[i] = 0;
        o.admitted[i] = o.stalled[i] = 0;
    }
    for (int64_t i = 0; i < n_req; i++) {
        if (!in->timed) {
            int64_t hit = hp_lookup(&h, i);
            int st = hp_steps(&h, i, hit, o.stalled);
            if (h.failed)
                break;
            if (st != HP_REFUSED)
                o.hit_tokens[i] = hit, o.admitted[i] = 1;
            if (st == HP_DONE)
                hp_free_request(&h, i);
            continue;
        }
        while (nrun && hk[0] <= arrival[i])
            hp_finish_earliest(&h, hk, hi, &nrun);
        int64_t computed = P[i] + hp_max(Gout[i] - 1, 0);
        bool waited = false;
        int st;
        for (;;) {
            int64_t hit = hp_lookup(&h, i);
            if (hp_need(&h, hit, computed) <= h.n_free) {
                st = hp_start(&h, i, hit, computed, computed / bs) ? HP_DONE : HP_REFUSED;
                if (st == HP_DONE)
                    o.hit_tokens[i] = hit, o.admitted[i] = 1;
                break;
            }
            if (!nrun) {
                st = hp_steps(&h, i, hit, o.stalled);
                if (st != HP_REFUSED)
                    o.hit_tokens[i] = hit, o.admitted[i] = 1;
                break;
            }
            waited = true;
            hp_finish_earliest(&h, hk, hi, &nrun);
        }
        if (h.failed)
            break;
        deferred += waited && st != HP_REFUSED; /* as the single-group model counts them */
        if (st == HP_DONE)
            nrun = kp_heap_push(hk, hi, nrun, hp_max(finish[i], arrival[i]), i);
    }
    while (nrun && !h.failed)
        hp_finish_earliest(&h, hk, hi, &nrun);
    if (h.failed) {
        for (int64_t k = 0; k < n_req * G; k++)
            free(h.table[k]);
        for (int k = 0; k < nm; k++)
            free(mem[k]);
        return KS_ENOMEM;
    }
    int64_t n = 0;
    for (int64_t b = h.fnext[0]; b != 0; b = h.fnext[b])
        o.free_queue[n++] = b;
    out->free_queue_len = n;
    out->num_deferred = deferred;
    for (int k = 0; k < nm; k++)
        free(mem[k]);
    return 0;
}
