"""Checkpoints through `overlap run` (issue 14): preemption by SIGTERM saves and exits 0, and a rank
killed with SIGKILL mid-run fails the job naming it, after which a resume from the last checkpoint
reproduces the uninterrupted run's losses exactly (same layout: the same operations in the same
order)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

MARK = "OVERLAP_TEST_MARK"
BASE = [
    "run",
    "-m",
    "qwen",
    "-mr",
    "dense_tiny",
    "-g",
    "cpu",
    "-ng",
    "2",
    "-c",
    "fp32",
    "-gb",
    "4",
    "-mb",
    "1",
    "-sl",
    "64",
]


def _start(args: list[str], mark: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "overlap.cli", *args],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, MARK: mark},
    )


def _read_until(proc: subprocess.Popen, needle: str, timeout: float = 180) -> list[str]:
    lines, until = [], time.monotonic() + timeout
    while time.monotonic() < until:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if re.search(needle, line):
            return lines
    raise AssertionError(f"{needle!r} never appeared:\n{''.join(lines[-30:])}")


def _rank_pid(mark: str, rank: int) -> int:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in env and f"RANK={rank}".encode() in env:
            return int(d.name)
    raise AssertionError(f"no rank {rank} running")


def _losses(metrics: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, metrics.read_text().splitlines())}


def test_sigterm_saves_at_the_step_boundary_and_exits_0(tmp_path):
    mark = uuid.uuid4().hex
    proc = _start(
        BASE + ["-ms", "500", f"checkpoint.save={tmp_path}", "train.exit_signal_handler=true"], mark
    )
    _read_until(proc, r"iteration\s+2/500")
    proc.send_signal(signal.SIGTERM)  # to the launcher, as Slurm would (it forwards to the ranks)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, rest[-3000:]
    saved = int((tmp_path / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 500
    assert f"stopping after iteration {saved} of 500: SIGTERM received" in rest
    assert f"checkpoint of iteration {saved} in {tmp_path}" in rest


def test_a_rank_killed_mid_run_is_named_and_the_resume_matches_the_uninterrupted_run(tmp_path):
    ref = tmp_path / "ref.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "overlap.cli", *BASE, "-ms", "6", "--metrics", str(ref)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    mark = uuid.uuid4().hex
    ckpt = tmp_path / "ckpt"
    proc = _start(
        BASE + ["-ms", "500", f"checkpoint.save={ckpt}", "checkpoint.save_interval=1"], mark
    )
    _read_until(proc, r"\(iteration 2\)")
    os.kill(_rank_pid(mark, 1), signal.SIGKILL)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "rank 1 of 2 killed by SIGKILL" in rest
    last = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= last < 6
    resumed = tmp_path / "resumed.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlap.cli",
            *BASE,
            "-ms",
            "6",
            f"checkpoint.load={ckpt}",
            # the killed run's schedule was built for 500 iterations: this run's is taken, on
            # purpose
            "scheduler.override_opt_param_scheduler=true",
            "--metrics",
            str(resumed),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumes at iteration {last}" in done.stderr
    want = {it: loss for it, loss in _losses(ref).items() if it > last}
    assert _losses(resumed) == want


def _cli(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_second_writer_a_reached_max_steps_and_a_full_disk_each_end_with_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from overlap.training.save_lock import "
            f"SaveFolderLock; lock = SaveFolderLock({str(ckpt)!r}); lock.acquire(); print('held', "
            "flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        done = _cli(BASE + ["-ms", "1", f"checkpoint.save={ckpt}"])
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 2  # a refusal, found by the ranks: as before launch
    errors = [ln for ln in done.stderr.splitlines() if "overlap: error:" in ln]
    assert (
        len(errors) == 1
        and f"pid {holder.pid} on host" in errors[0]
        and errors[0].count("another run is saving") == 1
    )
    # the holder was killed: its lock is stale and taken over; the run saves
    done = _cli(BASE + ["-ms", "1", f"checkpoint.save={ckpt}"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "stale lock" in done.stderr and not (ckpt / ".overlap_save.lock").exists()
    # a resume whose max_steps is reached: said, exit 0, no step time of nothing
    done = _cli(BASE + ["-ms", "1", f"checkpoint.save={ckpt}", f"checkpoint.load={ckpt}"])
    assert (
        done.returncode == 0 and "nothing to train: the checkpoint is at iteration 1" in done.stderr
    )
    assert "nan ms" not in done.stderr
    # a full disk: a 2 MiB tmpfs
    from tests.small_disk import small_disk

    with small_disk(tmp_path / "disk", "2m") as disk:
        done = _cli(BASE + ["-ms", "1", f"checkpoint.save={disk}"])
    errors = [ln for ln in done.stderr.splitlines() if "overlap: error:" in ln]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-2000:]
    assert (
        "no space left on device" in errors[0]
        and str(disk) in errors[0]
        and "bytes free" in errors[0]
    )
    assert "SIGABRT" not in errors[0] and "inline_container" not in errors[0]
