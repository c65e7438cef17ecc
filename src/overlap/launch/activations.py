"""Activation memory per transformer layer, block by block: what our layers keep for backward, next
to Megatron-Core's accounting for the same settings.

`layer_blocks` gives, for one layer, each block's bytes per token of the micro-batch on one rank:

- `ours`: what the layers keep (`overlap.layers`: each elementwise chain keeps its inputs and small
  statistics, `overlap.layers.fused.Chain`; the router takes its fp32 logits from the bf16 input;
  the permutation keeps index vectors; the router's probabilities weight the experts' activation).
  The memory model (`overlap.perf.memory_model`) counts these; tests/test_activation_memory.py
  measures them on real tensors (`overlap.perf.saved_activations`) and holds each to its formula.
- `megatron`: Megatron-Core's accounting for the same settings with its fused kernels (Transformer
  Engine's norms, flash attention, the fused permutation, the weighted SwiGLU that applies the
  router's probabilities in the experts): Korthikanti et al. 2022 (arXiv 2205.05198, table 2, the
  s^2 terms removed by flash attention; Megatron's `theoretical_memory_usage.py` uses the same
  `s b h (18 + 4 ffn / h)` per dense layer) and, for the MoE blocks it has no term for, the blocks'
  own saved tensors: the dispatched rows into the first grouped GEMM, its output (the SwiGLU input,
  2 x ffn wide), the SwiGLU output, an int32 row map per routed row, the router's fp32
  probabilities and its boolean routing map.

Where the two differ, `note` says why. Under sequence parallelism the column-parallel linears keep
their input's shard and gather it again in backward, as Megatron's do - except a TP-overlap slot
plan whose dgrad slot is not bulk, which keeps the gathered input (`LayerShape.gathered_inputs`).

Token counts: the norms, the router and the routed blocks see the micro-batch's tokens divided by TP
under sequence parallelism (each TP rank routes its own tokens), the attention core all of them
with 1/tp of the heads; everything is given per token of the whole micro-batch so that blocks add.
Routing is balanced (each local token's k rows land on some EP rank, which receives k rows per
local token); a padded expert capacity sends E x capacity rows instead of T x k, the sync-free
dispatch's blocks EP x ceil(T x k / EP x factor). Megatron's paged stash (`moe_paged_stash`, not
built here: the planner prices it as the reference runs it) keeps the experts' activations of only
a pool's worth of routed rows, the padded blocks being one layer's working buffers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from overlap.config.model import expert_rank_capacity

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig

SAVED_INPUT_BYTES = {"fp8": 1.0, "mxfp8": 1.0 + 1.0 / 32}
"""Bytes per element a linear keeps of its input when its GEMMs run in the planner's FP8
precisions (Transformer Engine quantises the input once and keeps the FP8 copy its weight-gradient
GEMM reads: a byte, and for MXFP8 one shared scale byte per 32 elements); the other precisions
keep the activation dtype."""

NORMS, ATTENTION, MLP, ROUTER, DISPATCH, EXPERTS, COMBINE, SHARED_EXPERT, CHECKPOINTS = (
    "norms",
    "attention",
    "mlp",
    "router",
    "dispatch",
    "experts",
    "combine",
    "shared expert",
    "checkpoint inputs",
)
BLOCK_ORDER = (
    NORMS,
    ATTENTION,
    MLP,
    ROUTER,
    DISPATCH,
    EXPERTS,
    COMBINE,
    SHARED_EXPERT,
    CHECKPOINTS,
)

INDEX_BYTES = 8  # int64 index vectors
_INDEX = INDEX_BYTES
_FP32 = 4
LOSS_CHUNK_BYTES = 1 << 28
"""fp32 bytes of logits the cross-entropy makes at once (256 MiB: about 440 rows of a 152k
vocabulary), forward and backward (`overlap.layers.cross_entropy`); the memory model counts one."""


@dataclass(frozen=True)
class Block:
    """One block of a layer: bytes kept for backward per token of the micro-batch, ours and
    Megatron-Core's, and what is kept."""

    name: str
    ours: float
    megatron: float
    kept: str
    note: str = ""


