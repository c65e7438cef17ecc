"""What a run reports: reference-style iteration lines, model FLOPs, the steady-state window, peak
memory.

Iteration numbering, one convention for users: everything a user reads (the log, `metrics.jsonl`'s
"iteration", `FILE.comm.jsonl`, `FILE.summary.json`, `overlap bench` tables and JSON, the timeline
title) numbers iterations from 1 (iteration 1 = the first optimizer step), and a window of
iterations is written `[first, last]` with both ends included (`window_iterations` in the JSON
files; "iterations 2-10" in the log). Inside the code, `StepRecord.iteration` and `steady_window`
are 0-based indices with a half-open `[start, end)` window; `window_iterations` converts.
"""

from __future__ import annotations

import resource
import statistics
import sys
from dataclasses import dataclass

import torch

from overlap.config.architecture import TransformerArchitecture
from overlap.config.training import TrainConfig


@dataclass(frozen=True)
class TrainingFlops:
    """Training FLOPs per token by part, as Megatron-Core counts them
    (`megatron/training/training.py:: num_floating_point_operations`, BSHD): 3 x forward (forward,
    dgrad, wgrad), 2 FLOPs per multiply-add. The parts are kept apart because the planner
    (`overlap.plan`) needs them: attention and experts are the compute windows the EP overlap hides
    the all-to-alls behind."""

    attention_linear: float  # QKV (GQA: q + 2 kv heads) and output projections, all layers
    attention_core: float  # QK^T and AV with the causal halving (6 q s per token per layer)
    dense_mlp: float  # dense layers' MLP
    # MoE layers: routed top-k experts + the shared expert (the router GEMM is not counted)
    moe: float
    logits: float  # output layer (6 h V); the embedding lookup is free
    # of `moe`: the shared expert's part (the work its overlap hides transfers behind)
    shared_expert: float = 0.0

    @property
    def attention(self) -> float:
        return self.attention_linear + self.attention_core

    @property
    def total(self) -> float:
        return self.attention + self.dense_mlp + self.moe + self.logits


def linear_macs(m: TransformerArchitecture, ffn: int | None = None) -> tuple[int, int, int, int]:
    """Multiply-adds per token of one layer's linears (qkv, proj, fc1, fc2): qkv h x (q + 2 kv),
    proj q x h, fc1 h x F per up projection (two under SwiGLU), fc2 F x h, with F = `ffn` (default:
    the dense MLP's)."""
    hd, h, f = m.head_dim, m.hidden_size, m.ffn_size if ffn is None else ffn
    q, kv = m.num_attention_heads * hd, m.query_groups * hd
    ups = 2 if m.gated_linear_unit else 1
    return h * (q + 2 * kv), q * h, ups * h * f, f * h


def training_flops(m: TransformerArchitecture) -> TrainingFlops:
    """Per-token training FLOPs of `m` by part (see TrainingFlops). Causal attention is halved as
    Megatron does, the router's h x E GEMM is left out as Megatron does (0.4% for Qwen3-30B-A3B),
    experts count only the top-k."""
    hd, h = m.head_dim, m.hidden_size
    q = m.num_attention_heads * hd
    qkv, proj, _fc1, _fc2 = linear_macs(m)
    n_moe = sum(1 for layer in range(m.num_layers) if m.is_moe_layer(layer))
    n_dense = m.num_layers - n_moe

    def mlp(ffn: int) -> int:
        return sum(linear_macs(m, ffn)[2:])  # fc1 + fc2 of an MLP of width ffn

    moe_layer = m.moe_router_topk * mlp(m.moe_ffn_size) if n_moe else 0
    shared = (
        mlp(m.moe_shared_expert_intermediate_size)
        if n_moe and m.moe_shared_expert_intermediate_size
        else 0
    )
    moe_layer += shared
    return TrainingFlops(
        attention_linear=6.0 * (qkv + proj) * m.num_layers,
        attention_core=6.0 * q * m.seq_length * m.num_layers,  # 6 q/2 x 2 (QK^T and AV), causal
        dense_mlp=6.0 * mlp(m.ffn_size) * n_dense,
        moe=6.0 * moe_layer * n_moe,
        logits=6.0 * h * m.vocab_size,
        shared_expert=6.0 * shared * n_moe,
    )


