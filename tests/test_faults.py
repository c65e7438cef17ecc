"""Every fault ends with one clear answer (issue 13): a rank killed, a rank hung, the launcher told
to stop or killed.

Most cases run the real launcher (`overlap.launch.local`) over stub ranks (small Python scripts that
fail the way ranks fail: a SIGKILL, a SIGSTOP, a collateral "Connection closed by peer" traceback),
which takes a second each; the signal handling of `overlap run` itself is checked through
`overlap.cli.main` with stub ranks; and two cases inject the fault into a real local world of tiny
models (a third, a real rank stopped with SIGSTOP, waits out a collective timeout: run it with
OVERLAP_SLOW_TESTS=1). Every test asserts that no process is left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from overlap.errors import RankFailure
from overlap.launch import local

MARK = "OVERLAP_TEST_MARK"


def procs_with(mark: str) -> list[int]:
    """Live processes whose environment carries MARK=mark (the launcher and every rank it
    started)."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if needle in env and state != "Z":
            found.append(int(d.name))
    return found


def wait_gone(mark: str, timeout: float = 10.0) -> list[int]:
    until = time.monotonic() + timeout
    while (left := procs_with(mark)) and time.monotonic() < until:
        time.sleep(0.1)
    return left


def stub(body: str) -> list[str]:
    """A stub rank: `body` runs with `rank` set (RANK from the launcher's environment)."""
    code = "import os, signal, sys, time\nrank = int(os.environ['RANK'])\n" + textwrap.dedent(body)
    return [sys.executable, "-c", code]


COLLATERAL = """
    time.sleep(1.0)
    raise RuntimeError(
        "[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection closed by peer"
    )
"""


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(local, "GRACE_S", 3.0)
    monkeypatch.setattr(local, "STOPPED_GRACE_S", 0.5)


def test_a_killed_rank_is_named_by_its_signal_and_the_others_are_summarised(tmp_path, fast, capfd):
    body = (
        "if rank == 1:\n    time.sleep(0.3)\n    os.kill(os.getpid(), "
        "signal.SIGKILL)\nprint('training', rank)\n" + textwrap.dedent(COLLATERAL)
    )
    mark = uuid.uuid4().hex
    with pytest.raises(RankFailure) as info:
        local.launch_local(stub(body), 3, {"PATH": "/usr/bin:/bin", MARK: mark}, log_dir=tmp_path)
    text = str(info.value)
    assert text.startswith(
        "rank 1 of 3 killed by SIGKILL (ranks 0, 2 then failed: RuntimeError: Read error"
    )
    assert (
        "Connection closed by peer" in text and "pair.cc" not in text and "exit code -9" not in text
    )
    assert str(tmp_path / "overlap-rank<r>.log") in text
    err = capfd.readouterr().err
    # live output forwarded; collateral tracebacks not
    assert "Traceback" not in err and "training 0" in err
    assert "Traceback" in (tmp_path / "overlap-rank0.log").read_text()
    assert wait_gone(mark) == []


def test_a_stopped_rank_is_the_one_named(tmp_path, fast, capfd):
    body = """
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(1.0)
    raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")
    """
    mark = uuid.uuid4().hex
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        local.launch_local(stub(body), 3, {"PATH": "/usr/bin:/bin", MARK: mark}, log_dir=tmp_path)
    text = str(info.value)
    assert text.startswith(
        "rank 2 of 3 stopped making progress (its process was stopped, e.g. by SIGSTOP); the "
        "launcher killed it (ranks 0, 1 then failed: RuntimeError: Timed out"
    ), text
    assert time.monotonic() - start < 15
    assert "Traceback" not in capfd.readouterr().err
    assert wait_gone(mark) == []


