"""Compute time of one micro-batch on one GPU, by piece, from Megatron-Core's FLOPs count.

FLOPs come from `overlap.training.metrics.training_flops` (the same count the trainer's TFLOP/s uses). One
micro-batch of b x s tokens is processed by the TP x PP GPUs of one model replica (CP is not built), so each GPU
does 1 / (TP x PP) of its FLOPs; expert parallelism moves tokens, not FLOPs (with balanced routing every EP rank
computes as many expert rows as it sends). Time = FLOPs / (peak x efficiency); the backward is twice the forward
(dgrad + wgrad, half each), and full recompute adds one more forward to the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.config.container import ConfigContainer
from overlap.config.layout import ParallelLayout
from overlap.config.pipeline_layout import resolve_pipeline_layout
from overlap.plan.hardware import Cluster
from overlap.plan.tp_slots import NO_GEMMS, TPGemms
from overlap.training.metrics import linear_macs, training_flops


@dataclass(frozen=True)
class MicrobatchCompute:
    """Forward seconds of one micro-batch on one GPU (its pipeline stage's share), by piece. Backward = 2 x forward
    (+ 1 x forward recomputed under full recompute)."""

    attention_fwd_s: float  # per layer (linear + core), every layer has one
    moe_fwd_s: float  # per MoE layer (routed + shared experts)
    shared_expert_fwd_s: float  # per MoE layer: the shared expert's part of moe_fwd_s
    dense_mlp_fwd_s: float  # per dense layer
    logits_fwd_s: float  # this stage's share of the output layer
    moe_layers: int  # MoE layers on this stage
    dense_layers: int
    recompute: bool  # full recompute: the backward re-runs the forward
    # Per virtual pipeline stage (v = chunk x PP + rank), its share of the work relative to the average stage: its
    # own layers, and the output layer on the last one (the embedding lookup is free). (1.0,) without PP.
    stage_weights: tuple[float, ...] = (1.0,)
    tp_gemms: TPGemms = NO_GEMMS  # per layer: the TP linears' forward GEMMs (`overlap.plan.tp_slots`)

    @property
    def layers(self) -> int:
        return self.moe_layers + self.dense_layers

    @property
    def fwd_s(self) -> float:
        return (self.attention_fwd_s * self.layers + self.moe_fwd_s * self.moe_layers
                + self.dense_mlp_fwd_s * self.dense_layers + self.logits_fwd_s)

    @property
    def bwd_factor(self) -> float:
        return 3.0 if self.recompute else 2.0

    @property
    def fwd_bwd_s(self) -> float:
        return self.fwd_s * (1.0 + self.bwd_factor)


def microbatch_compute(cfg: ConfigContainer, layout: ParallelLayout, cluster: Cluster) -> MicrobatchCompute:
    """Per-piece forward times of one micro-batch on one GPU of the layout (the pipeline stage's layers)."""
    m = cfg.model
    f = training_flops(m)
    tokens = cfg.train.micro_batch_size * m.seq_length
    rate = cluster.peak_tflops * 1e12 * cluster.efficiency.value
    n_moe = sum(1 for layer in range(m.num_layers) if m.is_moe_layer(layer))
    n_dense = m.num_layers - n_moe
    pp, tp = max(1, layout.pp), max(1, layout.tp)

    def per_gpu_fwd(total_flops_per_token: float, count: int) -> float:
        """Forward seconds of one of `count` identical pieces (training FLOPs are 3 x forward)."""
        return total_flops_per_token / max(1, count) / 3.0 * tokens / tp / rate if count else 0.0

    attention, moe, dense = (per_gpu_fwd(f.attention, m.num_layers), per_gpu_fwd(f.moe, n_moe),
                             per_gpu_fwd(f.dense_mlp, n_dense))
    logits = per_gpu_fwd(f.logits, 1)
    # The TP linears' forward GEMMs, 2 FLOPs per multiply-add (the dense MLP's only where a layer has one).
    qkv, proj, fc1, fc2 = (2.0 * macs * tokens / tp / rate for macs in linear_macs(m))
    # The MoE block refills a rate-limited link's bucket only where no all-to-all crosses that link during it (EP 1)
    gemms = TPGemms(qkv, proj, fc1 if n_dense else 0.0, fc2 if n_dense else 0.0, core=max(0.0, attention - qkv - proj),
                    moe=moe if max(1, layout.ep) == 1 else 0.0)
    weights = (1.0,)
    if pp > 1:
        # Each virtual stage's own layers (the shared resolution: an uneven layout weighs its
        # stages unevenly), and the output layer where the loss is
        stages = [sum(attention + (moe if m.is_moe_layer(layer) else dense)
                      for layer in range(s.start, s.end)) + (logits if s.loss else 0.0)
                  for s in resolve_pipeline_layout(m, pp).stages]
        mean = sum(stages) / len(stages)
        weights = tuple(x / mean for x in stages) if mean > 0 else (1.0,) * len(stages)
    return MicrobatchCompute(attention_fwd_s=attention, moe_fwd_s=moe,
                             shared_expert_fwd_s=per_gpu_fwd(f.shared_expert, n_moe), dense_mlp_fwd_s=dense,
                             logits_fwd_s=logits / pp, moe_layers=-(-n_moe // pp), dense_layers=-(-n_dense // pp),
                             recompute=m.recompute_granularity == "full", stage_weights=weights, tp_gemms=gemms)
