/* The per-capacity policy kernels (oracle/policies/lru.py, belady.py, belady_prefix.py), included by
 * policies.c once per id width: ID_T is the type of object ids and of next-use keys (int32_t while the
 * stream has fewer than 2^30 accesses, so that a key n + t still fits), KS_NAME(x) names this width's
 * functions. Each replays the stream (struct ks_access_stream, boundary.h) at one capacity, fills hits[r]
 * (the request's hit blocks) and returns the evictions, or KS_ENOMEM. */

/* ---- a max-heap of objects by key; where[o] = o's slot or -1 ----------------------------------------- */
/* (Arrays are `restrict` throughout: each is its own allocation, and without it every byte store into
 * `resident` would make the compiler reload the others.) */

/* Slot i takes the entry of slot j. */
static inline void KS_NAME(heap_move)(ID_T *restrict key, ID_T *restrict who, ID_T *restrict where, int64_t i, int64_t j)
{
    key[i] = key[j];
    who[i] = who[j];
    where[who[i]] = (ID_T)i;
}

static inline void KS_NAME(heap_set)(ID_T *restrict key, ID_T *restrict who, ID_T *restrict where, int64_t i, ID_T k, ID_T o)
{
    key[i] = k;
    who[i] = o;
    where[o] = (ID_T)i;
}

static inline void KS_NAME(sift_up)(ID_T *restrict key, ID_T *restrict who, ID_T *restrict where, int64_t i)
{
    ID_T k = key[i], o = who[i];
    while (i > 0) {
        int64_t p = (i - 1) >> 1;
        if (key[p] >= k)
            break;
        KS_NAME(heap_move)(key, who, where, i, p);
        i = p;
    }
    KS_NAME(heap_set)(key, who, where, i, k, o);
}

static inline void KS_NAME(sift_down)(ID_T *restrict key, ID_T *restrict who, ID_T *restrict where, int64_t i, int64_t size)
{
    ID_T k = key[i], o = who[i];
    for (int64_t c = 2 * i + 1; c < size; c = 2 * i + 1) {
        if (c + 1 < size && key[c + 1] > key[c])
            c++;
        if (key[c] <= k)
            break;
        KS_NAME(heap_move)(key, who, where, i, c);
        i = c;
    }
    KS_NAME(heap_set)(key, who, where, i, k, o);
}

static inline int64_t KS_NAME(heap_remove)(ID_T *restrict key, ID_T *restrict who, ID_T *restrict where, ID_T o, int64_t size)
{
    int64_t i = where[o];
    where[o] = -1;
    size--;
    if (i < size) {
        ID_T m = who[size];
        KS_NAME(heap_move)(key, who, where, i, size);
        KS_NAME(sift_up)(key, who, where, i);
        KS_NAME(sift_down)(key, who, where, where[m], size);
    }
    return size;
}

static inline int64_t KS_NAME(heap_push)(ID_T *restrict key, ID_T *restrict who, ID_T *restrict where, ID_T o, ID_T k, int64_t size)
{
    KS_NAME(heap_set)(key, who, where, size, k, o);
    KS_NAME(sift_up)(key, who, where, size);
    return size + 1;
}

/* A prefix lookup: the request's leading eligible reads [a, b) that are resident. */
static inline int64_t KS_NAME(prefix_hits)(const ID_T *obj, const uint8_t *eligible, const uint8_t *resident,
                                           int64_t a, int64_t b)
{
    int64_t h = 0;
    for (int64_t t = a; t < b && eligible[t] && resident[obj[t]]; t++)
        h++;
    return h;
}

/* ---- lru: a doubly linked recency list; node num_objects is the sentinel (next: most recent) ---------- */

