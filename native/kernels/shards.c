/* A spatial sample (SHARDS) taken while the input is read (oracle/shards.py): each access of a piece is kept
 * or dropped by the hash of its block hash alone, before anything about it is stored, so what the caller
 * holds is the sample's and never the whole stream's.
 *
 * ks_shards_sample: one piece (ks_shards_in, boundary.h) into its kept accesses (ks_shards_out). A block's
 * bucket is the top 24 bits of splitmix64's finaliser of ((hash ^ seed) + 1) * 0x9E3779B97F4A7C15, the
 * bucket oracle/sampling.py's `object_buckets` gives dense id `hash ^ seed`: the same block is in the same
 * bucket in every piece, every run and on every machine. Returns the accesses kept. */
#include "kernels.h"

#define KS_GOLDEN 0x9E3779B97F4A7C15ULL

static inline uint32_t block_bucket(uint64_t hash, uint64_t seed)
{
    uint64_t z = ((hash ^ seed) + 1) * KS_GOLDEN;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    return (uint32_t)(z >> 40);
}

KS_EXPORT int64_t ks_shards_sample(const ks_shards_in *in, ks_shards_out *out)
{
    const uint64_t seed = in->seed;
    const uint32_t threshold = (uint32_t)in->threshold;
    int64_t k = 0;
    for (int64_t r = 0; r < in->num_rows; r++) {
        const uint64_t *h = in->hashes + in->offsets[r];
        const int64_t n_keep = in->n_keep[r], n_elig = in->n_elig[r];
        const int64_t before = k;
        for (int64_t j = 0; j < n_keep; j++) {
            uint32_t b = block_bucket(h[j], seed);
            if (b >= threshold)
                continue;
            out->kept[k] = h[j];
            out->eligible[k] = j < n_elig;
            if (out->bucket)
                out->bucket[k] = b;
            k++;
        }
        out->row_kept[r] = k - before;
    }
    out->num_kept = k;
    return k;
}
