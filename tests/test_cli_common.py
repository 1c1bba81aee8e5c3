"""One CLI style: the workload registry behind every --scenario, shared --json/--csv/--out, exit codes in --help."""

from __future__ import annotations

import csv
import io
import json

import pytest
import typer

from kmesh_trace.cli import app
from kmesh_trace.datasets.workloads import SCENARIOS as WORKLOADS, get
from kmesh_trace.errors import KmeshTraceError

SCENARIO_COMMANDS = ["headroom", "pressure", "tiers"]


@pytest.mark.parametrize("command", SCENARIO_COMMANDS)
@pytest.mark.parametrize("name", list(WORKLOADS))
def test_every_registered_workload_runs_under_every_scenario_command(cli, command, name):
    r = cli([command, "--scenario", name, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["block_size"] == get(name).build().block_size


def test_the_agent_workload_keeps_the_plan_families():
    from kmesh_trace.datasets.workloads.agent import agent_workload

    built = get("agent-small").build()
    plan = agent_workload(size="small")
    assert len(built.requests) == len(plan.requests)
    by_id = {r.request_id: r for r in built.requests}
    for p in plan.requests:
        r = by_id[p.name]
        if p.parent is not None:  # a child's prompt starts with its parent's whole prompt + output
            parent = by_id[p.parent]
            assert r.parent_index == parent.index and r.index > parent.index
            n = len(parent.prompt_token_ids) + len(parent.output_token_ids)
            assert r.prompt_token_ids[:n] == parent.prompt_token_ids + parent.output_token_ids


def test_an_unknown_workload_names_the_known_ones(cli):
    with pytest.raises(KmeshTraceError, match="the built-in workloads are fork-tree, "):
        get("nope")
    r = cli(["headroom", "--scenario", "nope"])
    assert r.exit_code == 1 and "nope" in r.stderr


def test_out_writes_what_json_prints_and_csv_is_the_table(cli, tmp_path):
    args = ["headroom", "--scenario", "fork-tree", "--capacity-blocks", "64,512"]
    printed = json.loads(cli([*args, "--json"]).stdout)
    r = cli([*args, "--out", tmp_path / "h.json"])
    assert r.exit_code == 0 and r.stdout == ""  # the file is the output
    assert json.loads((tmp_path / "h.json").read_text()) == printed
    r = cli([*args, "--csv", "--out", tmp_path / "h.csv"])
    assert r.stdout == ""
    rows = list(csv.DictReader(io.StringIO((tmp_path / "h.csv").read_text())))
    assert [(x["policy"], int(x["capacity_blocks"]), int(x["hit_tokens"])) for x in rows] == [
        (x["policy"], x["capacity_blocks"], x["hit_tokens"]) for x in printed["results"]]
    assert (tmp_path / "h.csv").read_text() == cli([*args, "--csv"]).stdout
    r = cli([*args, "--json", "--csv"])
    assert (r.exit_code, r.stderr) == (1, "Error: give --json or --csv, not both.\n")
    r = cli([*args, "--out", tmp_path / "missing" / "h.json"])
    assert r.exit_code == 1 and "does not exist" in r.stderr


def test_pressure_takes_one_capacity_or_a_sweep_in_the_same_option(cli):
    one = json.loads(cli(["pressure", "--scenario", "hold-stress", "--capacity-blocks", "64", "--json"]).stdout)
    assert one["capacity_blocks"] == 64 and "arms" in one
    many = json.loads(cli(["pressure", "--scenario", "hold-stress", "--capacity-blocks", "64,128", "--json"]).stdout)
    assert [p["capacity_blocks"] for p in many["sweep"]] == [64, 128]
    assert many["sweep"][0]["net_cached_tokens"] == one["net_cached_tokens"]


def _commands(group: typer.Typer, prefix=()):
    for c in group.registered_commands:
        yield (*prefix, c.name)
    for g in group.registered_groups:
        yield from _commands(g.typer_instance, (*prefix, g.name))


@pytest.mark.parametrize("command", sorted(_commands(app)))
def test_every_command_documents_its_exit_codes(cli, command):
    r = cli([*command, "--help"])
    assert r.exit_code == 0
    assert "Exit codes:" in r.stdout, command


def test_analysis_errors_name_parameters_and_the_cli_names_its_options(cli, tmp_path):
    from kmesh_trace.datasets.importers.mooncake import import_mooncake
    from kmesh_trace.oracle.stream import pool_capacity

    with pytest.raises(KmeshTraceError, match=r"; give capacity_blocks=N\.$"):
        pool_capacity(None, None)
    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    import_mooncake(src, tmp_path / "t")
    r = cli(["pressure", tmp_path / "t", "--edges", "inferred"])
    assert r.exit_code == 1
    assert r.stderr == ("Error: the trace does not record the engine's usable blocks (imported traces cannot); "
                        "pass --capacity-blocks N.\n")
    r = cli(["tiers", tmp_path / "t"])  # the same parameter, the same option
    assert r.exit_code == 1
    assert r.stderr == ("Error: the trace does not record the engine's usable blocks (imported traces cannot); "
                        "pass --capacity-blocks N.\n")
