"""Row building: what one request or one pool event becomes in the trace, tied to the schema.

Rows travel from the engine thread to the writer thread as plain tuples in a table's column order.
The layouts below name those orders, and this module refuses to import if one differs from the
schema (`kmesh_trace/schema.py`), so a reordered or renamed column fails loudly instead of shifting
values. Conversions the engine thread need not pay for (block-hash bytes to the 64-bit ints vLLM's
KV events publish) happen in the writer thread (`BLOCK_EVENT_CONVERSIONS`).

Also here: the one parser of the caller's `vllm_xargs` keys (`declared`), the caller-id rule
(`caller_id_of`), the per-request state the hooks keep (`RequestState`) and the invocation row.
"""

from __future__ import annotations

from typing import Any

from kmesh_trace import schema

INVOCATION_LAYOUT = ("request_id", "caller_request_id", "seq", "family_id", "parent_id", "num_expected_children",
                     "num_prompt_tokens", "num_output_tokens", "prompt_token_ids", "output_token_ids",
                     "prompt_block_hashes", "arrival_ns", "first_scheduled_ns", "first_token_ns", "finish_ns", "status",
                     "num_cached_tokens", "num_external_tokens", "num_preemptions")
BLOCK_EVENT_LAYOUT = ("seq", "ts_ns", "step", "event", "block_id", "ref_cnt", "block_hash", "parent_block_hash",
                      "request_id", "num_free_blocks", "kv_group")
TRANSFER_LAYOUT = ("request_id", "direction", "num_tokens", "num_blocks", "num_bytes", "start_ns", "finish_ns", "status",
                   "connector")
STEP_LAYOUT = ("step", "start_ns", "finish_ns", "num_scheduled_tokens", "num_prefill_tokens", "num_decode_tokens",
               "batch_size", "num_prefill_requests", "num_decode_requests", "num_context_tokens", "num_preempted",
               "num_waiting")
LAYOUTS = {"invocations": INVOCATION_LAYOUT, "block_events": BLOCK_EVENT_LAYOUT, "transfers": TRANSFER_LAYOUT,
           "steps": STEP_LAYOUT}


def _check_layouts() -> None:
    """Each layout is the schema's columns in order; it may stop before trailing nullable columns the
    capture never fills (e.g. invocations' agent_id and agent_type, which only imports fill)."""
    for table, layout in LAYOUTS.items():
        t = schema.table(table)
        want = tuple(t.column_names)
        rest = want[len(layout):]
        if layout != want[:len(layout)] or not all(t.column(c).nullable for c in rest):
            raise ImportError(f"kmesh_trace.capture.rows: the {table} row layout {layout} does not match the schema's "
                              f"columns {want}; update the layout and every row built with it")


_check_layouts()

# vLLM RequestStatus names -> the contract's terminal statuses.
STATUS = {
    "FINISHED_STOPPED": "finished",
    "FINISHED_REPETITION": "finished",
    "FINISHED_LENGTH_CAPPED": "length_capped",
    "FINISHED_IGNORED": "length_capped",  # vLLM reports it as finish reason "length"
    "FINISHED_ABORTED": "aborted",
    "FINISHED_ERROR": "error",
}


# ---- hashes (converted in the writer thread) ------------------------------------------------------

def hash64(key: bytes) -> int:
    """Low 64 bits of a block hash (a BlockHashWithGroupId: hash bytes + 4-byte group id), as vLLM's KV events publish it."""
    return int.from_bytes(key[-12:-4], "big")


def plain_hash64(block_hash: bytes) -> int:
    """Low 64 bits of a plain BlockHash (no group id)."""
    return int.from_bytes(block_hash[-8:], "big")


def group_of(key: bytes) -> int:
    """KV cache group id of a BlockHashWithGroupId."""
    return int.from_bytes(key[-4:], "big")


def _hashes(values: list) -> list:
    return [v if v is None or isinstance(v, int) else hash64(v) for v in values]


def _plain_hashes(values: list) -> list:
    return [v if v is None or isinstance(v, int) else plain_hash64(v) for v in values]


