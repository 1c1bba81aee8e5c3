"""vLLM's and SGLang's KV event frames and a listener on private ipc endpoints, for the listener's tests."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import polars as pl
import pytest

from kmesh_trace.capture.listen import Listener, PublisherSpec


# ---- SGLang 0.5.23's structs, copied from sglang/srt/disaggregation/kv_events.py ---------------------


class SgEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SgKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(SgKVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(SgKVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(SgKVCacheEvent):
    pass


class SgKVEventBatch(SgEventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def _frames(seq: int, batch, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgspec.msgpack.Encoder().encode(batch)]


@pytest.fixture(scope="module")
def vllm_events():
    return pytest.importorskip("vllm.distributed.kv_events")


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))  # ipc paths must stay short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _listener(out: Path, sock_dir: Path, replay: bool = False, **spec) -> Listener:
    return Listener(out, [PublisherSpec(f"ipc://{sock_dir}/ev.sock", f"ipc://{sock_dir}/replay.sock" if replay else None,
                                        "kv", **spec)], replay_timeout_s=3)


def _rows(out: Path) -> pl.DataFrame:
    from kmesh_trace.trace import open_trace

    with open_trace(out) as t:
        return t.sql("SELECT * FROM block_events ORDER BY seq")


def _meta(out: Path) -> dict:
    (f,) = (out / "engines").glob("*.json")
    return json.loads(f.read_text())
