/* Whole hit-ratio curves, `lru` and `belady` at every capacity from one pass (oracle/curves.py, whose
 * docstring gives the algorithms: the LRU stack distance counted over a window of touch times, and the
 * Critical Stack Algorithm of Bilardi, Ekanadham and Pattnaik for OPT's stack distance).
 *
 * Both return the curve as two histograms over levels (count, position sum), malloc'ed here, grown by
 * doubling, handed to the caller through `*count` / `*possum` and released with ks_curves_free. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define KS_EBADSTREAM (-22) /* next_use does not match obj and eligible */
#define FIRST_LEVELS 1025

KS_EXPORT void ks_curves_free(void *p)
{
    free(p);
}

typedef struct {
    int64_t *count, *possum, len;
} hist_t;

static int hist_init(hist_t *h)
{
    h->len = FIRST_LEVELS;
    h->count = calloc((size_t)h->len, sizeof(int64_t));
    h->possum = calloc((size_t)h->len, sizeof(int64_t));
    return h->count && h->possum ? 0 : KS_ENOMEM;
}

/* Room for index `top`: at least twice as long, zeros added. */
static int hist_reach(hist_t *h, int64_t top)
{
    if (KS_LIKELY(top < h->len))
        return 0;
    int64_t len = 2 * h->len > top + 1 ? 2 * h->len : top + 1;
    int64_t *c = realloc(h->count, (size_t)len * sizeof(int64_t));
    if (!c)
        return KS_ENOMEM;
    h->count = c;
    int64_t *p = realloc(h->possum, (size_t)len * sizeof(int64_t));
    if (!p)
        return KS_ENOMEM;
    h->possum = p;
    memset(c + h->len, 0, (size_t)(len - h->len) * sizeof(int64_t));
    memset(p + h->len, 0, (size_t)(len - h->len) * sizeof(int64_t));
    h->len = len;
    return 0;
}

/* Hands the histograms to the caller (or frees them on an error); returns their length or `rc`. */
static int64_t hist_hand_over(hist_t *h, int rc, int64_t **count, int64_t **possum)
{
    if (rc < 0) {
        free(h->count);
        free(h->possum);
        *count = *possum = NULL;
        return rc;
    }
    *count = h->count;
    *possum = h->possum;
    return h->len;
}

