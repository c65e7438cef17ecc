"""Compute time of one micro-batch on one GPU, by piece, from the shapes of its kernels.

One micro-batch of b x s tokens is processed by the TP x CP x PP GPUs of one model replica, so each
GPU does 1 / (TP x CP) of the FLOPs of the layers its pipeline stages hold (a CP rank's b x s / CP
tokens; its queries attend every earlier key, and the load-balanced split gives every CP rank 1 /
CP of the causal attention's FLOPs) (the real
per-stage layout, `overlap.layout.pipeline`: uneven stages, the embedding and the loss where
the layout puts them); expert parallelism moves tokens, not FLOPs (with balanced routing every EP
rank computes as many expert rows as it sends). The backward is twice the forward (dgrad + wgrad,
half each); full recompute adds one more forward to it, selective recompute the forward of the
modules it names (`recompute_modules`: `core_attn`, `layernorm`, `moe_act`, `mlp`, `moe`,
`shared_experts`).

Each kernel's ideal time on the GPU type (`Cluster`: peaks, HBM bandwidth, SMs) is divided by the
fitted compute efficiency, and the fitted per-kernel overhead (`Efficiency.kernel_overhead_s`: the
host's cost of launching one kernel of an eager run, which no efficiency shrinks and no precision
halves; `overlap.plan.validate` fits both per GPU type on published runs) is a floor under it: a
kernel costs max(ideal / efficiency, overhead). The host launches while the GPU works, so a
kernel longer than its launch hides the next one's; one shorter leaves the GPU idle for the rest.
Per kernel, not per piece (max(the piece's GPU work, its launches x overhead)): while a long kernel
runs the host gains a lead it could spend on the short kernels after it, which the per-kernel
floor ignores. So it is exact over short kernels after the queue drained (at every host sync: the
alltoall dispatcher's split sizes, each MoE layer) and an upper bound elsewhere; the per-piece
floor would be the lower bound, and the exact queue needs the kernels' order and the sync points,
which the model does not have. The kernels:
- a GEMM (M x N x K): the roofline max(2 M N K / (peak x wave), operand and result bytes / HBM), at
  the plan's precision (BF16, FP8, MXFP8: FP8 operands are one byte). `wave` is the last wave's
  quantization: ceil(M / 128) x ceil(N / 256) output tiles (the Hopper/Blackwell GEMMs' tile) spread
  over the SMs; a grouped expert GEMM counts the tiles of all its local experts together, and one
  launch per local expert (TE's grouped linear runs one GEMM per expert). The expert GEMMs have
  T k EP / E rows per local expert (balanced routing), padded to the expert capacity or dropped past
  it under `moe_expert_capacity_factor` (`launch.activations.capacity_rows_per_token`, which the
  memory and communication models read too);
- the attention core (FlashAttention): its causal FLOPs at the BF16 peak (the reference's FP8
  recipes keep dot product attention in BF16) times 0.75, the share of the peak FlashAttention-3
  reaches on H100 (740 of 989 TFLOP/s BF16 forward, arXiv 2407.08608);
- the per-layer glue, memory-bound: the bytes its elementwise kernels read and write per token
  (norms, residual adds, rotary embedding, QK norms, the gated activation, the MoE permutation and
  un-permutation, the router's softmax and top-k, the cross-entropy's logits passes, the embedding's
  lookup and its gradient's accumulation, and under FP8 each GEMM input's cast: 2 bytes read, 1
  written) over the HBM bandwidth; the router's h x E GEMM too (Megatron's FLOPs count leaves it
  out, the GPU does not). Under the sync-free MoE buffers (`moe_expert_rank_capacity_factor`) the
  experts' activation and casts run over every row of the static EP blocks, the GEMMs over the
  routed rows (they read the counts on the GPU);
- the output layer's GEMM in BF16 (Megatron's output layer is not an FP8 module).
A -g cpu profile has no HBM or SM figures: there every FLOP costs the same (peak x efficiency),
glue and launches are free, as the CPU calibration measures them inside the efficiency.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from overlap.config.container import ConfigContainer
from overlap.config.model import expert_rank_capacity
from overlap.launch.activations import capacity_rows_per_token
from overlap.layout import ParallelLayout
from overlap.plan.hardware import Cluster
from overlap.plan.tp_slots import NO_GEMMS, TPGemms

FLASH_ATTENTION_SHARE = 0.75  # FlashAttention-3 on H100: 740 of 989 TFLOP/s (arXiv 2407.08608)
TILE_M, TILE_N = 128, 256  # a GEMM's output tile
FP8_PRECISIONS = ("fp8", "mxfp8")
ROUTER_KERNELS = 4  # softmax, top-k, the load-balancing loss's reduction, the routing map
ALL_SCOPES = frozenset({"attn", "mlp", "moe", "moe_router", "moe_preprocess", ""})


def graphed_scopes(model) -> frozenset[str]:
    """The pieces whose kernels run inside CUDA graphs (`cuda_graph_impl` / `cuda_graph_scope`):
    a full-iteration graph holds every piece, the output layer and embedding ("") included; a
    scope list those pieces of every layer (forward and backward); no scope whole layers."""
    scope = set(model.graph_scope)
    if model.cuda_graph_impl == "none":
        return frozenset()
    if "full_iteration" in scope:
        return ALL_SCOPES
    return frozenset(scope) if scope else ALL_SCOPES - {""}


@dataclass(frozen=True)
class MicrobatchCompute:
    """Forward seconds of one micro-batch on one GPU (the average pipeline rank's share), by piece.
    Backward = 2 x forward (+ 1 x forward under full recompute, + the recomputed modules' forward
    under selective recompute)."""

    attention_fwd_s: float  # per layer (linear + core), every layer has one
    moe_fwd_s: float  # per MoE layer (routed + shared experts)
    shared_expert_fwd_s: float  # per MoE layer: the shared expert's part of moe_fwd_s
    dense_mlp_fwd_s: float  # per dense layer
    logits_fwd_s: float  # the average rank's share of the output layer and the embedding
    # MoE / dense layers on the average pipeline rank (the layout's layers / PP: a fraction when
    # the stages are uneven; the stage weights say which rank holds more)
    moe_layers: float
    dense_layers: float
    recompute: bool  # full recompute: the backward re-runs the forward
    # Per virtual pipeline stage (v = chunk x PP + rank), its share of the work relative to the
    # average stage: its own layers, the embedding on the first and the output layer on the last.
    # (1.0,) without PP.
    stage_weights: tuple[float, ...] = (1.0,)
    # per layer: the TP linears' forward GEMMs (`overlap.plan.tp_slots`)
    tp_gemms: TPGemms = NO_GEMMS
    # per layer, selective recompute: the forward seconds its backward re-runs
    attention_recompute_s: float = 0.0
    moe_recompute_s: float = 0.0
    dense_recompute_s: float = 0.0
    # the embedding's backward (its gradient accumulated into the table), the average rank's share
    embedding_bwd_s: float = 0.0
    # per layer: the attention core's forward (part of attention_fwd_s), under CP what the KV
    # ring's steps hide behind (`overlap.plan.step_times`)
    attention_core_fwd_s: float = 0.0

    @property
    def layers(self) -> float:
        return self.moe_layers + self.dense_layers

    @property
    def fwd_s(self) -> float:
        return (
            self.attention_fwd_s * self.layers
            + self.moe_fwd_s * self.moe_layers
            + self.dense_mlp_fwd_s * self.dense_layers
            + self.logits_fwd_s
        )

    @property
    def bwd_factor(self) -> float:
        return 3.0 if self.recompute else 2.0

    @property
    def recompute_s(self) -> float:
        """Selective recompute's extra backward seconds per micro-batch."""
        return (
            self.attention_recompute_s * self.layers
            + self.moe_recompute_s * self.moe_layers
            + self.dense_recompute_s * self.dense_layers
        )

    @property
    def bwd_s(self) -> float:
        return self.fwd_s * self.bwd_factor + self.recompute_s + self.embedding_bwd_s

    @property
    def fwd_bwd_s(self) -> float:
        return self.fwd_s + self.bwd_s


class KernelCosts:
    """Ideal seconds of the kernels one GPU runs, on `cluster` (see the module docstring), and the
    seconds the GPU waits for their launches (`launch_wait`): a piece costs ideal / efficiency +
    its kernels' waits, each kernel max(0, per-kernel overhead - its ideal / efficiency)."""

    def __init__(self, cluster: Cluster) -> None:
        self.peak = cluster.peak_tflops * 1e12
        self.bf16_peak = (cluster.bf16_peak_tflops or cluster.peak_tflops) * 1e12
        self.hbm = cluster.hbm_Bps
        self.sms = cluster.sms
        self.fp8 = cluster.precision in FP8_PRECISIONS
        self.shaped = self.hbm > 0
        self.efficiency = cluster.efficiency.value
        # the CPU profile measures its launches inside the efficiency
        self.overhead = cluster.efficiency.kernel_overhead_s if self.shaped else 0.0
        self.wait = 0.0

    def _launch(self, ideal: float, kernels: int) -> float:
        """`kernels` launches sharing `ideal` seconds equally; returns `ideal`."""
        each = ideal / kernels / self.efficiency
        self.wait += kernels * max(0.0, self.overhead - each)
        return ideal

    def launch_wait(self) -> float:
        """Seconds the GPU waited for the launches since the last call."""
        w, self.wait = self.wait, 0.0
        return w

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
        return self._launch(max(flops / (peak * wave), nbytes / self.hbm), groups)

    def attention_core(self, flops: float) -> float:
        if not self.shaped:
            return flops / self.peak
        return self._launch(flops / (self.bf16_peak * FLASH_ATTENTION_SHARE), 1)

    def glue(self, nbytes: float, kernels: int = 1) -> float:
        """`kernels` memory-bound kernels moving `nbytes` in all (in equal shares: which of them
        moves more is not in the model)."""
        if not self.shaped or nbytes <= 0:
            return 0.0
        return self._launch(nbytes / self.hbm, kernels)

    def casts(self, elements: float, kernels: int = 1) -> float:
        """FP8 casts of GEMM inputs (2 bytes read, 1 written each); nothing at BF16."""
        return self.glue(3.0 * elements, kernels) if self.fp8 else 0.0


def microbatch_compute(
    cfg: ConfigContainer, layout: ParallelLayout, cluster: Cluster
) -> MicrobatchCompute:
    """Per-piece forward times of one micro-batch on one GPU of the layout (the average pipeline
    rank's layers; the stage weights carry the real stages' differences)."""
    m = cfg.resolved.model
    k = KernelCosts(cluster)
    eff = cluster.efficiency.value

    graphed = graphed_scopes(m)

    def cost(ideal: float, scope: str) -> float:
        """A piece's seconds: its kernels' ideal time / efficiency + what the GPU waits for their
        launches (nothing inside a CUDA graph: the graph replays them without the host)."""
        wait = k.launch_wait()
        return ideal / eff + (0.0 if scope in graphed else wait)

    tokens = cfg.train.micro_batch_size * m.seq_length // max(1, layout.cp)  # this CP rank's
    moe_layer = [m.is_moe_layer(layer) for layer in range(m.num_layers)]
    pp, tp, ep = max(1, layout.pp), max(1, layout.tp), max(1, layout.ep)
    h, hd = m.hidden_size, m.head_dim
    q, kv = m.num_attention_heads * hd, m.query_groups * hd
    ups = 2 if m.gated_linear_unit else 1
    # under SP the norms and residual adds see 1 / TP of them
    sp = tp if layout.sequence_parallel else 1
    act = 2.0  # bytes per activation element (BF16)
    selective = set(m.recompute_modules or ()) if m.recompute_granularity == "selective" else set()
    norm_bytes = act * tokens / sp * 2 * h  # one norm: read + write

    def mlp_glue(rows: float, ffn: float) -> float:
        """Gated activation (reads ups x F, writes F) and the FP8 casts of fc1's and fc2's
        inputs."""
        return k.glue(act * rows * (ups + 1) * ffn) + k.casts(rows * (h + ffn), 2)

    qkv_s = cost(k.gemm(tokens, (q + 2 * kv) / tp, h), "attn")
    proj_s = cost(k.gemm(tokens, h, q / tp), "attn")
    core_s = cost(k.attention_core(2.0 * q * m.seq_length * tokens / tp), "attn")  # causal: 2 q s
    # a norm (read + write) and a residual add (2 reads + 1 write) per block
    norm_residual = act * tokens / sp * 5 * h
    # rotary embedding of q and k (+ their norms): read + write
    rotary = act * tokens * 2 * (q + 2 * kv) / tp * (2 if m.qk_layernorm else 1)
    attention_glue = cost(
        k.glue(norm_residual, 2)
        + k.glue(rotary, 2 if m.qk_layernorm else 1)
        + k.casts(tokens * (h + q / tp), 2),
        "attn",
    )
    attention = qkv_s + proj_s + core_s + attention_glue
    norm_s = cost(k.glue(norm_bytes), "attn")  # one norm alone (what `layernorm` recompute re-runs)
    attention_recompute = (core_s if "core_attn" in selective else 0.0) + (
        norm_s if "layernorm" in selective else 0.0
    )

    dense = dense_recompute = fc1_s = fc2_s = 0.0
    if not all(moe_layer):
        fc1_s = cost(k.gemm(tokens, ups * m.ffn_size / tp, h), "mlp")
        fc2_s = cost(k.gemm(tokens, h, m.ffn_size / tp), "mlp")
        dense = (
            fc1_s
            + fc2_s
            + cost(k.glue(norm_residual, 2) + mlp_glue(tokens, m.ffn_size / tp), "mlp")
        )
        dense_recompute = (
            dense if "mlp" in selective else norm_s if "layernorm" in selective else 0.0
        )

    moe = shared = moe_recompute = 0.0
    if any(moe_layer):
        moe_tokens = tokens / tp  # expert TP 1: the dispatcher splits the tokens over the TP ranks
        experts, topk, f_moe = m.num_moe_experts, m.moe_router_topk, m.moe_ffn_size
        local = max(1, experts // ep)
        # per local expert, balanced routing; the expert capacity pads or drops them
        kept = capacity_rows_per_token(m, moe_tokens) / topk
        rows = moe_tokens * topk * ep / experts * kept
        routed = cost(k.gemm(rows, ups * f_moe, h, local) + k.gemm(rows, h, f_moe, local), "moe")
        # The rows the experts' elementwise kernels run over: the routed ones, or under the
        # sync-free dispatch (`moe_expert_rank_capacity_factor`) every row of its static EP blocks,
        # full or not (the host never learns the counts; the grouped GEMMs read them on the GPU
        # and skip the empty rows' tiles).
        slots = moe_tokens * topk * kept
        if m.moe_expert_rank_capacity_factor:
            factor = m.moe_expert_rank_capacity_factor
            slots = ep * expert_rank_capacity(round(moe_tokens), topk, ep, factor)
        # the gated activation alone (what `moe_act` recompute re-runs), then the casts
        act_s = cost(k.glue(act * slots * (ups + 1) * f_moe), "moe")
        # TE quantizes a grouped GEMM's inputs with one multi-tensor kernel
        routed += act_s + cost(k.casts(slots * (h + f_moe), 2), "moe")
        # the pre-MLP norm with the router (TE's moe_router graph holds both), then the residual
        router = cost(
            k.gemm(moe_tokens, experts, h, bf16=True)
            + k.glue(norm_bytes)
            + k.glue(act * moe_tokens * 4 * experts, ROUTER_KERNELS),
            "moe_router",
        )
        # permute (the dispatch's preprocessing) and un-permute: h in, k h out (and back)
        permute = cost(k.glue(act * moe_tokens * (h + topk * h)), "moe_preprocess") + cost(
            k.glue(act * moe_tokens * (h + topk * h)), "moe"
        )
        if m.moe_shared_expert_intermediate_size:
            f_sh = m.moe_shared_expert_intermediate_size
            shared = cost(
                k.gemm(moe_tokens, ups * f_sh, h)
                + k.gemm(moe_tokens, h, f_sh)
                + mlp_glue(moe_tokens, f_sh),
                "moe",
            )
        moe = routed + router + permute + cost(k.glue(norm_residual - norm_bytes), "moe") + shared
        moe_recompute = (
            moe
            if "moe" in selective
            else (act_s if "moe_act" in selective else 0.0)
            + (shared if "shared_experts" in selective else 0.0)
            + (norm_s if "layernorm" in selective else 0.0)
        )
    cross_entropy = k.glue(4.0 * 3 * tokens * m.vocab_size / tp, 3)  # three FP32 logits passes
    logits = cost(k.gemm(tokens, m.vocab_size / tp, h, bf16=True) + cross_entropy, "")
    # the embedding: its lookup (a row written per token) and, in the backward, its gradient
    # accumulated into the vocabulary-parallel table's (read, add, write in FP32)
    embedding = cost(k.glue(act * tokens * h), "")
    embedding_bwd = cost(k.glue((act + 8.0) * tokens * h), "")
    # The TP linears' forward GEMMs (the dense MLP's only where a layer has one).
    gemms = TPGemms(
        qkv_s,
        proj_s,
        fc1_s,
        fc2_s,
        core=max(0.0, attention - qkv_s - proj_s),
        # refills a rate-limited link's bucket only without all-to-alls
        moe=moe if ep == 1 else 0.0,
    )
    factor = 3.0 if m.recompute_granularity == "full" else 2.0
    layer_s = [
        attention * (1 + factor)
        + attention_recompute
        + (
            (moe * (1 + factor) + moe_recompute)
            if is_moe
            else dense * (1 + factor) + dense_recompute
        )
        for is_moe in moe_layer
    ]
    stages = cfg.resolved.pipeline.stages
    work = [
        sum(layer_s[s.start : s.end])
        + (logits * (1 + factor) if s.loss else 0.0)
        + (embedding * (1 + factor) + embedding_bwd if s.embedding else 0.0)
        for s in stages
    ]
    mean = sum(work) / len(work)
    weights = tuple(x / mean for x in work) if pp > 1 and mean > 0 else (1.0,)
    n_moe = sum(moe_layer)
    return MicrobatchCompute(
        attention_fwd_s=attention,
        moe_fwd_s=moe,
        shared_expert_fwd_s=shared,
        dense_mlp_fwd_s=dense,
        logits_fwd_s=(logits + embedding) / pp,
        moe_layers=n_moe / pp,
        dense_layers=(m.num_layers - n_moe) / pp,
        recompute=m.recompute_granularity == "full",
        stage_weights=weights,
        tp_gemms=gemms,
        attention_recompute_s=attention_recompute,
        moe_recompute_s=moe_recompute,
        dense_recompute_s=dense_recompute,
        embedding_bwd_s=embedding_bwd / pp,
        attention_core_fwd_s=core_s,
    )