KS_EXPORT int64_t KS_NAME(ks_policies_lru)(const ks_access_stream *stream, int64_t capacity, int64_t *hits)
{
    const ID_T *obj = KS_IDS(stream, ID_T);
    const uint8_t *eligible = stream->eligible;
    const int64_t *req_start = stream->req_start, num_requests = stream->num_requests;
    const int64_t num_objects = stream->num_objects;
    ID_T s = (ID_T)num_objects;
    ID_T *restrict prev = malloc((size_t)(num_objects + 1) * sizeof(ID_T));
    ID_T *restrict nxt = malloc((size_t)(num_objects + 1) * sizeof(ID_T));
    uint8_t *restrict resident = calloc((size_t)(num_objects > 0 ? num_objects : 1), 1);
    int64_t size = 0, evictions = 0;
    if (!prev || !nxt || !resident) {
        evictions = KS_ENOMEM;
        goto done;
    }
    prev[s] = nxt[s] = s;
    for (int64_t r = 0; r < num_requests; r++) {
        int64_t a = req_start[r], b = req_start[r + 1];
        hits[r] = KS_NAME(prefix_hits)(obj, eligible, resident, a, b);
        if (capacity <= 0)
            continue;
        for (int64_t t = b - 1; t >= a; t--) {
            ID_T o = obj[t];
            if (resident[o]) {
                nxt[prev[o]] = nxt[o];
                prev[nxt[o]] = prev[o];
            } else {
                if (size == capacity) {
                    ID_T victim = prev[s];
                    nxt[prev[victim]] = s;
                    prev[s] = prev[victim];
                    resident[victim] = 0;
                    evictions++;
                } else {
                    size++;
                }
                resident[o] = 1;
            }
            ID_T first = nxt[s];
            nxt[o] = first;
            prev[o] = s;
            prev[first] = o;
            nxt[s] = o;
        }
    }
done:
    free(prev);
    free(nxt);
    free(resident);
    return evictions;
}

/* ---- belady: a max-heap of resident blocks by next counted use ------------------------------------------ */

KS_EXPORT int64_t KS_NAME(ks_policies_belady)(const ks_access_stream *stream, int64_t capacity, int64_t *hits)
{
    const ID_T *obj = KS_IDS(stream, ID_T);
    const uint8_t *eligible = stream->eligible;
    const int64_t *next_use = stream->next_use, *req_start = stream->req_start;
    const int64_t num_requests = stream->num_requests, num_objects = stream->num_objects, never = stream->never;
    int64_t cap = capacity > 0 ? capacity : 0, slots = cap < num_objects ? cap : num_objects;
    ID_T *restrict key = malloc((size_t)(slots > 0 ? slots : 1) * sizeof(ID_T));
    ID_T *restrict who = malloc((size_t)(slots > 0 ? slots : 1) * sizeof(ID_T));
    ID_T *restrict where = malloc((size_t)(num_objects > 0 ? num_objects : 1) * sizeof(ID_T));
    int64_t size = 0, evictions = 0;
    if (!key || !who || !where) {
        evictions = KS_ENOMEM;
        goto done;
    }
    for (int64_t i = 0; i < num_objects; i++)
        where[i] = -1;
    for (int64_t r = 0; r < num_requests; r++) {
        int64_t h = 0;
        for (int64_t t = req_start[r]; t < req_start[r + 1]; t++) {
            ID_T o = obj[t];
            int64_t nu = next_use[t];
            int64_t i = where[o];
            if (i >= 0) {
                h += eligible[t] != 0;
                if (nu == never) { /* no counted future: drop it now, freeing its slot */
                    size = KS_NAME(heap_remove)(key, who, where, o, size);
                } else {
                    key[i] = (ID_T)nu;
                    KS_NAME(sift_up)(key, who, where, i);
                }
            } else if (nu != never && cap > 0) {
                if (size < cap) {
                    size = KS_NAME(heap_push)(key, who, where, o, (ID_T)nu, size);
                } else if (key[0] > nu) {
                    where[who[0]] = -1;
                    evictions++;
                    key[0] = (ID_T)nu;
                    who[0] = o;
                    KS_NAME(sift_down)(key, who, where, 0, size);
                }
            }
        }
        hits[r] = h;
    }
done:
    free(key);
    free(who);
    free(where);
    return evictions;
}

/* ---- belady-prefix: a prefix tree, a max-heap of resident leaves by effective next use ----------------- */

