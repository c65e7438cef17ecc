"""The local launcher never leaves ranks hanging: a dead rank stops the job quickly and is named."""

import sys
import time

import pytest

from overlap.errors import RankFailure
from overlap.launch import local

SCRIPT = (
    "import os, sys, time\nr = int(os.environ['RANK'])\nsys.exit(3) if r == 1 else "
    "time.sleep(120)\n"
)


def test_dead_rank_stops_the_others_and_is_named(monkeypatch):
    monkeypatch.setattr(local, "GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 3 failed \(exit code 3\)"):
        local.launch_local([sys.executable, "-c", SCRIPT], 3, {"PATH": "/usr/bin:/bin"})
    assert time.monotonic() - start < 30


def test_ranks_get_torchrun_style_environment():
    env = local.rank_env({"X": "1"}, 2, 4, "127.0.0.1", 1234)
    assert (
        env["RANK"] == "2"
        and env["WORLD_SIZE"] == "4"
        and env["MASTER_PORT"] == "1234"
        and env["X"] == "1"
    )
    assert env["OMP_NUM_THREADS"] == "1"


def test_successful_ranks_return_normally():
    local.launch_local([sys.executable, "-c", "pass"], 2, {"PATH": "/usr/bin:/bin"})


def test_sigterm_stops_the_ranks_and_unwinds(tmp_path):
    """A SIGTERM to the launcher (timeout, Slurm) stops every rank and unwinds through the caller's
    cleanup."""
    import signal
    import subprocess

    marker = tmp_path / "cleaned"
    code = (
        "import sys, pathlib\nfrom overlap.launch import local\nlocal.GRACE_S = 1.0\ntry:\n    "
        "local.launch_local([sys.executable, '-c', 'import time; time.sleep(120)'], 2, {'PATH': "
        "'/usr/bin:/bin'})\nfinally:\n    pathlib.Path(sys.argv[1]).write_text('ok')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(marker)])
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert marker.read_text() == "ok"


def _described(tmp_path, codes: tuple[str, ...]) -> str:
    """The launcher's one line for ranks that ran `codes` (one Python program per rank)."""
    import subprocess

    from overlap.launch.local import _Rank, describe_failure

    ranks = []
    for r, code in enumerate(codes):
        log = tmp_path / f"rank{r}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT
            )
        rk = _Rank(r, proc, log)
        rk.start_waiter()
        ranks.append(rk)
    deadline = time.monotonic() + 30
    while any(rk.code is None for rk in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    return describe_failure(ranks, len(codes))


def test_a_full_disk_line_is_the_cause_over_a_writer_that_aborted(tmp_path):
    """A full disk aborts a rank whose C++ stream writer hits it (SIGABRT, with no line of its own)
    while another rank says it in Python: the one line names the disk, not the abort, whichever died
    first."""
    said = "overlap: error: checkpoint.save='/d': no space left on device: 4096 bytes free in /d"
    line = _described(
        tmp_path,
        (
            "import os; os.abort()",
            f"import sys, time; time.sleep(0.3); print({said!r}); sys.exit(1)",
        ),
    )
    assert line.startswith(
        "rank 1 of 2 failed (exit code 1): checkpoint.save='/d': no space left on device"
    ), line
    assert "rank 0 then failed: killed by SIGABRT" in line


def test_a_rank_aborted_after_its_own_error_is_named_by_that_error(tmp_path):
    """A rank that reported its error and was then killed by a signal as it exited (gloo's worker
    aborting the interpreter's exit) failed on that error: the one line says it, not "killed by
    SIGABRT", even when that rank died first and a peer then failed on the lost connection."""
    said = "overlap: error: checkpoint.load='/c': the checkpoint holds tensors this model lacks"
    line = _described(
        tmp_path,
        (
            "import sys, time; time.sleep(0.5); "
            "print('RuntimeError: Connection closed by peer'); sys.exit(1)",
            f"import os, sys; print({said!r}, flush=True); "
            "sys.stderr.write('terminate called without an active exception\\n'); os.abort()",
        ),
    )
    assert line == (
        "rank 1 of 2 failed: checkpoint.load='/c': the checkpoint holds tensors this model lacks "
        "(then killed by SIGABRT as it exited) (rank 0 then failed: RuntimeError: Connection "
        "closed by peer)"
    ), line
