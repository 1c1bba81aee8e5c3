"""The run function `kmesh-trace tiers` calls (`kmesh_trace.oracle.tiers.run`) and the pool capacity's flag."""

from __future__ import annotations

import json

from kmesh_trace.oracle.tiers import TiersOptions, run


def test_run_is_what_the_command_prints(cli):
    from kmesh_trace.datasets.workloads import get

    options = TiersOptions(host="8", ssd="32", host_gbps=10.0, ssd_gbps=2.0, prefill_tokens_per_s=4000.0,
                           singleflight=True, early_prep=True)
    report = run(get("hold-stress").build(), options, name="scenario:hold-stress")
    r = cli(["tiers", "--scenario", "hold-stress", "--host", "8", "--ssd", "32", "--host-gbps", "10", "--ssd-gbps", "2",
             "--prefill-tokens-per-s", "4000", "--singleflight", "--early-prep", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == json.loads(json.dumps(report.to_dict()))
    assert report.to_dict()["configurations"][1]["hit_tokens_by_tier"]["ssd"] > 0


def test_capacity_blocks_is_the_flag_and_gpu_blocks_its_hidden_old_name(cli):
    args = ["tiers", "--scenario", "fork-tree", "--host", "8", "--json"]
    new = cli(args + ["--capacity-blocks", "12"])
    old = cli(args + ["--gpu-blocks", "12"])
    assert new.exit_code == old.exit_code == 0, new.output + old.output
    assert new.stdout == old.stdout and json.loads(new.stdout)["gpu_blocks"] == 12
    both = cli(args + ["--capacity-blocks", "12", "--gpu-blocks", "12"])
    assert both.exit_code == 1 and both.stderr == "Error: give --capacity-blocks once (--gpu-blocks is its old name).\n"
    shown = cli(["tiers", "--help"]).stdout
    assert "--capacity-blocks" in shown and "--gpu-blocks" not in shown


def test_tiers_options_name_their_flags():
    """The report's tiers reproduce line comes from the options (`oracle.options.flags`), as every section's."""
    from kmesh_trace.oracle.options import flags
    from kmesh_trace.oracle.tiers import TiersOptions

    assert flags(TiersOptions()) == ""
    assert flags(TiersOptions(capacity_blocks=64, sweep_host="0,64", sweep_ssd="0,64")) == \
        " --capacity-blocks 64 --sweep-host 0,64 --sweep-ssd 0,64"
    assert flags(TiersOptions(host="8GiB", host_write="write-through", singleflight=True, connector="simple-cpu")) == \
        " --host 8GiB --host-write write-through --singleflight --vllm-connector simple-cpu"
