"""`overlap run` as a careless or hostile user meets it (issue 48): one line and the command line's
exit codes where a traceback or a silent success was.

- A refusal the ranks find in a checkpoint (another schedule, a ckpt_step that contradicts the
  folder) exits 2 with its one line, as before launch, having read no shard; the launcher never
  prints a rank's final error line besides its own account, however slowly the rank exits.
- `~` and `$VAR` paths are expanded once: a restartable job started from two folders resumes, and
  the Slurm script carries the expanded paths.
- A handled SIGTERM's summary covers the iterations that ran (valid JSON, no "nan ms").
- A stale lock naming a live but unrelated pid is taken over.
- fp16: skipped overflow steps are not reported as NaN parameters; a bf16 -> fp16 resume says the
  loss scaler restarts; a static scale under which nothing trains is an error.
- A layout repeat too large to expand, and a `--metrics` path that is a link, are one-line
  refusals.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overlap.errors import CheckpointError
from overlap.training.save_lock import LOCK_NAME, SaveFolderLock

BASE = ["run", "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-gb", "2", "-mb", "1", "-sl", "32"]


def _cli(args: list[str], cwd: Path | None = None, env: dict | None = None, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "overlap: error:" in ln]


def test_refusals_found_by_the_ranks_exit_2_once_having_read_no_shard(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = _cli([*BASE, "-ng", "2", "-ms", "1", f"checkpoint.save={ckpt}"])
    assert done.returncode == 0, done.stderr[-2000:]
    for shard in (ckpt / "iter_0000001").glob("*.distcp"):
        shard.unlink()  # a refusal decided by the training state must not need them
    done = _cli([*BASE, "-ng", "2", "-ms", "3", f"checkpoint.load={ckpt}"])
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("overlap: error: train.train_iters=3: ")
    assert "another learning-rate schedule" in errors[0] and "Rank logs" not in errors[0]
    done = _cli(
        [
            *BASE,
            "-ng",
            "2",
            "-ms",
            "1",
            f"checkpoint.load={ckpt}/iter_0000001",
            "checkpoint.ckpt_step=2",
        ]
    )
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("overlap: error: checkpoint.ckpt_step=2: ")


def test_a_ranks_final_error_line_is_said_once_however_slowly_it_exits(tmp_path):
    """Under load a rank can take longer than the launcher's hold-back time to exit after printing
    its error (HOLD_S 0 here): the launcher's account is still the only copy."""
    rank = (
        "import sys, time\n"
        "print('overlap: error: checkpoint.load=x: refused. Fix: y.', flush=True)\n"
        "time.sleep(1.0)\n"
        "sys.exit(2)\n"
    )
    launcher = (
        "import sys\n"
        "from overlap.errors import RankFailure\n"
        "from overlap.launch import local\n"
        "local.HOLD_S = 0.0\n"
        "try:\n"
        f"    local.launch_local([sys.executable, '-c', {rank!r}], 2, {{'PATH': '/bin'}})\n"
        "except RankFailure as exc:\n"
        "    print(f'overlap: error: {exc}', file=sys.stderr)\n"
        "    sys.exit(getattr(exc, 'exit_code', 1))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60
    )
    assert done.stderr.count("checkpoint.load=x: refused") == 1, done.stderr
    assert done.returncode == 2


