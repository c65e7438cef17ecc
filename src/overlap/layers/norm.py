"""RMSNorm, the normalisation of Qwen3 (and of its per-head QK norms)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from overlap.layers import fused
from overlap.layers.init import mark_ones
from overlap.layers.tensor_parallel import copy_to_tp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, the statistics in fp32 and the product in the weight's
    promotion with x's dtype: the chain `model.rms_norm_fusion` compiles."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim; the statistics are computed in fp32 whatever the
    compute dtype.

    `sequence_parallel` marks the weight for the trainer: under sequence parallelism each TP rank
    normalises only its sequence shard, so the weight's gradient is partial and gets summed over TP.

    `weight_grad_group` is for a norm applied to a tensor-parallel slice of heads (the QK norms,
    which run on the full sequence after the QKV all-gather but on this rank's heads only): the
    weight enters through `copy_to_tp`, so its gradient is summed over that group inside backward
    and is complete on every rank, with or without sequence parallelism. Such a weight is not marked
    `sequence_parallel` (the trainer must not sum it again).

    `fusion` is `model.rms_norm_fusion` (None: by device, `overlap.config.fusion`).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        sequence_parallel: bool,
        params_dtype: torch.dtype,
        device: torch.device,
        weight_grad_group: ProcessGroup | None = None,
        fusion: bool | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.fusion = fusion
        self.weight_grad_group = weight_grad_group
        self.weight = mark_ones(
            nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        )
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.weight_grad_group is not None:
            weight = copy_to_tp(weight, self.weight_grad_group)
        return fused.run(rms_norm, self.fusion, x, weight, self.eps)
