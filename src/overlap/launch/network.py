"""Which network a run communicates over, and the emulated interconnect for local CPU runs.

`--network` takes one of:
- `real` (default): the backend's own transport (loopback TCP for local gloo ranks), nothing added;
- `tbf:RATE` (e.g. `tbf:800mbit`): all local ranks run inside a fresh network namespace whose
  loopback is rate limited by a token bucket (`tc ... tbf`). Traffic then really waits on a slow
  link, at little CPU cost, so an overlapped schedule can hide it the way it would hide a real
  interconnect. Needs root and iproute2 (`ip`, `tc`). That loopback is ONE queue for every rank
  pair, both directions and the TCP acknowledgements: a pipeline's activations (stage i -> i+1)
  wait behind its gradients (i+1 -> i), which a real interconnect would carry at the same time;
- `nic:RATE` (e.g. `nic:200mbit`): full-duplex NICs, the faithful emulation. Each local rank runs
  in a network namespace of its own (`overlap-<pid>-r<rank>`) with one veth interface (`nic`,
  address 10.77.0.<rank+1>) whose peer is a port of a bridge in namespace `overlap-<pid>`, as each
  GPU's NIC is a port of a switch. A token bucket on the rank's side of the veth shapes what the
  rank sends (its upload), one on the bridge's side what it receives (its download): every rank
  has RATE each way, transfers of different rank pairs or directions never share a queue (a
  rank's upload is shared by all it sends to, as one NIC's is), and a pipeline's activations and
  gradients cross at the same time. Each bucket holds 64 KiB (`NIC_BURST`), not tbf's 1 MiB: a NIC
  never sends faster than its line rate. gloo uses the veth (GLOO_SOCKET_IFNAME) and the
  rendezvous is rank 0's address on the bridge. Needs root and iproute2, as `tbf` does;
- `model:LATENCY,BANDWIDTH` (e.g. `model:100us,1GB/s`): the fallback where a namespace cannot be
  made. Collectives run for real and `comm.py` holds each one's completion back by a modelled time
  (see `overlap.parallel.link_model`).

Units: latency s / ms / us / ns; bandwidth B/s, KB/s, MB/s, GB/s (powers of 1000, as link speeds are
quoted), KiB/s, MiB/s, GiB/s, or bit rates kbit / mbit / gbit (per second). The tbf and nic RATE is
passed to `tc` as written (tc syntax: `800mbit`, `1gbit`; note that tc reads `mbps` as megaBYTES per
second).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from overlap.errors import ConfigError
from overlap.launch.interfaces import GLOO_IFNAME
from overlap.launch.kinds import parse_families

log = logging.getLogger("overlap")

FLAG = "--network"
MODEL_FALLBACK = "--network model:100us,1GB/s"
NETNS_ENV = "OVERLAP_NETNS"  # set for ranks started inside the emulated interconnect's namespace
EMULATED = ("tbf", "nic")  # the kinds that run the ranks in network namespaces (local launch only)

_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BYTE_RATE_UNITS = {
    "b/s": 1.0,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "kib/s": 2**10,
    "mib/s": 2**20,
    "gib/s": 2**30,
}
_BIT_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TC_BYTE_RATE_UNITS = {"bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_NUMBER = r"(\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class Network:
    """A parsed `--network` value."""

    kind: str  # "real" | "model" | "tbf" | "nic"
    text: str  # as the user wrote it
    # kind "model" (link_model.LinkModel's fields; kept torch-free for the launcher)
    latency_s: float | None = None
    bandwidth_Bps: float | None = None  # kind "model"
    rate: str | None = None  # kinds "tbf" and "nic", in tc syntax
    rate_Bps: float | None = None  # kinds "tbf" and "nic", for the record
    # kind "model": only these kinds' families use the link (None: all)
    families: tuple[str, ...] | None = None

    def describe(self) -> str:
        """One line that every result carries, so no number is read without knowing which link made
        it."""
        if self.kind == "model":
            only = f",{'+'.join(self.families)}" if self.families else ""
            scope = (
                f"; only {'/'.join(self.families)} collectives use it, the others run on the plain "
                "loopback"
                if self.families
                else ""
            )
            return (
                f"model:{_fmt_time(self.latency_s)},{_fmt_rate(self.bandwidth_Bps)}{only} "
                "(modelled link: real gloo transfer, completion held back to latency + factor x "
                "bytes / "
                f"bandwidth{scope})"
            )
        if self.kind == "tbf":
            return (
                f"tbf:{self.rate} (emulated interconnect: ranks in a network namespace, loopback "
                "rate-limited "
                f"to {self.rate_Bps / 1e6:.0f} MB/s by tc tbf)"
            )
        if self.kind == "nic":
            return (
                f"nic:{self.rate} (emulated full-duplex NICs: each rank in its own network "
                "namespace, a veth to a shared bridge, tc tbf limiting each direction to "
                f"{self.rate_Bps / 1e6:.0f} MB/s)"
            )
        return "real (the backend's own transport, nothing emulated; on one machine: loopback)"


def _fmt_scaled(value: float, units: dict[str, float], order: tuple[str, ...]) -> str:
    """`value` in the largest unit of `order` (largest first) that keeps it >= 1, e.g. 0.001 s ->
    "1ms"."""
    for unit in order:
        scaled = value / units[unit]
        if scaled >= 1 or unit == order[-1]:
            return f"{scaled:g}{unit}"
    raise AssertionError("unreachable")


def _fmt_time(seconds: float) -> str:
    return _fmt_scaled(seconds, _TIME_UNITS, ("s", "ms", "us", "ns"))


def _fmt_rate(bytes_per_s: float) -> str:
    return (
        _fmt_scaled(bytes_per_s, _BYTE_RATE_UNITS, ("gb/s", "mb/s", "kb/s", "b/s"))
        .upper()
        .replace("/S", "/s")
    )


def _bad(text: str, why: str) -> ConfigError:
    return ConfigError(
        FLAG,
        text,
        why,
        "use real, nic:RATE or tbf:RATE (e.g. nic:200mbit, needs root and iproute2) or "
        "model:LATENCY,BANDWIDTH (e.g. model:100us,1GB/s).",
    )


def parse_latency(text: str) -> float:
    m = re.fullmatch(_NUMBER + r"\s*(s|ms|us|ns)", text.strip().lower())
    if not m:
        raise _bad(text, "latency must be a number with a unit s, ms, us or ns.")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_bandwidth(text: str) -> float:
    """Bytes per second from `1GB/s`, `100MiB/s`, `800mbit`, `800mbit/s`."""
    low = text.strip().lower()
    m = re.fullmatch(_NUMBER + r"\s*([kmg]?i?b/s)", low)
    if m and m.group(2) in _BYTE_RATE_UNITS:
        value = float(m.group(1)) * _BYTE_RATE_UNITS[m.group(2)]
    else:
        m = re.fullmatch(_NUMBER + r"\s*([kmgt]?bit)(?:/s)?", low)
        if not m:
            raise _bad(
                text,
                "bandwidth must be a number with a unit B/s, KB/s, MB/s, GB/s, MiB/s, GiB/s, kbit, "
                "mbit or gbit.",
            )
        value = float(m.group(1)) * _BIT_RATE_UNITS[m.group(2)] / 8
    if value <= 0:
        raise _bad(text, "bandwidth must be positive.")
    return value


def _tc_rate_Bps(text: str) -> float:
    low = text.strip().lower()
    m = re.fullmatch(_NUMBER + r"([kmgt]?bit|[kmgt]?bps)", low)
    if not m:
        raise _bad(
            text, "the rate must be in tc syntax, e.g. 800mbit, 1gbit or 100mbps (megabytes/s)."
        )
    number, unit = float(m.group(1)), m.group(2)
    value = (
        number * _BIT_RATE_UNITS[unit] / 8
        if unit in _BIT_RATE_UNITS
        else number * _TC_BYTE_RATE_UNITS[unit]
    )
    if value <= 0:
        raise _bad(text, "the rate must be positive.")
    return value


def parse_network(text: str | None) -> Network:
    if text is None or text.strip().lower() in ("", "real"):
        return Network("real", "real")
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind == "model":
        parts = rest.split(",")
        if len(parts) not in (2, 3):
            raise _bad(
                text,
                "a modelled link needs a latency and a bandwidth (and optionally the families that "
                "use it, e.g. model:1ms,10MB/s,ep).",
            )
        families = parse_families(FLAG, text, parts[2]) if len(parts) == 3 else None
        return Network(
            "model",
            text,
            latency_s=parse_latency(parts[0]),
            bandwidth_Bps=parse_bandwidth(parts[1]),
            families=families,
        )
    if kind in EMULATED:
        rate = rest.strip().lower()
        return Network(kind, text, rate=rate, rate_Bps=_tc_rate_Bps(rate))
    raise _bad(text, "unknown network kind.")


def check_network_for(network: Network, gpu: str) -> None:
    """The modelled and emulated links stand in for an interconnect between CPU ranks: refused with
    a GPU type."""
    if gpu != "cpu" and network.kind != "real":
        raise ConfigError(
            FLAG,
            network.text,
            f"the {'modelled' if network.kind == 'model' else 'emulated'} link "
            "stands in for an interconnect between CPU ranks. On GPUs the collectives run over "
            "NCCL on the device, where the GPU timeline measures them; a delay added on the host "
            "would measure nothing of the device.",
            f"drop --network for -g {gpu} (the real network), or compare links with -g cpu.",
        )


def check_netns_support(value: str = "tbf") -> None:
    """Raise a ConfigError naming the fallback if this process cannot build an emulated
    interconnect (`value`: the --network value asked for, named in the error)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            FLAG,
            value,
            f"the emulated interconnect needs iproute2 ({', '.join(missing)} not found).",
            f"install iproute2, or use the modelled link instead: {MODEL_FALLBACK}.",
        )
    if os.geteuid() != 0:
        raise ConfigError(
            FLAG,
            value,
            "creating a network namespace needs root.",
            f"run as root, or use the modelled link instead: {MODEL_FALLBACK}.",
        )


