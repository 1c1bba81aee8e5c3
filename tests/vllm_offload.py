"""vLLM's real scheduler with SimpleCPUOffloadConnector's scheduler half, driven without a model, and random family workloads for it."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path
import pytest
import torch  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from kmesh_trace.apps.tiny_engine import cpu_engine_env, write_tiny_model  # noqa: E402

init_none_hash(sha256)  # vLLM's engine does this at start; a module run alone must too


def _connector(inner: dict, proxy: bool) -> dict:
    if not proxy:
        return inner
    return {"kv_connector": "KmeshProxyConnector", "kv_connector_module_path": "kmesh_trace.capture.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"inner": inner}}


class RealOffload:
    """vLLM's scheduler with SimpleCPUOffloadConnector: `gpu_blocks` usable GPU blocks, `cpu_blocks` usable CPU blocks."""

    def __init__(self, model_dir: Path, block_size: int, gpu_blocks: int, cpu_blocks: int, backend: str = "cpu",
                 kv_events_config=None, groups=None, proxy: bool = False):
        """`kv_events_config`: the scheduler publishes its KV events (GPU and the CPU tier's) as an engine does;
        `groups`: KV cache specs, one group of one layer each (default: one full-attention group); `proxy`:
        the connector is kmesh-trace's proxy around it (what a captured engine configures)."""
        cpu_engine_env()
        page = 2 * block_size * 1 * 32 * 2  # K and V of one fp16 KV head of 32 dims, per block
        n = gpu_blocks + 1  # vLLM's null block
        extra = {"cpu_bytes_to_use": (cpu_blocks + 1) * page}
        if backend == "disk":  # the scheduler side sizes its pool from the disk capacity and touches no file
            extra.update(kv_offload_backend="disk", disk_path=str(model_dir / "offload"),
                         disk_capacity_bytes=(cpu_blocks + 1) * page)
        cfg = EngineArgs(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
                         block_size=block_size, max_model_len=4096, max_num_batched_tokens=4096, enforce_eager=True,
                         kv_transfer_config=_connector({"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                                        "kv_connector_extra_config": extra}, proxy),
                         kv_events_config=kv_events_config).create_engine_config()
        cfg.cache_config.num_gpu_blocks = n
        specs = groups or [FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16)]
        layers = [f"layer.{i}" for i in range(len(specs))]
        kv = KVCacheConfig(num_blocks=n, kv_cache_tensors=[KVCacheTensor(size=n * page, layers=[layer], layer_stride=0,
                                                                          block_stride=page) for layer in layers],
                           kv_cache_groups=[KVCacheGroupSpec([layer], spec) for layer, spec in zip(layers, specs)])
        self.s = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=block_size)
        assert self.s.connector is not None
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.bs = block_size

    def _step(self, rid: str, output: list[int], log: dict) -> None:
        so = self.s.schedule()
        meta = so.kv_connector_metadata
        sampled = {}
        for r in so.num_scheduled_tokens:
            req = self.s.requests[r]
            if req.num_computed_tokens >= req.num_prompt_tokens:  # this step finishes the prompt: it samples
                sampled[r] = [output[req.num_output_tokens]]
        for nr in so.scheduled_new_reqs:
            if nr.req_id == rid:
                log["computed_at_schedule"] = nr.num_computed_tokens
        recv = set(meta.load_event_to_reqs.get(meta.load_event, [])) if meta.load_event >= 0 else set()
        log["loads"] += len(meta.load_cpu_blocks)
        log["stores"] += len(meta.store_cpu_blocks)
        ids = list(sampled)
        self.s.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: k for k, r in enumerate(ids)}, sampled_token_ids=[sampled[r] for r in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=recv or None,
                kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(
                    {meta.store_event: 1} if meta.store_event >= 0 else {}))))

    def run(self, rid: str, prompt: list[int], output: list[int]) -> tuple[int, int, int]:
        """(GPU prefix-hit blocks, blocks loaded from CPU, blocks stored to CPU) of one request run alone."""
        self.s.add_request(Request(rid, list(prompt), SamplingParams(max_tokens=len(output), ignore_eos=True), None,
                                   block_hasher=self.hasher))
        log = {"loads": 0, "stores": 0, "computed_at_schedule": None}
        for _ in range(len(output) + 8):
            self._step(rid, output, log)
            if rid not in self.s.requests and not self.s.connector.scheduler_manager.has_pending_stores():
                break
        assert rid not in self.s.requests, "the request did not finish"
        loaded = log["loads"]
        return log["computed_at_schedule"] // self.bs - loaded, loaded, log["stores"]

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()]


@pytest.fixture(scope="module")
def model_dir():
    with tempfile.TemporaryDirectory() as d:
        yield write_tiny_model(Path(d))


def random_families(seed: int, bs: int = 16, num: int = 30) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs: parents, children (parent prompt + output + tail), exact repeats and strangers."""
    rng = random.Random(seed)
    done: list[tuple[list[int], list[int]]] = []
    for _ in range(num):
        u = rng.random()
        if u < 0.4 and done:
            p, o = rng.choice(done)
            prompt = p + o + [rng.randrange(1000) for _ in range(rng.randint(1, 2 * bs))]
        elif u < 0.55 and done:
            prompt = list(rng.choice(done)[0])
        else:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(bs, 6 * bs))]
        out = [rng.randrange(1000) for _ in range(rng.choice([1, 1, 2, 3, bs, bs + 1]))]
        done.append((prompt, out))
    return done


def pool_for(pairs, bs: int, extra: int) -> int:
    """Usable GPU blocks: the largest request's blocks (every request must fit) plus `extra`."""
    return max(-(-(len(p) + len(o) - 1) // bs) for p, o in pairs) + extra
