"""Checkpoints (issue 14): exact resume, resharding across layouts, atomic and asynchronous saves,
bad checkpoints, early exit and the NaN stop.

Exact resume: a run of N = 4 iterations that saves at K = 2 (its later iterations are the
uninterrupted run), then a run that loads iter_0000002 and trains iterations 3-4: same layout, fp32
-> identical losses and identical parameters at the end (== , no tolerance). Resharding: the same
checkpoint loaded at another layout continues with the uninterrupted run's losses within rel 1e-5
(fp32; only the reduction order differs, as between any two layouts of the single-process reference,
see test_training.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from overlap.config import ConfigContainer
from overlap.errors import CheckpointError, NonFiniteError
from tests.configs import tiny_config
from tests.world import run_world

N, K = 4, 2


def _config(moe: bool, items: list[str], precision: str = "fp32") -> ConfigContainer:
    return tiny_config(moe, precision, 2, items, N)


def _train(moe: bool, items: list[str], precision: str = "fp32", poison: str | None = None):
    """Train; return ([(iteration, loss)], {param name: final tensor} of this rank)."""
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = _config(moe, items, precision=precision)
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    if poison is not None and dist.get_rank() == 1:
        with torch.no_grad():
            dict(trainer._named_params())[poison].view(-1)[0] = float("nan")
    summary = trainer.train()
    params = {n: p.detach().float().clone() for n, p in trainer._named_params()}
    return [(r.iteration, r.lm_loss) for r in summary.records], params


DENSE_DP4 = [
    "ddp.use_distributed_optimizer=true",
    "ddp.overlap_grad_reduce=true",
    "ddp.overlap_param_gather=true",
    "ddp.bucket_size=3000",
]
RESUME_CASES = {  # name: (world, moe, layout and settings)
    "dp4_distopt": (4, False, DENSE_DP4),
    "ep4": (4, True, ["model.expert_model_parallel_size=4"]),
    "tp2_dp2": (4, False, ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
    "pp2": (2, False, ["model.pipeline_model_parallel_size=2"]),
    "cp2_dp2_distopt": (4, False, DENSE_DP4 + ["model.context_parallel_size=2"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every resume case's uninterrupted run, saving at K (and at the end): {name: (folder, losses,
    params)}."""
    out = {}
    for name, (world, moe, items) in RESUME_CASES.items():
        folder = tmp_path_factory.mktemp(name)
        got = run_world(
            world,
            _train,
            moe,
            items + [f"checkpoint.save={folder}", f"checkpoint.save_interval={K}"],
        )
        out[name] = (folder, got)
    return out


@pytest.mark.parametrize("name", list(RESUME_CASES))
def test_exact_resume(saved, name):
    world, moe, items = RESUME_CASES[name]
    folder, straight = saved[name]
    resumed = run_world(
        world, _train, moe, items + [f"checkpoint.load={folder}", f"checkpoint.ckpt_step={K}"]
    )
    for (s_losses, s_params), (r_losses, r_params) in zip(straight, resumed):
        assert [it for it, _ in r_losses] == list(range(K, N))
        assert r_losses == s_losses[K:]
        assert r_params.keys() == s_params.keys()
        for n in s_params:
            assert torch.equal(r_params[n], s_params[n]), n


RESHARD_CASES = [  # (saved case, world, moe, new layout and settings)
    (
        "dp4_distopt",
        4,
        False,
        ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"],
    ),
    ("dp4_distopt", 2, False, []),  # distributed optimizer on -> off, DP4 -> DP2
    ("ep4", 4, True, ["model.expert_model_parallel_size=2"]),  # EP4 -> EP2 x DP2
    ("pp2", 1, False, []),  # PP2 -> PP1
    # the distributed optimizer's shards over DP x CP: DP4 -> CP2 x DP2 and CP2 x DP2 -> DP2 plain
    ("dp4_distopt", 4, False, DENSE_DP4 + ["model.context_parallel_size=2"]),
    ("cp2_dp2_distopt", 2, False, []),
]