@dataclass(frozen=True)
class LayerShape:
    """What a layer's activations depend on beyond the model's sizes: this rank's TP size and
    sequence parallelism, the activation dtype's bytes, whether attention is a fused kernel (flash,
    memory-efficient, cuDNN: output and log-sum-exp) or the unfused product (the s x s scores), the
    micro-batch's tokens and sequence length, the token dispatcher that runs (the resolved one,
    `Kernels.moe_token_dispatcher_type`), and the recomputed modules."""

    tp: int
    ep: int
    sequence_parallel: bool
    act_bytes: int
    fused_attention: bool
    seq_length: int
    micro_batch: int
    moe_token_dispatcher_type: str
    recompute: frozenset[str] = frozenset()
    # column-parallel linears ("qkv", "fc1") that keep their all-gathered input (a TP-overlap plan
    # without a bulk dgrad slot); the others keep their shard
    gathered_inputs: frozenset[str] = frozenset()
    # context parallelism (p2p, all_gather): the keys one query row scores at once in a block of
    # `overlap.layers.block_attention` (0: the layer's own kernel); seq_length is then the rank's
    cp_block_keys: int = 0
    # CP p2p: the ring's forward keeps the last KV block it received (its backward starts there)
    cp_kept_kv: bool = False
    # bytes per element of what a linear keeps of its input for its weight gradient: the
    # activation dtype's (None), or under the planner's FP8 precisions the FP8 copy
    # (`SAVED_INPUT_BYTES`)
    linear_bytes: float | None = None

    @property
    def saved_input_bytes(self) -> float:
        """Bytes per element a linear keeps of its input."""
        return self.act_bytes if self.linear_bytes is None else self.linear_bytes

    def linear_input(self, elements: float, linear: str) -> float:
        """What a column-parallel linear keeps of its input (`elements` a token), per token of the
        micro-batch."""
        kept = elements * self.saved_input_bytes
        return kept if linear in self.gathered_inputs else kept / self.seq_div

    @property
    def seq_div(self) -> int:
        """What the norms' and the routed blocks' token counts are divided by (SP)."""
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    @property
    def tokens(self) -> int:
        return self.seq_length * self.micro_batch


def routed_rows_per_token(m: ModelConfig, shape: LayerShape) -> float:
    """Rows the experts of one EP rank process per local token (balanced routing): as the expert
    capacity leaves them (`capacity_rows_per_token`), or with the sync-free dispatch's blocks
    EP x C / T, about k x the factor (`overlap.layers.moe.rank_capacity`: every block is full size,
    padding included)."""
    local_tokens = shape.tokens // shape.seq_div
    if m.moe_expert_rank_capacity_factor is not None:
        block = expert_rank_capacity(
            local_tokens, m.moe_router_topk, shape.ep, m.moe_expert_rank_capacity_factor
        )
        return shape.ep * block / local_tokens
    return capacity_rows_per_token(m, local_tokens)


def stashed_rows_per_token(m: ModelConfig, rows: float) -> float:
    """Rows per local token whose activations the experts keep for the backward: every row they
    process (`rows`), or under Megatron's paged stash (`moe_paged_stash`, the sync-free dispatch's)
    the pages of its pool, |moe_paged_stash_buffer_size_factor_cuda| x the k rows routed a token on
    average (balanced routing makes the largest the average): the padded blocks are working buffers
    of the layer that runs (`backward_working_bytes`)."""
    if m.moe_paged_stash:
        return abs(m.moe_paged_stash_buffer_size_factor_cuda) * m.moe_router_topk
    return rows


def _expert_row_bytes(m: ModelConfig, shape: LayerShape) -> float:
    """What the experts keep per row: the dispatched row (fc1's input), fc1's output (the SwiGLU
    input, 2 x ffn), its row weight and fc2's input (unless moe_act is recomputed)."""
    B, f, L = shape.act_bytes, m.moe_ffn_size, shape.saved_input_bytes
    act = 0.0 if "moe_act" in shape.recompute else L * f
    return L * m.hidden_size + 2 * B * f + _FP32 + act


