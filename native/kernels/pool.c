/* The `vllm` block-pool model's replay, family holds included (oracle/blockpool_compiled.py): the steps of
 * pool_steps.h request by request. */
#include "pool_steps.h"

/* Replay the stream (obj32 or obj64: the accesses' dense hash ids; per request req_start (n_req + 1),
 * listed, prompt_tokens, output_tokens, finish_ns, arrival) through a pool of num_usable blocks.
 * Holds (has_holds): per request is_parent, release_after, parent_of, fam (family ids < num_families),
 * the caps (-1: none). Writes per request hit_blocks, num_evictions, admitted, stalled; the final free
 * queue into free_queue (num_usable values; NULL: not wanted); the hold records into records (KP_NUM_RECORD_ROWS x n_req);
 * out[0..2] = free queue length, deferrals, records. Returns 0 or KS_ENOMEM. */
KS_EXPORT int64_t ks_pool_replay(const int32_t *obj32, const int64_t *obj64, const int64_t *req_start,
                                 const int64_t *listed, const int64_t *prompt_tokens, const int64_t *output_tokens,
                                 const int64_t *finish_ns, const int64_t *arrival, int64_t n_req, int32_t timed,
                                 int64_t block_size, int64_t num_usable, int64_t num_objects, int32_t has_holds,
                                 const uint8_t *is_parent, const int64_t *release_after, const int64_t *parent_of,
                                 const int64_t *fam, int64_t num_families, int64_t expiry_ns, int64_t max_held,
                                 int64_t max_families, int64_t *hit_blocks, int64_t *num_evictions, uint8_t *admitted,
                                 uint8_t *stalled, int64_t *free_queue, int64_t *records, int64_t *out)
{
    kp_engine e = {
        .obj32 = obj32, .obj64 = obj64, .req_start = req_start, .listed = listed, .prompt_tokens = prompt_tokens,
        .output_tokens = output_tokens, .finish_ns = finish_ns, .arrival = arrival, .n_req = n_req,
        .block_size = block_size, .timed = timed != 0, .has_holds = has_holds != 0, .is_parent = is_parent,
        .release_after = release_after, .parent_of = parent_of, .fam = fam, .expiry_ns = expiry_ns,
        .max_held = max_held, .max_fam = max_families,
    };
    if (!kp_engine_init(&e, num_usable, num_objects, num_families, records)) {
        kp_engine_free(&e);
        return KS_ENOMEM;
    }
    for (int64_t i = 0; i < n_req; i++) {
        hit_blocks[i] = num_evictions[i] = 0;
        admitted[i] = stalled[i] = 0;
        kp_admission ad = kp_arrive(&e, i);
        if (ad.outcome == KP_REFUSED)
            continue;
        int64_t nk;
        num_evictions[i] = kp_allocate_request(&e, i, &ad, NULL, &nk);
        hit_blocks[i] = ad.nh;
        admitted[i] = 1;
        stalled[i] = ad.outcome == KP_STALLS;
        kp_end_admission(&e, i, &ad);
    }
    kp_drain(&e);
    out[0] = free_queue ? kp_free_queue(&e, free_queue) : 0;
    out[1] = e.num_deferred;
    out[2] = e.n_records;
    kp_engine_free(&e);
    return 0;
}