@pytest.mark.parametrize(
    "case",
    RESHARD_CASES,
    ids=[
        "dp4-to-tp2dp2",
        "distopt-to-plain-dp2",
        "ep4-to-ep2dp2",
        "pp2-to-pp1",
        "dp4-to-cp2dp2",
        "cp2dp2-to-plain-dp2",
    ],
)
def test_resharded_load_continues_the_uninterrupted_run(saved, case):
    name, world, moe, items = case
    folder, straight = saved[name]
    resumed = run_world(
        world, _train, moe, items + [f"checkpoint.load={folder}", f"checkpoint.ckpt_step={K}"]
    )
    want = [loss for _, loss in straight[0][0][K:]]
    for losses, _ in resumed:
        assert [loss for _, loss in losses] == pytest.approx(want, rel=1e-5)


def test_bf16_distributed_optimizer_resume_keeps_fp32_masters(tmp_path):
    """bf16 parameters: the fp32 masters and moments are saved, so the resumed run is
    bit-identical."""
    items = ["ddp.use_distributed_optimizer=true"]
    straight = run_world(
        2,
        _train,
        False,
        items + [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2"],
        "bf16_mixed",
    )
    resumed = run_world(
        2,
        _train,
        False,
        items + [f"checkpoint.load={tmp_path}", "checkpoint.ckpt_step=2"],
        "bf16_mixed",
    )
    assert resumed[0][0] == straight[0][0][K:]
    assert all(torch.equal(resumed[0][1][n], straight[0][1][n]) for n in straight[0][1])


def test_async_save_resumes_exactly_and_the_folder_is_complete(tmp_path):
    items = [
        "checkpoint.async_save=true",
        "checkpoint.save_interval=1",
        "checkpoint.most_recent_k=2",
    ]
    straight = run_world(
        2,
        _train,
        True,
        ["model.expert_model_parallel_size=2", f"checkpoint.save={tmp_path}", *items],
    )
    # most_recent_k=2: iterations 3 and 4 are kept; the tracker names 4; no temporary folder is
    # left.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000003",
        "iter_0000004",
        "latest_checkpointed_iteration.txt",
    ]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    state = json.loads((tmp_path / "iter_0000003" / "train_state.json").read_text())
    assert (
        state["iteration"] == 3
        and state["consumed_train_samples"] == 24
        and state["optimizer_steps"] == 3
    )
    resumed = run_world(
        2,
        _train,
        True,
        [
            "model.expert_model_parallel_size=2",
            f"checkpoint.load={tmp_path}",
            "checkpoint.ckpt_step=3",
        ],
    )
    assert resumed[0][0] == straight[0][0][3:]


