/* The layout of the structures at the boundary (boundary.h), which the binding compares with its mirrors
 * when it declares an entry that takes them (kmesh_trace.native.kernels). */
#include "../layout_table.h"
#include "kernels.h"

#define KS_TYPE(T) LAYOUT_TYPE(#T, T)
#define KS_FIELD(T, F) LAYOUT_FIELD(#T, T, F)

static const layout_row ks_layout_rows[] = {
    KS_TYPE(ks_access_stream),
    KS_FIELD(ks_access_stream, obj32), KS_FIELD(ks_access_stream, obj64), KS_FIELD(ks_access_stream, eligible),
    KS_FIELD(ks_access_stream, next_use), KS_FIELD(ks_access_stream, req_start),
    KS_FIELD(ks_access_stream, num_requests), KS_FIELD(ks_access_stream, num_objects),
    KS_FIELD(ks_access_stream, never),

    KS_TYPE(ks_curve_out),
    KS_FIELD(ks_curve_out, count), KS_FIELD(ks_curve_out, possum), KS_FIELD(ks_curve_out, window),
    KS_FIELD(ks_curve_out, tracked),

    KS_TYPE(ks_stream_build_in),
    KS_FIELD(ks_stream_build_in, flat), KS_FIELD(ks_stream_build_in, starts), KS_FIELD(ks_stream_build_in, n_keep),
    KS_FIELD(ks_stream_build_in, n_elig), KS_FIELD(ks_stream_build_in, num_requests), KS_FIELD(ks_stream_build_in, n),
    KS_FIELD(ks_stream_build_in, key_xor), KS_FIELD(ks_stream_build_in, wide_table),
    KS_FIELD(ks_stream_build_in, never),

    KS_TYPE(ks_stream_build_out),
    KS_FIELD(ks_stream_build_out, eligible), KS_FIELD(ks_stream_build_out, obj32),
    KS_FIELD(ks_stream_build_out, obj64), KS_FIELD(ks_stream_build_out, next_use),

    KS_TYPE(ks_pool_stream),
    KS_FIELD(ks_pool_stream, obj32), KS_FIELD(ks_pool_stream, obj64), KS_FIELD(ks_pool_stream, req_start),
    KS_FIELD(ks_pool_stream, listed), KS_FIELD(ks_pool_stream, prompt_tokens),
    KS_FIELD(ks_pool_stream, output_tokens), KS_FIELD(ks_pool_stream, finish_ns), KS_FIELD(ks_pool_stream, arrival),
    KS_FIELD(ks_pool_stream, n_req), KS_FIELD(ks_pool_stream, timed), KS_FIELD(ks_pool_stream, block_size),
    KS_FIELD(ks_pool_stream, num_usable), KS_FIELD(ks_pool_stream, num_objects),

    KS_TYPE(ks_pool_result),
    KS_FIELD(ks_pool_result, hit_blocks), KS_FIELD(ks_pool_result, num_evictions), KS_FIELD(ks_pool_result, admitted),
    KS_FIELD(ks_pool_result, stalled), KS_FIELD(ks_pool_result, free_queue), KS_FIELD(ks_pool_result, free_queue_len),
    KS_FIELD(ks_pool_result, num_deferred),

    KS_TYPE(ks_pool_in),
    KS_FIELD(ks_pool_in, stream), KS_FIELD(ks_pool_in, has_holds), KS_FIELD(ks_pool_in, is_parent),
    KS_FIELD(ks_pool_in, release_after), KS_FIELD(ks_pool_in, parent_of), KS_FIELD(ks_pool_in, fam),
    KS_FIELD(ks_pool_in, num_families), KS_FIELD(ks_pool_in, expiry_ns), KS_FIELD(ks_pool_in, max_held),
    KS_FIELD(ks_pool_in, max_families),

    KS_TYPE(ks_pool_out),
    KS_FIELD(ks_pool_out, pool), KS_FIELD(ks_pool_out, records), KS_FIELD(ks_pool_out, num_records),

    KS_TYPE(ks_tiers_in),
    KS_FIELD(ks_tiers_in, stream), KS_FIELD(ks_tiers_in, tail32), KS_FIELD(ks_tiers_in, tail64),
    KS_FIELD(ks_tiers_in, tstart), KS_FIELD(ks_tiers_in, nt), KS_FIELD(ks_tiers_in, cap), KS_FIELD(ks_tiers_in, chunk),
    KS_FIELD(ks_tiers_in, retain), KS_FIELD(ks_tiers_in, refresh_on_hit), KS_FIELD(ks_tiers_in, write_through),
    KS_FIELD(ks_tiers_in, below), KS_FIELD(ks_tiers_in, on_evict), KS_FIELD(ks_tiers_in, n_on_evict),
    KS_FIELD(ks_tiers_in, chunk_bytes), KS_FIELD(ks_tiers_in, has_cost), KS_FIELD(ks_tiers_in, lat_ns),
    KS_FIELD(ks_tiers_in, dur0), KS_FIELD(ks_tiers_in, dur1), KS_FIELD(ks_tiers_in, singleflight),
    KS_FIELD(ks_tiers_in, any_gpu), KS_FIELD(ks_tiers_in, with_costs), KS_FIELD(ks_tiers_in, preload),
    KS_FIELD(ks_tiers_in, pstart), KS_FIELD(ks_tiers_in, early_prep), KS_FIELD(ks_tiers_in, prep_at),
    KS_FIELD(ks_tiers_in, prep_p), KS_FIELD(ks_tiers_in, n_prep), KS_FIELD(ks_tiers_in, children_of),
    KS_FIELD(ks_tiers_in, parent_of),

    KS_TYPE(ks_tiers_out),
    KS_FIELD(ks_tiers_out, pool), KS_FIELD(ks_tiers_out, hit), KS_FIELD(ks_tiers_out, wait0),
    KS_FIELD(ks_tiers_out, wait1), KS_FIELD(ks_tiers_out, marks), KS_FIELD(ks_tiers_out, num_reads),
    KS_FIELD(ks_tiers_out, read_bytes), KS_FIELD(ks_tiers_out, num_stores), KS_FIELD(ks_tiers_out, reads),
    KS_FIELD(ks_tiers_out, num_read_rows), KS_FIELD(ks_tiers_out, num_needed), KS_FIELD(ks_tiers_out, num_shared),

    KS_TYPE(ks_hybrid_pool_in),
    KS_FIELD(ks_hybrid_pool_in, G), KS_FIELD(ks_hybrid_pool_in, kind), KS_FIELD(ks_hybrid_pool_in, span),
    KS_FIELD(ks_hybrid_pool_in, n_sg), KS_FIELD(ks_hybrid_pool_in, sg_kind), KS_FIELD(ks_hybrid_pool_in, sg_span),
    KS_FIELD(ks_hybrid_pool_in, sg_start), KS_FIELD(ks_hybrid_pool_in, sg_gid), KS_FIELD(ks_hybrid_pool_in, n_req),
    KS_FIELD(ks_hybrid_pool_in, P), KS_FIELD(ks_hybrid_pool_in, Gout), KS_FIELD(ks_hybrid_pool_in, ph_off),
    KS_FIELD(ks_hybrid_pool_in, n_ph), KS_FIELD(ks_hybrid_pool_in, ph), KS_FIELD(ks_hybrid_pool_in, oh_off),
    KS_FIELD(ks_hybrid_pool_in, n_oh), KS_FIELD(ks_hybrid_pool_in, oh), KS_FIELD(ks_hybrid_pool_in, K),
    KS_FIELD(ks_hybrid_pool_in, arrival), KS_FIELD(ks_hybrid_pool_in, finish), KS_FIELD(ks_hybrid_pool_in, timed),
    KS_FIELD(ks_hybrid_pool_in, tab_cap), KS_FIELD(ks_hybrid_pool_in, maxb), KS_FIELD(ks_hybrid_pool_in, bs),
    KS_FIELD(ks_hybrid_pool_in, N), KS_FIELD(ks_hybrid_pool_in, retention),

    KS_TYPE(ks_hybrid_pool_out),
    KS_FIELD(ks_hybrid_pool_out, hit_tokens), KS_FIELD(ks_hybrid_pool_out, num_evictions),
    KS_FIELD(ks_hybrid_pool_out, admitted), KS_FIELD(ks_hybrid_pool_out, stalled),
    KS_FIELD(ks_hybrid_pool_out, free_queue), KS_FIELD(ks_hybrid_pool_out, free_queue_len),
    KS_FIELD(ks_hybrid_pool_out, num_deferred),

    KS_TYPE(ks_shards_in),
    KS_FIELD(ks_shards_in, hashes), KS_FIELD(ks_shards_in, offsets), KS_FIELD(ks_shards_in, n_keep),
    KS_FIELD(ks_shards_in, n_elig), KS_FIELD(ks_shards_in, num_rows), KS_FIELD(ks_shards_in, seed),
    KS_FIELD(ks_shards_in, threshold),

    KS_TYPE(ks_shards_out),
    KS_FIELD(ks_shards_out, kept), KS_FIELD(ks_shards_out, eligible), KS_FIELD(ks_shards_out, bucket),
    KS_FIELD(ks_shards_out, row_kept), KS_FIELD(ks_shards_out, num_kept),
};

/* Row i of the layout table: 0, or -1 past its end. */
KS_EXPORT int64_t ks_layout(int64_t i, const char **type, const char **field, uint64_t *offset, uint64_t *size)
{
    return i < 0 ? -1 : layout_row_at(ks_layout_rows, sizeof ks_layout_rows / sizeof ks_layout_rows[0], (uint64_t)i,
                                      type, field, offset, size);
}
