/* The prefix hashes of a Bailian request's block ids (datasets/importers/bailian.py, chain_hashes): h_i is the
 * 64-bit BLAKE2b (RFC 7693, unkeyed, 8-byte digest) of the 16 bytes h_{i-1} || id_i, both little-endian,
 * h_{-1} = 0, read back as a little-endian integer -- what hashlib.blake2b(..., digest_size=8) gives, one
 * compression of one block per id. */
#include "kernels.h"

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr(uint64_t x, int n)
{
    return (x >> n) | (x << (64 - n));
}

#define G(a, b, c, d, x, y)                                                                                     \
    do {                                                                                                        \
        v[a] = v[a] + v[b] + (x);                                                                               \
        v[d] = rotr(v[d] ^ v[a], 32);                                                                           \
        v[c] = v[c] + v[d];                                                                                     \
        v[b] = rotr(v[b] ^ v[c], 24);                                                                           \
        v[a] = v[a] + v[b] + (y);                                                                               \
        v[d] = rotr(v[d] ^ v[a], 16);                                                                           \
        v[c] = v[c] + v[d];                                                                                     \
        v[b] = rotr(v[b] ^ v[c], 63);                                                                           \
    } while (0)

/* The digest (as a little-endian integer) of the one 16-byte message parent || id. */
static uint64_t blake2b64(uint64_t parent, uint64_t id)
{
    uint64_t m[16] = {parent, id};
    uint64_t h0 = IV[0] ^ 0x01010008ULL; /* digest length 8, no key, fanout 1, depth 1 */
    uint64_t v[16] = {h0, IV[1], IV[2], IV[3], IV[4], IV[5], IV[6], IV[7],
                      IV[0], IV[1], IV[2], IV[3], IV[4] ^ 16, IV[5], ~IV[6], IV[7]}; /* 16 bytes, last block */
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    return h0 ^ v[0] ^ v[8];
}

/* out[i] = the chained hash of ids[0..i] (one request's block ids). */
KS_EXPORT void ks_bailian_chain(const uint64_t *ids, int64_t n, uint64_t *out)
{
    uint64_t parent = 0;
    for (int64_t i = 0; i < n; i++)
        out[i] = parent = blake2b64(parent, ids[i]);
}