def _save_then_fail(tmp_path: str, where: str) -> str:
    """Save at 2, then make the save at 4 fail on one rank (`where`: while writing shards, or after
    every shard is written and before rank 0 renames the folder - the two moments a killed job can
    leave behind)."""
    from unittest import mock

    from overlap.training import checkpoint as ckpt

    if where == "writing":
        original = ckpt.dcp.FileSystemWriter.write_data

        def write_data(self, plan, planner):
            if dist.get_rank() == 1 and "iter_0000004" in str(self.path):
                raise OSError("disk gone")
            return original(self, plan, planner)

        patch = mock.patch.object(ckpt.dcp.FileSystemWriter, "write_data", write_data)
    else:
        original_finalize = ckpt.finalize_save

        def finalize(base, iteration, *args):
            if iteration == 4:
                raise OSError("killed before the rename")
            return original_finalize(base, iteration, *args)

        patch = mock.patch.object(ckpt, "finalize_save", finalize)
    with patch:
        try:
            _train(False, [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2"])
        except Exception as exc:  # noqa: BLE001 - any failure of the save is what we want
            return type(exc).__name__
    return "no failure"


@pytest.mark.parametrize("where", ["writing", "renaming"])
def test_a_failed_save_leaves_the_previous_checkpoint_latest_and_loadable(tmp_path, where):
    failures = run_world(2, _save_then_fail, str(tmp_path), where)
    # writing: DCP reports rank 1's failure on every rank; renaming: rank 0 (the renamer) fails,
    # rank 1 trains on (under the launcher it would be stopped once rank 0 is gone)
    assert failures == (
        ["CheckpointError"] * 2 if where == "writing" else ["CheckpointError", "no failure"]
    )
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (tmp_path / "iter_0000004").exists() and (tmp_path / "iter_0000004.tmp").exists()
    losses = run_world(
        2, _train, False, [f"checkpoint.load={tmp_path}", f"checkpoint.save={tmp_path}"]
    )[0][0]
    assert [it for it, _ in losses] == [2, 3]
    assert not (tmp_path / "iter_0000004.tmp").exists()  # the stale temporary folder was removed


def _load_error(items: list[str], moe: bool = False) -> str:
    try:
        _train(moe, items)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small")
    run_world(1, _train, False, [f"checkpoint.save={folder}", "train.train_iters=1"])
    return folder


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_another_model_shape_is_an_error_naming_the_tensor(small_ckpt):
    # trained for 1 iteration, resumed for 4: this run's schedule is taken, or the schedule
    # refusal (decided before any shard is read) would come first
    load = [f"checkpoint.load={small_ckpt}", "scheduler.override_opt_param_scheduler=true"]
    (msg,) = run_world(1, _load_error, [*load, "model.ffn_hidden_size=256"])
    assert "layers.0.mlp.linear_fc1.weight" in msg and "shape" in msg
    (msg,) = run_world(1, _load_error, [*load, "model.num_layers=3"])
    assert "'model.layers.2." in msg and "not in the checkpoint" in msg
    (msg,) = run_world(1, _load_error, [*load, "model.num_layers=1"])
    assert "does not have: model.layers.1." in msg


def test_truncated_and_corrupt_files_are_named(small_ckpt, tmp_path):
    # (the checkpoint was trained for 1 iteration, these runs for 4: their own schedule is taken,
    # or the schedule refusal - decided before any shard is read - would come first)
    load = ["scheduler.override_opt_param_scheduler=true"]
    base = _copy(small_ckpt, tmp_path / "trunc")
    shard = base / "iter_0000001" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={base}", *load])
    assert "__0_0.distcp" in msg and "truncated" in msg
    base = _copy(small_ckpt, tmp_path / "meta")
    (base / "iter_0000001" / ".metadata").write_bytes(b"\x80\x04garbage")
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={base}", *load])
    assert ".metadata" in msg and "corrupt" in msg
    base = _copy(small_ckpt, tmp_path / "bytes")
    shard = base / "iter_0000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:64] = b"\x00" * 64
    shard.write_bytes(bytes(data))
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={base}", *load])
    assert "iter_0000001/__0_0.distcp (tensor 'model." in msg and "checksum" in msg
    # a checkpoint from before shard checksums: DCP's failure, then the tensor that does not read
    (base / "iter_0000001" / "digests.json").unlink()
    state = json.loads((base / "iter_0000001" / "train_state.json").read_text())
    del state["shard_digests"]
    (base / "iter_0000001" / "train_state.json").write_text(json.dumps(state))
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={base}", *load])
    assert (
        "reading the shards failed" in msg
        and "iter_0000001/__0_0.distcp" in msg
        and "tensor 'model." in msg
    )


def test_missing_checkpoint_folder_rules(tmp_path, small_ckpt):
    # empty: a fresh start only as the run's own save folder (a restartable job), else an error
    own = tmp_path / "own"
    assert (
        run_world(1, _load_error, [f"checkpoint.load={own}", f"checkpoint.save={own}"])[0]
        == "loaded"
    )
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={tmp_path / 'other'}"])
    assert "holds no checkpoint" in msg and "checkpoint.save folder" in msg
    (msg,) = run_world(
        1,
        _load_error,
        [f"checkpoint.load={tmp_path}", "checkpoint.exit_on_missing_checkpoint=true"],
    )
    assert "no checkpoint there" in msg
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={small_ckpt}", "checkpoint.ckpt_step=7"])
    assert "iter_0000007" in msg and "[1]" in msg
    base = tmp_path / "noopt"
    run_world(
        1,
        _train,
        False,
        [f"checkpoint.save={base}", "checkpoint.save_optim=false", "train.train_iters=1"],
    )
    (msg,) = run_world(1, _load_error, [f"checkpoint.load={base}"])
    assert "load_optim=false" in msg
    (msg,) = run_world(
        1, _load_error, [f"checkpoint.load={small_ckpt}", "train.global_batch_size=16"]
    )
    assert "global batch 8" in msg and "skip or repeat" in msg


def test_finetune_and_pretrained_load_weights_only(small_ckpt):
    ((saved_losses, saved_params),) = run_world(
        1,
        _train,
        False,
        [f"checkpoint.load={small_ckpt}", "checkpoint.finetune=true", "train.train_iters=1"],
    )
    assert [it for it, _ in saved_losses] == [0]  # iteration 0 again, from the saved weights
    ((pre_losses, _),) = run_world(
        1, _train, False, [f"checkpoint.pretrained_checkpoint={small_ckpt}", "train.train_iters=1"]
    )
    assert pre_losses == saved_losses
    ((fresh_losses, _),) = run_world(1, _train, False, ["train.train_iters=1"])
    assert fresh_losses != saved_losses


def test_exit_duration_stops_every_rank_after_one_iteration_with_a_checkpoint(tmp_path):
    got = run_world(
        2, _train, False, [f"checkpoint.save={tmp_path}", "train.exit_duration_in_mins=0"]
    )
    assert [[it for it, _ in losses] for losses, _ in got] == [[0], [0]]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def _nan_error(tmp_path: str) -> str:
    try:
        _train(
            False,
            ["ddp.check_for_nan_in_grad=true", f"checkpoint.save={tmp_path}"],
            poison="layers.1.mlp.linear_fc2.weight",
        )
    except NonFiniteError as exc:
        return str(exc)
    return "trained"


def test_nan_stops_at_the_iteration_naming_rank_and_tensor(tmp_path):
    msgs = run_world(2, _nan_error, str(tmp_path))
    assert msgs[0] == msgs[1]
    # rank 1's forward made the NaN (its lm loss); the DP all-reduce then spread it to every rank's
    # gradients
    assert "iteration 1:" in msgs[0] and "rank 1: the lm loss; gradients of" in msgs[0]
    assert "rank 0: gradients of" in msgs[0] and "the lm loss" not in msgs[0].split("rank 1:")[0]
    assert not any(tmp_path.iterdir())  # nothing was saved


def test_checkpoint_decisions_and_bad_values():
    from overlap.errors import ConfigError

    cfg = _config(
        False, ["checkpoint.save=/x", "checkpoint.save_interval=5", "checkpoint.async_save=true"]
    )
    text = cfg.finalize(1).decisions.format_sections()
    assert (
        "Checkpoint decisions:" in text
        and "every 5 iterations" in text
        and "background thread" in text
    )
    for item, field in [
        ("checkpoint.ckpt_format=zarr", "checkpoint.ckpt_format"),
        ("checkpoint.ckpt_format=torchh", "checkpoint.ckpt_format"),
        ("checkpoint.save_interval=0", "checkpoint.save_interval"),
        ("checkpoint.most_recent_k=0", "checkpoint.most_recent_k"),
        ("checkpoint.ckpt_step=3", "checkpoint.ckpt_step"),
    ]:
        with pytest.raises(ConfigError) as err:
            _config(False, [item]).finalize(1)
        assert err.value.field == field
    noop = _config(False, ["checkpoint.save_interval=5"]).finalize(1).decisions
    assert [n.field for n in noop.noops] == ["checkpoint.save_interval"]
