"""What a run reports: reference-style iteration lines, model FLOPs, the steady-state window, peak memory.

Iteration numbering, one convention for users: everything a user reads (the log, `metrics.jsonl`'s "iteration",
`FILE.comm.jsonl`, `FILE.summary.json`, `overlap bench` tables and JSON, the timeline title) numbers iterations from 1
(iteration 1 = the first optimizer step), and a window of iterations is written `[first, last]` with both ends
included (`window_iterations` in the JSON files; "iterations 2-10" in the log). Inside the code, `StepRecord.iteration`
and `steady_window` are 0-based indices with a half-open `[start, end)` window; `window_iterations` converts.
"""

from __future__ import annotations

import resource
import statistics
import sys
from dataclasses import dataclass

import torch

from overlap.config.model import ModelConfig
from overlap.config.training import TrainConfig


def flops_per_token(m: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), counting only active (routed top-k) experts."""
    hd, h = m.head_dim, m.hidden_size
    attn_proj = h * (m.num_attention_heads * hd + 2 * m.query_groups * hd) + m.num_attention_heads * hd * h
    gate = 3 if m.gated_linear_unit else 2
    matmul = 0
    for layer in range(m.num_layers):
        if m.is_moe_layer(layer):
            mlp = m.moe_router_topk * gate * h * m.moe_ffn_size + h * m.num_moe_experts
            if m.moe_shared_expert_intermediate_size:
                mlp += gate * h * m.moe_shared_expert_intermediate_size
        else:
            mlp = gate * h * m.ffn_size
        matmul += attn_proj + mlp
    matmul += h * m.vocab_size
    attention_core = 2 * 2 * m.seq_length * m.num_attention_heads * hd * m.num_layers  # QK^T and AV, forward
    return 3 * (2 * matmul + attention_core)


def steady_window(cfg: TrainConfig, first: int = 0) -> tuple[int, int]:
    """Half-open [start, end) of 0-based iteration indices averaged for the steady-state step time (reference: skip
    the first part). Users see it as `window_iterations(...)`. A run resumed at iteration `first` skips the first
    part of its own iterations [first, train_iters) (its first step warms up like any first step)."""
    n = cfg.train_iters
    run = n - first
    start = cfg.eval_time_start_step if cfg.eval_time_start_step is not None else \
        first + max(1, int(run * cfg.skip_first_percent_time))
    end = cfg.eval_time_end_step if cfg.eval_time_end_step is not None else n
    start, end = max(min(start, n - 1), first), max(min(end, n), first + 1)
    return (start, end) if start < end else (first, n)


def window_iterations(window: tuple[int, int]) -> tuple[int, int]:
    """0-based half-open [start, end) -> 1-based inclusive (first, last): (1, 10) -> (2, 10), iterations 2 to 10."""
    start, end = window
    return start + 1, end


@dataclass
class StepRecord:
    iteration: int  # 0-based index; printed as iteration + 1
    lm_loss: float
    grad_norm: float
    step_time_ms: float
    lr: float


def format_iteration(r: StepRecord, cfg: TrainConfig, tokens_per_s: float, tflops: float, *, on_gpu: bool) -> str:
    """The reference's iteration line. On GPU ranks it carries the model TFLOP/s per GPU; on CPU ranks there is no
    GPU to quote a number for, so the line gives tokens/s per rank and no TFLOP/s (metrics.jsonl still has
    `tflops_per_rank`)."""
    rate = (f"throughput per GPU (TFLOP/s/GPU): {tflops:.4f} | tokens/s per GPU: {tokens_per_s:.0f}" if on_gpu
            else f"tokens/s per rank: {tokens_per_s:.0f}")
    return (f"iteration {r.iteration + 1:>6}/{cfg.train_iters:<6} | elapsed time per iteration (ms): "
            f"{r.step_time_ms:.1f} | {rate} | learning rate: {r.lr:.6E} | global batch size: "
            f"{cfg.global_batch_size:>5} | lm loss: {r.lm_loss:.6E} | grad norm: {r.grad_norm:.4f}")


def steady_mean_ms(records: list[StepRecord], window: tuple[int, int]) -> float:
    times = [r.step_time_ms for r in records if window[0] <= r.iteration < window[1]]
    return statistics.fmean(times) if times else float("nan")


def peak_memory_mb() -> float:
    """Peak device memory on GPU, else this process's peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024
