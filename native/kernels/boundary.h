/* The structures at the boundary: every kernel entry with more than a few parameters takes its inputs as one
 * structure and writes its results into another, each mirrored once in Python (a `kernels.Struct`, next to
 * the module that calls the kernel) and compared field by field with ks_layout()'s table (layout.c) when
 * the entry is declared, so a stale build or an edit on one side only is refused, never misread.
 *
 * Conventions: pointers are the numpy arrays the caller made (it checked their dtype and contiguity and
 * keeps them alive during the call); every scalar is an int64_t (a flag is 0 or 1), so no structure has
 * padding; an output structure holds the arrays the kernel fills (the caller allocated them) and the
 * scalars it writes. Field names are the Python mirror's. */
#ifndef KMESH_BOUNDARY_H
#define KMESH_BOUNDARY_H

#include <stdint.h>

/* ---- the access stream as the policies and the curves read it (policies_body.h, curves.c) ------------ */

/* Accesses obj[req_start[r]:req_start[r + 1]] per request (ids of the kernel's width: obj32 for the _i32
 * entries and ks_curves_belady_levels, obj64 for the _i64 ones; the other NULL), the eligible (counted)
 * ones, each access's next eligible use (`never`: none); num_objects dense ids. */
typedef struct ks_access_stream {
    const int32_t *obj32;
    const int64_t *obj64;
    const uint8_t *eligible;
    const int64_t *next_use, *req_start;
    int64_t num_requests, num_objects, never;
} ks_access_stream;

/* A curve's histograms (count, possum: malloc'd, free each with ks_curves_free; the entry returns their
 * length) and the final sizes of its trees (window; tracked: the belady curve's capacities). */
typedef struct ks_curve_out {
    int64_t *count, *possum;
    int64_t window, tracked;
} ks_curve_out;

/* ---- the stream's construction (stream_index.c) -------------------------------------------------------- */

/* Request r's accesses are flat[starts[r] + j] for j < n_keep[r] (num_requests requests, n accesses in
 * all); eligible: the first n_elig[r] of each (NULL: the flags are read from the output's eligible);
 * hashes compared as hash ^ key_xor; wide_table: 64-bit table slots; never: "no next use". */
typedef struct ks_stream_build_in {
    const uint64_t *flat;
    const int64_t *starts, *n_keep, *n_elig;
    int64_t num_requests, n;
    uint64_t key_xor;
    int64_t wide_table, never;
} ks_stream_build_in;

/* Per access: the eligible flags (written with n_elig, else read), the object ids (obj32, else obj64),
 * the next uses. */
typedef struct ks_stream_build_out {
    uint8_t *eligible;
    int32_t *obj32;
    int64_t *obj64, *next_use;
} ks_stream_build_out;

/* ---- a request stream as the block pool replays it (pool.c, tiers.c) --------------------------------- */

/* Accesses obj[req_start[i]:req_start[i + 1]] per request (its listed prompt hashes, then its output
 * hashes; ids int32 or int64, the other pointer NULL), its listed prompt hashes, tokens and times (timed:
 * admissions in arrival order at their times, else in sequence), through a pool of num_usable blocks over
 * num_objects dense ids. */
typedef struct ks_pool_stream {
    const int32_t *obj32;
    const int64_t *obj64;
    const int64_t *req_start, *listed, *prompt_tokens, *output_tokens, *finish_ns, *arrival;
    int64_t n_req, timed, block_size, num_usable, num_objects;
} ks_pool_stream;

/* Per request: its hit blocks, evictions, admitted and stalled flags; the final free queue (NULL: not
 * wanted) and its length; the deferred admissions. */
typedef struct ks_pool_result {
    int64_t *hit_blocks, *num_evictions;
    uint8_t *admitted, *stalled;
    int64_t *free_queue;
    int64_t free_queue_len, num_deferred;
} ks_pool_result;

/* ks_pool_replay: the stream and the family holds (has_holds: per request is_parent, release_after,
 * parent_of, fam, family ids < num_families; the caps -1: none). */
typedef struct ks_pool_in {
    ks_pool_stream stream;
    int64_t has_holds;
    const uint8_t *is_parent;
    const int64_t *release_after, *parent_of, *fam;
    int64_t num_families, expiry_ns, max_held, max_families;
} ks_pool_in;

/* The pool's results and the hold records (KP_NUM_RECORD_ROWS x n_req, num_records of them). */
typedef struct ks_pool_out {
    ks_pool_result pool;
    int64_t *records;
    int64_t num_records;
} ks_pool_out;