def test_a_traceback_the_rank_survives_is_forwarded_and_a_clean_run_leaves_no_logs(
    tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    body = (
        "import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n    "
        "traceback.print_exc()\nprint('done', rank)\n"
    )
    local.launch_local(stub(body), 2, {"PATH": "/usr/bin:/bin"})
    err = capfd.readouterr().err
    assert err.count("ZeroDivisionError") == 2 and "done 0" in err and "done 1" in err
    assert not list(tmp_path.glob("overlap-run-*"))


def test_ranks_die_with_a_killed_launcher(tmp_path):
    mark = uuid.uuid4().hex
    code = (
        "import sys\nfrom overlap.launch import local\nlocal.launch_local([sys.executable, '-c', "
        "'import time; time.sleep(120)'], 2, "
        f"{{'PATH': '/usr/bin:/bin', '{MARK}': '{mark}'}})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, MARK: mark})
    until = time.monotonic() + 30
    while len(procs_with(mark)) < 3 and time.monotonic() < until:
        time.sleep(0.1)
    assert len(procs_with(mark)) == 3
    proc.kill()
    proc.wait()
    assert wait_gone(mark) == []  # the parent-death signal took the ranks along


RUN_WITH_STUB_RANKS = """
import sys
import overlap.commands as commands
from overlap.launch import local

def cmd_run(args):
    script = 'import time; print("rank up", flush=True); time.sleep(120)'
    local.launch_local([sys.executable, '-c', script], 2,
                       {'PATH': '/usr/bin:/bin', 'OVERLAP_TEST_MARK': sys.argv[1]})
    return 0

commands.cmd_run = cmd_run
from overlap.cli import main
sys.exit(main(['run', '-m', 'qwen', '-mr', 'dense_tiny', '-ng', '2']))
"""


@pytest.mark.parametrize(
    "sig, code, line",
    [
        (signal.SIGTERM, 143, "overlap: stopped by SIGTERM; ranks stopped"),
        (signal.SIGINT, 130, "overlap: interrupted (Ctrl-C); ranks stopped"),
    ],
)
def test_the_launcher_told_to_stop_says_so_once_with_the_right_code(sig, code, line):
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_WITH_STUB_RANKS, mark],
        env={**os.environ, MARK: mark},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as a terminal starts it: a suite run as a background job of a non-interactive shell
        # inherits SIGINT ignored, and Python then installs no Ctrl-C handler in the launcher or
        # the ranks
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    until = time.monotonic() + 60
    while len(procs_with(mark)) < 3 and time.monotonic() < until:
        time.sleep(0.1)
    time.sleep(0.5)
    # Ctrl-C reaches the whole group
    os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert (
        err.strip().splitlines()[-1] == line
        and err.count("overlap:") == 1
        and "Traceback" not in err
    )
    assert wait_gone(mark) == []


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root + ip"
)
def test_stale_namespaces_are_removed_and_live_ones_kept(caplog):
    from overlap.launch.network import remove_stale_namespaces

    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "overlap"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    # a launcher's own namespace, and (--network nic:RATE) one per rank beside it
    stale, live = f"overlap-{dead.pid}", f"overlap-{keeper.pid}"
    stale_rank, live_rank = f"{stale}-r0", f"{live}-r0"
    try:
        for name in (stale, live, stale_rank, live_rank):
            subprocess.run(["ip", "netns", "add", name], check=True)
        with caplog.at_level("WARNING", logger="overlap"):
            removed = remove_stale_namespaces()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert stale in removed and stale not in listed and live in listed
        assert stale_rank in removed and stale_rank not in listed.split()
        assert live_rank in listed.split()
        gone = f"removed stale network namespace {stale}: its owner (pid {dead.pid}) is gone"
        assert gone in caplog.text
    finally:
        keeper.kill()
        keeper.wait()
        for name in (stale, live, stale_rank, live_rank):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


# --- faults injected into a real local world (tiny models; each takes a few seconds of torch
# start-up) ---------------
TINY = [
    "-m",
    "qwen",
    "-mr",
    "dense_tiny",
    "-ng",
    "2",
    "model.num_layers=1",
    "model.hidden_size=64",
    "-sl",
    "32",
    "-ms",
    "400",
]


def _start_real(tmp_path, *extra: str):
    mark = uuid.uuid4().hex
    env = {**os.environ, MARK: mark, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlap.cli", "run", *TINY, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    until = time.monotonic() + 180
    while time.monotonic() < until and proc.poll() is None:  # training: rank 0 logged an iteration
        logs = list(tmp_path.glob("overlap-run-*/overlap-rank0.log"))
        if logs and "iteration      2/" in logs[0].read_text(errors="replace"):
            break
        time.sleep(0.2)
    ranks = {}
    for pid in procs_with(mark):
        env_items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = [e for e in env_items if e.startswith(b"RANK=")]
        if rank:
            ranks[int(rank[0][5:])] = pid
    assert proc.poll() is None and len(ranks) == 2, (
        proc.stderr.read() if proc.poll() is not None else ranks
    )
    return proc, ranks, mark


def test_real_world_rank_killed(tmp_path):
    proc, ranks, mark = _start_real(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "overlap: error: rank 1 of 2 killed by SIGKILL (rank 0 then failed: RuntimeError:"
    ), last
    assert "Traceback" not in err and "exit code -9" not in last
    log = re.search(r"Rank logs: (\S+)", last).group(1).replace("<r>", "0")
    # rank 0's collateral traceback, kept in its log
    assert "Traceback" in Path(log).read_text(errors="replace")
    assert wait_gone(mark) == []


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated interconnect needs root + iproute2",
)
@pytest.mark.parametrize("network", ["tbf:800mbit", "nic:800mbit"])
def test_real_world_launcher_killed_takes_ranks_and_leaves_a_namespace_the_next_run_removes(
    tmp_path, network
):
    """tbf: one namespace, overlap-<pid>; nic: the bridge's and one per rank
    (overlap-<pid>-r<rank>)."""
    from overlap.launch.network import remove_stale_namespaces

    proc, ranks, mark = _start_real(tmp_path, "--network", network)
    proc.kill()
    proc.communicate(timeout=30)
    assert wait_gone(mark) == []  # ranks died with their launcher instead of training on as orphans
    name = f"overlap-{proc.pid}"
    names = [name, f"{name}-r0", f"{name}-r1"] if network.startswith("nic:") else [name]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert set(names) <= {line.split()[0] for line in listed.splitlines() if line.split()}
    ours = [n for n in remove_stale_namespaces() if n == name or n.startswith(f"{name}-")]
    assert sorted(ours) == sorted(names)


@pytest.mark.skipif(
    os.environ.get("OVERLAP_SLOW_TESTS") != "1",
    reason="waits out a collective timeout; OVERLAP_SLOW_TESTS=1 runs it",
)
def test_real_world_rank_stopped(tmp_path):
    proc, ranks, mark = _start_real(tmp_path, "train.comm_timeout_s=8")
    os.kill(ranks[1], signal.SIGSTOP)
    out, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in err
    assert last.startswith(
        "overlap: error: rank 1 of 2 stopped making progress (its process was stopped"
    ), last
    assert "rank 0 then failed: RuntimeError: Timed out" in last
    assert wait_gone(mark) == []
