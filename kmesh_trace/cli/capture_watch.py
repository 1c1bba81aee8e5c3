"""`kmesh-trace capture` watching its engines: one line when an engine's capture starts, one when an
engine dies under it, and the verdict on each partition once the command has ended.

The watch reads only what the engines write anyway: each engine partition's metadata file
(`TRACE/engines/<engine_id>.json`, written atomically when the capture starts and at every flush).
An engine that dies of an error vLLM handles (e.g. its worker process killed by the OOM killer) says so
itself in `engine_died` and still closes its partition; one whose own process is killed (SIGKILL, the
OOM killer, a native crash) closes nothing: its partition stays `complete: false` with its process
gone, and the watch writes `engine_died` for it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from typing import Callable

#: Seconds between two looks at the engines' metadata files while the command runs.
POLL_S = 0.5

#: `engine_died` of an engine whose process ended without closing its partition.
KILLED = ("its process ended without closing its capture (killed by SIGKILL: the OOM killer or kill -9; "
          "or a native crash); rows recorded after its last flush are lost")


def _read(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (an exited one its parent has not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def death(path: Path, meta: dict) -> str | None:
    """How the engine of partition `path` died, or None while it runs or after it was stopped."""
    if meta.get("engine_died"):
        return str(meta["engine_died"])
    pid = meta.get("pid")
    if meta.get("complete") or not isinstance(pid, int) or meta.get("host") not in (None, socket.gethostname()):
        return None
    if _alive(pid):
        return None
    again = _read(path)  # read after the process is gone: it may have closed its partition meanwhile
    return KILLED if again is not None and not again.get("complete") else None


class EngineWatch:
    """Polls `engines_dir` in a thread while the command runs; `finish()` takes the last look."""

    def __init__(self, engines_dir: Path, say: Callable[[str], None]):
        self.engines_dir, self.say = engines_dir, say
        self.started: set[str] = set()
        self.died: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capture-watch", daemon=True)

    def __enter__(self) -> "EngineWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.look()

    def look(self) -> None:
        for path in sorted(self.engines_dir.glob("*.json")):
            meta = _read(path)
            if meta is None:
                continue
            eid = path.stem
            if eid not in self.started:
                self.started.add(eid)
                self.say(f"kmesh-trace: capturing engine {eid} (pid {meta.get('pid')}) into "
                         f"{self.engines_dir.parent}")
            if eid not in self.died and (how := death(path, meta)) is not None:
                self.died[eid] = how
                self.say(f"kmesh-trace: engine {eid} died under the capture: {how}")

    def finish(self) -> dict[str, str]:
        """The last look, once the command has ended: every engine that died, with how; a partition left
        incomplete by a killed process gets its `engine_died` written."""
        from kmesh_trace.writer import write_json_atomic

        self.look()
        for eid, how in self.died.items():
            path = self.engines_dir / f"{eid}.json"
            meta = _read(path)
            if meta is not None and not meta.get("engine_died"):
                write_json_atomic(path, {**meta, "engine_died": how})
        return dict(self.died)
