"""FP16 training with Megatron's loss scaling (`overlap.optim.loss_scaler`).

- The scaler's rules, alone: hysteresis, back-off to the floor, growth after a window, a static
  scale.
- An injected overflow (one element of one rank's expert gradient set to inf before the reduction,
  at iterations 2 and 3) skips exactly those steps on every rank: parameters and Adam's step count
  unchanged, the scale halved at the second (hysteresis 2), the learning-rate schedule held, the
  NaN check not tripped; then training goes on. Under NCCL's rules the ranks' collectives match.
- Losses of fp16 runs (initial scale 4096: no step skipped) follow the bf16 run of the same tiny
  recipe over 6 iterations: |fp16 - bf16| <= 1e-3 per iteration (losses ~5.5; measured <= 4.3e-4)
  and, where fp32 can run, |fp16 - fp32| <= 3e-4 (measured <= 1.1e-4: fp16's 10-bit mantissa is
  closer to fp32 than bf16's 7 bits, whose own distance to fp32 is up to 3.9e-4), under DP 2 with
  the distributed optimizer (overlapped), EP 2 with EP overlap + delay_wgrad + the distributed
  optimizer, TP 2 with sequence parallelism (MoE) and PP 2 x VPP 2.
- A checkpoint of an fp16 run resumes exactly (losses and parameters ==), scaler state included.
- Bad values get one ConfigError naming the field; the decision table shows the scaler.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from overlap.config.mixed_precision import Precision
from overlap.errors import ConfigError
from overlap.optim.loss_scaler import LossScaler
from overlap.training.metrics import StepRecord, format_iteration
from tests.configs import tiny_config
from tests.world import run_world, run_world_nccl_rules

ITERS = 6
SCALE = ["mixed_precision.initial_loss_scale=4096"]  # 2^32 skips the first ~20 steps of a tiny run
EP2_OVERLAP = [
    "model.expert_model_parallel_size=2",
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=true",
    "ddp.use_distributed_optimizer=true",
]


def _trainer(moe: bool, precision: str, items: list[str], iters: int = ITERS, layers: int = 2):
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = tiny_config(moe, precision, layers, items, iters)
    return Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))


# --- the scaler's rules --------------------------------------------------------------------------
def test_dynamic_scaler_backs_off_after_the_hysteresis_and_grows_after_a_window():
    cfg = Precision(
        "float16",
        fp16=True,
        initial_loss_scale=8.0,
        min_loss_scale=2.0,
        loss_scale_window=3,
        hysteresis=2,
    )
    s = LossScaler.of(cfg)
    seen = []
    for overflow in (True, False, True, True, True, False, False, False, True):
        s.update(overflow)
        seen.append(s.scale)
    # 1st overflow: tolerated; 2nd (not consecutive: Megatron counts since the last growth):
    # 8 -> 4; every later one halves, floored at 2; three clean steps double and re-arm the
    # hysteresis (the next overflow is tolerated)
    assert seen == [8.0, 8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 4.0, 4.0]
    restored = LossScaler.of(cfg)
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert restored == s


def test_static_scale_never_changes_and_no_scaler_without_fp16():
    s = LossScaler.of(Precision(loss_scale=128.0))
    for overflow in (True, True, True, False):
        s.update(overflow)
    assert (s.scale, s.dynamic) == (128.0, False)
    assert LossScaler.of(Precision("bfloat16", bf16=True)) is None


def test_the_iteration_line_shows_the_scale_and_a_skip():
    from overlap.config.training import TrainConfig

    rec = StepRecord(2, 5.5, float("inf"), 10.0, 1e-3, 1024.0, 512.0)
    line = format_iteration(rec, TrainConfig(), 100.0, 0.0, on_gpu=False)
    assert "| loss scale: 1024.0 | grad norm: inf | skipped: overflow, scale -> 512.0" in line
    plain = StepRecord(2, 5.5, 1.0, 10.0, 1e-3)
    assert "loss scale" not in format_iteration(plain, TrainConfig(), 100.0, 0.0, on_gpu=False)


# --- configuration --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "item, field",
    [
        ("mixed_precision.loss_scale=0", "mixed_precision.loss_scale"),
        ("mixed_precision.loss_scale=-4", "mixed_precision.loss_scale"),
        ("mixed_precision.initial_loss_scale=0", "mixed_precision.initial_loss_scale"),
        ("mixed_precision.min_loss_scale=-1", "mixed_precision.min_loss_scale"),
        ("mixed_precision.min_loss_scale=8192", "mixed_precision.min_loss_scale"),  # above 4096
        ("mixed_precision.loss_scale_window=0", "mixed_precision.loss_scale_window"),
        ("mixed_precision.hysteresis=0", "mixed_precision.hysteresis"),
    ],
)
def test_bad_loss_scaling_values_get_one_clear_error(item, field):
    with pytest.raises(ConfigError) as err:
        tiny_config(False, "fp16_mixed", 1, SCALE + [item], 1).finalize(1)
    assert err.value.field == field and "\n" not in str(err.value)


def test_the_decision_table_shows_the_scaler():
    def scaler(precision: str, items: list[str]):
        res = tiny_config(False, precision, 1, items, 1).finalize(1)
        (row,) = res.decisions.sections["precision"]
        return row.effective, res.decisions

    effective, decisions = scaler("fp16_mixed", [])
    assert effective == "dynamic from 4294967296 (min 1, window 1000, hysteresis 2)"
    assert "Precision decisions:" in decisions.format_sections()
    assert scaler("fp16_mixed", ["mixed_precision.loss_scale=256"])[0] == "static 256"
    assert scaler("bf16_mixed", [])[0] == "off"
    # a dynamic-scaler setting on bf16 is a switch that does nothing: said, not silent
    _, decisions = scaler("bf16_mixed", ["mixed_precision.hysteresis=4"])
    assert [n.field for n in decisions.noops] == ["mixed_precision.hysteresis"]
    # the preset owns the optimizer's copy: a different value set there is a logged decision
    cfg = tiny_config(False, "fp16_mixed", 1, ["optimizer.hysteresis=5"], 1)
    res = cfg.finalize(1)
    decision = res.decisions.get("optimizer.hysteresis")
    assert (decision.requested, decision.effective, res.precision.hysteresis) == (5, 2, 2)


# --- an injected overflow -------------------------------------------------------------------------
POISONED = (2, 3)


def _overflow_run():
    """EP 2 with EP overlap, delay_wgrad and the distributed optimizer; rank 1 poisons one element
    of its own expert gradient (reduced over nobody: expert-DP is 1) before the reduction at
    POISONED iterations. Per step: (scale used, stepped, parameters changed, Adam steps after,
    lr); the losses, the metrics lines and the scaling state."""
    trainer = _trainer(True, "fp16_mixed", SCALE + EP2_OVERLAP + ["ddp.check_for_nan_in_grad=true"])
    ddp, opt = trainer.ddps[0], trainer.optimizer
    expert = next(p for p in trainer.model.parameters() if getattr(p, "is_expert", False))
    finish, step = ddp.finish_grad_sync, opt.step
    calls, out = [0], []

    def poisoned_finish():
        if calls[0] in POISONED and dist.get_rank() == 1:
            expert.main_grad.view(-1)[0] = float("inf")
        calls[0] += 1
        finish()

    def watched_step(lr, norm):
        before = [p.detach().clone() for p in trainer.model.parameters()]
        scale, stepped = opt.loss_scale, step(lr, norm)
        after = trainer.model.parameters()
        changed = any(not torch.equal(b, p) for b, p in zip(before, after))
        out.append((scale, stepped, changed, opt.steps_taken(), lr))
        return stepped

    ddp.finish_grad_sync, opt.step = poisoned_finish, watched_step
    metrics = _Records()
    summary = trainer.train(metrics=metrics)
    return out, [r.lm_loss for r in summary.records], list(metrics), opt.scaling_state()


class _Records(list):
    """A metrics sink (profiling/sinks.py) that keeps the per-iteration records."""

    def write(self, record: dict) -> None:
        self.append(record)


def test_an_injected_overflow_skips_exactly_that_step_on_every_rank_and_backs_the_scale_off():
    from overlap.optim.adam import learning_rate

    results = run_world(2, _overflow_run)
    assert results[0][0] == results[1][0]  # every rank decided alike, with the same scale and lr
    steps, losses, metrics, state = results[0]
    # halved at the second overflow (hysteresis 2)
    assert [s[0] for s in steps] == [4096.0] * 4 + [2048.0] * 2
    assert [(s[1], s[2]) for s in steps] == [(i not in POISONED,) * 2 for i in range(ITERS)]
    assert [s[3] for s in steps] == [1, 2, 2, 2, 3, 4]  # Adam's step count held while skipping
    cfg = tiny_config(True, "fp16_mixed", 2, SCALE, ITERS)
    held = [0, 1, 2, 2, 2, 3]  # the schedule's position: skipped steps do not advance it
    assert [s[4] for s in steps] == [
        learning_rate(i, cfg.optimizer, cfg.scheduler, ITERS) for i in held
    ]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert [(m["loss_scale"], m["skipped"]) for m in metrics] == [(s[0], not s[1]) for s in steps]
    assert state == {
        "skipped_iterations": 2,
        "loss_scaler": {"scale": 2048.0, "growth_tracker": 2, "hysteresis_tracker": 0},
    }


def test_a_skipped_step_keeps_the_ranks_collectives_matched_under_nccl_rules():
    """The skip is decided alike on every rank, so no rank waits in a collective (the parameter
    gather) that its peers skipped: the recorded programs replay together under NCCL's rules."""
    results = run_world_nccl_rules(2, _overflow_run)
    assert [not s[1] for s in results[0][0]] == [i in POISONED for i in range(ITERS)]


