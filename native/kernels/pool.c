/* The `vllm` block-pool model's replay, family holds included (oracle/blockpool_compiled.py): the steps of
 * pool_steps.h request by request. */
#include "pool_steps.h"

/* Replay in->stream (struct ks_pool_in in boundary.h: the stream, the holds and their caps); writes the
 * per-request results, the final free queue and the hold records into *out. Returns 0 or KS_ENOMEM. */
KS_EXPORT int64_t ks_pool_replay(const ks_pool_in *in, ks_pool_out *out)
{
    const ks_pool_stream s = in->stream;
    const ks_pool_result r = out->pool;
    kp_engine e = {
        .obj32 = s.obj32, .obj64 = s.obj64, .req_start = s.req_start, .listed = s.listed,
        .prompt_tokens = s.prompt_tokens, .output_tokens = s.output_tokens, .finish_ns = s.finish_ns,
        .arrival = s.arrival, .n_req = s.n_req, .block_size = s.block_size, .timed = s.timed != 0,
        .has_holds = in->has_holds != 0, .is_parent = in->is_parent, .release_after = in->release_after,
        .parent_of = in->parent_of, .fam = in->fam, .expiry_ns = in->expiry_ns, .max_held = in->max_held,
        .max_fam = in->max_families,
    };
    if (!kp_engine_init(&e, s.num_usable, s.num_objects, in->num_families, out->records)) {
        kp_engine_free(&e);
        return KS_ENOMEM;
    }
    for (int64_t i = 0; i < s.n_req; i++) {
        r.hit_blocks[i] = r.num_evictions[i] = 0;
        r.admitted[i] = r.stalled[i] = 0;
        kp_admission ad = kp_arrive(&e, i);
        if (ad.outcome == KP_REFUSED)
            continue;
        int64_t nk;
        r.num_evictions[i] = kp_allocate_request(&e, i, &ad, NULL, &nk);
        r.hit_blocks[i] = ad.nh;
        r.admitted[i] = 1;
        r.stalled[i] = ad.outcome == KP_STALLS;
        kp_end_admission(&e, i, &ad);
    }
    kp_drain(&e);
    out->pool.free_queue_len = r.free_queue ? kp_free_queue(&e, r.free_queue) : 0;
    out->pool.num_deferred = e.num_deferred;
    out->num_records = e.n_records;
    kp_engine_free(&e);
    return 0;
}
