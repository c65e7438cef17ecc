"""This rank's routed experts: SwiGLU MLPs whose weights are stacked along a leading local-expert
dimension, each row's output scaled by its combine weight.

The router's probability of each row is applied inside the activation (`SWIGLU` with row weights:
silu(gate) * up * p, then fc2), as Megatron-Core's grouped experts apply it in their weighted
SwiGLU: fc2 is linear, so the output is the weighted expert output, and the probability's gradient
comes from the activation's inputs, which backward keeps anyway. Applying it after fc2 instead
would keep fc2's output, one more hidden-wide row per routed token, for that gradient alone.

Each expert's gate and up projections are one fused fc1 weight, [2 * ffn, hidden] with the gate rows
first, as Megatron-Core's grouped experts hold `linear_fc1` and transformers 5 holds `gate_up_proj`
(so that layout loads as it is). One grouped GEMM of width 2 * ffn instead of two of width ffn: the
per-expert GEMMs are small (tens of rows at bench/hf_compute_bench.py's shapes), where the wider one
is cheaper, and the input gradient comes out of one GEMM instead of two added together. With the
outputs bit-identical, the experts' forward + backward at those shapes (16 experts, hidden 512,
width 384, 1024 rows, one thread) took 8% less time in bf16 than as two GEMMs, and the same in fp32;
the MoE rows of bench/results/hf_compute*.md are the model-level measurement. (Expert tensor
parallelism, not built, would cut each half.)

Stacking (rather than a ModuleList of experts) keeps parameter names independent of the EP size,
which is what lets `init_model_params` give every layout the weights of the single-process model:
each stacked tensor is marked as shard `ep_rank` of `ep_size` along dim 0 of the full [num_experts,
...] tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from overlap.config.mixed_precision import Precision
from overlap.config.model import ModelConfig
from overlap.config.recompute import selective_modules
from overlap.errors import NotBuiltError
from overlap.kernels import Kernels
from overlap.layers.init import mark_shard
from overlap.layers.linear_functions import GroupedLinear, grouped_offsets
from overlap.layers.mlp import SWIGLU
from overlap.layers.recompute import discarding_output
from overlap.layers.tensor_parallel import params_dtype
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel.state import ParallelState


def _expert_param(shape: tuple[int, ...], dtype: torch.dtype, ps: ParallelState) -> nn.Parameter:
    param = mark_shard(
        nn.Parameter(torch.empty(shape, dtype=dtype, device=ps.device)), 0, ps.ep_rank, ps.layout.ep
    )
    # The trainer reduces expert grads over the expert-data-parallel group, not the data-parallel
    # group.
    param.is_expert = True
    return param


class GroupedExperts(nn.Module):
    """`num_experts / ep_size` SwiGLU experts applied to rows already grouped by local expert, each
    output row weighted by its combine weight; the weight gradients go through `wgrad_store` (the
    model's; None: computed in backward). `kernels`: the run's choices of the GEMMs' kernel and
    the SwiGLU's fusion."""

    def __init__(
        self,
        config: ModelConfig,
        ps: ParallelState,
        precision: Precision,
        kernels: Kernels,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        self.wgrad_store = wgrad_store
        self.grouped_gemm = kernels.moe_grouped_gemm
        self.num_local_experts = config.num_moe_experts // ps.layout.ep
        h, ffn = config.hidden_size, config.moe_ffn_size
        dtype = params_dtype(precision)
        self.fusion = kernels.bias_activation_fusion
        # Filled by init_model_params (full-tensor draw, then this rank's slice).
        self.fc1_weight = _expert_param((self.num_local_experts, 2 * ffn, h), dtype, ps)
        self.down_weight = _expert_param((self.num_local_experts, h, ffn), dtype, ps)
        # selective "moe_act": the SwiGLU's intermediate and output are recomputed in backward from
        # fc1's output (not when "moe" recomputes the whole layer already)
        modules = selective_modules(config)
        self.recompute_act = "moe_act" in modules and "moe" not in modules
        # named by the refusal of a sync-free dispatch the grouped kernel cannot run (`forward`)
        self.rank_capacity_factor = config.moe_expert_rank_capacity_factor

    def forward(
        self,
        rows: torch.Tensor,
        probs: torch.Tensor,
        tokens_per_local_expert: list[int] | None,
        local_expert_counts: torch.Tensor,
    ) -> torch.Tensor:
        """`rows` [R, h] holds `tokens_per_local_expert[e]` contiguous rows for local expert e, in
        order, `probs` [R] (fp32) their combine weights; `local_expert_counts` are the same counts
        as an int64 tensor on the rows' device (the grouped kernel's offsets are computed from it
        there, `grouped_offsets`). Returns the weighted expert outputs [R, h].

        The two GEMMs are `GroupedLinear`, whose weight gradients can be delayed
        (delay_wgrad_compute). `tokens_per_local_expert` is None where the dispatch keeps its
        counts on the device alone (`rank_capacity`): only the grouped kernel, whose offsets come
        from the device counts, can run the GEMMs then."""
        counts = tokens_per_local_expert
        offs = grouped_offsets(
            local_expert_counts,
            rows,
            (self.fc1_weight, self.down_weight),
            self.grouped_gemm,
            counts is not None,
        )
        if offs is None and counts is None:
            raise NotBuiltError(
                "model.moe_expert_rank_capacity_factor",
                self.rank_capacity_factor,
                f"The sync-free dispatch on {rows.device.type} in {rows.dtype} with hidden size "
                f"{rows.shape[-1]} and expert width {self.down_weight.shape[-1]} (the grouped "
                "GEMM kernel does not take these tensors, and the per-expert loop needs the "
                "split sizes on the host)",
                "drop model.moe_expert_rank_capacity_factor here, or run where the grouped "
                "kernel is used (the CPU, Hopper in bf16; rows a multiple of 16 bytes).",
            )
        store = self.wgrad_store
        fc1_out = GroupedLinear.apply(rows, self.fc1_weight, counts, offs, store)

        def fc2(act: torch.Tensor) -> torch.Tensor:
            return GroupedLinear.apply(act, self.down_weight, counts, offs, store)

        if self.recompute_act:
            return discarding_output(self._activation, (fc1_out, probs), fc2)
        return fc2(self._activation(fc1_out, probs))

    def _activation(self, fc1_out: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up * probs of fc1's fused [gate; up] output (compiled where the fusion is
        on)."""
        gate, up = fc1_out.chunk(2, dim=-1)
        return SWIGLU(self.fusion, gate, up, probs)
