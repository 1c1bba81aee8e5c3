"""Publisher endpoints: what a `tcp://` or `ipc://` address may be, and where the listener may connect or bind.

Every endpoint, given on the command line or announced by a server, is checked here before a socket
sees it: a tcp port is 1..65535 (libzmq would wrap 70000 to 4464), a host is a name, a dotted IPv4
address or a bracketed IPv6 one (`0`, `0x0` or `127.1`, which resolvers read as other addresses, are
refused), an ipc path fits a Unix socket address (107 bytes). The policy: publishers announced by a
server on a loopback URL must be on this host unless `--allow-remote`; the listener binds only a
loopback address or the host it was named (never every interface).
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from kmesh_trace.errors import KmeshTraceError

#: The longest ipc:// path a Unix socket address holds (sun_path is 108 bytes with its terminating NUL).
MAX_IPC_PATH = 107
UNSPECIFIED = ("*", "0.0.0.0", "::", "[::]")
# A host name's last label starts with a letter: `0x7f` or `127.1` are read as addresses by resolvers.
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9-]{0,62}\.)*[A-Za-z][A-Za-z0-9-]{0,62}\.?$")
_IPV4 = re.compile(r"^(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}$")


def split_tcp(endpoint: str) -> tuple[str, int]:
    """(host, port) of a tcp:// endpoint; the host of an IPv6 one without its brackets."""
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise KmeshTraceError(f"{endpoint} is not a tcp:// endpoint: give tcp://HOST:PORT.")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise KmeshTraceError(f"{endpoint} has port {port!r}: a tcp port is a number from 1 to 65535.")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise KmeshTraceError(f"{endpoint} has host {host}, which is not an IPv6 address.") from None
        return host[1:-1], int(port)
    if host == "*" or _IPV4.match(host) or _NAME.match(host):
        return host, int(port)
    raise KmeshTraceError(f"{endpoint} has host {host!r}: give a host name, a dotted IPv4 address (all four "
                          "numbers) or an IPv6 address in brackets.")


def check_endpoint(endpoint: object, what: str = "endpoint") -> str:
    """`endpoint` if it is a usable tcp:// or ipc:// address, else a one-sentence error naming `what`."""
    if not isinstance(endpoint, str):
        raise KmeshTraceError(f"the {what} is {type(endpoint).__name__}, not a tcp:// or ipc:// address.")
    if endpoint.startswith("tcp://"):
        split_tcp(endpoint)
        return endpoint
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            raise KmeshTraceError(f"the {what} {endpoint} names no socket path: give ipc:///PATH.")
        if len(path.encode()) > MAX_IPC_PATH:
            raise KmeshTraceError(f"the {what} {endpoint[:60]}... has a path of {len(path.encode())} bytes; a Unix "
                                  f"socket path holds at most {MAX_IPC_PATH}: use a shorter one.")
        return endpoint
    raise KmeshTraceError(f"the {what} {endpoint} is not a tcp://HOST:PORT or ipc://PATH address.")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def url_host(url: str) -> str:
    host = urlsplit(url).hostname
    if not host:
        raise KmeshTraceError(f"{url} names no host: give http://HOST:PORT.")
    return host


def check_connect(endpoint: str, url: str, allow_remote: bool) -> None:
    """A server on a loopback URL announced `endpoint`: it must be on this host unless `allow_remote`."""
    if allow_remote or not endpoint.startswith("tcp://") or not is_loopback(url_host(url)):
        return
    host, _ = split_tcp(endpoint)
    if not is_loopback(host):
        raise KmeshTraceError(f"{url} announces a publisher at {endpoint}, which is not on this host; pass "
                              "--allow-remote to connect to it.")


def check_bind(endpoint: str, named_host: str | None = None) -> None:
    """The listener binds `endpoint` (`--bind`): only a loopback address or the host it was named."""
    host, _ = split_tcp(endpoint)
    if host in UNSPECIFIED or host == "[::]":
        raise KmeshTraceError(f"--bind would bind {endpoint} on every interface; give the address to bind "
                              "(e.g. tcp://127.0.0.1:PORT).")
    if not is_loopback(host) and host != named_host:
        raise KmeshTraceError(f"--bind binds only a loopback address or the host named in the source, not "
                              f"{endpoint}.")