def flops_per_token(m: TransformerArchitecture) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), Megatron-Core's count
    (training_flops): the trainer's TFLOP/s and the planner's compute time come from this one
    function."""
    return training_flops(m).total


def steady_window(cfg: TrainConfig, first: int = 0, stop: int | None = None) -> tuple[int, int]:
    """Half-open [start, end) of 0-based iteration indices averaged for the steady-state step time
    (reference: skip the first part). Users see it as `window_iterations(...)`. A run resumed at
    iteration `first` skips the first part of its own iterations [first, train_iters) (its first
    step warms up like any first step); a run that stopped early (SIGTERM, a time limit) after
    iteration index `stop` - 1 is measured over the iterations it ran, not the ones it never
    reached."""
    n = cfg.train_iters if stop is None else stop
    run = n - first
    start = (
        cfg.eval_time_start_step
        if cfg.eval_time_start_step is not None
        else first + max(1, int(run * cfg.skip_first_percent_time))
    )
    end = cfg.eval_time_end_step if cfg.eval_time_end_step is not None else n
    start, end = max(min(start, n - 1), first), max(min(end, n), first + 1)
    return (start, end) if start < end else (first, n)


def window_iterations(window: tuple[int, int]) -> tuple[int, int]:
    """0-based half-open [start, end) -> 1-based inclusive (first, last): (1, 10) -> (2, 10),
    iterations 2 to 10."""
    start, end = window
    return start + 1, end


@dataclass
class StepRecord:
    iteration: int  # 0-based index; printed as iteration + 1
    lm_loss: float
    grad_norm: float
    step_time_ms: float
    lr: float
    loss_scale: float | None = None  # the scale the step's backward used (None: no loss scaling)
    skipped_to: float | None = None  # a step skipped for an overflow: the scale it backed off to
    # forward-backward re-runs on the dropless path after a sync-free MoE block overflowed
    # (model.moe_expert_rank_capacity_factor; 0 or 1)
    moe_reruns: int = 0


def format_iteration(
    r: StepRecord, cfg: TrainConfig, tokens_per_s: float, tflops: float, *, on_gpu: bool
) -> str:
    """The reference's iteration line. On GPU ranks it carries the model TFLOP/s per GPU; on CPU
    ranks there is no GPU to quote a number for, so the line gives tokens/s per rank and no TFLOP/s
    (metrics.jsonl still has `tflops_per_rank`)."""
    rate = (
        f"throughput per GPU (TFLOP/s/GPU): {tflops:.4f} | tokens/s per GPU: {tokens_per_s:.0f}"
        if on_gpu
        else f"tokens/s per rank: {tokens_per_s:.0f}"
    )
    return (
        f"iteration {r.iteration + 1:>6}/{cfg.train_iters:<6} | elapsed time per iteration (ms): "
        f"{r.step_time_ms:.1f} | {rate} | learning rate: {r.lr:.6E} | global batch size: "
        f"{cfg.global_batch_size:>5} | lm loss: {r.lm_loss:.6E} | "
        + (f"loss scale: {r.loss_scale:.1f} | " if r.loss_scale is not None else "")
        + f"grad norm: {r.grad_norm:.4f}"
        + ("" if r.skipped_to is None else f" | skipped: overflow, scale -> {r.skipped_to:.1f}")
    )


def steady_mean_ms(records: list[StepRecord], window: tuple[int, int]) -> float | None:
    """The mean step time over the window; None when no iteration ran in it (nothing to train)."""
    times = [r.step_time_ms for r in records if window[0] <= r.iteration < window[1]]
    return statistics.fmean(times) if times else None


def peak_memory_mb() -> float:
    """Peak device memory on GPU, else this process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024
