"""The linear layers' autograd functions, whose weight gradient can be deferred through a
`WeightGradStore` (`overlap.layers.wgrad_store`): `Linear` (attention, MLP and shared-expert GEMMs;
`linear`) and `GroupedLinear` (the routed experts' grouped GEMM; `grouped_offsets` picks its
kernel).

Each computes its input gradient in backward at once and hands its weight gradient to the store it
was given (its model's, passed down at construction), which runs it now or queues it
(`WeightGradStore.take`); without a store the weight gradient is computed in the backward itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from overlap.layers.wgrad_store import WeightGradStore, take_weight_grad
from overlap.parallel import comm
from overlap.parallel.trace import recorder

TP_GATHER, TP_SCATTER = "tp_ag", "tp_rs"  # the sequence-parallel collectives' kinds


class GroupedLinear(torch.autograd.Function):
    """rows [R, in] grouped by expert (`counts`) x stacked weight [E, out, in] -> [R, out]; the
    weight gradient can be delayed through `store` (None: computed in backward).

    `offs` (`grouped_offsets`) selects the kernel: PyTorch's grouped GEMM (`F.grouped_mm`, one call
    for every expert and the expert loop in C++), or, where it is None, one `torch.mm` per expert
    written straight into its rows of a preallocated output (and into its slice of one [E, out, in]
    weight gradient), never a `cat` of per-expert results (which would copy every activation and
    gradient once more). Both give bit-identical results on CPU (tests/test_moe.py); the grouped
    kernel saves the Python loop, ~1 ms per GEMM's forward + backward at hidden 512 with 16 experts
    (about 1% of bench/hf_compute_bench.py's MoE step)."""

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        weight: nn.Parameter,
        counts: list[int],
        offs: torch.Tensor | None,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.weight, ctx.counts, ctx.offs, ctx.store = weight, counts, offs, store
        if offs is not None:
            return F.grouped_mm(rows, weight.transpose(1, 2), offs=offs)
        return _grouped_mm(rows, counts, [w.t() for w in weight.unbind(0)], weight.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        # detached: a delayed weight gradient keeps the rows, not the graph that made them
        rows = rows.detach()
        weight, counts, offs = ctx.weight, ctx.counts, ctx.offs
        grad = grad.contiguous()
        if offs is not None:
            grad_rows = F.grouped_mm(grad, weight, offs=offs)
        else:
            grad_rows = _grouped_mm(grad, counts, weight.unbind(0), weight.shape[2])

        def weight_grad() -> torch.Tensor:
            if offs is not None:
                # [out, R] x [R, in] cut along R: an expert without rows gets zeros
                return F.grouped_mm(grad.t(), rows, offs=offs)
            out = torch.empty_like(weight)
            for g, x, o in zip(grad.split(counts), rows.split(counts), out.unbind(0)):
                # an expert without rows gets zeros (a GEMM over an empty dimension)
                torch.mm(g.t(), x, out=o)
            return out

        return grad_rows, take_weight_grad(ctx.store, weight, weight_grad), None, None, None


def grouped_offsets(
    counts: torch.Tensor,
    rows: torch.Tensor,
    weights: Sequence[torch.Tensor],
    grouped: bool,
    host_counts: bool = True,
) -> torch.Tensor | None:
    """The end row of each expert's group (int32), the grouped GEMM's `offs`, where that kernel
    takes these tensors; None where it does not, and `GroupedLinear` loops over the experts instead.

    `counts` [E] are the rows per expert as a tensor on the rows' device (the dispatch plan's
    `local_expert_counts`), not the host list: a tensor made from Python ints is a host-to-device
    copy from pageable memory on a GPU, which waits for the queue; the cumulative sum of the device
    counts needs no host at all.

    The grouped kernel is used where the run decided so (`grouped`: `Kernels.moe_grouped_gemm`, by
    the architecture rule of `overlap.kernels.grouped_gemm`: the CPU, Hopper in bf16; the decision
    table's "model" section shows it for the run's GPU) on real tensors (a dry run's stand-ins
    take the loop), and only when each operand's row stride is a multiple of 16 bytes (its layout
    rule: a tiny test model's hidden 4 in bf16 breaks it); elsewhere the loop. On CUDA its
    agreement with the loop and what it buys are the device script's to measure
    (`bench/gpu_check.py`, step env: `grouped_gemm`).

    `host_counts=False`: the dispatch has no host counts for the loop (the sync-free dispatch,
    `overlap.layers.moe.rank_capacity`, which `overlap run` refuses where the run's GPU takes the
    loop): a dry run's stand-in tensors then take the grouped kernel, as the GPU they stand for."""
    stand_in = rows.device.type == "meta"
    if not (grouped and not stand_in) and not (stand_in and not host_counts):
        return None
    if any(t.shape[-1] * t.element_size() % 16 for t in (rows, *weights)):
        return None
    return counts.cumsum(0).to(torch.int32)


def _grouped_mm(
    rows: torch.Tensor, counts: list[int], weights: Sequence[torch.Tensor], width: int
) -> torch.Tensor:
    """[R, width]: the `counts[e]` rows of expert e (after those of experts < e) times
    `weights[e]`."""
    rows = rows.contiguous()
    out = rows.new_empty((rows.shape[0], width))
    for x, w, o in zip(rows.split(counts), weights, out.split(counts)):
        torch.mm(x, w, out=o)
    return out


class Linear(torch.autograd.Function):
    """y = x W^T + b with W = `weight` viewed as [-1, in] (fused weights keep their own shape); the
    weight gradient can be delayed through `store` (None: computed in backward), the input and bias
    gradients never are.

    `split` (a fused weight [k, out, in]): return the k fused linears' outputs as k contiguous
    tensors, one GEMM each, instead of one [..., k * out] tensor. Slicing the fused output hands its
    consumer (SwiGLU) strided halves, and autograd then concatenates their gradients into one
    [..., k * out] tensor for the backward GEMMs; split, backward takes the k gradients as they come
    and writes the weight gradient straight into the fused weight's k slices. In
    bench/hf_compute_bench.py's dense MLP (hidden 512, width 1536, sequence 256) that is
    8.3 -> 6.8 ms per layer's forward + backward in bf16, 29.4 -> 27.5 ms in fp32.

    `gather` (sequence parallelism: the TP group): x is this rank's sequence shard, all-gathered
    along dim 0 before the GEMM. Only the shard is kept for backward (Megatron-Core's and
    Transformer Engine's sequence-parallel linear: 1/tp of the gathered input's memory), and
    backward gathers it again in flight under the dgrad GEMM, then reduce-scatters the input
    gradient in flight under the weight-gradient GEMM."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: nn.Parameter,
        bias: torch.Tensor | None,
        store: WeightGradStore | None,
        split: bool = False,
        gather: ProcessGroup | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x)
        ctx.weight, ctx.has_bias, ctx.store, ctx.split = weight, bias is not None, store, split
        ctx.gather = gather
        if gather is not None:
            x = comm.all_gather(x.contiguous(), gather, TP_GATHER).wait()
        if split:
            k = weight.shape[0]
            biases = [None] * k if bias is None else bias.view(k, -1).unbind(0)
            return tuple(F.linear(x, w, b) for w, b in zip(weight.unbind(0), biases))
        return F.linear(x, weight.reshape(-1, weight.shape[-1]), bias)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, group = ctx.weight, ctx.gather
        # the input's gather again, in flight under the dgrad GEMM
        regather = comm.all_gather(x.contiguous(), group, TP_GATHER) if group is not None else None
        if ctx.split:
            parts = weight.unbind(0)
            grad_x = grads[0] @ parts[0]
            flat = grad_x.view(-1, grad_x.shape[-1])
            for g, w in zip(grads[1:], parts[1:]):
                flat.addmm_(g.reshape(-1, g.shape[-1]), w)
            grad = grads
        else:
            (grad,) = grads
            grad_x = grad @ weight.reshape(-1, weight.shape[-1])
        scatter = None
        if regather is not None:
            x = regather.wait()
            # the input gradient's reduce-scatter, in flight under the weight-gradient GEMM
            scatter = comm.reduce_scatter(grad_x, group, TP_SCATTER)
        grad_bias = None
        if ctx.has_bias:
            grad_bias = torch.cat([g.reshape(-1, g.shape[-1]).sum(0) for g in grads])
        grad_w = linear_weight_grad(weight, grad, x, store=ctx.store)
        if scatter is not None:
            grad_x = scatter.wait()
        return grad_x, grad_w, grad_bias, None, None, None


def linear_weight_grad(
    weight: nn.Parameter,
    grad: torch.Tensor | Sequence[torch.Tensor],
    inp: torch.Tensor,
    span: str | None = None,
    store: WeightGradStore | None = None,
) -> torch.Tensor | None:
    """A linear's weight gradient grad^T inp (over all leading dims) in the weight's shape, through
    `take_weight_grad`: returned now, or queued while `store` is delaying (None).
    `grad` may be a sequence of the k gradients of a fused weight [k, out, in]'s split outputs
    (`Linear`'s `split`): each GEMM then writes its own slice of the one gradient tensor. `span`
    names it on the timeline. The input is kept detached: a saved input still carries its
    autograd graph, which would keep every tensor behind it alive (back to the pipeline's received
    activation and its gradient) for as long as a delayed or deferred GEMM waits in the store."""
    x2 = inp.detach().reshape(-1, inp.shape[-1])
    if isinstance(grad, torch.Tensor):
        g2 = grad.reshape(-1, grad.shape[-1])

        def compute() -> torch.Tensor:
            return (g2.t() @ x2).reshape(weight.shape)
    else:
        parts = [g.reshape(-1, g.shape[-1]) for g in grad]

        def compute() -> torch.Tensor:
            out = torch.empty_like(weight)
            for g2, o in zip(parts, out.unbind(0)):
                torch.mm(g2.t(), x2, out=o)
            return out

    def weight_grad() -> torch.Tensor:
        if span is None:
            return compute()
        with recorder().span(span):
            return compute()

    return take_weight_grad(store, weight, weight_grad)


def linear(
    x: torch.Tensor,
    weight: nn.Parameter,
    bias: torch.Tensor | None = None,
    store: WeightGradStore | None = None,
    split: bool = False,
    gather: ProcessGroup | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """`Linear` (see there for `store`, `split` and `gather`)."""
    return Linear.apply(x, weight, bias, store, split, gather)