def test_tilde_and_variable_paths_mean_one_folder_from_any_launch_folder(tmp_path):
    home, first, second = tmp_path / "home", tmp_path / "a", tmp_path / "b"
    for folder in (home, first, second):
        folder.mkdir()
    job = ["-ng", "1", "checkpoint.save=~/ck", "checkpoint.load=$HOME/ck"]
    env = {"HOME": str(home)}
    done = _cli([*BASE, *job, "-ms", "1"], cwd=first, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (home / "ck" / "iter_0000001").is_dir() and not (first / "~").exists()
    more = ["-ms", "2", "scheduler.override_opt_param_scheduler=true"]
    done = _cli([*BASE, *job, *more], cwd=second, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumes at iteration 1" in done.stderr and not (second / "~").exists()
    done = _cli(
        [*BASE, *job, "-ms", "2", "--metrics", "m.jsonl", "--emit-slurm", "job.sh"],
        cwd=first,
        env=env,
    )
    script = (first / "job.sh").read_text()
    assert done.returncode == 0 and f'checkpoint.save="{home}/ck"' in script
    assert f'checkpoint.load="{home}/ck"' in script and f"    {first}/m.jsonl" in script
    done = _cli([*BASE, "-ng", "1", "-ms", "1", "checkpoint.save=$OVERLAP_UNSET_48/ck"], cwd=first)
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1 and "$OVERLAP_UNSET_48" in errors[0]
    assert not (first / "$OVERLAP_UNSET_48").exists()


def test_a_handled_sigterm_summarises_the_iterations_that_ran(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "overlap.cli",
            *BASE,
            "-ng",
            "1",
            "-ms",
            "500",
            "--metrics",
            str(metrics),
            "train.exit_signal_handler=true",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    seen, until = [], time.monotonic() + 180
    while time.monotonic() < until:
        line = proc.stderr.readline()
        seen.append(line)
        if "iteration      3/500" in line or not line:
            break
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, "".join(seen[-20:]) + rest[-3000:]
    assert "nan ms" not in rest and "stopping after iteration" in rest

    def no_nan(name: str):
        raise AssertionError(f"summary.json holds {name}")

    summary = json.loads(
        metrics.with_name("m.jsonl.summary.json").read_text(), parse_constant=no_nan
    )
    ran = len(metrics.read_text().splitlines())
    first, last = summary["window_iterations"]
    assert 1 <= first <= last == ran and summary["steady_step_ms"] > 0


def test_a_stale_lock_naming_a_live_unrelated_process_is_taken_over(tmp_path, caplog):
    """After a container restart the pid a lock names can belong to anything: a process that
    started after the lock was taken is not its holder (a lock file of today's main, which records
    no start time), nor one whose start time differs from the recorded one; the holder itself (its
    start time recorded) is still refused."""
    folder = tmp_path / "ck"
    folder.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    here = socket.gethostname()
    try:
        time.sleep(0.5)
        for holder in (
            {"pid": other.pid, "host": here, "started": time.time() - 3600},
            {"pid": other.pid, "host": here, "started": time.time(), "pid_start_ticks": 1},
        ):
            (folder / LOCK_NAME).write_text(json.dumps(holder))
            lock = SaveFolderLock(folder)
            with caplog.at_level(logging.WARNING, logger="overlap.checkpoint"):
                lock.acquire()
            lock.release()
        assert caplog.text.count("now belongs to another process") == 2
        from overlap.training.save_lock import _start_ticks

        holder = {"pid": other.pid, "host": here, "pid_start_ticks": _start_ticks(other.pid)}
        (folder / LOCK_NAME).write_text(json.dumps(holder))
        with pytest.raises(CheckpointError, match=f"pid {other.pid} on host"):
            SaveFolderLock(folder).acquire()
    finally:
        other.kill()
        other.wait()


def test_fp16_skips_are_not_nan_and_a_bf16_to_fp16_resume_says_the_scaler_restarts(tmp_path):
    ckpt = tmp_path / "ckpt"
    done = _cli([*BASE, "-ng", "1", "-c", "bf16", "-ms", "1", f"checkpoint.save={ckpt}"])
    assert done.returncode == 0, done.stderr[-2000:]
    done = _cli(
        [
            *BASE,
            "-ng",
            "1",
            "-c",
            "fp16",
            "-ms",
            "3",
            f"checkpoint.load={ckpt}",
            "scheduler.override_opt_param_scheduler=true",
            "ddp.check_for_nan_in_grad=false",
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped: overflow" in done.stderr  # at the default 2^32 the first steps overflow
    assert "may now be NaN" not in done.stderr and "non-finite" not in done.stderr
    assert "the fp16 loss scaler restarts" in done.stderr and "no loss-scaler state" in done.stderr
    done = _cli([*BASE, "-ng", "1", "-c", "fp16", "-ms", "2", "mixed_precision.loss_scale=1e30"])
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith("overlap: error: mixed_precision.loss_scale=1e+30: ")
    assert "the optimizer took no step" in errors[0]


def test_a_huge_layout_repeat_and_a_metrics_link_are_one_line_refusals(tmp_path):
    done = _cli(
        [
            "explain",
            *BASE[1:],
            "-ng",
            "2",
            "-pp",
            "2",
            "model.pipeline_model_parallel_layout=Et*9999999999|tL",
        ],
        timeout=60,
    )
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "more than 1,000,000 symbols" in errors[0]
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "m.jsonl").symlink_to(victim)
    done = _cli([*BASE, "-ng", "1", "-ms", "1", "--metrics", str(tmp_path / "m.jsonl")])
    errors = _errors(done.stderr)
    assert done.returncode == 2 and len(errors) == 1 and "symbolic link" in errors[0]
    assert victim.read_text() == "precious"
