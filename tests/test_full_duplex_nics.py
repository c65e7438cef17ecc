"""`--network nic:RATE` (overlap.launch.network.full_duplex_nics): each local rank in a network
namespace of its own, a veth to a shared bridge, each direction shaped by its own token bucket.

- the wiring: a rank's upload is shaped on its side of the veth, its download on the bridge's side;
  every rank has its address on the bridge's subnet; every namespace goes, also when the body
  fails;
- training: a pipeline run over the emulated NICs (the ranks in separate namespaces, gloo on the
  veths, the rendezvous at rank 0's address) gives the losses of the same run on the plain loopback
  exactly (the same operations in the same order), with two ranks and with four.

Not timed here (a loaded 2-core machine): that both directions carry at once is the design, which
the wiring test pins (a queue per direction and per rank).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

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
