"""Where the publishers are: an engine server's URL, asked for its KV-event sources.

vLLM answers `GET /kv_event_sources` (each data-parallel rank's publisher configuration); `/version`,
`/v1/models` and the `vllm:cache_config_info` line of `/metrics` name the engine, the model, the block
size and the pool. SGLang describes its publisher under `kv_events` in `GET /server_info` (tcp port
bases per rank, topic, page size). Wildcard hosts are replaced by the URL's host.

What a server says is input like any other: each answer is read within `MAX_BODY_BYTES` and one
deadline (`DISCOVERY_TIMEOUT_S`, however slowly it drips), redirects stay on the server's host, a
server announces at most `MAX_RANKS` publishers, and every endpoint, rank and block size is checked
(`capture/endpoints.py`) before it reaches a socket or a trace's metadata.
"""

from __future__ import annotations

import json
import re
import socket
import time

from kmesh_trace.capture.endpoints import UNSPECIFIED, check_connect, check_endpoint, split_tcp, url_host
from kmesh_trace.schema import MAX_BLOCK_SIZE
from kmesh_trace.capture.listen import PublisherSpec
from kmesh_trace.errors import KmeshTraceError

MAX_BODY_BYTES = 4 << 20
DISCOVERY_TIMEOUT_S = 10.0
MAX_RANKS = 1024


def subscribe_endpoint(endpoint: str, host: str | None = None) -> str:
    """The address a subscriber connects to for an endpoint the engine was given (wildcards -> `host`)."""
    if host and endpoint.startswith("tcp://"):
        bound, port = split_tcp(endpoint)
        if bound in UNSPECIFIED:
            return f"tcp://{f'[{host}]' if ':' in host else host}:{port}"
    return endpoint


def _get(url: str, timeout: float = DISCOVERY_TIMEOUT_S) -> bytes:
    """The body of `GET url`: at most `MAX_BODY_BYTES`, all of it within `timeout`, redirects only to the
    same host."""
    import urllib.error
    import urllib.request

    host = url_host(url)

    class SameHost(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if url_host(newurl) != host:
                raise KmeshTraceError(f"{url} redirects to {newurl}, another host; give that server's URL "
                                      "if it is the one to ask.")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    deadline = time.monotonic() + timeout
    try:
        with urllib.request.build_opener(SameHost).open(url, timeout=min(timeout, 5.0)) as r:
            body = bytearray()
            while chunk := r.read1(65536):
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise KmeshTraceError(f"{url} answered more than {MAX_BODY_BYTES >> 20} MiB; is it an engine "
                                          "server?")
                if time.monotonic() > deadline:
                    raise KmeshTraceError(f"{url} did not finish its answer in {timeout:.0f} s.")
            return bytes(body)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise KmeshTraceError(f"cannot reach {url} ({getattr(e, 'reason', e)}); is the engine server running?") from None


def _count(value: object, what: str, lo: int, hi: int) -> int | None:
    """A server's integer (or decimal string) within lo..hi; None when absent or not a number."""
    if isinstance(value, str) and value.isdigit() and len(value) < 20:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if not lo <= value <= hi:
        raise KmeshTraceError(f"the server gives {what} {value}, outside {lo}..{hi}.")
    return value


_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)


