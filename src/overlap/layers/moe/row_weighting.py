"""Expert output rows times their fp32 combine weights, rounded back to the rows' dtype:
`weight_rows`.

The product is taken in fp32 whatever the activation dtype (the router's weights are fp32, see
`router.py`), so in bf16 it is `(rows.float() * weights[:, None]).to(bf16)`, and its backward the
same passes again plus the weights' gradient `sum(grad.float() * rows.float())` per row. Written as
those tensor expressions, each pass runs over the whole [rows, hidden] tensor and the fp32
intermediates (twice the size of the rows) go out to memory and back: on one CPU core, a
bandwidth-bound ~2.4 ms per forward + backward at 1024 x 512 in bf16, against ~0.75 ms for a plain
bf16 multiply (what transformers does, with the weights rounded to bf16 first).

On CPU, `weight_rows` therefore runs the same operations a block of rows at a time, with the fp32
intermediates in one reused buffer that stays in the core's cache: bit-identical results
(tests/test_moe.py), ~1.6 ms for that forward + backward (measured in isolation on the Intel AMX CPU
of bench/results/hf_compute*.md; blocks of 64 KiB gained nothing, 256 KiB and up about the same).
Elsewhere (CUDA: kernels, not caches, and a Python loop per block would cost launches) and for rows
already in fp32 it is the plain expression, `scale_rows`. With `model.bias_activation_fusion` on
(`overlap.config.fusion`) `scale_rows` runs compiled instead, on any device: one kernel forward and
one backward, the fp32 intermediates in registers.
"""

from __future__ import annotations

import torch

from overlap.layers import fused

_BLOCK_BYTES = 1 << 19
"""fp32 bytes of one block's intermediate (512 KiB: a block of 256 rows at hidden 512; backward
holds two)."""


def scale_rows(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The plain expression of `weight_rows`: the chain `model.bias_activation_fusion` compiles."""
    return (rows.float() * weights.unsqueeze(-1)).to(rows.dtype)


def weight_rows(
    rows: torch.Tensor, weights: torch.Tensor, fusion: bool | None = None
) -> torch.Tensor:
    """rows [R, h] (any float dtype) x fp32 weights [R] -> [R, h] in the rows' dtype, the product
    taken in fp32; `fusion` is `model.bias_activation_fusion` (None: by device)."""
    if fused.compiling(fusion, rows):
        return fused.compiled(scale_rows)(rows, weights)
    if rows.device.type != "cpu" or rows.dtype == torch.float32:
        return scale_rows(rows, weights)
    return _BlockedWeighting.apply(rows, weights)


def _blocks(rows: torch.Tensor) -> range:
    return range(0, rows.shape[0], max(1, _BLOCK_BYTES // (4 * max(1, rows.shape[-1]))))


class _BlockedWeighting(torch.autograd.Function):
    """`(rows.float() * weights[:, None]).to(rows.dtype)` and its autograd backward, a cache-sized
    block at a time."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows = rows.contiguous()
        ctx.save_for_backward(rows, weights)
        blocks = _blocks(rows)
        out = torch.empty_like(rows)
        buf = rows.new_empty((blocks.step, rows.shape[-1]), dtype=torch.float32)
        for s in blocks:
            e = min(s + blocks.step, rows.shape[0])
            tmp = buf[: e - s]
            tmp.copy_(rows[s:e])
            tmp.mul_(weights[s:e].unsqueeze(-1))
            out[s:e].copy_(tmp)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, weights = ctx.saved_tensors
        grad = grad.contiguous()
        blocks = _blocks(rows)
        grad_rows = torch.empty_like(rows)
        grad_weights = torch.empty_like(weights)
        g_buf = rows.new_empty((blocks.step, rows.shape[-1]), dtype=torch.float32)
        r_buf = torch.empty_like(g_buf)
        for s in blocks:
            e = min(s + blocks.step, rows.shape[0])
            g, r = g_buf[: e - s], r_buf[: e - s]
            g.copy_(grad[s:e])
            r.copy_(rows[s:e])
            torch.linalg.vecdot(g, r, out=grad_weights[s:e])
            g.mul_(weights[s:e].unsqueeze(-1))
            grad_rows[s:e].copy_(g)
        return grad_rows, grad_weights
