"""Checkpoints a user saved are never deleted or overwritten without their say: retention within a
run's lineage, a lost tracker, iter_* load paths, the guarded and locked save folder, and what a
resume refuses (another learning-rate schedule, a renamed folder). Real files and real 1-2 rank
worlds of the tiny dense model."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from overlap.errors import CheckpointError, ConfigError
from overlap.training.save_lock import LOCK_NAME, SaveFolderLock
from tests.configs import tiny_config
from tests.world import run_world

# the schedule does not depend on train_iters: runs may extend
CONSTANT = ["scheduler.lr_decay_style=constant"]


def _run(items: list[str], iters: int):
    """Train; (first iteration, [lr per iteration]) or the CheckpointError's text."""
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = tiny_config(False, "fp32", 2, items, iters)
    res = cfg.finalize(dist.get_world_size())
    try:
        trainer = Trainer(cfg, ParallelState(res.layout))
        summary = trainer.train()
    except CheckpointError as exc:
        return str(exc)
    return summary.first_iteration, [r.lr for r in summary.records]


def _iters(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("iter_"))


def test_retention_keeps_the_lineage_newest_and_the_loaded_one_and_refuses_older_resumes(tmp_path):
    a = tmp_path / "a"
    keep = [
        f"checkpoint.save={a}",
        "checkpoint.save_interval=1",
        "checkpoint.most_recent_k=2",
        *CONSTANT,
    ]
    run_world(1, _run, keep, 4)
    assert _iters(a) == ["iter_0000003", "iter_0000004"]
    # another run's checkpoint in the same folder (same model) is never pruned
    shutil.copytree(a / "iter_0000003", a / "iter_0000001")
    state = json.loads((a / "iter_0000001" / "train_state.json").read_text())
    state.update(iteration=1, lineage="someone-else")
    (a / "iter_0000001" / "train_state.json").write_text(json.dumps(state))
    first, _ = run_world(1, _run, keep + [f"checkpoint.load={a}"], 6)[0]
    assert first == 4
    # the loaded iter 4 stays (this run's fallback), the lineage's 2 newest are kept, the other
    # run's iter 1 too
    assert _iters(a) == ["iter_0000001", "iter_0000004", "iter_0000005", "iter_0000006"]
    assert (a / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    # resuming an older checkpoint into the folder: refused, naming the newer ones; nothing deleted
    msg = run_world(1, _run, keep + [f"checkpoint.load={a}", "checkpoint.ckpt_step=4"], 6)[0]
    assert (
        "newer than iteration 4" in msg and "iter_0000005, iter_0000006" in msg and "another" in msg
    )
    assert _iters(a) == ["iter_0000001", "iter_0000004", "iter_0000005", "iter_0000006"]
    # a fresh run into a folder with checkpoints is refused the same way
    msg = run_world(1, _run, [f"checkpoint.save={a}", *CONSTANT], 2)[0]
    assert "newer than iteration 0" in msg and "set checkpoint.load to this folder" in msg


def test_a_lost_tracker_and_an_iteration_folder_both_resume(tmp_path):
    b = tmp_path / "b"
    run_world(1, _run, [f"checkpoint.save={b}", "checkpoint.save_interval=1", *CONSTANT], 3)
    (b / "latest_checkpointed_iteration.txt").unlink()
    shutil.rmtree(b / "iter_0000003" / "train_state.json", ignore_errors=True)
    (b / "iter_0000003" / "train_state.json").unlink()  # an incomplete newest folder is passed over
    assert run_world(1, _run, [f"checkpoint.load={b}", *CONSTANT], 4)[0][0] == 2
    assert run_world(1, _run, [f"checkpoint.load={b}/iter_0000001", *CONSTANT], 4)[0][0] == 1
    msg = run_world(
        1, _run, [f"checkpoint.load={b}/iter_0000001", "checkpoint.ckpt_step=2", *CONSTANT], 4
    )[0]
    assert "itself a checkpoint folder" in msg
    # a folder whose train_state disagrees with its name
    shutil.copytree(b / "iter_0000002", b / "iter_0000009")
    msg = run_world(1, _run, [f"checkpoint.load={b}", "checkpoint.ckpt_step=9", *CONSTANT], 12)[0]
    assert "says iteration 2 but the folder's name says 9" in msg
    # no tracker and no complete folder: refused, naming them
    (b / "iter_0000001" / ".metadata").unlink()
    for name in ("iter_0000002", "iter_0000009"):
        shutil.rmtree(b / name)
    msg = run_world(1, _run, [f"checkpoint.load={b}", *CONSTANT], 4)[0]
    assert "none of its checkpoint folders" in msg and "iter_0000001" in msg


def test_another_models_folder_is_refused_unless_allowed(tmp_path):
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    run_world(1, _run, [f"checkpoint.save={theirs}", *CONSTANT], 1)
    run_world(1, _run, [f"checkpoint.save={mine}", "model.ffn_hidden_size=256", *CONSTANT], 1)
    items = [
        f"checkpoint.load={mine}",
        f"checkpoint.save={theirs}",
        "model.ffn_hidden_size=256",
        *CONSTANT,
    ]
    msg = run_world(1, _run, items, 2)[0]
    assert "checkpoints of another model" in msg and "allow_other_model_in_save=true" in msg
    assert _iters(theirs) == ["iter_0000001"]
    assert run_world(1, _run, items + ["checkpoint.allow_other_model_in_save=true"], 2)[0][0] == 1
    assert _iters(theirs) == ["iter_0000001", "iter_0000002"]


def test_the_lock_refuses_a_second_writer_and_a_stale_one_is_taken_over(tmp_path, caplog):
    folder = tmp_path / "locked"
    lock = SaveFolderLock(folder)
    lock.acquire()
    try:
        msg = run_world(1, _run, [f"checkpoint.save={folder}"], 1)[0]
        assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and LOCK_NAME in msg
        assert not any(p.name.startswith("iter_") for p in folder.iterdir())
    finally:
        lock.release()
    assert not (folder / LOCK_NAME).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / LOCK_NAME).write_text(
        json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": 0})
    )
    with caplog.at_level(logging.WARNING, logger="overlap.checkpoint"):
        lock.acquire()
    lock.release()
    assert "stale lock" in caplog.text and "no longer runs" in caplog.text
    # released on an exception too: a run that fails after taking it leaves the folder free
    run_world(1, _run, [f"checkpoint.save={folder}", f"checkpoint.load={tmp_path / 'none'}"], 1)
    assert not (folder / LOCK_NAME).exists()


