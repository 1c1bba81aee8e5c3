/* The lru curve (oracle/curves.py), included by curves.c once per id width: ID_T is the type of the
 * object ids and of the touch times (int32_t while the stream has fewer than 2^31 accesses), KS_NAME(x)
 * names this width's entry point.
 *
 * A read's level is its object's stack distance when its request starts: the number of objects whose last
 * touch is at or after the object's own, counted by a Fenwick tree over touch times (1, 2, ...: a request's
 * blocks are touched tail first). The tree holds a window of times [base, base + w): a reuse reads it only
 * from a last touch on, and a last touch is read again only when its object's next access after its request
 * is a counted read, so when the window is full it moves on to the earliest such live touch, or doubles when
 * that frees less than half of it. Slot state: bit 0 a live last touch, bit 1 one a reuse may read. */

KS_EXPORT int64_t KS_NAME(ks_curves_lru_levels)(const ks_access_stream *stream, int64_t measure_from,
                                                int64_t first_window, ks_curve_out *out)
{
    const ID_T *obj = KS_IDS(stream, ID_T);
    const uint8_t *eligible = stream->eligible;
    const int64_t *next_use = stream->next_use, *req_start = stream->req_start;
    const int64_t num_requests = stream->num_requests, num_objects = stream->num_objects, never = stream->never;
    hist_t h;
    int rc = hist_init(&h);
    int64_t w = first_window > 0 ? first_window : 1;
    /* restrict: the byte stores into `state` would otherwise make every other array's pointer reload */
    ID_T *restrict last = calloc((size_t)(num_objects > 0 ? num_objects : 1), sizeof(ID_T)); /* 0: never */
    int32_t *restrict tree = calloc((size_t)(w + 1), sizeof(int32_t)); /* Fenwick over window positions 1..w */
    uint8_t *restrict state = calloc((size_t)w, 1);
    if (!last || !tree || !state)
        rc = KS_ENOMEM;
    int64_t base = 1, low = 1, clock = 0, wlive = 0; /* wlive: live last touches in the window */
    for (int64_t r = 0; r < num_requests && rc == 0; r++) {
        int64_t a = req_start[r], b = req_start[r + 1], m = 0;
        for (int64_t t = a; t < b; t++) {
            if (!eligible[t])
                break;
            int64_t lt = last[obj[t]];
            if (lt == 0)
                break;
            if (KS_UNLIKELY(lt < base)) {
                rc = KS_EBADSTREAM;
                break;
            }
            int64_t s = 0;
            for (int64_t i = lt - base; i > 0; i -= i & -i)
                s += tree[i];
            int64_t rank = wlive - s; /* objects touched at or after lt */
            if (rank > m) {
                m = rank;
                if ((rc = hist_reach(&h, m)) < 0)
                    break;
            }
            if (r >= measure_from) {
                int64_t *restrict count_m = h.count + m, *restrict possum_m = h.possum + m;
                ++*count_m;
                *possum_m += t - a;
            }
        }
        int64_t before = clock; /* touches of this request come after it */
        for (int64_t t = b - 1; t >= a && rc == 0; t--) {
            ID_T o = obj[t];
            int64_t lt = last[o];
            uint8_t read_later = next_use[t] != never;
            if (lt >= base) { /* lt == 0 (never touched) is below every base */
                int64_t j = lt - base;
                if (lt > before && (state[j] & 2))
                    read_later = 1; /* the object's access after this request is its later access's next use */
                state[j] = 0;
                for (int64_t i = j + 1; i <= w; i += i & -i)
                    tree[i]--;
                wlive--;
            }
            clock++;
            if (clock - base == w) { /* the window is full: move on to the earliest live touch read later */
                while (low < clock && (state[low - base] & 3) != 3)
                    low++;
                int64_t keep = clock - low;
                if (2 * keep > w) {
                    int64_t w2 = 2 * w;
                    uint8_t *st2 = calloc((size_t)w2, 1);
                    int32_t *tr2 = realloc(tree, (size_t)(w2 + 1) * sizeof(int32_t));
                    if (tr2)
                        tree = tr2;
                    if (!st2 || !tr2) {
                        free(st2);
                        rc = KS_ENOMEM;
                        break;
                    }
                    memcpy(st2, state + (low - base), (size_t)keep);
                    free(state);
                    state = st2;
                    w = w2;
                } else {
                    memmove(state, state + (low - base), (size_t)keep);
                    memset(state + keep, 0, (size_t)(w - keep));
                }
                base = low;
                wlive = 0;
                for (int64_t i = 1; i <= w; i++) { /* the Fenwick tree of the kept slots, in linear time */
                    tree[i] = state[i - 1] & 1;
                    wlive += tree[i];
                }
                for (int64_t i = 1; i <= w; i++) {
                    int64_t up = i + (i & -i);
                    if (up <= w)
                        tree[up] += tree[i];
                }
            }
            int64_t j = clock - base;
            state[j] = (uint8_t)(1 | (read_later << 1));
            for (int64_t i = j + 1; i <= w; i += i & -i)
                tree[i]++;
            wlive++;
            last[o] = (ID_T)clock;
        }
    }
    out->window = w;
    free(last);
    free(tree);
    free(state);
    return hist_hand_over(&h, rc, &out->count, &out->possum);
}
