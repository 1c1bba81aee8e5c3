"""Where the publishers are: an engine server's URL, asked for its KV-event sources.

vLLM answers `GET /kv_event_sources` (each data-parallel rank's publisher configuration); `/version`,
`/v1/models` and the `vllm:cache_config_info` line of `/metrics` name the engine, the model, the block
size and the pool. SGLang describes its publisher under `kv_events` in `GET /server_info` (tcp port
bases per rank, topic, page size). Wildcard hosts are replaced by the URL's host.
"""

from __future__ import annotations

import json
import re
import socket

from kmesh_trace.capture.listen import PublisherSpec
from kmesh_trace.errors import KmeshTraceError


def subscribe_endpoint(endpoint: str, host: str | None = None) -> str:
    """The address a subscriber connects to for an endpoint the engine was given (wildcards -> `host`)."""
    if host:
        endpoint = endpoint.replace("*", host).replace("0.0.0.0", host)
    return endpoint



def _get(url: str, timeout: float = 5.0) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except (urllib.error.URLError, OSError) as e:
        raise KmeshTraceError(f"cannot reach {url} ({getattr(e, 'reason', e)}); is the engine server running?") from None


_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)


def discover(url: str) -> list[PublisherSpec]:
    """The publishers an engine server announces (`GET /kv_event_sources`: one per DP rank), with what the
    server says about its engine (`/version`, `/v1/models`, the block size and GPU blocks of `/metrics`)."""
    from urllib.parse import urlparse

    base = url.rstrip("/")
    host = urlparse(base).hostname or "127.0.0.1"
    try:
        sources = json.loads(_get(f"{base}/kv_event_sources"))
    except KmeshTraceError:
        sglang = _discover_sglang(base, host)
        if sglang is None:
            raise
        return sglang
    except json.JSONDecodeError:
        raise KmeshTraceError(f"{base}/kv_event_sources did not answer JSON; is {base} a vLLM server?") from None
    if not isinstance(sources, dict) or not sources:
        raise KmeshTraceError(f"{base} publishes no KV events; start it with --kv-events-config "
                              "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", ...}'.")
    engine = model = None
    try:
        engine = "vllm " + json.loads(_get(f"{base}/version"))["version"]
        model = json.loads(_get(f"{base}/v1/models"))["data"][0]["id"]
    except (KmeshTraceError, KeyError, IndexError, TypeError, json.JSONDecodeError):
        pass
    blocks: dict[str, dict[str, str]] = {}
    try:
        for labels in _CACHE_INFO.findall(_get(f"{base}/metrics").decode()):
            kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            blocks[kv.get("engine", "0")] = kv
    except KmeshTraceError:
        pass
    specs = []
    for rank, cfg in sorted(sources.items(), key=lambda kv: int(kv[0])):
        if not isinstance(cfg, dict) or not cfg.get("endpoint"):
            raise KmeshTraceError(f"{base}/kv_event_sources gives no endpoint for rank {rank}.")
        info = blocks.get(str(rank), {})
        num_gpu = int(info["num_gpu_blocks"]) if info.get("num_gpu_blocks", "").isdigit() else None
        replay = cfg.get("replay_endpoint")
        specs.append(PublisherSpec(
            endpoint=subscribe_endpoint(cfg["endpoint"], host), topic=cfg.get("topic") or "",
            replay_endpoint=subscribe_endpoint(replay, host) if replay else None, rank=int(rank),
            engine=engine, model=model,
            block_size=int(info["block_size"]) if info.get("block_size", "").isdigit() else None,
            num_usable_blocks=num_gpu - 1 if num_gpu else None,  # vLLM's pool keeps one null block
            host=host if host not in ("127.0.0.1", "localhost", "::1") else socket.gethostname()))
    return specs


def _discover_sglang(base: str, host: str) -> list[PublisherSpec] | None:
    """An SGLang server's publishers, from the `kv_events` descriptor of its `GET /server_info` (per rank r:
    tcp://HOST:endpoint_port_base + r, replay on replay_endpoint_port_base + r); None when it has none."""
    try:
        info = json.loads(_get(f"{base}/server_info"))
    except (KmeshTraceError, json.JSONDecodeError):
        return None
    d = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(d, dict) or not isinstance(d.get("endpoint_port_base"), int):
        return None
    dial = host if d.get("endpoint_host") in (None, "*", "0.0.0.0", "::") else d["endpoint_host"]
    replay = d.get("replay_endpoint_port_base")
    model = info.get("model_path") if isinstance(info.get("model_path"), str) else None
    version = info.get("version")
    return [PublisherSpec(endpoint=f"tcp://{dial}:{d['endpoint_port_base'] + r}", topic=d.get("topic") or "",
                          replay_endpoint=f"tcp://{dial}:{replay + r}" if isinstance(replay, int) else None, rank=r,
                          engine=f"sglang {version}" if version else "sglang", model=model,
                          block_size=d.get("block_size") if isinstance(d.get("block_size"), int) else None,
                          format="sglang", host=host if host not in ("127.0.0.1", "localhost", "::1") else socket.gethostname())
            for r in range(int(d.get("dp_size") or 1))]