def capacity_rows_per_token(m: ModelConfig, local_tokens: float) -> float:
    """Rows the experts process (and the dispatch sends) per local token under balanced routing and
    the expert capacity (`moe_expert_capacity_factor`, Megatron's `get_capacity`, as in
    `overlap.layers.moe.permute`): k without one; padded, every expert's capacity, E x capacity / T;
    unpadded, the routed rows up to the capacity, k x min(1, factor) (the rest are dropped). The
    memory, compute and communication models read the same rows."""
    k, factor = m.moe_router_topk, m.moe_expert_capacity_factor
    if factor is None:
        return float(k)
    if m.moe_pad_expert_input_to_capacity:
        capacity = math.ceil(local_tokens * k / m.num_moe_experts * factor)
        return m.num_moe_experts * capacity / local_tokens
    return k * min(1.0, factor)


def _attention(m: ModelConfig, shape: LayerShape) -> Block:
    B, t, h, d = shape.act_bytes, shape.tp, m.hidden_size, m.head_dim
    a, g = m.num_attention_heads / t, m.query_groups / t
    core_recompute = "core_attn" in shape.recompute
    qkv_in = shape.linear_input(h, "qkv")  # the QKV projection's input (its shard under SP)
    # at FP8 the output projection keeps an FP8 copy of its input beside the output the attention
    # kernel keeps in BF16 (one tensor for both at BF16)
    proj_copy = 0.0 if shape.linear_bytes is None else shape.linear_bytes * a * d
    # with QK norms the projection's output is kept (the norms' inputs, v); without, v alone
    qkv_out = B * (a + 2 * g) * d + _FP32 * (a + g) if m.qk_layernorm else B * g * d
    megatron = (
        shape.saved_input_bytes * h / shape.seq_div
        + B * (a + g) * d * (1 if m.qk_layernorm else 0)
        + B * (a + 2 * g) * d
        + B * a * d
        + proj_copy
        + _FP32 * a
    )
    if shape.fused_attention:
        # rotated q and k (the kernel's inputs), the output (the output projection's input) and
        # one fp32 log-sum-exp per head; recomputed, the kernel keeps nothing of its own
        ours = qkv_in + qkv_out + B * (a + g) * d + B * a * d + proj_copy
        ours += 0.0 if core_recompute else _FP32 * a
        kept = "QKV input, QKV output (QK-norm inputs, v), rotated q and k, output + LSE"
        if shape.cp_kept_kv and not core_recompute:
            ours += 2 * B * g * d
            kept += ", the CP ring's last KV block"
    else:
        s = shape.seq_length
        # copies of q, of k and v repeated per head, the fp32 probabilities and their bf16 cast
        # (the s x s scores), the output made contiguous for the projection; recomputed, the
        # core's inputs instead (rotated q and k, v)
        core = (
            B * (a + g) * d + B * g * d if core_recompute else 3 * B * a * d + (_FP32 + B) * a * s
        )
        # v's own copy is the core's input when the norms keep the projection's output
        norms_kept = qkv_out if m.qk_layernorm else 0.0
        if core_recompute and m.qk_layernorm:
            core -= B * g * d
        # (the output is the projection's input alone: at FP8 its FP8 copy)
        ours = qkv_in + norms_kept + core + shape.saved_input_bytes * a * d
        kept = "QKV input and output, q/k/v copies, s x s probabilities (fp32 and bf16), output"
    note = (
        "the TP-overlap plan keeps the all-gathered QKV input (no bulk dgrad slot)"
        if "qkv" in shape.gathered_inputs and shape.seq_div > 1
        else ""
    )
    return Block(ATTENTION, ours, megatron, kept, note)


def _norms(m: ModelConfig, shape: LayerShape) -> Block:
    per = (shape.act_bytes * m.hidden_size + _FP32) / shape.seq_div
    if "layernorm" in shape.recompute:  # inputs kept by the checkpoints (`_checkpoints`)
        return Block(NORMS, 0.0, 0.0, "nothing (recomputed)")
    return Block(NORMS, 2 * per, 2 * per, "each norm's input and fp32 reciprocal RMS")


