"""`--network nic:RATE` (overlap.launch.network.full_duplex_nics): each local rank in a network
namespace of its own, a veth to a shared bridge, each direction shaped by its own token bucket.

- the wiring: a rank's upload is shaped on its side of the veth, its download on the bridge's side;
  every rank has its address on the bridge's subnet; every namespace goes, also when the body
  fails;
- training: a pipeline run over the emulated NICs (the ranks in separate namespaces, gloo on the
  veths, the rendezvous at rank 0's address) gives the losses of the same run on the plain loopback
  exactly (the same operations in the same order), with two ranks and with four.

- full duplex, timed with generous bounds (a loaded 2-core machine): two ranks sending 8 MB to each
  other at once take about what one direction alone takes (measured: 1.05-1.3x), where on `tbf:`
  the same two transfers share one queue and take at least twice the line time (measured: 2.1x).
  Each side of the probe is a few lines of plain sockets (`PROBE`): little CPU, the link sets the
  time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from overlap.launch import network as net
from tests.local_run import run_locally

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated NICs need root and iproute2",
)

TINY = "-m qwen -mr dense_tiny -g cpu -mb 1 model.hidden_size=64 -sl 32".split()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _qdisc(prefix: tuple[str, ...], device: str) -> str:
    shown = subprocess.run(
        [*prefix, "tc", "qdisc", "show", "dev", device], capture_output=True, text=True
    )
    return shown.stdout


def _tbf(qdisc: str) -> tuple[float, float]:
    """(rate bit/s, burst bytes) of tc's line for a tbf qdisc (it prints the burst it could make of
    the rate's table, e.g. 65512b for 64Kb)."""
    m = re.search(r"qdisc tbf .* rate (\d+)([KMG]?)bit burst (\d+)(K?)b", qdisc)
    assert m, qdisc
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}
    return int(m.group(1)) * scale[m.group(2)], int(m.group(3)) * (1024 if m.group(4) else 1)


def test_each_rank_gets_a_shaped_upload_and_download_and_every_namespace_goes():
    name = f"overlap-{os.getpid()}-t"
    names = [name, *(f"{name}-r{r}" for r in range(3))]
    try:
        with pytest.raises(KeyError):
            with net.full_duplex_nics("300mbit", 3, name) as ranks:
                assert ranks.namespace == name and ranks.master_addr == "10.77.0.1"
                assert ranks.env == {net.NETNS_ENV: name, "GLOO_SOCKET_IFNAME": net.NIC}
                listed = _namespaces()
                assert all(n in listed for n in names)
                bridge = ("ip", "netns", "exec", name)
                for r, prefix in enumerate(ranks.prefixes):
                    assert prefix == ("ip", "netns", "exec", f"{name}-r{r}")
                    upload, download = _qdisc(prefix, net.NIC), _qdisc(bridge, f"r{r}")
                    for shaped in (upload, download):
                        assert _tbf(shaped) == pytest.approx((300e6, net.NIC_BURST_BYTES), rel=0.01)
                    shown = subprocess.run(
                        [*prefix, "ip", "-4", "addr", "show", "dev", net.NIC],
                        capture_output=True,
                        text=True,
                    ).stdout
                    assert f"inet {net.nic_address(r)}/16" in shown
                raise KeyError("a failing body must still remove every namespace")
        listed = _namespaces()
        assert not any(n in listed.split() for n in names), listed
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


@pytest.mark.parametrize(
    "args",
    [
        # PP 2 on 2 ranks, the overlapped p2p: activations and gradients cross at once
        [
            "-ng",
            "2",
            "-pp",
            "2",
            "-gb",
            "4",
            "model.num_layers=2",
            "comm_overlap.batch_p2p_comm=false",
            "comm_overlap.overlap_p2p_comm=true",
        ],
        # PP 4 on 4 ranks, batched p2p (Bridge's default at VPP 1)
        ["-ng", "4", "-pp", "4", "-gb", "4", "model.num_layers=4"],
    ],
    ids=["pp2-overlapped", "pp4-batched"],
)
def test_a_pipeline_over_the_emulated_nics_trains_like_the_plain_loopback(tmp_path, args):
    args = [*TINY, *args, "-ms", "2"]
    over_nics = run_locally([*args, "--network", "nic:200mbit"], tmp_path / "nic.jsonl")
    assert over_nics == run_locally(args, tmp_path / "real.jsonl")
    summary = (tmp_path / "nic.jsonl.summary.json").read_text()
    assert "nic:200mbit (emulated full-duplex NICs" in summary


# --- full duplex, timed ---------------------------------------------------------------------------
PROBE_BYTES = 8_000_000
PROBE_PORT = 5055


# One side of the probe, run with `python -c` (the standard library only: it starts at once):
# connect both ways, then send argv[3] bytes while receiving argv[4]; print the seconds from a
# common start (a byte each way) until both are done and the peer has all it was sent.
PROBE = """
import socket, sys, threading, time
me, peer, send_n, recv_n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
server = socket.create_server((me, PORT))
for _ in range(400):
    try:
        out = socket.create_connection((peer, PORT))
        break
    except OSError:
        time.sleep(0.025)
inc, _ = server.accept()
out.sendall(b"s")
assert inc.recv(1) == b"s"
start = time.perf_counter()
sender = threading.Thread(target=out.sendall, args=(bytes(send_n),))
sender.start()
got = 0
while got < recv_n:
    got += len(inc.recv(min(1 << 20, recv_n - got)))
sender.join()
out.sendall(b"d")
assert inc.recv(1) == b"d"
print(time.perf_counter() - start, flush=True)
""".replace("PORT", str(PROBE_PORT))


def _exchange(prefixes, addresses, both: bool) -> float:
    """Seconds for rank 0 -> rank 1 (and rank 1 -> rank 0 at once when `both`), the slower side."""
    sizes = [(PROBE_BYTES, PROBE_BYTES if both else 0), (PROBE_BYTES if both else 0, PROBE_BYTES)]
    procs = [
        subprocess.Popen(
            [*prefixes[k], sys.executable, "-c", PROBE, addresses[k], addresses[1 - k]]
            + list(map(str, sizes[k])),
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in (0, 1)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return max(float(o) for o in outs)


def test_both_directions_at_once_take_what_one_takes_on_nic_and_twice_on_tbf():
    rate = "200mbit"  # 25 MB/s: 8 MB in ~0.32 s
    line_s = PROBE_BYTES / 25e6
    with net.full_duplex_nics(rate, 2, f"overlap-{os.getpid()}-d") as ranks:
        addresses = [net.nic_address(0), net.nic_address(1)]
        one = min(_exchange(ranks.prefixes, addresses, False) for _ in range(2))
        both = min(_exchange(ranks.prefixes, addresses, True) for _ in range(2))
    assert one >= 0.9 * (PROBE_BYTES - net.NIC_BURST_BYTES) / 25e6  # the NIC's rate holds
    assert both < 1.6 * one, (one, both)  # a shared queue would take 2x
    with net.emulated_interconnect(rate, f"overlap-{os.getpid()}-l") as (_, prefix):
        shared = _exchange((prefix, prefix), ["127.0.0.1", "127.0.0.2"], True)
    # one queue: 16 MB at the line rate, less the bucket's 1 MiB
    assert shared >= 0.95 * (2 * line_s - net.TBF_BURST_BYTES / 25e6), shared
