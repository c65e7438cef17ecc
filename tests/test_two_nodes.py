"""Two nodes for real on one machine: two network namespaces joined by a veth pair, each with its
own address, and torchrun in each (c10d rendezvous at node 0's address) running `overlap run` across
them - what a cluster run goes through: the rendezvous, ranks and LOCAL_RANK from the environment,
the group layout across hosts, gloo over a real interface (the rank picks it,
overlap.launch.interfaces). Losses equal the single-host run's exactly (same ranks, same operations
in the same order). A node that dies mid-run stops every rank with the cause named; a rendezvous
address that cannot work gets one clear error; both in bounded time. Needs root and iproute2
(skipped otherwise).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import pytest

from overlap.errors import ConfigError
from overlap.launch.network import (
    check_netns_support,
    ip,
    kill_inside,
    network_namespace,
    remove_stale_namespaces,
)
from tests.local_run import metrics_losses, run_locally

# ovl2n-<pid of the test process>-<node>: unique per run, swept once that process is gone
PREFIX = "ovl2n-"
ADDRESSES = ("10.77.0.1", "10.77.0.2")  # inside our own namespaces only
TINY = "-m qwen -mr dense_tiny -g cpu model.num_layers=1 model.hidden_size=64 -sl 32".split()
_ports = count(29611)


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@dataclass
class Nodes:
    names: tuple[str, str]
    prefixes: tuple[list[str], list[str]]


@pytest.fixture(scope="module")
def nodes():
    try:
        check_netns_support()
    except ConfigError as exc:
        pytest.skip(f"two nodes on one machine need network namespaces: {exc}")
    remove_stale_namespaces(PREFIX, _pid_alive)
    names = tuple(f"{PREFIX}{os.getpid()}-{k}" for k in range(2))
    with ExitStack() as stack:  # deleted on every way out, the veth pair with them
        prefixes = tuple(stack.enter_context(network_namespace(name)) for name in names)
        veth = f"link add node0 type veth peer name node1 netns {names[1]}"
        ip("-n", names[0], *veth.split())
        for k, name in enumerate(names):
            ip("-n", name, "addr", "add", f"{ADDRESSES[k]}/24", "dev", f"node{k}")
            ip("-n", name, "link", "set", f"node{k}", "up")
        yield Nodes(names, prefixes)


@dataclass
class Node:
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def launch(nodes, tmp_path):
    """Start torchrun on both nodes; whatever a test leaves running is killed at its end."""
    started: list[Node] = []

    def start(
        args: list[str],
        per_node: int = 1,
        endpoint: str | None = None,
        local_addr: bool = True,
        only: tuple[int, ...] = (0, 1),
        rdzv_conf: tuple[str, ...] = (),
    ) -> list[Node]:
        port, run_id = next(_ports), uuid.uuid4().hex[:8]
        for k in only:
            conf = ",".join((*(["is_host=1"] if k == 0 else []), *rdzv_conf))
            rdzv = f"--rdzv-backend c10d --rdzv-endpoint {endpoint or f'{ADDRESSES[0]}:{port}'}"
            torchrun = [
                *f"{sys.executable} -m torch.distributed.run --nnodes 2".split(),
                *f"--nproc-per-node {per_node} {rdzv} --rdzv-id {run_id}".split(),
                # this machine's host name resolves to loopback: each node names its own address, as
                # on a cluster whose /etc/hosts gets it right
                *(["--local-addr", ADDRESSES[k]] if local_addr else []),
                *(["--rdzv-conf", conf] if conf else []),
            ]
            log = tmp_path / f"node{k}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [*nodes.prefixes[k], *torchrun, "-m", "overlap.cli", "run", *args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1"},
                )
            started.append(Node(proc, log))
        return started[-len(only) :]

    yield start
    for node in started:
        if node.proc.poll() is None:
            os.killpg(node.proc.pid, signal.SIGKILL)
        node.proc.wait()
    for name in nodes.names:
        kill_inside(name)  # the workers torchrun started in sessions of their own


def _wait(pair: list[Node], timeout: float) -> list[int]:
    until = time.monotonic() + timeout
    codes = []
    for node in pair:
        try:
            codes.append(node.proc.wait(timeout=max(0.1, until - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"not done within {timeout:.0f} s:\n" + "\n".join(n.text()[-3000:] for n in pair)
            ) from None
    return codes


def _training(pair: list[Node], metrics: Path) -> None:
    """Wait until rank 0 has logged two iterations: the world formed and trains."""
    until = time.monotonic() + 60
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert time.monotonic() < until and all(n.proc.poll() is None for n in pair), (
            pair[0].text()[-3000:] + pair[1].text()[-3000:]
        )
        time.sleep(0.2)


@pytest.mark.parametrize(
    "case, args, per_node",
    [
        # data parallel: one rank per node, the gradient all-reduce crosses the link
        ("dp", [*TINY, "-ng", "2", "-ms", "3"], 1),
        # expert parallel over 4 ranks, 2 per node (LOCAL_RANK 0 and 1 on each), all-to-all
        # overlapped
        ("ep", "-m qwen -mr qwen3_moe_tiny -g cpu -ng 4 -ms 3 --moe_a2a_overlap true".split(), 2),
    ],
)
def test_losses_across_two_nodes_equal_the_single_host_run(launch, tmp_path, case, args, per_node):
    metrics = tmp_path / "two_nodes.jsonl"
    pair = launch([*args, "--metrics", str(metrics)], per_node=per_node)
    assert _wait(pair, 90) == [0, 0], pair[0].text()[-3000:] + pair[1].text()[-3000:]
    head = pair[0].text()
    chosen = "GLOO_SOCKET_IFNAME=node0: the route to MASTER_ADDR=10.77.0.1 leaves through node0"
    assert chosen in head
    if case == "ep":
        assert "EP 4" in head
    want = run_locally(args, tmp_path / "single.jsonl")
    assert metrics_losses(metrics) == want  # tolerance 0: the same operations in the same order


def test_a_node_that_dies_stops_every_rank_with_the_cause_named(launch, nodes, tmp_path):
    metrics = tmp_path / "m.jsonl"
    pair = launch([*TINY, "-ng", "2", "-ms", "400", "--metrics", str(metrics)])
    _training(pair, metrics)
    killed_at = time.monotonic()
    assert kill_inside(nodes.names[1]) >= 2  # node 1 dies: its torchrun and its rank, at once
    code = _wait(pair[:1], 60)[0]
    assert code != 0 and time.monotonic() - killed_at < 60
    text = pair[0].text()
    errors = [line for line in text.splitlines() if line.startswith("overlap: error:")]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith(
        f"overlap: error: rank 0 of 2 lost its connection to rank 1 on {ADDRESSES[1]} ("
    ), errors[0]


def test_a_rendezvous_host_that_resolves_to_loopback_is_one_clear_error(launch):
    # Without --local-addr torchrun hands the workers node 0's host name: here that is 127.0.0.1.
    pair = launch([*TINY, "-ng", "2", "-ms", "3"], local_addr=False)
    codes = _wait(pair, 60)
    for node, code in zip(pair, codes):
        text = node.text()
        assert code != 0
        errors = [line for line in text.splitlines() if line.startswith("overlap: error:")]
        assert len(errors) == 1, text[-3000:]
        assert "it resolves to this node's loopback" in errors[0] and "--local-addr" in errors[0]
        assert "Gloo connectFullMesh failed" not in text  # stopped before any connection was tried


def test_a_rendezvous_endpoint_nobody_serves_fails_in_bounded_time(launch):
    # torchrun's own check, before any overlap rank exists: bounded by the c10d store's read
    # timeout (two tries).
    started = time.monotonic()
    (node,) = launch(
        [*TINY, "-ng", "2", "-ms", "3"],
        endpoint=f"{ADDRESSES[0]}:{next(_ports)}",
        only=(1,),
        rdzv_conf=("read_timeout=5",),
    )
    assert _wait([node], 45) == [1] and time.monotonic() - started < 45
    text = node.text()
    failed = "RendezvousConnectionError: The connection to the C10d store has failed"
    assert failed in text, text[-3000:]
    assert "Launch environment" not in text  # no rank was started


def test_a_node_cut_off_from_the_network_is_bounded_by_the_comm_timeout(launch, nodes, tmp_path):
    metrics = tmp_path / "m.jsonl"
    pair = launch(
        [*TINY, "-ng", "2", "-ms", "400", "train.comm_timeout_s=5", "--metrics", str(metrics)]
    )
    _training(pair, metrics)
    # no FIN, no RST: the peer just goes silent
    ip("-n", nodes.names[1], "link", "set", "node1", "down")
    try:
        cut_at = time.monotonic()
        code = _wait(pair[:1], 60)[0]
        assert code != 0 and time.monotonic() - cut_at < 60
    finally:
        ip("-n", nodes.names[1], "link", "set", "node1", "up")
    text = pair[0].text()
    errors = [line for line in text.splitlines() if line.startswith("overlap: error:")]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith(
        "overlap: error: rank 0 of 2 got no answer from its peers for train.comm_timeout_s=5 s"
    ), errors[0]


def test_namespaces_of_a_test_run_that_was_killed_are_swept(nodes):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"{PREFIX}{dead.pid}-0"
    ip("netns", "add", stale)
    try:
        assert stale in remove_stale_namespaces(PREFIX, _pid_alive)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale not in listed and all(name in listed for name in nodes.names)  # ours kept
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