def _dense_mlp(m: ModelConfig, shape: LayerShape) -> Block:
    B, t, h, f = shape.act_bytes, shape.tp, m.hidden_size, m.ffn_size
    # gate and up (or the GELU input), and fc2's input
    inner = ((2 if m.gated_linear_unit else 1) * B + shape.saved_input_bytes) * f / t
    if "mlp" in shape.recompute:  # its input is kept by the checkpoint (`_checkpoints`)
        return Block(MLP, 0.0, 0.0, "nothing (recomputed)")
    gathered = "fc1" in shape.gathered_inputs and shape.seq_div > 1
    return Block(
        MLP,
        shape.linear_input(h, "fc1") + inner,
        shape.saved_input_bytes * h / shape.seq_div + inner,
        "fc1 input, SwiGLU inputs (gate, up), fc2 input",
        "the TP-overlap plan keeps fc1's all-gathered input (no bulk dgrad slot)"
        if gathered
        else "",
    )


def _moe_blocks(m: ModelConfig, shape: LayerShape) -> list[Block]:
    B, h, k = shape.act_bytes, m.hidden_size, m.moe_router_topk
    E = m.num_moe_experts
    div = shape.seq_div
    rows = routed_rows_per_token(m, shape)
    if "moe" in shape.recompute:  # its input is kept by the checkpoint (`_checkpoints`)
        return []
    aux = bool(m.moe_aux_loss_coeff) and m.moe_router_load_balancing_type == "aux_loss"
    # pre-softmax: the softmax over every expert, then the top-k of it (indices); otherwise the
    # top-k of the logits (indices) and the softmax over the k winners; the aux loss takes a
    # softmax of its own over every expert
    choose = _FP32 * E + _INDEX * k if m.moe_router_pre_softmax else (_FP32 + _INDEX) * k
    router = B * h + choose + (_FP32 * E if aux else 0.0)
    blocks = [
        Block(
            ROUTER,
            router / div,
            (B * h + _FP32 * E + E) / div,
            "input, top-k indices and weights, fp32 probabilities (aux loss, pre-softmax)",
            "Megatron keeps a boolean routing map (E bytes) where ours keeps the top-k indices",
        )
    ]
    if shape.moe_token_dispatcher_type == "flex":
        # per row sent (one per token and destination rank: at most k, at most EP): its token index,
        # its k-wide expert mask and, on the receiver, its k weight slots' sort order; per routed
        # pair its row index
        sent = min(k, shape.ep)
        dispatch = (_INDEX + k + _INDEX * k) * sent + _INDEX * rows
        what = "token index and expert mask per sent row, row and slot index per pair (int64)"
    elif m.moe_expert_rank_capacity_factor is not None:
        # each block row's token and routing slot (sent), and the received rows' sort by local
        # expert: one entry per block row each
        dispatch = 3 * _INDEX * rows
        what = "token and slot index per block row, the received rows' local-expert order (int64)"
    else:
        dispatch = 2 * _INDEX * rows  # each row's token and routing slot
        what = "token and slot index per routed row (int64)"
    blocks.append(
        Block(
            DISPATCH,
            dispatch / div,
            4 * rows / div,
            what,
            "Megatron's fused permutation keeps one int32 map entry per routed row",
        )
    )
    experts = stashed_rows_per_token(m, rows) * _expert_row_bytes(m, shape)
    blocks.append(
        Block(
            EXPERTS,
            experts / div,
            experts / div,
            "dispatched rows, fc1 output (SwiGLU input), row weights, fc2 input"
            + (" (paged: the rows routed)" if m.moe_paged_stash else ""),
        )
    )
    if m.moe_expert_rank_capacity_factor is not None:
        # the sort's inverse, which puts the expert outputs back in block order
        combine = Block(
            COMBINE,
            _INDEX * rows / div,
            0.0,
            "the inverse of the local-expert order, per block row (int64)",
            "Megatron's sync-free path sorts inside its fused kernels",
        )
    else:
        combine = Block(
            COMBINE, 0.0, 0.0, "nothing: the row weights are applied in the experts' SwiGLU"
        )
    blocks.append(combine)
    fs = m.moe_shared_expert_intermediate_size
    if fs:
        # its input (the shard of the norm's output) is the router's, counted there; at FP8 its
        # fc1 keeps an FP8 copy of it beside
        fc1_copy = 0.0 if shape.linear_bytes is None else shape.linear_bytes * h / shape.seq_div
        swiglu = (2 * B + shape.saved_input_bytes) * fs / shape.tp  # gate, up and fc2's input
        inner = 0.0 if "shared_experts" in shape.recompute else swiglu + fc1_copy
        blocks.append(Block(SHARED_EXPERT, inner, inner, "SwiGLU inputs and fc2 input"))
    return blocks


