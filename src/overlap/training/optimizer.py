"""Adam with fp32 main parameters, global-norm gradient clipping and the warm-up + decay learning-rate schedule.

Gradients arrive in `param.main_grad` (fp32, already reduced across data parallel). With bf16 parameters the
optimizer keeps fp32 master copies and writes the update back in bf16; with fp32 parameters the master *is* the
parameter. The gradient norm counts every logical parameter once: tensor-parallel replicas (norms, router) only on
TP rank 0, expert shards summed over the expert-parallel group.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from overlap.config.training import OptimizerConfig, SchedulerConfig
from overlap.parallel import comm
from overlap.parallel.state import ParallelState


def learning_rate(it: int, opt: OptimizerConfig, sched: SchedulerConfig, train_iters: int) -> float:
    """Linear warm-up to `lr`, then cosine / linear decay to `min_lr` (Megatron's schedule); `it` counts from 0."""
    warm = sched.lr_warmup_iters
    if warm and it < warm:
        return opt.lr * (it + 1) / warm
    if sched.lr_decay_style == "constant":
        return opt.lr
    decay = (sched.lr_decay_iters or train_iters) - warm
    frac = min(1.0, (it - warm) / decay) if decay > 0 else 1.0
    if sched.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    return opt.min_lr + coeff * (opt.lr - opt.min_lr)


def grad_norm_sq_local(params: list[nn.Parameter], ps: ParallelState) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense, expert) local sums of squared gradients, each logical element counted once after reduction."""
    dense = torch.zeros((), dtype=torch.float32)
    expert = torch.zeros((), dtype=torch.float32)
    for p in params:
        g = p.main_grad
        if getattr(p, "is_expert", False):
            expert += g.float().pow(2).sum()
        elif hasattr(p, "shard") or ps.tp_rank == 0:
            dense += g.float().pow(2).sum()
    return dense, expert


def global_grad_norm(params: list[nn.Parameter], ps: ParallelState) -> float:
    dense, expert = grad_norm_sq_local(params, ps)
    comm.all_reduce(dense, ps.tp_group, "mp_norm").wait()
    comm.all_reduce(expert, ps.ep_group, "mp_norm").wait()
    return math.sqrt(float(dense + expert))


class MixedPrecisionAdam:
    """AdamW over fp32 master parameters; no weight decay on 1-D parameters (norms), as Megatron."""

    def __init__(self, params: list[nn.Parameter], cfg: OptimizerConfig) -> None:
        if cfg.optimizer != "adam":
            raise ValueError(f"optimizer.optimizer={cfg.optimizer!r}: only adam is built")
        self.params = params
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in params]
        decay = [m for m, p in zip(self.masters, params) if p.dim() > 1]
        no_decay = [m for m, p in zip(self.masters, params) if p.dim() <= 1]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, foreach=False)
        self.clip = cfg.clip_grad

    @torch.no_grad()
    def step(self, lr: float, grad_norm: float) -> None:
        scale = min(1.0, self.clip / (grad_norm + 1e-6)) if self.clip > 0 else 1.0
        for master, p in zip(self.masters, self.params):
            master.grad = p.main_grad if scale == 1.0 else p.main_grad * scale
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for master, p in zip(self.masters, self.params):
            master.grad = None
            if master is not p:
                p.copy_(master)