#: Block-event columns the engine thread may fill with raw vLLM values (hash bytes), converted when written.
BLOCK_EVENT_CONVERSIONS = {"block_hash": _hashes, "parent_block_hash": _plain_hashes}


# ---- block-event batch records (engine thread) and their expansion (writer thread) ---------------

#: Tags of the batch records the pool wrappers append instead of one row per block.
ALLOCATED = "A"  # (ALLOCATED, seq, n, ts, step, request, free_before, blocks, keys_before, kv_group)
REF_CHANGE = "R"  # (REF_CHANGE, seq, n, ts, step, request, free_before, event, blocks, refs, keys, edge, delta, kv_group)


class BlockEventExpander:
    """Turns the block-event buffer's contents (rows and batch records) into rows, in order.

    Batch records hold what vLLM handed the pool call (the list of blocks, by reference; block ids
    never change) plus what must be read at the event (reference counts, hashes before an
    allocation evicted them). Each record reserves `n` engine seqs; rows are numbered here, so an
    event the engine dropped (its seqs reserved but never buffered) leaves a gap of exactly its size,
    and a block the pool skips (null, or another pool's) takes no seq.
    """

    def __init__(self, pool=None, multi_group: bool = False):
        self.pool = pool
        self.multi_group = multi_group
        # Hybrid engines: each block's group as of its last allocation, for a free whose caller did
        # not name one (vLLM's scheduler frees every group's blocks of a request in one call).
        self.block_group: dict[int, int] = {}
        self.expected = 0  # next engine seq
        self.next_seq = 0  # next seq written

    def events_in(self, record: tuple) -> int:
        return record[2] if type(record[0]) is str else 1

    def expand(self, batch: list[tuple]) -> list[tuple]:
        out: list[tuple] = []
        append = out.append
        pool = self.pool
        multi = self.multi_group
        block_group = self.block_group
        for r in batch:
            tag = r[0]
            if type(tag) is not str:  # a row already (its seq is the engine's)
                self.next_seq += r[0] - self.expected
                self.expected = r[0] + 1
                append((self.next_seq,) + r[1:])
                self.next_seq += 1
                continue
            self.next_seq += r[1] - self.expected
            self.expected = r[1] + r[2]
            s = self.next_seq
            if tag == ALLOCATED:
                _, _, _, ts, step, req, free, blocks, keys, group = r
                for i, b in enumerate(blocks):
                    free -= 1
                    key = keys[i] if keys is not None else None
                    if key is not None:
                        append((s, ts, step, "evicted", b.block_id, 0, key, None, req, free,
                                group_of(key) if multi else group))
                        s += 1
                    append((s, ts, step, "allocated", b.block_id, 1, None, None, req, free, group))
                    s += 1
                    if multi:
                        block_group[b.block_id] = group
            else:
                _, _, _, ts, step, req, free, event, blocks, refs, keys, edge, delta, group = r
                for b, rc, key in zip(blocks, refs, keys):
                    if b.is_null or (pool is not None and b.pool is not None and b.pool is not pool):
                        continue  # the pool does not count these (vLLM's own rule)
                    if rc == edge:
                        free += delta
                    if multi:
                        g = group_of(key) if key is not None else group if group is not None else \
                            block_group.get(b.block_id)
                    else:
                        g = group
                    append((s, ts, step, event, b.block_id, rc, key, None, req, free, g))
                    s += 1
            self.next_seq = s
        return out


# ---- scheduler steps (engine thread) -------------------------------------------------------------

