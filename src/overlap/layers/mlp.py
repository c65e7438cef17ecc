"""The dense feed-forward block: SwiGLU (or GELU) between a column-parallel and a row-parallel
linear."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from overlap.config.tp_overlap import linear_plan
from overlap.layers import fused
from overlap.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear, params_dtype
from overlap.parallel.state import ParallelState

if TYPE_CHECKING:
    from overlap.config.comm_overlap import OverlapPlan


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the chain `model.bias_activation_fusion` compiles (here and in the routed
    experts)."""
    return F.silu(gate) * up


class MLP(nn.Module):
    """[seq_local, batch, hidden] -> [seq_local, batch, hidden]; `forward` returns (y, None) like an
    MoE layer's (y, aux_loss), so a transformer layer treats both alike.

    With `gated_linear_unit`, fc1 fuses the gate and up projections into one weight (`num_fused=2`):
    each TP rank holds [gate_i, up_i], and the logical weight [2, ffn, hidden] is the same at any TP
    size. It runs as two GEMMs into contiguous gate and up tensors (`split=True`): SwiGLU on the
    fused output's strided halves, and the `cat` of their gradients in backward, cost more than the
    one wider GEMM saves. `overlap` is the run's resolved overlap plan, whose TP slots fc1 and fc2
    run; None keeps the plain TP collectives whatever the plan (shared experts: the reference
    disables userbuffers in them, they run beside the dispatch). `ffn_hidden_size` overrides the
    config's width (shared experts use their own). SwiGLU runs through `fused.run`
    (`model.bias_activation_fusion`); GELU is one kernel already.
    """

    def __init__(
        self,
        config,
        ps: ParallelState,
        overlap: OverlapPlan | None,
        ffn_hidden_size: int | None = None,
    ) -> None:
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_size
        dtype = params_dtype(config)
        self.gated = config.gated_linear_unit
        self.fusion = config.bias_activation_fusion
        fused = 2 if self.gated else 1
        sp = config.sequence_parallel
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fused * ffn,
            ps,
            sp,
            bias=config.add_bias_linear,
            num_fused=fused,
            params_dtype=dtype,
            overlap=linear_plan(overlap, "fc1") if overlap is not None else None,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            ps,
            sp,
            bias=config.add_bias_linear,
            params_dtype=dtype,
            overlap=linear_plan(overlap, "fc2") if overlap is not None else None,
        )

    def fc1_and_activation(self, x: torch.Tensor) -> torch.Tensor:
        """The first half (fc1 + SwiGLU/GELU); a separate step so shared-expert overlap can run it
        under a dispatch."""
        if self.gated:
            gate, up = self.linear_fc1(x, split=True)
            return fused.run(swiglu, self.fusion, gate, up)
        return F.gelu(self.linear_fc1(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.linear_fc2(self.fc1_and_activation(x)), None
