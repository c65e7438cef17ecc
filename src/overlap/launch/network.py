"""Which network a run communicates over, and the emulated interconnect for local CPU runs.

`--network` takes one of:
- `real` (default): the backend's own transport (loopback TCP for local gloo ranks), nothing added;
- `tbf:RATE` (e.g. `tbf:800mbit`): all local ranks run inside a fresh network namespace whose
  loopback is rate limited by a token bucket (`tc ... tbf`). Traffic then really waits on a slow
  link, at little CPU cost, so an overlapped schedule can hide it the way it would hide a real
  interconnect. Needs root and iproute2 (`ip`, `tc`);
- `model:LATENCY,BANDWIDTH` (e.g. `model:100us,1GB/s`): the fallback where a namespace cannot be
  made. Collectives run for real and `comm.py` holds each one's completion back by a modelled time
  (see `overlap.parallel.link_model`).

Units: latency s / ms / us / ns; bandwidth B/s, KB/s, MB/s, GB/s (powers of 1000, as link speeds are
quoted), KiB/s, MiB/s, GiB/s, or bit rates kbit / mbit / gbit (per second). The tbf RATE is passed
to `tc` as written (tc syntax: `800mbit`, `1gbit`; note that tc reads `mbps` as megaBYTES per
second).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from overlap.errors import ConfigError
from overlap.launch.kinds import parse_families

log = logging.getLogger("overlap")

FLAG = "--network"
MODEL_FALLBACK = "--network model:100us,1GB/s"
NETNS_ENV = "OVERLAP_NETNS"  # set for ranks started inside the emulated interconnect's namespace

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

    kind: str  # "real" | "model" | "tbf"
    text: str  # as the user wrote it
    # kind "model" (link_model.LinkModel's fields; kept torch-free for the launcher)
    latency_s: float | None = None
    bandwidth_Bps: float | None = None  # kind "model"
    rate: str | None = None  # kind "tbf", in tc syntax
    rate_Bps: float | None = None  # kind "tbf", for the record
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
        "use real, tbf:RATE (e.g. tbf:800mbit, needs root and iproute2) or model:LATENCY,BANDWIDTH "
        "(e.g. model:100us,1GB/s).",
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
            text, "the tbf rate must be in tc syntax, e.g. 800mbit, 1gbit or 100mbps (megabytes/s)."
        )
    number, unit = float(m.group(1)), m.group(2)
    value = (
        number * _BIT_RATE_UNITS[unit] / 8
        if unit in _BIT_RATE_UNITS
        else number * _TC_BYTE_RATE_UNITS[unit]
    )
    if value <= 0:
        raise _bad(text, "the tbf rate must be positive.")
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
    if kind == "tbf":
        rate = rest.strip().lower()
        return Network("tbf", text, rate=rate, rate_Bps=_tc_rate_Bps(rate))
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


def check_netns_support() -> None:
    """Raise a ConfigError naming the fallback if this process cannot build an emulated
    interconnect."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ConfigError(
            FLAG,
            "tbf",
            f"the emulated interconnect needs iproute2 ({', '.join(missing)} not found).",
            f"install iproute2, or use the modelled link instead: {MODEL_FALLBACK}.",
        )
    if os.geteuid() != 0:
        raise ConfigError(
            FLAG,
            "tbf",
            "creating a network namespace needs root.",
            f"run as root, or use the modelled link instead: {MODEL_FALLBACK}.",
        )


def ip(*args: str) -> None:
    """Run `ip ARGS`; a failure is a ConfigError naming the command and the fallback."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ConfigError(
            FLAG,
            "tbf",
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
def network_namespace(name: str) -> Iterator[list[str]]:
    """Create namespace `name` with its loopback up; yield the command prefix that runs a process
    inside it. On exit, also when the body fails, what still runs inside is killed and the
    namespace deleted."""
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        yield ["ip", "netns", "exec", name]
    finally:
        kill_inside(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


# The token bucket's depth: bytes that pass at the line rate after the link has been idle long
# enough to refill them (tc sizes: "mb" is 1024 x 1024 bytes). The planner models it
# (`overlap.plan.hardware.TokenBucket`).
TBF_BURST, TBF_BURST_BYTES = "1mb", 1 << 20


@contextmanager
def emulated_interconnect(rate: str, name: str | None = None) -> Iterator[tuple[str, list[str]]]:
    """Create namespace `name` (default overlap-<pid>) with a rate-limited loopback; yield (name,
    command prefix that runs a process inside it). The namespace is deleted on exit, also when the
    body fails. Namespaces left behind by earlier launchers that are gone are removed first
    (`remove_stale_namespaces`)."""
    check_netns_support()
    remove_stale_namespaces()
    name = name or f"{NETNS_PREFIX}{os.getpid()}"
    with network_namespace(name) as prefix:
        ip(
            "netns",
            "exec",
            name,
            "tc",
            "qdisc",
            "replace",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            TBF_BURST,
            "latency",
            "100ms",
        )
        yield name, prefix