/* ---- the tier model (tiers.c) -------------------------------------------------------------------------- */

/* The stream (num_objects: every id, the tails' and the preloads' included); each request's prompt hashes
 * past its listed ones, tail[tstart[i]:tstart[i + 1]]; per tier (nt): the configuration; the preloaded ids
 * per tier (preload[pstart[ti]:pstart[ti + 1]]); early preparation's schedule (prep_at, prep_p: n_prep
 * entries; children_of, parent_of per request). */
typedef struct ks_tiers_in {
    ks_pool_stream stream;
    const int32_t *tail32;
    const int64_t *tail64, *tstart;
    int64_t nt;
    const int64_t *cap, *chunk;
    const uint8_t *retain, *refresh_on_hit, *write_through;
    const int64_t *below, *on_evict;
    int64_t n_on_evict;
    const int64_t *chunk_bytes;
    const uint8_t *has_cost;
    const int64_t *lat_ns, *dur0, *dur1;
    int64_t singleflight, any_gpu, with_costs;
    const int64_t *preload, *pstart;
    int64_t early_prep;
    const int64_t *prep_at, *prep_p;
    int64_t n_prep;
    const int64_t *children_of, *parent_of;
} ks_tiers_in;

/* The pool's results; hits per tier (nt + 1 x n_req), the restore waits, the store marks per request; per
 * tier the reads, their bytes, the stores; the read rows (malloc'd rows of 5, free with ks_tiers_free:
 * num_read_rows of them); the distinct blocks needed and the shared reads. */
typedef struct ks_tiers_out {
    ks_pool_result pool;
    int64_t *hit;
    double *wait0, *wait1;
    int64_t *marks, *num_reads, *read_bytes, *num_stores;
    int64_t *reads;
    int64_t num_read_rows, num_needed, num_shared;
} ks_tiers_out;

/* ---- the hybrid pool (hybrid_pool.c) --------------------------------------------------------------------- */

/* G groups (kind, span), the spec groups (sg_kind, sg_span; sg_start: n_sg + 1 offsets into sg_gid); per
 * request prompt tokens P, output tokens Gout, its prompt hash ids (ph at ph_off, n_ph of them) and output
 * hash ids (oh at oh_off, n_oh; -1: unknown), hash ids < K, arrival and finish (timed), tab_cap the most
 * blocks one of its tables holds; maxb the most prompt blocks of a request; bs tokens a block; N usable
 * blocks; retention vLLM's prefix_cache_retention_interval (-1: none). */
typedef struct ks_hybrid_pool_in {
    int64_t G;
    const int64_t *kind, *span;
    int64_t n_sg;
    const int64_t *sg_kind, *sg_span, *sg_start, *sg_gid;
    int64_t n_req;
    const int64_t *P, *Gout, *ph_off, *n_ph, *ph, *oh_off, *n_oh, *oh;
    int64_t K;
    const int64_t *arrival, *finish;
    int64_t timed;
    const int64_t *tab_cap;
    int64_t maxb, bs, N, retention;
} ks_hybrid_pool_in;

/* Per request the hit tokens, evictions, admitted and stalled flags; the final free queue (N values) and its
 * length; the deferred admissions. */
typedef struct ks_hybrid_pool_out {
    int64_t *hit_tokens, *num_evictions;
    uint8_t *admitted, *stalled;
    int64_t *free_queue;
    int64_t free_queue_len, num_deferred;
} ks_hybrid_pool_out;

/* ---- a spatial sample taken at read time (shards.c) ---------------------------------------------------- */

/* One piece of the input: row r lists hashes[offsets[r]:offsets[r + 1]], of which the first n_keep[r] are
 * accesses and the first n_elig[r] of those eligible (num_rows rows). An access is kept when its hash's
 * bucket (the top 24 bits of splitmix64's finaliser of ((hash ^ seed) + 1) * golden) is below threshold. */
typedef struct ks_shards_in {
    const uint64_t *hashes;
    const int64_t *offsets, *n_keep, *n_elig;
    int64_t num_rows;
    uint64_t seed;
    int64_t threshold;
} ks_shards_in;

/* The kept accesses in order (room for every access of the piece): their hashes, eligible flags and
 * buckets (bucket NULL: not wanted); the kept accesses per row; how many were kept. */
typedef struct ks_shards_out {
    uint64_t *kept;
    uint8_t *eligible;
    uint32_t *bucket;
    int64_t *row_kept;
    int64_t num_kept;
} ks_shards_out;

#endif
