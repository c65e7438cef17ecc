"""Rotary position embedding (RoPE), rotate-half form as in Llama / Qwen3."""

from __future__ import annotations

import torch
from torch import nn

from overlap.layers.fused import Chain


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim: pairs feature i with feature i + d/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_half_back(x: torch.Tensor) -> torch.Tensor:
    """The transpose of `rotate_half`: [v1, v2] -> [v2, -v1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x2, -x1), dim=-1)


def _rope_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor]:
    """x * cos + rotate_half(x) * sin in fp32, back in x's dtype."""
    xf = x.float()
    return ((xf * cos + rotate_half(xf) * sin).to(x.dtype),)


def _rope_backward(
    grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, None, None]:
    """The rotation is linear in x: its gradient is the transposed rotation of the gradient, which
    needs only the tables."""
    gf = grad.float()
    return (gf * cos + _rotate_half_back(gf * sin)).to(grad.dtype), None, None


APPLY_ROPE = Chain("apply_rope", _rope_forward, _rope_backward, saves=(1, 2))
"""Keeps only the cos / sin tables (buffers, no new memory): the rotated tensors' memory is their
consumer's."""


class RotaryEmbedding(nn.Module):
    """Applies RoPE to [seq, batch, heads, head_dim] tensors whose positions are 0..seq-1, or the
    given positions (context parallelism).

    The cos/sin tables are built once in fp32 and the rotation runs in fp32, because bf16 angles
    lose the position information of long sequences. Tables are non-persistent buffers: derived
    data, not part of a checkpoint. `fusion`: whether it runs compiled (the run's
    `Kernels.apply_rope_fusion`).
    """

    def __init__(
        self,
        head_dim: int,
        base: float,
        max_seq_length: int,
        device: torch.device,
        fusion: bool = False,
        positions: torch.Tensor | None = None,
    ) -> None:
        """`positions`: the global positions of the tokens this rank holds, in its order (a
        context-parallel rank's two chunks, `overlap.parallel.cp_chunks`); None: 0..seq-1."""
        super().__init__()
        self.fusion = fusion
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
        inv_freq = 1.0 / (
            base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        )
        angles = torch.outer(
            torch.arange(max_seq_length, dtype=torch.float32, device=device), inv_freq
        )
        if positions is not None:
            angles = angles.index_select(0, positions)
        angles = torch.cat((angles, angles), dim=-1)[:, None, None, :]  # [seq, 1, 1, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[0]
        if seq > self.cos.shape[0]:
            raise ValueError(
                f"sequence length {seq} exceeds the rotary table ({self.cos.shape[0]}, "
                "model.seq_length)"
            )
        return APPLY_ROPE(self.fusion, x, self.cos[:seq], self.sin[:seq])
