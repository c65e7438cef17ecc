"""Compute time of one micro-batch on one GPU, by piece, from the shapes of its kernels.

One micro-batch of b x s tokens is processed by the TP x PP GPUs of one model replica (CP is not
built), so each GPU does 1 / (TP x PP) of its FLOPs; expert parallelism moves tokens, not FLOPs
(with balanced routing every EP rank computes as many expert rows as it sends). The backward is
twice the forward (dgrad + wgrad, half each), and full recompute adds one more forward to the
backward.

Each piece's ideal time on the GPU type (`Cluster`: peaks, HBM bandwidth, SMs), divided by the one
fitted number, the compute efficiency (`overlap.plan.validate` fits it per GPU type on published
runs):
- a GEMM (M x N x K): the roofline max(2 M N K / (peak x wave), operand and result bytes / HBM), at
  the plan's precision (BF16, FP8, MXFP8: FP8 operands are one byte). `wave` is the last wave's
  quantization: ceil(M / 128) x ceil(N / 256) output tiles (the Hopper/Blackwell GEMMs' tile) spread
  over the SMs; a grouped expert GEMM counts the tiles of all its local experts together. The expert
  GEMMs have T k EP / E rows per local expert (balanced routing);
- the attention core (FlashAttention): its causal FLOPs at the BF16 peak (the reference's FP8
  recipes keep dot product attention in BF16) times 0.75, the share of the peak FlashAttention-3
  reaches on H100 (740 of 989 TFLOP/s BF16 forward, arXiv 2407.08608);
- the per-layer glue, memory-bound: the bytes its elementwise kernels read and write per token
  (norms, residual adds, rotary embedding, QK norms, the gated activation, the MoE permutation and
  un-permutation, the router's softmax, the cross-entropy's logits passes, and under FP8 each GEMM
  input's cast: 2 bytes read, 1 written) over the HBM bandwidth; the router's h x E GEMM too
  (Megatron's FLOPs count leaves it out, the GPU does not);
- the output layer's GEMM in BF16 (Megatron's output layer is not an FP8 module).
A -g cpu profile has no HBM or SM figures: there every FLOP costs the same (peak x efficiency) and
glue is free, as the CPU calibration measures it inside the efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from overlap.config.container import ConfigContainer
from overlap.config.layout import ParallelLayout
from overlap.config.pipeline_layout import resolve_pipeline_layout
from overlap.plan.hardware import Cluster
from overlap.plan.tp_slots import NO_GEMMS, TPGemms

FLASH_ATTENTION_SHARE = 0.75  # FlashAttention-3 on H100: 740 of 989 TFLOP/s (arXiv 2407.08608)
TILE_M, TILE_N = 128, 256  # a GEMM's output tile
FP8_PRECISIONS = ("fp8", "mxfp8")


@dataclass(frozen=True)
class MicrobatchCompute:
    """Forward seconds of one micro-batch on one GPU (its pipeline stage's share), by piece.
    Backward = 2 x forward (+ 1 x forward recomputed under full recompute)."""

    attention_fwd_s: float  # per layer (linear + core), every layer has one
    moe_fwd_s: float  # per MoE layer (routed + shared experts)
    shared_expert_fwd_s: float  # per MoE layer: the shared expert's part of moe_fwd_s
    dense_mlp_fwd_s: float  # per dense layer
    logits_fwd_s: float  # this stage's share of the output layer
    moe_layers: int  # MoE layers on this stage
    dense_layers: int
    recompute: bool  # full recompute: the backward re-runs the forward
    # Per virtual pipeline stage (v = chunk x PP + rank), its share of the work relative to the
    # average stage: its own layers, and the output layer on the last one (the embedding lookup is
    # free). (1.0,) without PP.
    stage_weights: tuple[float, ...] = (1.0,)
    # per layer: the TP linears' forward GEMMs (`overlap.plan.tp_slots`)
    tp_gemms: TPGemms = NO_GEMMS

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


class KernelCosts:
    """Ideal seconds of the kernels one GPU runs, on `cluster` (see the module docstring); divide
    by the efficiency."""

    def __init__(self, cluster: Cluster) -> None:
        self.peak = cluster.peak_tflops * 1e12
        self.bf16_peak = (cluster.bf16_peak_tflops or cluster.peak_tflops) * 1e12
        self.hbm = cluster.hbm_Bps
        self.sms = cluster.sms
        self.fp8 = cluster.precision in FP8_PRECISIONS
        self.shaped = self.hbm > 0

    def gemm(self, m: float, n: float, k: float, groups: int = 1, bf16: bool = False) -> float:
        """`groups` GEMMs of m x n x k (a grouped expert GEMM: one per local expert)."""
        if m <= 0 or n <= 0 or k <= 0 or groups <= 0:
            return 0.0
        peak = self.bf16_peak if bf16 else self.peak
        flops = 2.0 * m * n * k * groups
        if not self.shaped:
            return flops / peak
        wave = 1.0
        if self.sms:
            tiles = groups * ceil(m / TILE_M) * ceil(n / TILE_N)
            wave = tiles / (ceil(tiles / self.sms) * self.sms)
        operand = 1 if self.fp8 and not bf16 else 2
        nbytes = groups * ((m * k + k * n) * operand + m * n * 2)
        return max(flops / (peak * wave), nbytes / self.hbm)

    def attention_core(self, flops: float) -> float:
        if not self.shaped:
            return flops / self.peak
        return flops / (self.bf16_peak * FLASH_ATTENTION_SHARE)

    def glue(self, nbytes: float) -> float:
        return nbytes / self.hbm if self.shaped else 0.0

    def casts(self, elements: float) -> float:
        """FP8 casts of GEMM inputs (2 bytes read, 1 written each); nothing at BF16."""
        return self.glue(3.0 * elements) if self.fp8 else 0.0


def microbatch_compute(cfg: ConfigContainer, layout: ParallelLayout,
                       cluster: Cluster) -> MicrobatchCompute:
    """Per-piece forward times of one micro-batch on one GPU of the layout (the pipeline stage's
    layers)."""
    m = cfg.model
    k = KernelCosts(cluster)
    eff = cluster.efficiency.value
    tokens = cfg.train.micro_batch_size * m.seq_length
    n_moe = sum(1 for layer in range(m.num_layers) if m.is_moe_layer(layer))
    n_dense = m.num_layers - n_moe
    pp, tp, ep = max(1, layout.pp), max(1, layout.tp), max(1, layout.ep)
    h, hd = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * hd, m.query_groups * hd
    ups = 2 if m.gated_linear_unit else 1
    sp = tp if m.sequence_parallel else 1  # under SP the norms and residual adds see 1 / TP of them
    act = 2.0  # bytes per activation element (BF16)

    def mlp_glue(rows: float, ffn: float) -> float:
        """Gated activation (reads ups x F, writes F) and the FP8 casts of fc1's and fc2's
        inputs."""
        return k.glue(act * rows * (ups + 1) * ffn) + k.casts(rows * (h + ffn))

    qkv_s = k.gemm(tokens, (q + 2 * kv) / tp, h)
    proj_s = k.gemm(tokens, h, q / tp)
    core_s = k.attention_core(2.0 * q * m.seq_length * tokens / tp)  # causal: 2 q s per token
    # a norm (read + write) and a residual add (2 reads + 1 write) per block
    norm_residual = act * tokens / sp * 5 * h
    # rotary embedding of q and k (+ their norms): read + write
    rotary = act * tokens * 2 * (q + 2 * kv) / tp * (2 if m.qk_layernorm else 1)
    attention_glue = k.glue(norm_residual + rotary) + k.casts(tokens * (h + q / tp))
    attention = (qkv_s + proj_s + core_s + attention_glue) / eff

    fc1_s = k.gemm(tokens, ups * m.ffn_size / tp, h)
    fc2_s = k.gemm(tokens, h, m.ffn_size / tp)
    dense = 0.0
    if n_dense:
        dense = (fc1_s + fc2_s + k.glue(norm_residual) + mlp_glue(tokens, m.ffn_size / tp)) / eff

    moe = shared = 0.0
    if n_moe:
        moe_tokens = tokens / tp  # expert TP 1: the dispatcher splits the tokens over the TP ranks
        experts, topk, f_moe = m.num_moe_experts, m.moe_router_topk, m.moe_ffn_size
        local = max(1, experts // ep)
        rows = moe_tokens * topk * ep / experts  # per local expert, balanced routing
        routed = k.gemm(rows, ups * f_moe, h, local) + k.gemm(rows, h, f_moe, local)
        router = (k.gemm(moe_tokens, experts, h, bf16=True) + k.glue(act * moe_tokens * 4 * experts)
                  if k.shaped else 0.0)
        # permute and un-permute: h in, k h out (and back)
        permute = k.glue(act * moe_tokens * 2 * (h + topk * h))
        routed += mlp_glue(moe_tokens * topk, f_moe)
        if m.moe_shared_expert_intermediate_size:
            f_sh = m.moe_shared_expert_intermediate_size
            shared = (k.gemm(moe_tokens, ups * f_sh, h) + k.gemm(moe_tokens, h, f_sh)
                      + mlp_glue(moe_tokens, f_sh)) / eff
        moe = (routed + router + permute + k.glue(norm_residual)) / eff + shared
    cross_entropy = k.glue(4.0 * 3 * tokens * m.vocab_size / tp)  # three FP32 logits passes
    vocab_s = k.gemm(tokens, m.vocab_size / tp, h, bf16=True) + cross_entropy
    logits = vocab_s / eff
    # The TP linears' forward GEMMs (the dense MLP's only where a layer has one).
    fc1_fwd, fc2_fwd = (fc1_s / eff, fc2_s / eff) if n_dense else (0.0, 0.0)
    gemms = TPGemms(qkv_s / eff, proj_s / eff, fc1_fwd, fc2_fwd,
                    core=max(0.0, attention - (qkv_s + proj_s) / eff),
                    # refills a rate-limited link's bucket only without all-to-alls
                    moe=moe if ep == 1 else 0.0)
    weights = (1.0,)
    if pp > 1:
        # Each virtual stage's own layers (the shared resolution: an uneven layout weighs its
        # stages unevenly), and the output layer where the loss is
        stages = [sum(attention + (moe if m.is_moe_layer(layer) else dense)
                      for layer in range(s.start, s.end)) + (logits if s.loss else 0.0)
                  for s in resolve_pipeline_layout(m, pp).stages]
        mean = sum(stages) / len(stages)
        weights = tuple(x / mean for x in stages) if mean > 0 else (1.0,) * len(stages)
    return MicrobatchCompute(attention_fwd_s=attention, moe_fwd_s=moe, shared_expert_fwd_s=shared,
                             dense_mlp_fwd_s=dense, logits_fwd_s=logits / pp,
                             moe_layers=-(-n_moe // pp), dense_layers=-(-n_dense // pp),
                             recompute=m.recompute_granularity == "full", stage_weights=weights,
                             tp_gemms=gemms)
