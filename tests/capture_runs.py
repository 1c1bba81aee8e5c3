"""A tiny vLLM engine run in-process under the capture, with vLLM's own KV events beside it."""

from __future__ import annotations

import time
from pathlib import Path
from tiny_llm import engine_env, make_llm  # tests/ is on sys.path


class KVEventListener:
    """Subscribes to vLLM's ZMQ KV-event stream and decodes every batch."""

    def __init__(self, endpoint: str):
        import zmq
        from msgspec.msgpack import Decoder
        from vllm.distributed.kv_events import KVEventBatch

        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._decoder = Decoder(type=KVEventBatch)
        self.events: list = []

    def drain(self, quiet_s: float = 1.0) -> list:
        import zmq

        while self._sub.poll(int(quiet_s * 1000), zmq.POLLIN):
            _topic, _seq, payload = self._sub.recv_multipart()
            self.events.extend(self._decoder.decode(payload).events)
        return self.events

    def close(self) -> None:
        self._sub.close(linger=0)


def captured_with_kv_events(tmp: Path, model_dir: Path, workload, **llm_kwargs):
    """(trace, workload(llm), vLLM's own KV events): an in-process engine captured while it publishes
    its KV events over ZMQ `ipc://` (a listener subscribed before the workload)."""
    from kmesh_trace.capture.session import capture_in_process
    from vllm.config import KVEventsConfig

    from kmesh_trace.trace import open_trace

    engine_env(multiprocess=False)
    endpoint = f"ipc://{tmp}/kv-events"
    with capture_in_process(tmp / "trace") as session:
        llm = make_llm(model_dir, kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=""), **llm_kwargs)
        listener = KVEventListener(endpoint)
        time.sleep(0.5)  # let the subscription reach the publisher before the first event
        result = workload(llm)
        events = listener.drain()
        listener.close()
    llm.llm_engine.engine_core.shutdown()
    assert len(session.engine_ids) == 1
    return open_trace(tmp / "trace"), result, events
