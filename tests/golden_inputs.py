"""The golden cases' inputs: small synthetic files in each public format, written from fixed seeds.

The files live in tests/golden/inputs/ (committed: the cases read them as data); `python tests/golden_inputs.py`
writes them again, and tests/test_golden.py checks that this reproduces the committed bytes. A KV-events
recording (for `residency`) is made at test time by the listener itself, fed frames without an engine.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

INPUTS = Path(__file__).resolve().parent / "golden" / "inputs"


def _jsonl(rows) -> str:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows)


def mooncake(seed: int = 35) -> str:
    """Mooncake JSONL: conversations whose turns extend a shared system prefix, ids at 512 tokens each."""
    rng = random.Random(seed)
    rows, t, next_id = [], 0, 1000
    system = list(range(1, 9))  # one system prompt shared by every conversation
    for _ in range(24):
        ids = system + [next_id + i for i in range(rng.randint(1, 4))]
        next_id += 10
        for _turn in range(rng.randint(1, 5)):
            t += rng.randint(50, 900)
            rows.append({"timestamp": t, "input_length": len(ids) * 512 - rng.randint(0, 511),
                         "output_length": rng.randint(16, 400), "hash_ids": list(ids)})
            ids = ids + [next_id + i for i in range(rng.randint(1, 3))]
            next_id += 10
    rows.sort(key=lambda r: r["timestamp"])
    return _jsonl(rows)


def weka(seed: int = 35) -> dict[str, str]:
    """kv-cache-tester agentic conversations (one JSON file each), with sub-agents."""
    rng = random.Random(seed)
    files = {}
    for c in range(3):
        reqs, t, first = [], 0.0, 1
        for i in range(rng.randint(4, 8)):
            n = first + rng.randint(2, 6)
            reqs.append({"t": round(t, 3), "type": "n", "in": n * 64 + rng.randint(0, 63), "out": rng.randint(8, 200),
                         "hash_ids": list(range(1, n + 1)), "api_time": round(rng.uniform(0.5, 3.0), 3)})
            first = n
            t += rng.uniform(1.0, 20.0)
            if i == 2:
                sub = [{"t": round(t + j, 3), "type": "n", "in": (3 + j) * 64, "out": 32,
                        "hash_ids": list(range(500, 503 + j)), "api_time": 1.0} for j in range(3)]
                reqs.append({"t": round(t, 3), "type": "subagent", "agent_id": f"agent_{c:03d}",
                             "subagent_type": "Explore", "requests": sub})
        files[f"trace_{c:04d}.json"] = json.dumps({"id": f"trace_{c:04d}", "block_size": 64, "hash_id_scope": "local",
                                                   "requests": reqs}, separators=(",", ":"))
    return files


def lmcache_agent(seed: int = 35) -> dict[str, str]:
    """LMCache agent traces: sessions whose inputs extend the last input and output."""
    rng = random.Random(seed)
    rows = []
    for s in range(4):
        text, ts = f"system: you are agent {s % 2}. " * 4, 1_760_000_000.0 + s
        for turn in range(rng.randint(2, 5)):
            text += f"user: step {turn} " + "x" * rng.randint(10, 150) + " "
            out = f"answer {turn} " + "y" * rng.randint(5, 80)
            rows.append({"timestamp": round(ts, 3), "session_id": f"s{s}", "input": text, "output": out})
            text += out + " "
            ts += rng.uniform(0.5, 6.0)
    rows.sort(key=lambda r: r["timestamp"])
    return {"agent/run.jsonl": _jsonl(rows)}


def requests(seed: int = 35) -> str:
    """OpenAI-compatible request JSONL (chat and completion bodies) sharing a system prompt."""
    rng = random.Random(seed)
    rows = []
    for i in range(12):
        if i % 3 == 2:
            rows.append({"prompt": "Complete: the cache keeps blocks " + "z" * rng.randint(1, 90), "max_tokens": 16})
        else:
            rows.append({"messages": [{"role": "system", "content": "You are terse. " * 8},
                                      {"role": "user", "content": f"question {i} " + "q" * rng.randint(1, 200)}],
                         "max_tokens": rng.randint(8, 64)})
    return _jsonl(rows)


def files() -> dict[str, str]:
    """Every input file, by its path under tests/golden/inputs/."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bailian_data import generate_bailian

    out = {"mooncake.jsonl": mooncake(), "requests.jsonl": requests()}
    out.update({f"weka/{k}": v for k, v in weka().items()})
    out.update({f"lmcache/{k}": v for k, v in lmcache_agent().items()})
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "bailian.jsonl"
        generate_bailian(p, num_sessions=12, max_turns=4, seed=35)
        out["bailian.jsonl"] = p.read_text()
    return out


def write(root: Path = INPUTS) -> None:
    for rel, text in files().items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def record_listen(out: Path) -> Path:
    """A KV-events recording made by the listener from vLLM-format frames (no engine): GPU stores, removals,
    a CPU copy brought back, and reported hits."""
    import msgspec

    from kmesh_trace.capture.listen import Listener, PublisherSpec

    def st(hashes, parent=None, medium="GPU"):
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": [],
                "block_size": 32, "lora_id": None, "medium": medium, "lora_name": None, "group_idx": 0}

    def rm(hashes, medium="GPU"):
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": 0}

    batches = [[st([1, 2, 3])], [st([1, 2]), st([4], parent=2)], [st([5], parent=4)], [st([6], parent=1)],
               [rm([3]), st([3], medium="CPU")], [st([1, 2, 3])], [rm([5, 6]), rm([3], medium="CPU")]]
    # A fixed endpoint that nothing publishes on (the frames are handed in), so the engine id it names is stable.
    listener = Listener(out, [PublisherSpec("ipc:///tmp/kmesh-golden-listen.sock", None, "kv", num_usable_blocks=8)],
                        replay_timeout_s=3)
    for i, events in enumerate(batches):
        listener._on_live(listener.recorders[0], [b"kv", i.to_bytes(8, "big"), msgspec.msgpack.encode([100.0 + i, events, 0])])
    listener.close()
    return out


if __name__ == "__main__":
    write()