def discover(url: str, *, allow_remote: bool = False) -> list[PublisherSpec]:
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
        return _checked(sglang, base, allow_remote)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise KmeshTraceError(f"{base}/kv_event_sources did not answer JSON; is {base} a vLLM server?") from None
    if isinstance(sources, dict) and len(sources) > MAX_RANKS:
        raise KmeshTraceError(f"{base}/kv_event_sources announces {len(sources)} publishers, more than {MAX_RANKS}.")
    if not isinstance(sources, dict) or not sources:
        raise KmeshTraceError(f"{base} publishes no KV events; start it with --kv-events-config "
                              "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", ...}'.")
    engine = model = None
    try:
        engine = "vllm " + json.loads(_get(f"{base}/version"))["version"]
        model = json.loads(_get(f"{base}/v1/models"))["data"][0]["id"]
    except (KmeshTraceError, KeyError, IndexError, TypeError, json.JSONDecodeError, UnicodeDecodeError):
        pass
    engine = engine if isinstance(engine, str) else None
    model = model if isinstance(model, str) else None
    blocks: dict[str, dict[str, str]] = {}
    try:
        for labels in _CACHE_INFO.findall(_get(f"{base}/metrics").decode(errors="replace")):
            kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            blocks[kv.get("engine", "0")] = kv
    except KmeshTraceError:
        pass
    specs = []
    for key, cfg in sources.items():
        rank = _count(key, "rank", 0, MAX_RANKS - 1)
        if rank is None:
            raise KmeshTraceError(f"{base}/kv_event_sources names rank {key!r}, not a number.")
        if not isinstance(cfg, dict) or not cfg.get("endpoint"):
            raise KmeshTraceError(f"{base}/kv_event_sources gives no endpoint for rank {rank}.")
        info = blocks.get(str(rank), {})
        num_gpu = _count(info.get("num_gpu_blocks"), "num_gpu_blocks", 0, 1 << 40)
        replay = cfg.get("replay_endpoint")
        topic = cfg.get("topic") or ""
        if not isinstance(topic, str):
            raise KmeshTraceError(f"{base}/kv_event_sources gives rank {rank} a topic that is not a string.")
        specs.append(PublisherSpec(
            endpoint=subscribe_endpoint(check_endpoint(cfg["endpoint"], f"rank {rank}'s endpoint"), host),
            topic=topic,
            replay_endpoint=subscribe_endpoint(check_endpoint(replay, f"rank {rank}'s replay endpoint"), host)
            if replay else None, rank=rank, engine=engine, model=model,
            block_size=_count(info.get("block_size"), "block size", 1, MAX_BLOCK_SIZE),
            num_usable_blocks=num_gpu - 1 if num_gpu else None,  # vLLM's pool keeps one null block
            host=host if host not in ("127.0.0.1", "localhost", "::1") else socket.gethostname()))
    return _checked(sorted(specs, key=lambda s: s.rank), base, allow_remote)


def _checked(specs: list[PublisherSpec], url: str, allow_remote: bool) -> list[PublisherSpec]:
    for spec in specs:
        for ep in (spec.endpoint, spec.replay_endpoint):
            if ep:
                check_connect(check_endpoint(ep), url, allow_remote)
    return specs


def _discover_sglang(base: str, host: str) -> list[PublisherSpec] | None:
    """An SGLang server's publishers, from the `kv_events` descriptor of its `GET /server_info` (per rank r:
    tcp://HOST:endpoint_port_base + r, replay on replay_endpoint_port_base + r); None when it has none."""
    try:
        info = json.loads(_get(f"{base}/server_info"))
    except (KmeshTraceError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return None
    d = info.get("kv_events") if isinstance(info, dict) else None
    if not isinstance(d, dict) or not isinstance(d.get("endpoint_port_base"), int):
        return None
    dp_size = _count(d.get("dp_size") or 1, "dp_size", 1, MAX_RANKS)
    if dp_size is None:
        raise KmeshTraceError(f"{base}/server_info gives a dp_size that is not a number.")
    port = _count(d["endpoint_port_base"], "endpoint_port_base", 1, 65536 - dp_size)
    replay = _count(d.get("replay_endpoint_port_base"), "replay_endpoint_port_base", 1, 65536 - dp_size)
    named = d.get("endpoint_host")
    if named is not None and not isinstance(named, str):
        raise KmeshTraceError(f"{base}/server_info gives an endpoint_host that is not a string.")
    dial = host if named in (None, "*", "0.0.0.0", "::") else named
    dial = f"[{dial}]" if ":" in dial else dial
    model = info.get("model_path") if isinstance(info.get("model_path"), str) else None
    version = info.get("version") if isinstance(info.get("version"), str) else None
    topic = d.get("topic") if isinstance(d.get("topic"), str) else ""
    return [PublisherSpec(endpoint=f"tcp://{dial}:{port + r}", topic=topic,
                          replay_endpoint=f"tcp://{dial}:{replay + r}" if replay else None, rank=r,
                          engine=f"sglang {version}" if version else "sglang", model=model,
                          block_size=_count(d.get("block_size"), "block size", 1, MAX_BLOCK_SIZE),
                          format="sglang", host=host if host not in ("127.0.0.1", "localhost", "::1") else socket.gethostname())
            for r in range(dp_size)]
