"""Memory follows the data, not the flags: a flag that would size an allocation beyond
the machine is refused before any work, in one sentence naming it, and `import weka --arrival users:N`
holds only the users it meets."""

from __future__ import annotations

import heapq
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh_trace.datasets.workloads.fork_tree import BLOCK_SIZE, fork_tree_rows
from kmesh_trace.writer import TraceWriter

CLI = [sys.executable, "-m", "kmesh_trace.cli"]
#: Far beyond the memory of any machine these tests run on (a pool slot is over 100 bytes).
HUGE_BLOCKS = 2_000_000_000


@pytest.fixture
def fork_tree(tmp_path):
    rows = fork_tree_rows()
    with TraceWriter(tmp_path / "t", "fork-tree", {"block_size": BLOCK_SIZE, "num_usable_blocks": 512}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return tmp_path / "t"


def _run(args, limit_gib=8):
    """The console script under an address-space limit: without the estimate, an oversized pool fails
    here with MemoryError (a different sentence) instead of taking the machine."""
    limit = limit_gib << 30
    pre = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))"
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", f"{pre}\nfrom kmesh_trace.cli import main; main()", *map(str, args)],
                       capture_output=True, text=True, timeout=300)
    return p, time.monotonic() - t0


@pytest.mark.parametrize("args, flag", [
    (["headroom", "{t}", "--capacity-blocks", HUGE_BLOCKS], "--capacity-blocks"),
    (["headroom", "{t}", "--capacity-blocks", f"64,{HUGE_BLOCKS}", "--policies", "belady"], "--capacity-blocks"),
    (["pressure", "{t}", "--capacity-blocks", HUGE_BLOCKS], "--capacity-blocks"),
    (["fleet", "{t}", "--engines", 1_000_000_000], "--engines"),
    (["tiers", "{t}", "--gpu-blocks", HUGE_BLOCKS, "--host", "64", "--prefill-tokens-per-s", "5000"], "--gpu-blocks"),
    (["fleet", "{t}", "--engines", 2, "--capacity-blocks", HUGE_BLOCKS], "--engines x --capacity-blocks"),
])
def test_a_flag_asking_for_more_memory_than_the_machine_has_is_refused_at_once(fork_tree, args, flag):
    p, elapsed = _run([str(a).format(t=fork_tree) for a in args])
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: {flag} asks for "), p.stderr
    assert f"give a smaller {flag}" in errors[0]
    assert elapsed < 120


@pytest.mark.parametrize("command", [["pressure"], ["headroom", "--policies", "vllm"], ["tiers", "--host", "64",
                                                                                   "--prefill-tokens-per-s", "5000"]])
def test_a_pool_size_from_the_trace_metadata_is_checked_as_a_flag_is(tmp_path, command):
    """`num_usable_blocks` is input too: a trace whose metadata names 2e9 blocks is refused in one sentence
    naming where the size came from and the flag that asks for less, not sized until memory runs out."""
    rows = fork_tree_rows()
    with TraceWriter(tmp_path / "t", "fork-tree", {"block_size": BLOCK_SIZE, "num_usable_blocks": HUGE_BLOCKS}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    p, elapsed = _run([command[0], tmp_path / "t", *command[1:]])
    assert p.returncode == 1, p.stderr
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"Error: the trace's num_usable_blocks ({HUGE_BLOCKS:,}) asks for a vLLM pool model of about"), p.stderr
    assert "give a smaller --capacity-blocks" in errors[0]
    assert elapsed < 120


def test_the_available_memory_counts_an_address_space_limit():
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
            "from kmesh_trace.resources import available_memory; print(available_memory())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 0 < int(out) < 4 << 30


def test_a_pool_that_fits_still_runs(fork_tree, cli):
    r = cli(["headroom", fork_tree, "--capacity-blocks", "100000", "--policies", "vllm,belady", "--json"])
    assert r.exit_code == 0, r.stderr


# ---- weka: users met, not users named -----------------------------------------------------------


def _eager_starts(users: int, durations: list[float]) -> list[float]:
    """The reference: every user in the heap from the start (what the importer did before)."""
    free = [(0.0, u) for u in range(users)]
    starts = []
    for d in durations:
        start, user = heapq.heappop(free)
        heapq.heappush(free, (start + max(d, 0.0), user))
        starts.append(start)
    return starts


@settings(max_examples=300, deadline=None)
@given(users=st.integers(1, 12), durations=st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5, 10.0]), max_size=40))
def test_the_lazy_user_clock_equals_the_eager_one(users, durations):
    from kmesh_trace.datasets.importers.weka import Arrival, _Clock

    clock = _Clock(Arrival("users", users=users))
    assert [clock.start(d) for d in durations] == _eager_starts(users, durations)


def test_a_hundred_million_users_hold_only_the_users_met():
    from kmesh_trace.datasets.importers.weka import Arrival, _Clock

    clock = _Clock(Arrival.parse("users:100000000"))
    assert [clock.start(5.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert len(clock.free) == 3