static int cmp_i64(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

/* One request's hit levels charged as a prefix: the k-th cheapest hit is block k of its hit prefix. */
static int charge_as_prefix(int64_t *levels, int64_t nh, hist_t *h)
{
    qsort(levels, (size_t)nh, sizeof(int64_t), cmp_i64);
    if (hist_reach(h, levels[nh - 1]) < 0)
        return KS_ENOMEM;
    for (int64_t k = 0; k < nh; k++) {
        h->count[levels[k]]++;
        h->possum[levels[k]] += k;
    }
    return 0;
}

/* ---- lru: the recency stack over a window of touch times ------------------------------------------ */

#define KS_BODY "lru_curve_body.h"
#include "by_width.h"

/* ---- belady: the Critical Stack Algorithm ------------------------------------------------------------ */

#define INF32 ((int32_t)1 << 30) /* "no last touch in this node" (sums stay far below it) */
#define S_CAP_READ 1
#define S_TOUCH 2
#define S_CAP_DUMMY 4
#define S_DONE 8
#define BLK 8 /* slots per leaf of the time tree, scanned in place */

/* Slot j holds times 2j (access j) and 2j + 1 (its dummy): its sum of (capacity marks - last touches) and
 * the smallest such sum after one of its last touches (INF32: none). */
static inline int32_t slot_sum(uint8_t st, int32_t *low)
{
    if (!(st & S_DONE)) {
        *low = INF32;
        return 0;
    }
    int32_t dummy = ((st >> 2) & 1) - 1; /* the dummy is always a last touch */
    *low = (st & S_TOUCH) ? (dummy < 0 ? dummy : 0) : 0;
    return (st & S_CAP_READ) - ((st >> 1) & 1) + dummy;
}

/* Over slots [lo, hi) with `after` the sum of everything later: their sum, the smallest suffix sum after a
 * last touch (*low) and the earliest last touch whose suffix sum is 0 (*first, -1: none). */
static inline int64_t scan(const uint8_t *slots, int64_t lo, int64_t hi, int64_t after, int32_t *low, int64_t *first)
{
    int64_t total = 0, lw = INF32, fst = -1;
    for (int64_t j = hi - 1; j >= lo; j--) {
        uint8_t st = slots[j];
        int32_t m;
        int32_t s = slot_sum(st, &m);
        if (m != INF32) {
            if (after + total == 0) /* the dummy at 2j + 1 */
                fst = 2 * j + 1;
            if ((st & S_TOUCH) && after + total + ((st >> 2) & 1) - 1 == 0)
                fst = 2 * j;
            if (m + total < lw)
                lw = m + total;
        }
        total += s;
    }
    if (low)
        *low = (int32_t)lw;
    if (first)
        *first = fst;
    return total;
}

typedef struct {
    int32_t sm, ms; /* the sum of its slots, the smallest suffix sum after a last touch (INF32: none) */
} tt_node;

typedef struct {
    tt_node *node; /* nodes 1..nb-1 internal, nb + b summarises block b */
    uint8_t *slots;
    int64_t nb;
} time_tree_t;

/* (sum, smallest suffix sum after a last touch) of two slots side by side, indexed by their states
 * (earlier slot's in the low 4 bits): filled once by pair_table_init. */
static tt_node PAIR[256];

__attribute__((constructor)) static void pair_table_init(void)
{
    for (int k = 0; k < 256; k++) {
        uint8_t two[2] = {(uint8_t)(k & 15), (uint8_t)(k >> 4)};
        int32_t m;
        int32_t s = (int32_t)scan(two, 0, 2, 0, &m, NULL);
        PAIR[k] = (tt_node){s, m};
    }
}

static inline tt_node join_nodes(tt_node l, tt_node r)
{
    int32_t a = l.ms + r.sm;
    return (tt_node){l.sm + r.sm, a < r.ms ? a : r.ms};
}

static inline void tt_leaf(time_tree_t *tt, int64_t b)
{
    uint64_t w;
    memcpy(&w, tt->slots + b * BLK, 8);
    uint64_t k = (w & 0x000f000f000f000fULL) | ((w >> 4) & 0x00f000f000f000f0ULL); /* pair i in byte 2i */
    tt_node a = join_nodes(PAIR[k & 255], PAIR[(k >> 16) & 255]);
    tt_node c = join_nodes(PAIR[(k >> 32) & 255], PAIR[(k >> 48) & 255]);
    tt->node[tt->nb + b] = join_nodes(a, c);
}

static inline tt_node tt_joined(const time_tree_t *tt, int64_t i)
{
    return join_nodes(tt->node[2 * i], tt->node[2 * i + 1]);
}

static inline void tt_join(time_tree_t *tt, int64_t i)
{
    tt->node[i] = tt_joined(tt, i);
}

/* From node i up to the root, stopping at the first node its children leave unchanged (every node above
 * it is then up to date). */
static inline void tt_up(time_tree_t *tt, int64_t i)
{
    for (; i >= 1; i >>= 1) {
        tt_node v = tt_joined(tt, i), o = tt->node[i];
        if (v.sm == o.sm && v.ms == o.ms)
            return;
        tt->node[i] = v;
    }
}

/* Slots j and k changed (j == k: one slot): their leaves and paths up, joined where they meet, so that changes
 * that cancel (a sum + 1 below one, - 1 below the other) stop there. */
static inline void tt_pull2(time_tree_t *tt, int64_t j, int64_t k)
{
    int64_t a = j / BLK, b = k / BLK;
    tt_leaf(tt, a);
    if (b != a)
        tt_leaf(tt, b);
    int64_t ia = (tt->nb + a) >> 1, ib = (tt->nb + b) >> 1;
    while (ia != ib) {
        tt_join(tt, ia);
        tt_join(tt, ib);
        ia >>= 1;
        ib >>= 1;
    }
    tt_up(tt, ia);
}

static inline void tt_pull(time_tree_t *tt, int64_t j)
{
    tt_pull2(tt, j, j);
}

static void tt_build(time_tree_t *tt)
{
    for (int64_t b = 0; b < tt->nb; b++)
        tt_leaf(tt, b);
    for (int64_t i = tt->nb - 1; i >= 1; i--)
        tt_join(tt, i);
}

static int tt_alloc(time_tree_t *tt, int64_t nb)
{
    tt->nb = nb;
    tt->node = malloc((size_t)(2 * nb) * sizeof(tt_node));
    tt->slots = calloc((size_t)(nb * BLK), 1);
    if (!tt->node || !tt->slots)
        return KS_ENOMEM;
    for (int64_t i = 0; i < 2 * nb; i++)
        tt->node[i] = (tt_node){0, INF32};
    return 0;
}

static void tt_free(time_tree_t *tt)
{
    free(tt->node);
    free(tt->slots);
    tt->node = NULL;
    tt->slots = NULL;
}

/* The earliest last touch after time 2p with nothing after it on balance (imbalance 0). Time 2(t - 1) + 1,
 * the latest dummy, always qualifies. */
static int64_t first_balanced(const time_tree_t *tt, int64_t p)
{
    int64_t nodes[64], after[64];
    int64_t nb = tt->nb, bp = p / BLK, k = 0;
    for (int64_t lo = bp + 1 + nb, hi = 2 * nb; lo < hi; lo >>= 1, hi >>= 1)
        if (lo & 1)
            nodes[k++] = lo++;
    int64_t a = 0;
    for (int64_t q = k - 1; q >= 0; q--) {
        after[q] = a;
        a += tt->node[nodes[q]].sm;
    }
    int64_t first;
    int64_t total = scan(tt->slots, p + 1, (bp + 1) * BLK, a, NULL, &first);
    if (a + total == 0) /* the dummy right after p */
        return 2 * p + 1;
    if (first >= 0)
        return first;
    for (int64_t q = 0; q < k; q++) {
        int64_t i = nodes[q];
        a = after[q];
        if (tt->node[i].ms + a != 0)
            continue;
        while (i < nb) {
            int64_t sr = tt->node[2 * i + 1].sm;
            if (tt->node[2 * i].ms + a + sr == 0) {
                a += sr;
                i = 2 * i;
            } else {
                i = 2 * i + 1;
            }
        }
        int64_t b = i - nb;
        scan(tt->slots, b * BLK, (b + 1) * BLK, a, NULL, &first);
        return first;
    }
    return -1; /* unreachable */
}

/* The window [*base, *base + nb * BLK) of slots is full at access t. Its new start is the block of the
 * earliest last touch that a counted reuse will still read (*low, found by moving on from the last one);
 * earlier slots are never scanned again. The slots kept move to the front, into a tree twice as large when
 * they would fill more than half of it. */
static int tt_move(time_tree_t *tt, int64_t *base, int64_t *low, int64_t t, const int64_t *next_use, int64_t never)
{
    int64_t lw = *low, b0 = *base;
    while (lw < t && !((tt->slots[lw - b0] & S_TOUCH) && next_use[lw] != never))
        lw++;
    int64_t start = lw - lw % BLK, keep = t - start;
    if (2 * keep > tt->nb * BLK) {
        time_tree_t grown;
        if (tt_alloc(&grown, 2 * tt->nb) < 0) {
            tt_free(&grown);
            return KS_ENOMEM;
        }
        memcpy(grown.slots, tt->slots + (start - b0), (size_t)keep);
        tt_free(tt);
        *tt = grown;
    } else {
        memmove(tt->slots, tt->slots + (start - b0), (size_t)keep);
        memset(tt->slots + keep, 0, (size_t)(tt->nb * BLK - keep));
    }
    tt_build(tt);
    *base = start;
    *low = lw;
    return 0;
}

/* "Not critical at any time": above every time 2t + 1 a search compares with (t < 2^30), which INF32 is not
 * (past 2^29 accesses, times reach it). */
#define NOT_CRITICAL INT32_MAX

/* The capacities' critical times under a 16-ary min tree: level 0 holds capacity c's time at c (NOT_CRITICAL: not
 * tracked, or capacity 0), each level above the minimum of 16 below it, up to one root. Sixteen children
 * are one cache line, compared at once, so a search reads a line a level, four levels for 65,536 capacities. */
#define FAN 16
#define MAX_LEVELS 12

typedef struct {
    int32_t *lv[MAX_LEVELS];
    int levels; /* lv[levels - 1] is the root (one value) */
} cap_tree_t;

/* The smallest of the FAN values at v (one cache line). */
static inline int32_t line_min(const int32_t *v)
{
    int32_t m = v[0];
    for (int k = 1; k < FAN; k++)
        m = v[k] < m ? v[k] : m;
    return m;
}

static void ct_free(cap_tree_t *ct)
{
    for (int l = 0; l < ct->levels; l++)
        free(ct->lv[l]);
    ct->levels = 0;
}

/* Level 0 from times[1..top) (NOT_CRITICAL elsewhere), every level above built from it. */
static int ct_build(cap_tree_t *ct, int64_t size, const int32_t *times, int64_t top)
{
    ct->levels = 0;
    for (int64_t n = size;; n = (n + FAN - 1) / FAN) {
        int64_t padded = n < FAN ? FAN : (n + FAN - 1) / FAN * FAN;
        int32_t *v = aligned_alloc(64, (size_t)padded * sizeof(int32_t));
        if (!v)
            return KS_ENOMEM;
        ct->lv[ct->levels++] = v;
        for (int64_t i = 0; i < padded; i++)
            v[i] = NOT_CRITICAL;
        if (ct->levels == 1) {
            for (int64_t c = 1; c < top; c++)
                v[c] = times[c];
        } else {
            const int32_t *below = ct->lv[ct->levels - 2];
            for (int64_t g = 0; g < n; g++)
                v[g] = line_min(below + FAN * g);
        }
        if (n == 1)
            return 0;
    }
}

static inline int32_t ct_root(const cap_tree_t *ct)
{
    return ct->lv[ct->levels - 1][0];
}

/* The smallest capacity critical at or before s (the root is <= s). */
static inline int64_t ct_first_at_or_before(const cap_tree_t *ct, int32_t s)
{
    int64_t i = 0;
    for (int l = ct->levels - 2; l >= 0; l--) {
        const int32_t *v = ct->lv[l] + FAN * i;
        uint32_t mask = 0;
        for (int k = 0; k < FAN; k++)
            mask |= (uint32_t)(v[k] <= s) << k;
        i = FAN * i + __builtin_ctz(mask);
    }
    return i;
}

static inline void set_critical(cap_tree_t *ct, int64_t c, int32_t when)
{
    ct->lv[0][c] = when;
    for (int l = 1; l < ct->levels; l++) {
        c /= FAN;
        int32_t m = line_min(ct->lv[l - 1] + FAN * c);
        if (ct->lv[l][c] == m)
            return;
        ct->lv[l][c] = m;
    }
}

/* The capacity tree doubled. Capacities at or above the old size were created without being tracked (each
 * at its creation time, never critical since); their critical times come back from the accesses that created
 * them (a fresh access creates one at 2u, its dummy one at 2u + 1), one bit per access in `fresh`. */
static int more_capacities(int32_t **crit, cap_tree_t *ct, int64_t *csize, int64_t num_caps, const uint8_t *fresh)
{
    int64_t old = *csize, size = 2 * old, top = num_caps < size ? num_caps : size;
    int32_t *grown = malloc((size_t)size * sizeof(int32_t));
    if (!grown)
        return KS_ENOMEM;
    memcpy(grown, *crit, (size_t)old * sizeof(int32_t));
    for (int64_t c = old; c < size; c++)
        grown[c] = -1;
    for (int64_t c = 0, u = 0; c < top; u++) {
        if (fresh[u >> 3] >> (u & 7) & 1) {
            if (c >= old)
                grown[c] = (int32_t)(2 * u);
            c++;
        }
        if (old <= c && c < size)
            grown[c] = (int32_t)(2 * u + 1);
        c++;
    }
    ct_free(ct);
    free(*crit);
    *crit = grown;
    *csize = size;
    return ct_build(ct, size, grown, top);
}

/* The belady curve of the stream (obj32 ids; n < 2^30: times 2t + 1 are int32). Returns the histograms'
 * length (out->count, out->possum), KS_ENOMEM, or KS_EBADSTREAM; out->window and out->tracked: the final
 * sizes of the two trees (slots, capacities). */
KS_EXPORT KS_WIDE_VECTORS int64_t ks_curves_belady_levels(const ks_access_stream *stream, int64_t measure_from,
                                          int64_t first_blocks, int64_t first_caps, ks_curve_out *out)
{
    const int32_t *obj = KS_IDS(stream, int32_t);
    const uint8_t *eligible = stream->eligible;
    const int64_t *next_use = stream->next_use, *req_start = stream->req_start;
    const int64_t num_requests = stream->num_requests, num_objects = stream->num_objects, never = stream->never;
    int64_t n = req_start[num_requests], longest = 1;
    for (int64_t r = 0; r < num_requests; r++)
        if (req_start[r + 1] - req_start[r] > longest)
            longest = req_start[r + 1] - req_start[r];
    int64_t csize = 1;
    int64_t goal = num_objects + 2 < first_caps ? num_objects + 2 : first_caps;
    while (csize < goal)
        csize *= 2;
    hist_t h;
    time_tree_t tt = {0};
    int rc = hist_init(&h);
    cap_tree_t ct = {0};
    int32_t *crit = malloc((size_t)csize * sizeof(int32_t));
    uint8_t *fresh = calloc((size_t)((n >> 3) + 1), 1);
    int32_t *last = malloc((size_t)(num_objects > 0 ? num_objects : 1) * sizeof(int32_t));
    int64_t *thr = malloc((size_t)longest * sizeof(int64_t));
    if (tt_alloc(&tt, first_blocks) < 0 || !crit || !fresh || !last || !thr)
        rc = KS_ENOMEM;
    if (rc < 0)
        goto done;
    for (int64_t i = 0; i < csize; i++)
        crit[i] = -1;
    for (int64_t i = 0; i < num_objects; i++)
        last[i] = -1;
    if ((rc = ct_build(&ct, csize, crit, 0)) < 0)
        goto done;
    int64_t base = 0, low = 0, num_caps = 0;
    for (int64_t r = 0; r < num_requests && rc == 0; r++) {
        int64_t nh = 0;
        for (int64_t t = req_start[r]; t < req_start[r + 1]; t++) {
            if (t - base == tt.nb * BLK && (rc = tt_move(&tt, &base, &low, t, next_use, never)) < 0)
                goto done;
            int32_t o = obj[t];
            int64_t p = last[o];
            if (eligible[t] && p >= 0) { /* a counted reuse: its level d; then d becomes critical */
                if (p < base) {
                    rc = KS_EBADSTREAM;
                    goto done;
                }
                int64_t s = first_balanced(&tt, p - base) + 2 * base, d;
                if (ct_root(&ct) > s) { /* no tracked capacity is critical by s: the smallest untracked one is */
                    d = csize;
                    if ((rc = more_capacities(&crit, &ct, &csize, num_caps, fresh)) < 0)
                        goto done;
                } else {
                    d = ct_first_at_or_before(&ct, (int32_t)s);
                }
                thr[nh++] = d;
                int32_t old = crit[d];
                crit[d] = (int32_t)(2 * t);
                set_critical(&ct, d, (int32_t)(2 * t));
                tt.slots[p - base] &= (uint8_t)~S_TOUCH; /* the object's last touch moves to t */
                if (old >= 0 && (old >> 1) >= base) { /* an earlier mark before the window is never read again */
                    tt.slots[(old >> 1) - base] &= (uint8_t)~((old & 1) ? S_CAP_DUMMY : S_CAP_READ);
                    tt_pull2(&tt, (old >> 1) - base, p - base);
                } else {
                    tt_pull(&tt, p - base);
                }
            } else { /* a fresh object (first access, write, or a read after a write): a new capacity */
                fresh[t >> 3] |= (uint8_t)(1 << (t & 7));
                if (0 < num_caps && num_caps < csize) {
                    crit[num_caps] = (int32_t)(2 * t);
                    set_critical(&ct, num_caps, (int32_t)(2 * t));
                }
                num_caps++;
            }
            if (0 < num_caps && num_caps < csize) { /* the dummy after t: a fresh object, a new capacity */
                crit[num_caps] = (int32_t)(2 * t + 1);
                set_critical(&ct, num_caps, (int32_t)(2 * t + 1));
            }
            num_caps++;
            tt.slots[t - base] = S_DONE | S_CAP_READ | S_TOUCH | S_CAP_DUMMY;
            tt_pull(&tt, t - base);
            last[o] = (int32_t)t;
        }
        if (r >= measure_from && nh > 0)
            rc = charge_as_prefix(thr, nh, &h);
    }
    out->window = tt.nb * BLK;
    out->tracked = csize;
done:
    tt_free(&tt);
    ct_free(&ct);
    free(crit);
    free(fresh);
    free(last);
    free(thr);
    return hist_hand_over(&h, rc, &out->count, &out->possum);
}
