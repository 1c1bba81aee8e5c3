"""vLLM's KV-events wire format for listener tests: batches as vLLM frames them, a replay socket (a real
ZeroMQ ROUTER speaking vLLM's replay protocol) that answers from a buffer the test controls, or
misbehaves as a hostile one would, and an engine server's HTTP answers (a real server on 127.0.0.1)."""

from __future__ import annotations

import http.server
import json
import threading
from contextlib import contextmanager

import msgspec


def stored(h: int, **over) -> dict:
    """A vLLM BlockStored event (tagged map) of one block."""
    ev = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [], "block_size": 32,
          "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0}
    ev.update(over)
    return ev


def payload(ts: float, events: list, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([ts, events, rank])


def frames(seq: int, body: bytes, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), body]


class ReplayBuffer:
    """A publisher's replay socket: for a start seq, every buffered batch from it (`buffer`: seq -> payload),
    then the end marker, as vLLM's `ZmqEventPublisher._service_replay` does. `mode` "endless" never sends
    the end marker and repeats its buffer forever; "mute" answers nothing."""

    def __init__(self, ctx, endpoint: str, buffer: dict[int, bytes], mode: str = "vllm"):
        import zmq

        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.buffer, self.mode, self.done = buffer, mode, threading.Event()
        self.requests: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            if not self.sock.poll(20):
                continue
            ident, _, start = self.sock.recv_multipart()
            first = int.from_bytes(start, "big")
            self.requests.append(first)
            if self.mode == "mute":
                continue
            while not self.done.is_set():
                for s in sorted(k for k in self.buffer if k >= first):
                    self.sock.send_multipart([ident, b"", b"kv", s.to_bytes(8, "big"), self.buffer[s]])
                if self.mode != "endless":
                    break
            self.sock.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.done.set()
        self.thread.join()
        self.sock.close()


@contextmanager
def http_server(routes: dict[str, object]):
    """An HTTP server on 127.0.0.1 answering GET path -> JSON (or bytes; or (status, location) to redirect)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = routes.get(self.path)
            if isinstance(body, tuple):
                self.send_response(body[0])
                self.send_header("Location", body[1])
                self.end_headers()
                return
            data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else b""
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}"
    finally:
        srv.shutdown()
        srv.server_close()




def rebuild_rows(events):
    """`kv_stream.rebuilt_rows` (block size 32) of (event, hash, parent, publisher seq) rows."""
    import polars as pl

    from kmesh_trace.oracle.kv_stream import rebuilt_rows

    df = pl.DataFrame({"event": [e[0] for e in events], "block_hash": [e[1] for e in events],
                       "parent_block_hash": [e[2] for e in events], "publisher_seq": [e[3] for e in events],
                       "ts_ns": list(range(len(events))), "seq": list(range(len(events)))},
                      schema={"event": pl.String, "block_hash": pl.UInt64, "parent_block_hash": pl.UInt64,
                              "publisher_seq": pl.Int64, "ts_ns": pl.Int64, "seq": pl.Int64})
    return rebuilt_rows(df, 32, "e0")