def ip(*args: str, value: str = "tbf") -> None:
    """Run `ip ARGS`; a failure is a ConfigError naming the command and the fallback (`value`: the
    --network value being built)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(
            FLAG,
            value,
            f"`ip {' '.join(args)}` failed: {done.stderr.strip() or done.returncode}.",
            f"check network-namespace support here, or use the modelled link: {MODEL_FALLBACK}.",
        )


NETNS_PREFIX = "overlap-"  # our namespaces are named overlap-<pid of the launcher that made them>


def _launcher_alive(pid: int) -> bool:
    """Whether `pid` is still an overlap launcher (a reused pid running something else does not
    count)."""
    try:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return False
    return b"overlap" in cmdline


def kill_inside(name: str) -> int:
    """SIGKILL every process in namespace `name` (as a machine that dies takes its processes);
    returns how many."""
    listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    pids = listed.stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    return len(pids)


def remove_stale_namespaces(
    prefix: str = NETNS_PREFIX, owner_alive: Callable[[int], bool] = _launcher_alive
) -> list[str]:
    """Delete the namespaces an earlier owner made and could not remove (it was killed with
    SIGKILL): named <prefix><pid> or <prefix><pid>-<suffix>, with that pid no longer `owner_alive`.
    Processes still inside one are orphaned ranks and are killed first. Returns the names removed;
    each is logged."""
    ours = re.compile(re.escape(prefix) + r"(\d+)(?:-[A-Za-z0-9]+)?")
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = ours.fullmatch(name)
        if not m or int(m.group(1)) == os.getpid() or owner_alive(int(m.group(1))):
            continue
        killed = kill_inside(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
        orphans = f"; killed {killed} orphaned process(es) inside it" if killed else ""
        log.warning(
            "removed stale network namespace %s: its owner (pid %s) is gone%s",
            name,
            m.group(1),
            orphans,
        )
    return removed


@contextmanager
def network_namespace(name: str, value: str = "tbf") -> Iterator[list[str]]:
    """Create namespace `name` with its loopback up; yield the command prefix that runs a process
    inside it. On exit, also when the body fails, what still runs inside is killed and the
    namespace deleted (its interfaces with it: a veth goes with either end)."""
    ip("netns", "add", name, value=value)
    try:
        ip("-n", name, "link", "set", "lo", "up", value=value)
        yield ["ip", "netns", "exec", name]
    finally:
        kill_inside(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# The token bucket's depth: bytes that pass at the line rate after the link has been idle long
# enough to refill them (tc sizes: "mb" is 1024 x 1024 bytes). The planner models it
# (`overlap.plan.hardware.TokenBucket`).
TBF_BURST, TBF_BURST_BYTES = "1mb", 1 << 20


def token_bucket(namespace: str, device: str, rate: str, burst: str, value: str) -> None:
    """Rate-limit what `device` in `namespace` sends (its egress) to `rate` with tc's token bucket
    of depth `burst` (packets that would wait over 100 ms are dropped, as a full queue drops
    them)."""
    tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", "100ms"]
    ip("netns", "exec", namespace, "tc", "qdisc", "replace", "dev", device, *tbf, value=value)


@contextmanager
def emulated_interconnect(rate: str, name: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """Create namespace `name` (default overlap-<pid>) with a rate-limited loopback; yield (name,
    command prefix that runs a process inside it). The namespace is deleted on exit, also when the
    body fails. Namespaces left behind by earlier launchers that are gone are removed first
    (`remove_stale_namespaces`)."""
    value = f"tbf:{rate}"
    check_netns_support(value)
    remove_stale_namespaces()
    name = name or f"{NETNS_PREFIX}{os.getpid()}"
    with network_namespace(name, value) as prefix:
        token_bucket(name, "lo", rate, TBF_BURST, value)
        yield name, prefix


NIC = "nic"  # each rank's interface, inside the rank's own namespace (GLOO_SOCKET_IFNAME)
SWITCH = "switch"  # the bridge every rank's veth is a port of
NIC_SUBNET = ipaddress.IPv4Network("10.77.0.0/16")  # inside our own namespaces only
# A NIC's bucket: one GSO packet (64 KiB), the least a token bucket passes whole. A real NIC sends
# at its line rate and never faster; tbf's 1 MiB bucket would let a pipeline's activation (~131 KB
# for dense_tiny) cross at the veth's own speed after any pause, hiding the very link time the
# emulation is for. The planner models it (`overlap.plan.calibrate.cpu_cluster`).
NIC_BURST, NIC_BURST_BYTES = "64kb", 1 << 16


def nic_address(rank: int) -> str:
    """Rank `rank`'s address on the emulated NICs' bridge (rank 0's is the rendezvous)."""
    return str(NIC_SUBNET.network_address + rank + 1)


@dataclass(frozen=True)
class EmulatedRanks:
    """Where the local ranks of an emulated interconnect run: what `launch_local` needs."""

    namespace: str  # the link's namespace (tbf: the ranks' own; nic: the bridge's), to report
    prefixes: tuple[tuple[str, ...], ...]  # per rank: the prefix that runs it in its namespace
    master_addr: str  # the rendezvous (the TCP store), rank 0's address
    env: dict[str, str]  # for every rank's environment


@contextmanager
def full_duplex_nics(rate: str, world: int, name: str | None = None) -> Iterator[EmulatedRanks]:
    """`nic:RATE` (module docstring) for `world` local ranks: a bridge in namespace `name` (default
    overlap-<pid>), and per rank a namespace `name`-r<rank> whose veth `nic` is a port of it, each
    direction shaped to `rate`. Every namespace (and with it every veth and the bridge) is deleted
    on exit, also when the body fails, what runs inside them killed first; namespaces of earlier
    launchers that are gone are removed first (`remove_stale_namespaces`, which knows both names).
    """
    value = f"nic:{rate}"
    check_netns_support(value)
    remove_stale_namespaces()
    name = name or f"{NETNS_PREFIX}{os.getpid()}"
    with ExitStack() as stack:  # unwinds the ranks' namespaces first, then the bridge's
        stack.enter_context(network_namespace(name, value))
        ip("-n", name, "link", "add", SWITCH, "type", "bridge", value=value)
        ip("-n", name, "link", "set", SWITCH, "up", value=value)
        prefixes = []
        for rank in range(world):
            inside, port = f"{name}-r{rank}", f"r{rank}"
            prefixes.append(tuple(stack.enter_context(network_namespace(inside, value))))
            veth = ["type", "veth", "peer", "name", NIC, "netns", inside]
            ip("-n", name, "link", "add", port, *veth, value=value)
            ip("-n", name, "link", "set", port, "master", SWITCH, "up", value=value)
            address = f"{nic_address(rank)}/{NIC_SUBNET.prefixlen}"
            ip("-n", inside, "addr", "add", address, "dev", NIC, value=value)
            ip("-n", inside, "link", "set", NIC, "up", value=value)
            token_bucket(inside, NIC, rate, NIC_BURST, value)  # what the rank sends: its upload
            token_bucket(name, port, rate, NIC_BURST, value)  # what the bridge hands it: download
        yield EmulatedRanks(
            name, tuple(prefixes), nic_address(0), {NETNS_ENV: name, GLOO_IFNAME: NIC}
        )


@contextmanager
def emulated_ranks(network: Network, world: int) -> Iterator[EmulatedRanks]:
    """The namespaces of an emulated `network` (a kind in EMULATED) for `world` local ranks."""
    if network.kind == "nic":
        with full_duplex_nics(network.rate, world) as ranks:
            yield ranks
        return
    with emulated_interconnect(network.rate) as (name, prefix):
        yield EmulatedRanks(name, (tuple(prefix),) * world, "127.0.0.1", {NETNS_ENV: name})