KS_EXPORT int64_t KS_NAME(ks_policies_belady_prefix)(const ks_access_stream *stream, int64_t capacity,
                                                     int64_t *hits)
{
    const ID_T *obj = KS_IDS(stream, ID_T);
    const uint8_t *eligible = stream->eligible;
    const int64_t *next_use = stream->next_use, *req_start = stream->req_start;
    const int64_t num_requests = stream->num_requests, num_objects = stream->num_objects, never = stream->never;
    int64_t n = req_start[num_requests], m = num_objects > 0 ? num_objects : 1;
    int64_t cap = capacity > 0 ? capacity : 0, slots = cap < m ? cap : m;
    uint8_t *restrict resident = calloc((size_t)m, 1);
    ID_T *restrict nkey = calloc((size_t)m, sizeof(ID_T));       /* effective next use of a resident block */
    ID_T *restrict parent_of = malloc((size_t)m * sizeof(ID_T)); /* its parent when admitted (-1: a root) */
    ID_T *restrict children = calloc((size_t)m, sizeof(ID_T));   /* its resident children */
    ID_T *restrict where = malloc((size_t)m * sizeof(ID_T));     /* its slot in the heap of leaves, -1: none */
    ID_T *restrict key = malloc((size_t)(slots > 0 ? slots : 1) * sizeof(ID_T));
    ID_T *restrict who = malloc((size_t)(slots > 0 ? slots : 1) * sizeof(ID_T));
    int64_t heap = 0, size = 0, evictions = 0;
    if (!resident || !nkey || !parent_of || !children || !where || !key || !who) {
        evictions = KS_ENOMEM;
        goto done;
    }
    for (int64_t i = 0; i < num_objects; i++)
        where[i] = parent_of[i] = -1;
    for (int64_t r = 0; r < num_requests; r++) {
        int64_t a = req_start[r], b = req_start[r + 1];
        hits[r] = KS_NAME(prefix_hits)(obj, eligible, resident, a, b);
        if (cap == 0)
            continue;
        for (int64_t t = a; t < b; t++) {
            ID_T o = obj[t];
            int64_t e = next_use[t];
            ID_T k = (ID_T)(e != never ? e : n + t); /* no counted future: after every block that has one */
            ID_T parent = t > a ? obj[t - 1] : -1;
            if (resident[o]) {
                nkey[o] = k;
                if (where[o] >= 0) {
                    int64_t i = where[o];
                    key[i] = k;
                    KS_NAME(sift_up)(key, who, where, i);
                    KS_NAME(sift_down)(key, who, where, where[o], heap);
                }
                continue;
            }
            if (parent >= 0 && !resident[parent])
                continue;
            if (size == cap) {
                ID_T victim = -1;
                if (heap > 0 && who[0] != parent) {
                    victim = who[0];
                } else {
                    for (int64_t c = 1; c <= 2; c++)
                        if (c < heap && (victim < 0 || key[c] > nkey[victim]))
                            victim = who[c];
                }
                if (victim < 0 || nkey[victim] <= k)
                    continue; /* the incoming block's next use is the farthest: not admitted */
                heap = KS_NAME(heap_remove)(key, who, where, victim, heap);
                resident[victim] = 0;
                size--;
                evictions++;
                ID_T vp = parent_of[victim];
                if (vp >= 0) {
                    children[vp]--;
                    if (children[vp] == 0 && resident[vp])
                        heap = KS_NAME(heap_push)(key, who, where, vp, nkey[vp], heap);
                }
            }
            resident[o] = 1;
            nkey[o] = k;
            parent_of[o] = parent;
            children[o] = 0;
            size++;
            heap = KS_NAME(heap_push)(key, who, where, o, k, heap);
            if (parent >= 0) {
                children[parent]++;
                if (children[parent] == 1 && where[parent] >= 0)
                    heap = KS_NAME(heap_remove)(key, who, where, parent, heap);
            }
        }
    }
done:
    free(resident);
    free(nkey);
    free(parent_of);
    free(children);
    free(where);
    free(key);
    free(who);
    return evictions;
}