def _checkpoints(m: ModelConfig, shape: LayerShape, moe_layer: bool) -> Block | None:
    """What selective recompute's layer-level checkpoints keep: their inputs (each norm's, the
    MLP's or MoE layer's: the pre-MLP norm's output); the checkpoints inside a block (the attention
    core, the experts' activation, the shared expert) are counted in their block."""
    per_token = shape.act_bytes * m.hidden_size / shape.seq_div
    kept = 0.0
    if "layernorm" in shape.recompute:
        kept += 2 * per_token
    if ("moe" if moe_layer else "mlp") in shape.recompute:
        kept += per_token
    if not kept:
        return None
    return Block(CHECKPOINTS, kept, kept, "the recomputed norms' and MLP's inputs")


def layer_blocks(m: ModelConfig, shape: LayerShape, moe_layer: bool) -> list[Block]:
    """One layer's blocks (module docstring). Full recompute is the caller's: a recomputed layer
    keeps only its input."""
    blocks = [_norms(m, shape), _attention(m, shape)]
    blocks += _moe_blocks(m, shape) if moe_layer else [_dense_mlp(m, shape)]
    checkpoints = _checkpoints(m, shape, moe_layer)
    return blocks + ([checkpoints] if checkpoints else [])


def backward_working_bytes(m: ModelConfig, shape: LayerShape, moe_layer: bool) -> float:
    """Bytes per token of the micro-batch that one layer's backward holds at its largest beyond its
    saved tensors, eager (the dry run's, and the CPU's): the SwiGLU backward's temporaries (four
    rows' widths in the activation dtype; weighted, in the experts, four fp32 ones and three in the
    activation dtype) per row of the MLP or the experts; the norm's (three fp32 copies of its
    input); the attention gradients. A compiled chain (CUDA) holds less: this bounds it from
    above. Under Megatron's paged stash (the planner's: not built here) the layer's pages are
    popped back into its padded blocks for its backward, which the experts' term adds."""
    B, t, h, d = shape.act_bytes, shape.tp, m.hidden_size, m.head_dim
    a, g = m.num_attention_heads / t, m.query_groups / t
    norm = (3 * _FP32 + B) * h / shape.seq_div
    attention = (2 * B + _FP32) * (a + 2 * g) * d
    # a CP block's backward: its fp32 probabilities and their gradient, a row of keys per head
    attention += 2 * _FP32 * a * shape.cp_block_keys

    def swiglu(width: float, weighted: bool) -> float:
        return ((4 * _FP32 + 3 * B) if weighted else 4 * B) * width

    if moe_layer:
        rows = routed_rows_per_token(m, shape)
        mlp = rows * swiglu(m.moe_ffn_size, True) / shape.seq_div
        if m.moe_paged_stash:  # the layer's pages popped back into its padded blocks
            mlp += rows * _expert_row_bytes(m, shape) / shape.seq_div
        if m.moe_shared_expert_intermediate_size:
            mlp = max(mlp, swiglu(m.moe_shared_expert_intermediate_size / t, False))
    else:
        mlp = swiglu(m.ffn_size / t, False) if m.gated_linear_unit else 3 * B * m.ffn_size / t
    return max(norm, attention, mlp)


def layer_bytes(m: ModelConfig, shape: LayerShape, moe_layer: bool) -> float:
    """Our bytes per token of the micro-batch for one layer."""
    return sum(b.ours for b in layer_blocks(m, shape, moe_layer))