# --- fp16 follows bf16 ----------------------------------------------------------------------------
LAYOUTS = {  # name: (moe, layers, settings)
    "dp2-distopt": (
        False,
        2,
        [
            "ddp.use_distributed_optimizer=true",
            "ddp.overlap_grad_reduce=true",
            "ddp.overlap_param_gather=true",
            "ddp.bucket_size=3000",
        ],
    ),
    "ep2-overlap-delay-distopt": (True, 2, EP2_OVERLAP),
    "tp2-sp": (True, 2, ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
    "pp2-vpp2": (
        False,
        4,
        ["model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2"],
    ),
}


def _losses(moe: bool, layers: int, precision: str, items: list[str]):
    scaling = SCALE if precision == "fp16_mixed" else []
    trainer = _trainer(moe, precision, scaling + items, layers=layers)
    summary = trainer.train()
    return [r.lm_loss for r in summary.records], trainer.optimizer.skipped


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp16_losses_follow_the_bf16_run(name):
    moe, layers, items = LAYOUTS[name]

    def losses(precision: str) -> tuple[list[float], int]:
        return run_world(2, _losses, moe, layers, precision, items)[0]

    def apart(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) for x, y in zip(a, b, strict=True))

    (bf16, _), (fp16, skipped) = losses("bf16_mixed"), losses("fp16_mixed")
    assert skipped == 0
    assert apart(fp16, bf16) <= 1e-3, (fp16, bf16)
    if "overlap" not in name:  # EP overlap needs a 16-bit model
        fp32, _ = losses("fp32")
        assert apart(fp16, fp32) <= 3e-4, (fp16, fp32)