def step_counts(scheduler_output, requests: dict) -> tuple[int, int, int, int, int, int, int]:
    """(scheduled, prefill tokens, decode tokens, batch size, prefill requests, decode requests, context
    tokens) of one step, read when vLLM's `schedule()` returns (it has advanced each scheduled request's
    `num_computed_tokens` past the step). A request decodes when everything before the step covered its
    prompt and it computes one token (plus its speculative ones); anything else is a prefill (a prompt
    chunk, or a preempted request's recomputation)."""
    scheduled = scheduler_output.num_scheduled_tokens
    spec = scheduler_output.scheduled_spec_decode_tokens
    prefill = decode = num_decode = context = 0
    for rid, n in scheduled.items():
        req = requests.get(rid)
        if req is None:
            prefill += n
            continue
        done = req.num_computed_tokens
        context += done
        if n == 1 + (len(spec.get(rid, ())) if spec else 0) and done - n >= req.num_prompt_tokens:
            decode += n
            num_decode += 1
        else:
            prefill += n
    batch = len(scheduled)
    return prefill + decode, prefill, decode, batch, batch - num_decode, num_decode, context


# ---- what the caller declared -------------------------------------------------------------------

#: The most children a request may declare (`invocations.num_expected_children` is int32).
MAX_CHILDREN = (1 << 31) - 1


def _as_int(value) -> int | None:
    """A declared count: an integer (or its decimal digits) in 0..MAX_CHILDREN; anything else is None, never
    raised (callers declare through JSON, vllm_xargs) and counted by `bad_declaration`."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 10:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_CHILDREN:
        return None
    return value


def bad_declaration(request) -> str | None:
    """Why the request's `kmesh_children` cannot be read as a count (then it is recorded as null), or None."""
    value = extra_args(request).get(schema.XARG_CHILDREN)
    if value is None or _as_int(value) is not None:
        return None
    return f"{schema.XARG_CHILDREN} {str(value)[:40]!r} is not a count from 0 to {MAX_CHILDREN}"


def extra_args(request) -> dict:
    sp = getattr(request, "sampling_params", None)
    return (getattr(sp, "extra_args", None) or {}) if sp is not None else {}


def declared(request) -> tuple[str | None, str | None, int | None]:
    """(family, parent, expected children) the caller declared (`kmesh_family`, `kmesh_parent`, `kmesh_children`)."""
    extra = extra_args(request)
    if not extra:
        return None, None, None
    family, parent = extra.get(schema.XARG_FAMILY), extra.get(schema.XARG_PARENT)
    return (None if family is None else str(family), None if parent is None else str(parent),
            _as_int(extra.get(schema.XARG_CHILDREN)))


def caller_id_of(request) -> str | None:
    """The id the caller gave the request: vLLM's external id, else the engine id without its random suffix."""
    caller = getattr(request, "_kmesh_caller_id", None)
    if caller is not None:
        return caller
    rid = request.request_id
    head, sep, tail = rid.rpartition("-")
    return head if sep and len(tail) == 8 else None


# ---- per-request state and the invocation row ----------------------------------------------------

class RequestState:
    """What the hooks note about one request between arrival and finish (kept on it as `_kmesh`)."""

    __slots__ = ("arrival_ns", "first_scheduled_ns", "first_token_ns", "num_cached_tokens", "num_external_tokens", "seq")

    def __init__(self, seq: int, arrival_ns: int):
        self.seq = seq
        self.arrival_ns = arrival_ns
        self.first_scheduled_ns: int | None = None
        self.first_token_ns: int | None = None
        self.num_cached_tokens: int | None = None
        self.num_external_tokens: int | None = None


def invocation_row(request, finish_ns: int | None, status: str | None) -> tuple:
    """The request's invocations row (INVOCATION_LAYOUT). Token lists are taken by reference: vLLM
    no longer changes them once the request is finished, and the writer converts them."""
    st: RequestState = request._kmesh
    family, parent, children = declared(request)
    output = request._output_token_ids if hasattr(request, "_output_token_ids") else list(request.output_token_ids)
    return (
        request.request_id, caller_id_of(request), st.seq, family, parent, children,
        request.num_prompt_tokens, len(output), request.prompt_token_ids, output, None,
        st.arrival_ns, st.first_scheduled_ns, st.first_token_ns, finish_ns, status,
        st.num_cached_tokens, st.num_external_tokens, request.num_preemptions,
    )


def unfinished_row(request) -> tuple:
    return invocation_row(request, None, None)


def as_dict(layout: tuple[str, ...], row: tuple) -> dict[str, Any]:
    return dict(zip(layout, row))
