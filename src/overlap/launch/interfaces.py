"""Which network interface CPU ranks (gloo) use when the world spans several nodes.

gloo binds each rank to the address its host name resolves to, unless ``GLOO_SOCKET_IFNAME`` names
an interface. Many machines resolve their own name to a loopback address (Debian writes ``127.0.1.1
<hostname>`` into ``/etc/hosts``), and then every rank tells its peers on other nodes to connect to
127.x: the world never forms and the ranks fail after gloo's connect retries with "Connection
refused" from an address nobody chose. So a rank of a multi-node world (``WORLD_SIZE`` >
``LOCAL_WORLD_SIZE``, as torchrun sets them) picks the interface the kernel routes ``MASTER_ADDR``
through, the one the rendezvous itself works over, before the process group is made. A
``GLOO_SOCKET_IFNAME`` already set is the user's choice and is kept.

A ``MASTER_ADDR`` that resolves to nothing, or only to a loopback address, cannot carry a multi-node
world: that is one ConfigError naming the value and the fix, before any connection is tried.

NCCL chooses its own interfaces (``NCCL_SOCKET_IFNAME``), skipping loopback; nothing here applies to
GPU ranks.
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from overlap.errors import ConfigError

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
_IF_INET6 = Path("/proc/net/if_inet6")


@dataclass(frozen=True)
class Interface:
    """The interface a rank's gloo connections use, and the address of it that routes to
    MASTER_ADDR."""

    name: str
    address: str
    reason: str


def _int_env(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(
            name,
            text,
            "the launcher sets it to a whole number.",
            "start the ranks with torchrun (or srun + torchrun), which sets RANK, WORLD_SIZE, "
            "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.",
        ) from None


def spans_nodes(env: Mapping[str, str]) -> bool:
    """Whether this world has ranks on other nodes: torchrun's LOCAL_WORLD_SIZE counts this node's
    ranks only."""
    world = _int_env(env, "WORLD_SIZE")
    return _int_env(env, "LOCAL_WORLD_SIZE", world) < world


def _route_source(host: str, port: int) -> str:
    """This node's address that the kernel would use to reach `host` (a UDP connect sends
    nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise ConfigError(
            "MASTER_ADDR",
            host,
            f"the rendezvous host does not resolve here ({exc.strerror}).",
            "give torchrun an --rdzv-endpoint (or --master-addr) that every node can resolve, e.g. "
            "the first node's address.",
        ) from None
    errors = []
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(sockaddr)
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
                continue
            return probe.getsockname()[0]
    raise ConfigError(
        "MASTER_ADDR",
        host,
        f"no route from this node to the rendezvous host ({'; '.join(errors)}).",
        "give torchrun an --rdzv-endpoint on a network every node shares.",
    )


def _ipv4_interfaces() -> dict[str, str]:
    """Address -> interface name, the primary IPv4 address of each interface that has one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(
                    s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:  # no IPv4 address on it
                continue
            out[socket.inet_ntoa(reply[20:24])] = name
    return out


def _ipv6_interfaces() -> dict[str, str]:
    """Address -> interface name from /proc/net/if_inet6 (address, index, prefix, scope, flags,
    name)."""
    out = {}
    try:
        lines = _IF_INET6.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            out[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    return out


def _interface_of(address: str) -> str | None:
    ip = ipaddress.ip_address(address.split("%")[0])
    table = _ipv4_interfaces() if ip.version == 4 else _ipv6_interfaces()
    return table.get(str(ip))


def gloo_interface(env: Mapping[str, str]) -> Interface | None:
    """The interface to set as GLOO_SOCKET_IFNAME for this rank, or None when nothing needs setting:
    one node (gloo's own choice, loopback included, reaches every peer), or GLOO_SOCKET_IFNAME
    already set. Raises ConfigError for a MASTER_ADDR a multi-node world cannot use."""
    if env.get(GLOO_IFNAME) or not spans_nodes(env):
        return None
    host = env.get("MASTER_ADDR", "")
    if not host:
        raise ConfigError(
            "MASTER_ADDR",
            host,
            "a rank of a multi-node world needs the rendezvous host.",
            "start the ranks with torchrun, which sets MASTER_ADDR and MASTER_PORT.",
        )
    port = _int_env(env, "MASTER_PORT")
    source = _route_source(host, port)
    if ipaddress.ip_address(source.split("%")[0]).is_loopback:
        raise ConfigError(
            "MASTER_ADDR",
            host,
            f"it resolves to this node's loopback ({source}), and the world spans several nodes "
            f"(WORLD_SIZE={env['WORLD_SIZE']}, LOCAL_WORLD_SIZE={env.get('LOCAL_WORLD_SIZE')}): "
            "the ranks on other nodes cannot connect to an address there. torchrun passes the "
            "first node's host name; on this node that name resolves to loopback.",
            "give torchrun --local-addr with each node's own address (or fix the host name's entry "
            f"in /etc/hosts), or set {GLOO_IFNAME} to the interface the nodes share.",
        )
    name = _interface_of(source)
    if name is None:
        raise ConfigError(
            "MASTER_ADDR",
            host,
            f"no interface here holds {source}, the address that routes to the rendezvous host.",
            f"set {GLOO_IFNAME} to the interface the nodes share.",
        )
    return Interface(
        name, source, f"the route to MASTER_ADDR={host} leaves through {name} ({source})"
    )


# gloo's words when the other end of a connection went away, and the peer it names:
# "[10.0.0.2]:49304".
_PEER_GONE = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused"
)
_PEER = re.compile(r"\[([0-9A-Fa-f:.]+)\]:(\d+)")
# ... and when nothing came back within the process group's timeout (train.comm_timeout_s)
_SILENT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")


def lost_peer(error: str, rank: int, world: int, hosts: Mapping[str, list[int]]) -> str | None:
    """One line for a rank whose collective failed because a peer went away (its process or its node
    died: the ranks at that address are named when `hosts`, address -> ranks gathered at start-up,
    knows them) or went silent past the communication timeout; None when `error` is something else.
    """
    silent = _SILENT.search(error)
    if silent is not None:
        return (
            f"rank {rank} of {world} got no answer from its peers for train.comm_timeout_s="
            f"{int(silent.group(1)) / 1000:g} s (a {silent.group(2)} never completed): a rank or "
            "its node hung, stopped or was cut off from the network; see the other nodes' logs"
        )
    gone = _PEER_GONE.search(error)
    if gone is None:
        return None
    peer = _PEER.search(error)
    if peer is None:
        who = "a peer"
    else:
        ranks = hosts.get(peer.group(1))
        listed = ", ".join(map(str, ranks or []))
        plural = "rank" if len(ranks or []) == 1 else "ranks"
        who = f"{plural} {listed} on {peer.group(1)}" if ranks else f"the peer at {peer.group(1)}"
    return (
        f"rank {rank} of {world} lost its connection to {who} ({gone.group(0)}): that process or "
        "its node stopped, so this rank stops too; see that node's log for why"
    )
