/* Flattening a workload into its access stream (oracle/stream.py, AccessStream.from_arrays). */
#include "kernels.h"

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

/* From `order`, a stable argsort of `hashes`: obj[t] = the rank of hashes[t] among the distinct hashes
 * (np.unique's numbering) and next_use[t] = the position of the next access of the same hash when that
 * access is eligible, else `never`. Returns the number of distinct hashes. */
KS_EXPORT int64_t ks_stream_dense_ids(const uint64_t *hashes, const int64_t *order, int64_t n, const uint8_t *eligible,
                                      int32_t *obj32, int64_t *obj64, int64_t *next_use, int64_t never)
{
    int64_t rank = -1;
    for (int64_t k = 0; k < n; k++) {
        int64_t t = order[k];
        if (k == 0 || hashes[t] != hashes[order[k - 1]])
            rank++;
        if (obj32)
            obj32[t] = (int32_t)rank;
        else
            obj64[t] = rank;
        int64_t nxt = never;
        if (k + 1 < n) {
            int64_t u = order[k + 1];
            if (hashes[u] == hashes[t] && eligible[u])
                nxt = u;
        }
        next_use[t] = nxt;
    }
    return rank + 1;
}
