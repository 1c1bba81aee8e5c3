"""Where the listener connects and binds, and what it takes from a server: endpoints checked before a socket
sees them (ports, hosts, ipc paths), a loopback server's publishers kept on this host unless
--allow-remote, --bind never on every interface, IPv6 handled, and discovery bounded (body, redirects,
ranks, values). Servers are real HTTP servers on 127.0.0.1."""

from __future__ import annotations


import pytest

from kmesh_trace.capture.endpoints import check_endpoint
from kmesh_trace.capture.sources import discover
from kmesh_trace.errors import KmeshTraceError
from kv_wire import http_server  # tests/ is on sys.path


@pytest.mark.parametrize("endpoint, says", [
    ("tcp://127.0.0.1:notaport", "a tcp port is a number from 1 to 65535"),
    ("tcp://127.0.0.1:70000", "a tcp port is a number from 1 to 65535"),
    ("tcp://127.0.0.1:0", "a tcp port is a number from 1 to 65535"),
    ("tcp://0:5557", "has host '0'"), ("tcp://0x0:5557", "has host '0x0'"), ("tcp://127.1:5557", "has host '127.1'"),
    ("tcp://[zz]:5557", "not an IPv6 address"), ("tcp://:5557", "give tcp://HOST:PORT"),
    ("ipc://", "names no socket path"), ("ipc:///tmp/" + "a" * 110, "holds at most 107"),
    ("udp://x:1", "not a tcp://HOST:PORT or ipc://PATH"), (5557, "is int"),
])
def test_a_bad_endpoint_is_one_sentence(endpoint, says):
    with pytest.raises(KmeshTraceError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        check_endpoint(endpoint)


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:1",
                                      "tcp://engine-0.example:65535", "ipc:///tmp/kv.sock", "tcp://*:5557"])
def test_a_good_endpoint_passes(endpoint):
    assert check_endpoint(endpoint) == endpoint


@pytest.mark.parametrize("args, says", [
    (["tcp://127.0.0.1:70000"], "a tcp port is a number from 1 to 65535"),
    (["ipc://"], "names no socket path"),
    (["tcp://127.0.0.1:5557", "--replay-endpoint", "tcp://127.0.0.1:notaport"], "'notaport'"),
    (["tcp://0.0.0.0:5557", "--bind"], "every interface"),
])
def test_the_cli_refuses_bad_endpoints_in_one_line(args, says, cli, tmp_path):
    r = cli(["listen", *args, "--out", tmp_path / "t"])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and says in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def _vllm(sources, metrics: str = "") -> dict:
    return {"/kv_event_sources": sources, "/metrics": metrics.encode()}


@pytest.mark.parametrize("routes, says", [
    (_vllm({"-3": {"endpoint": "ipc:///tmp/a.sock"}}), "rank '-3', not a number"),
    (_vllm({"0": {"endpoint": "tcp://10.1.2.3:5557"}}), "not on this host; pass --allow-remote"),
    (_vllm({"0": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://evil.example:5558"}}),
     "not on this host"),
    (_vllm({"0": {"endpoint": "tcp://0:5557"}}), "has host '0'"),
    (_vllm({"0": {"endpoint": "tcp://127.0.0.1:70000"}}), "from 1 to 65535"),
    (_vllm({"0": {"endpoint": ["x"]}}), "is list, not a tcp:// or ipc:// address"),
    (_vllm({"0": {"endpoint": "ipc:///tmp/a.sock"}},
           'vllm:cache_config_info{engine="0",block_size="0",num_gpu_blocks="10"} 1\n'), "block size 0, outside"),
    (_vllm({str(i): {"endpoint": f"ipc:///tmp/{i}.sock"} for i in range(1025)}), "more than 1024"),
    ({"/server_info": {"kv_events": {"endpoint_port_base": 5557, "dp_size": 10 ** 9}}}, "dp_size 1000000000"),
    ({"/server_info": {"kv_events": {"endpoint_port_base": 65535, "dp_size": 2}}}, "endpoint_port_base 65535"),
    ({"/server_info": {"kv_events": {"endpoint_port_base": 5557, "endpoint_host": "10.0.0.9"}}},
     "not on this host"),
    ({"/kv_event_sources": b"x" * (5 << 20)}, "more than 4 MiB"),
    ({"/kv_event_sources": (302, "http://192.0.2.1:9/kv_event_sources")}, "redirects to http://192.0.2.1"),
])
def test_discovery_refuses_what_a_server_should_not_say(routes, says):
    with http_server(routes) as url:
        with pytest.raises(KmeshTraceError, match=says.replace("(", r"\(").replace("[", r"\[")):
            discover(url)


def test_allow_remote_lets_a_loopback_server_name_another_host():
    with http_server(_vllm({"0": {"endpoint": "tcp://10.1.2.3:5557", "topic": "kv"}})) as url:
        (spec,) = discover(url, allow_remote=True)
    assert (spec.endpoint, spec.rank, spec.topic) == ("tcp://10.1.2.3:5557", 0, "kv")


def test_a_wildcard_publisher_is_dialled_on_the_servers_host_and_may_be_bound_there(cli, tmp_path):
    from kmesh_trace.cli.listen import _specs

    with http_server(_vllm({"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://0.0.0.0:5558"}})) as url:
        (spec,) = _specs([url], [], "", "auto", None, None, bind=True)
    assert (spec.endpoint, spec.replay_endpoint, spec.bind) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", True)


def test_an_ipv6_publisher_is_recorded(tmp_path):
    import zmq

    from kmesh_trace.capture.listen import Listener, PublisherSpec
    from kv_wire import frames, payload, stored  # tests/ is on sys.path

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.IPV6, 1)
    try:
        port = pub.bind_to_random_port("tcp://[::1]")
    except zmq.ZMQError as e:
        pub.close()
        ctx.term()
        pytest.skip(f"no IPv6 loopback here ({e})")
    out = tmp_path / "trace"
    listener = Listener(out, [PublisherSpec(f"tcp://[::1]:{port}", None, "kv")])
    try:
        assert pub.poll(20000) and pub.recv()[:1] == b"\x01"  # subscribed over IPv6
        pub.send_multipart(frames(0, payload(100.0, [stored(7)])))
        assert listener.subs[0].poll(20000)
        listener._on_live(listener.recorders[0], listener.subs[0].recv_multipart())
    finally:
        listener.close()
        pub.close(linger=0)
        ctx.term()
    assert listener.recorders[0].stats["num_batches"] == 1
