"""The dense feed-forward block: SwiGLU (or GELU) between a column-parallel and a row-parallel
linear."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from overlap.layers.fused import Chain, fp32_copy
from overlap.layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear, params_dtype
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel.state import ParallelState

if TYPE_CHECKING:
    from overlap.config.comm_overlap import OverlapPlan
    from overlap.config.mixed_precision import Precision
    from overlap.kernels import Kernels


def _swiglu_forward(
    gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor | None
) -> tuple[torch.Tensor]:
    """silu(gate) * up; with `probs` (fp32, one per row: the routed experts' combine weights)
    silu(gate) * up * probs, that product in fp32 and rounded once, as Megatron-Core's weighted
    SwiGLU applies the router's probabilities inside the experts."""
    if probs is None:
        return (F.silu(gate) * up,)
    act = F.silu(gate.float()) * up.float() * probs.unsqueeze(-1)
    return (act.to(gate.dtype),)


def _swiglu_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, probs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of gate, up (and probs) from the inputs alone: silu(gate) is made again from gate,
    nothing of the forward is kept but its inputs. Unweighted, the same operations autograd runs
    for `F.silu(gate) * up` (in the inputs' dtype); weighted, in fp32 as the forward."""
    if probs is None:
        d_up = grad * F.silu(gate)
        return torch.ops.aten.silu_backward(grad * up, gate), d_up, None
    gate_f, up_f = gate.float(), up.float()
    silu = F.silu(gate_f)
    g = fp32_copy(grad)
    d_probs = (g * silu).mul_(up_f).sum(dim=-1)
    g.mul_(probs.unsqueeze(-1))
    d_up = (g * silu).to(up.dtype)
    d_gate = torch.ops.aten.silu_backward(g.mul_(up_f), gate_f).to(gate.dtype)
    return d_gate, d_up, d_probs


SWIGLU = Chain("swiglu", _swiglu_forward, _swiglu_backward, saves=(0, 1, 2))
"""Keeps gate and up (fc1's output) and the row weights if any: the activation's output is kept by
fc2, its consumer, and nothing in between (Transformer Engine's and Megatron-Core's fused SwiGLU
keep the same). `model.bias_activation_fusion` compiles it, here and in the routed experts."""


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
    config's width (shared experts use their own). SwiGLU is the `SWIGLU` chain, compiled where
    `kernels.bias_activation_fusion` (the run's decision) is on; GELU is one kernel already.
    `wgrad_store`: the model's store the weight gradients go through (None: computed in
    backward).
    """

    def __init__(
        self,
        config,
        ps: ParallelState,
        overlap: OverlapPlan | None,
        precision: Precision,
        kernels: Kernels,
        ffn_hidden_size: int | None = None,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        ffn = ffn_hidden_size or config.ffn_size
        dtype = params_dtype(precision)
        self.gated = config.gated_linear_unit
        self.fusion = kernels.bias_activation_fusion
        fused = 2 if self.gated else 1
        sp = ps.layout.sequence_parallel
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fused * ffn,
            ps,
            sp,
            bias=config.add_bias_linear,
            num_fused=fused,
            params_dtype=dtype,
            overlap=overlap.linear("fc1") if overlap is not None else None,
            wgrad_store=wgrad_store,
        )
        self.linear_fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            ps,
            sp,
            bias=config.add_bias_linear,
            params_dtype=dtype,
            overlap=overlap.linear("fc2") if overlap is not None else None,
            wgrad_store=wgrad_store,
        )

    def fc1_and_activation(self, x: torch.Tensor) -> torch.Tensor:
        """The first half (fc1 + SwiGLU/GELU); a separate step so shared-expert overlap can run it
        under a dispatch."""
        if self.gated:
            gate, up = self.linear_fc1(x, split=True)
            return SWIGLU(self.fusion, gate, up, None)
        return F.gelu(self.linear_fc1(x))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.linear_fc2(self.fc1_and_activation(x)), None
