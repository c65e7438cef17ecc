"""End-to-end numerical tests of the training loop: every parallel layout trains like the
single-process reference.

Each case runs the real Trainer for 3 optimizer steps over the same mock global batches and compares
the per-step mean lm loss with the single-process run. Tolerances: fp32 1e-5 relative (same math,
different reduction order across ranks); bf16 2e-2 relative (bf16 rounding of activations differs
when partial sums are split across ranks).
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from overlap.config import OptimizerConfig
from overlap.parallel.state import ParallelState
from overlap.training.trainer import Trainer
from tests.configs import tiny_config
from tests.world import run_world

STEPS = 3


def _train(moe: bool, precision: str, layout: dict) -> list[float]:
    cfg = tiny_config(moe, precision, 2, [], STEPS, micro_batch_size=2, **layout)
    res = cfg.finalize(dist.get_world_size())
    summary = Trainer(cfg, ParallelState(res.layout)).train()
    return [r.lm_loss for r in summary.records]


CASES = [
    # (world, moe, layout)
    (2, False, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    (2, False, dict(tensor_model_parallel_size=2, sequence_parallel=False)),
    (2, False, dict()),  # DP=2
    (2, True, dict(expert_model_parallel_size=2)),  # EP=2 (carved out of DP=2)
    (4, True, dict(expert_model_parallel_size=4)),  # EP=4
    (
        4,
        True,
        dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
    ),
]


@pytest.mark.parametrize(
    "world,moe,layout", CASES, ids=["tp2_sp", "tp2", "dp2", "ep2", "ep4", "tp2_ep2"]
)
def test_layout_matches_single_process_fp32(world, moe, layout):
    ref = run_world(1, _train, moe, "fp32", {})[0]
    got = run_world(world, _train, moe, "fp32", layout)
    for rank_losses in got:
        assert rank_losses == pytest.approx(ref, rel=1e-5)


def test_tp2_ep2_matches_single_process_bf16():
    layout = dict(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2
    )
    ref = run_world(1, _train, True, "bf16_mixed", {})[0]
    got = run_world(4, _train, True, "bf16_mixed", layout)[0]
    assert got == pytest.approx(ref, rel=2e-2)


def test_losses_decrease_is_not_required_but_losses_are_finite():
    losses = run_world(2, _train, True, "fp32", dict(expert_model_parallel_size=2))[0]
    assert all(loss == loss and 0 < loss < 20 for loss in losses)


def _train_cfg(cfg_overrides: list[str], layout: dict) -> list[float]:
    from overlap.config.overrides import apply_overrides

    cfg = tiny_config(True, "bf16_mixed", 2, [], STEPS, micro_batch_size=2, **layout)
    apply_overrides(cfg, cfg_overrides)
    res = cfg.finalize(dist.get_world_size())
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["comm_overlap.delay_wgrad_compute=true"],
        [
            "comm_overlap.delay_wgrad_compute=true",
            "ddp.use_distributed_optimizer=true",
            "ddp.overlap_grad_reduce=true",
            "ddp.overlap_param_gather=true",
            "ddp.bucket_size=3000",
        ],
    ],
    ids=["ep_overlap", "ep_overlap+delay_wgrad", "ep_overlap+delay_wgrad+dp_overlaps"],
)
def test_trainer_with_ep_overlap_matches_without(extra):
    """EP overlap (bf16, as its prerequisites demand) trains exactly like the plain micro-batch
    loop: same pieces, same operations, so the losses agree to bf16 accumulation-order noise (rel
    1e-3)."""
    layout = dict(expert_model_parallel_size=2)
    off = run_world(
        2, _train_cfg, [x for x in extra if not x.startswith("comm_overlap.delay")], layout
    )[0]
    on = run_world(
        2, _train_cfg, ["comm_overlap.overlap_moe_expert_parallel_comm=true", *extra], layout
    )[0]
    assert on == pytest.approx(off, rel=1e-3)


def test_adam_split_step_equals_one_full_step():
    """The distributed optimizer updates the first-gathered bucket first (`first=(select, then)`):
    two partial AdamW steps must be bit-identical to one full step (step counts, decoupled weight
    decay, clipping scale)."""
    import torch
    from torch import nn

    from overlap.optim.adam import MixedPrecisionAdam, Slot

    def run(split: bool) -> tuple[list[torch.Tensor], list[str]]:
        gen = torch.Generator().manual_seed(0)
        params = [
            nn.Parameter(torch.randn(4, 3, generator=gen)),
            nn.Parameter(torch.randn(5, generator=gen)),
            nn.Parameter(torch.randn(2, 2, generator=gen)),
        ]
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
        adam = MixedPrecisionAdam(
            [Slot(p, p, g, p, p.dim() > 1) for p, g in zip(params, grads)], cfg
        )
        calls = []
        for it in range(3):
            first = (
                (lambda s: s.param is params[2], lambda it=it: calls.append(it)) if split else None
            )
            adam.step(1e-2, grad_norm=4.0, first=first)
        return [p.detach().clone() for p in params], calls

    full, _ = run(split=False)
    split, calls = run(split=True)
    assert calls == [0, 1, 2]
    assert all(torch.equal(a, b) for a, b in zip(full, split))
