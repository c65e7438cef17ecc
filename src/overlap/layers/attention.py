"""Grouped-query self-attention with QK RMSNorm and RoPE (Qwen3), tensor-parallel over query groups.

The fused QKV weight is laid out group by group: for each query group g, the rows of its query
heads, then its key head, then its value head ([q heads of g | k_g | v_g]). TP shards that logical
weight by whole groups along its rows, so a rank holds complete groups and its local weight is a
contiguous slice: the logical full weight is the same at any TP size, which lets a TP run start from
exactly the reference weights. Query heads are numbered group-major, so the output projection's
input columns (heads x head_dim) are sharded consistently by the same contiguous cut.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from overlap.config.recompute import selective_modules
from overlap.layers.cp_attention import cp_attention
from overlap.layers.norm import RMSNorm
from overlap.layers.recompute import maybe_checkpoint
from overlap.layers.rotary import RotaryEmbedding
from overlap.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    divide,
    params_dtype,
)
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel.cp_chunks import cp_positions
from overlap.parallel.state import ParallelState

if TYPE_CHECKING:
    from overlap.config.comm_overlap import OverlapPlan
    from overlap.config.mixed_precision import Precision
    from overlap.kernels import Kernels

_SDPA_KERNELS = {
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
}


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention as two batched GEMMs, on [b, heads, s, d] queries and [b, groups, s, d] keys
    and values: the scores scaled by 1/sqrt(d) with the causal mask added in one `baddbmm`, the
    softmax in fp32 (as Megatron's unfused attention and transformers' eager one take it), the
    probabilities cast back to the inputs' dtype for `p v`. Keys and values are repeated per query
    head so that both products are plain bmm."""
    b, heads, s, d = q.shape
    per_group = heads // k.shape[1]
    k, v = (t.repeat_interleave(per_group, dim=1).reshape(b * heads, s, d) for t in (k, v))
    mask = torch.full((s, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(1)
    scores = torch.baddbmm(
        mask.expand(b * heads, s, s), q.reshape(b * heads, s, d), k.transpose(1, 2), alpha=d**-0.5
    )
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(probs, v).view(b, heads, s, d)


def fused_attention_on_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fused kernels (flash, memory-efficient, cuDNN) on meta tensors, which stand for CUDA ones
    in a dry run. SDPA makes no kernel choice on meta and takes its math path, which keeps the [b,
    heads, s, s] probabilities for backward; a CUDA rank's fused kernel keeps only its output and a
    log-sum-exp per row. The flash kernel's meta function has exactly those shapes (grouped keys and
    values included), so the dry run measures a GPU's memory."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]


class SelfAttention(nn.Module):
    """Causal self-attention on [seq_local, batch, hidden] -> [seq_local, batch, hidden].

    Parts, so that recompute (and later schedules) can address them: `linear_qkv` (column-parallel;
    all-gathers the sequence under SP), `q_layernorm`/`k_layernorm`, rotary, `core_attention` (the
    attention product; selective recompute "core_attn"), `linear_proj` (row-parallel;
    reduce-scatters under SP). Their TP overlap is the run's resolved plan's (`overlap.tp_slots`);
    the attention product's kernel and the norms' and RoPE's fusions are the run's `kernels`;
    their weight gradients go through `wgrad_store`, the model's (None: computed in backward).
    """

    def __init__(
        self,
        config,
        ps: ParallelState,
        layer_number: int,
        overlap: OverlapPlan,
        precision: Precision,
        kernels: Kernels,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        # Heads divisible by their query groups, groups by TP: the resolution's split rules
        # (`overlap.layout.resolve.split_rules`); only a model built from a bare config reaches
        # these guards
        if config.num_attention_heads % config.query_groups:
            raise ValueError(
                f"{config.num_attention_heads} attention heads do not split into "
                f"{config.query_groups} query groups"
            )
        dtype = params_dtype(precision)
        self.layer_number = layer_number
        self.head_dim = config.head_dim
        self.heads_per_group = config.num_attention_heads // config.query_groups
        self.local_groups = divide(config.query_groups, ps.layout.tp, "num_query_groups")
        self.recompute_core = "core_attn" in selective_modules(config)
        self.attention_backend = kernels.attention_backend
        sp = ps.layout.sequence_parallel
        qkv_size = config.query_groups * (self.heads_per_group + 2) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            ps,
            sp,
            bias=config.add_qkv_bias,
            params_dtype=dtype,
            overlap=overlap.linear("qkv"),
            wgrad_store=wgrad_store,
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            qk_norm = (
                self.head_dim,
                config.layernorm_epsilon,
                False,
                dtype,
                ps.device,
                ps.tp_group,
                kernels.rms_norm_fusion,
            )
            self.q_layernorm = RMSNorm(*qk_norm)
            self.k_layernorm = RMSNorm(*qk_norm)
        # context parallelism: this rank's tokens are its two load-balanced chunks, each rotated
        # by its global position; the attention exchange is the resolved plan's
        self.ps = ps
        self.cp_comm_type, self.cp_comm_overlap = overlap.cp_comm_type, overlap.cp_comm_overlap
        positions = None
        if ps.layout.cp > 1:
            positions = cp_positions(config.seq_length, ps.cp_rank, ps.layout.cp, ps.device)
        self.rotary = RotaryEmbedding(
            self.head_dim,
            config.rotary_base,
            config.seq_length,
            ps.device,
            kernels.apply_rope_fusion,
            positions,
        )
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            ps,
            sp,
            bias=config.add_bias_linear,
            params_dtype=dtype,
            overlap=overlap.linear("proj"),
            wgrad_store=wgrad_store,
        )

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project, split per group, normalise and rotate: q [s, b, local heads, d], k and v [s, b,
        local groups, d]."""
        mixed = self.linear_qkv(x)
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = mixed[:, :, :, : self.heads_per_group]
        k = mixed[:, :, :, self.heads_per_group]
        v = mixed[:, :, :, self.heads_per_group + 1]
        # The norms read their slices of the projection in place and keep them (the projection's
        # output is what backward keeps, v included); only then are the query heads made one
        # contiguous tensor, as the norm's output already is. Without the norms nothing else
        # needs the projection's output: v is copied out so that the attention kernel, which
        # keeps v, does not keep the whole projection alive through it.
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        else:
            v = v.contiguous()
        q = q.reshape(s, b, -1, self.head_dim)
        return self.rotary(q), self.rotary(k), v

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(q k^T / sqrt(d)) v on [s, b, heads, d] -> [s, b, heads x d]; query head
        i reads key/value group i // heads_per_group. Under context parallelism over the whole
        sequence, through the CP ranks' exchange (overlap.layers.cp_attention)."""
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        if self.cp_comm_type is None:
            out = self.attend(q, k, v)
        else:
            out = cp_attention(
                q, k, v, self.ps, self.cp_comm_type, self.cp_comm_overlap, self.attend
            )
        b, heads, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of [b, heads, s, d] queries on [b, groups, s, d] keys and values in
        position order, by the kernel the run decided (`Kernels.attention_backend`,
        overlap.kernels.attention)."""
        kernel = self.attention_backend
        if kernel == "unfused":
            return unfused_attention(q, k, v)
        if q.device.type == "meta":  # a dry run's stand-in for a CUDA rank (overlap.perf.dry_run)
            return fused_attention_on_meta(q, k, v)
        if kernel == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with sdpa_kernel(_SDPA_KERNELS[kernel]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)
        context = maybe_checkpoint(self.recompute_core, self.core_attention, q, k, v)
        return self.linear_proj(context)
