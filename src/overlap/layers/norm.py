"""RMSNorm, the normalisation of Qwen3 (and of its per-head QK norms)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from overlap.layers.fused import Chain, fp32_product
from overlap.layers.init import mark_ones
from overlap.layers.tensor_parallel import copy_to_tp


def _rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x / rms(x) * weight over the last dim, the statistics in fp32 and the product in the weight's
    promotion with x's dtype; also the fp32 reciprocal RMS per row, which backward needs."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


def _rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The input's and the weight's gradients from the input and rstd alone (the normalised rows
    are made again, in fp32): d x = rstd (g w - x^ mean(g w x^)), d w = sum over rows of g
    round(x^). In place where it can be (eager, at most three fp32 copies of x at once)."""
    normed = fp32_product(x, rstd)
    dw = (grad.float() * normed.to(x.dtype)).reshape(-1, x.shape[-1]).sum(dim=0)
    gw = fp32_product(grad, weight.float())
    dot = (gw * normed).mean(dim=-1, keepdim=True)
    dx = gw.sub_(normed.mul_(dot)).mul_(rstd)
    return dx.to(x.dtype), dw.to(weight.dtype), None


RMS_NORM = Chain("rms_norm", _rms_norm_forward, _rms_norm_backward, saves=(0, 1))
"""Keeps the input and the weight (a parameter: no new memory) and the fp32 rstd: 2 bytes per
element of a bf16 input plus 4 per row, as Transformer Engine's RMSNorm."""


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

    `fusion`: whether it runs compiled (the run's `Kernels.rms_norm_fusion`).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        sequence_parallel: bool,
        params_dtype: torch.dtype,
        device: torch.device,
        weight_grad_group: ProcessGroup | None = None,
        fusion: bool = False,
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
        return RMS_NORM(self.fusion, x, weight, self.eps)