def test_a_resume_keeps_the_learning_rate_schedule_unless_told(tmp_path):
    c = tmp_path / "c"
    full = run_world(1, _run, [], 6)[0][1]  # the uninterrupted cosine schedule over 6 iterations
    run_world(1, _run, [f"checkpoint.save={c}", "scheduler.lr_decay_iters=6"], 3)
    msg = run_world(1, _run, [f"checkpoint.load={c}"], 8)[0]  # -ms 8: the decay would follow it
    assert msg.startswith("train.train_iters=8") and "lr_decay_iters 6 -> 8" in msg
    assert "scheduler.lr_decay_iters=6" in msg  # the fix that trains on along the same schedule
    msg = run_world(1, _run, [f"checkpoint.load={c}", "optimizer.lr=0.01"], 6)[0]
    assert msg.startswith("optimizer.lr=0.01") and "override_opt_param_scheduler" in msg
    # the same schedule through an explicit decay length: the resumed learning rates are the
    # uninterrupted run's
    first, lrs = run_world(1, _run, [f"checkpoint.load={c}", "scheduler.lr_decay_iters=6"], 6)[0]
    assert first == 3 and lrs == full[3:]
    first, lrs = run_world(
        1,
        _run,
        [
            f"checkpoint.load={c}",
            "scheduler.use_checkpoint_opt_param_scheduler=true",
            "optimizer.lr=0.5",
        ],
        6,
    )[0]
    assert lrs == full[3:]
    first, lrs = run_world(
        1, _run, [f"checkpoint.load={c}", "scheduler.override_opt_param_scheduler=true"], 8
    )[0]
    assert first == 3 and lrs[0] != full[3]
    with pytest.raises(ConfigError) as err:
        tiny_config(
            False,
            "fp32",
            2,
            [
                f"checkpoint.load={c}",
                "scheduler.override_opt_param_scheduler=true",
                "scheduler.use_checkpoint_opt_param_scheduler=true",
            ],
            6,
        ).finalize(1)
    assert err.value.field == "scheduler.use_checkpoint_opt_param_scheduler"


def test_training_through_nan_is_warned_once_with_a_count(caplog):
    from overlap.training.stopping import NonFiniteCount

    count = NonFiniteCount(checked=False, rank=0)
    with caplog.at_level(logging.WARNING, logger="overlap.train"):
        count.see(0, 1.0, 2.0)
        for it in (3, 4, 7):
            count.see(it, float("nan"), float("nan"))
        count.report()
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(lines) == 2
        and lines[0].startswith("iteration 4: lm loss nan")
        and "check_for_nan_in_grad" in lines[0]
    )
    assert (
        lines[1].startswith("3 iteration(s) had a non-finite") and "first: 4, last: 8" in lines[1]
    )