# --- checkpoints ----------------------------------------------------------------------------------
# From 2^20, with a window of 1 and hysteresis 1, the tiny MoE's fp16 gradients really overflow at
# every other step (2^20 overflows, 2^19 does not, one clean step doubles it back): the checkpoint
# at K = 3 holds a scale and a skipped-step count (the schedule's position) that a fresh run lacks.
GROWING = EP2_OVERLAP + [
    "mixed_precision.initial_loss_scale=1048576",
    "mixed_precision.loss_scale_window=1",
    "mixed_precision.hysteresis=1",
]
K = 3


def _resumable(items: list[str]):
    trainer = _trainer(True, "fp16_mixed", GROWING + items)
    summary = trainer.train()
    params = {n: p.detach().clone() for n, p in trainer._named_params()}
    scales = [r.loss_scale for r in summary.records]
    return [r.lm_loss for r in summary.records], scales, params, trainer.optimizer.scaling_state()


def test_an_fp16_checkpoint_resumes_exactly_with_the_scaler_state(tmp_path):
    straight = run_world(
        2, _resumable, [f"checkpoint.save={tmp_path}", f"checkpoint.save_interval={K}"]
    )
    saved = json.loads((tmp_path / f"iter_{K:07d}" / "train_state.json").read_text())
    assert straight[0][1] == [2.0**20, 2.0**19] * 3
    assert straight[0][3]["skipped_iterations"] == 3
    # the scale iteration K + 1 trains with, and the skips before it
    assert (saved["loss_scaler"]["scale"], saved["skipped_iterations"]) == (2.0**19, 2)
    resumed = run_world(2, _resumable, [f"checkpoint.load={tmp_path}", f"checkpoint.ckpt_step={K}"])
    for straight_rank, resumed_rank in zip(straight, resumed):
        s_losses, s_scales, s_params, s_state = straight_rank
        r_losses, r_scales, r_params, r_state = resumed_rank
        assert r_losses == s_losses[K:] and r_scales == s_scales[K:] and r_state == s_state
        assert r_params.keys() == s_params.keys()
        for n in s_params:
            assert torch.equal(r_params[n], s_params[n]), n


def test_the_run_summary_lists_the_steps_an_overflow_skipped(tmp_path):
    """At the default initial scale (2^32) a tiny fp16 run's gradients overflow for its first steps
    (as a Megatron run's do); the summary file lists exactly the iterations the metrics mark as
    skipped, and the bf16 run none."""
    import subprocess
    import sys

    for precision, scale in (
        ("fp16", []),
        ("fp16", ["mixed_precision.initial_loss_scale=4096"]),
        ("bf16", []),
    ):
        metrics = tmp_path / f"{precision}{len(scale)}.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "overlap.cli",
                "run",
                "-m",
                "qwen",
                "-mr",
                "dense_tiny",
                "-g",
                "cpu",
                "-ng",
                "1",
                "-c",
                precision,
                "-ms",
                "3",
                # 32 tokens: torch's fp16 GEMMs on a CPU without fp16 arithmetic are ~700x slower
                # than bf16's (2.3 s an iteration at dense_tiny's 256)
                "-sl",
                "32",
                "--metrics",
                str(metrics),
                *scale,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [json.loads(line) for line in metrics.read_text().splitlines()]
        marked = [m["iteration"] for m in lines if m.get("skipped")]
        summary = json.loads(metrics.with_name(metrics.name + ".summary.json").read_text())
        assert summary["overflow_skipped_iterations"] == marked
        if precision == "bf16" or scale:
            assert marked == []
        else:
            assert marked == [1, 2, 3]
