"""Tensor-parallel communication overlap: the sequence-parallel all-gathers and reduce-scatters
hidden behind the GEMMs they feed or follow, per GEMM slot, as Transformer Engine's userbuffers do
on GPUs - here with our own async collectives and point-to-point transfers (`overlap.parallel.comm`;
the ring exchanges are `overlap.parallel.ring`'s), so it runs on gloo and NCCL alike.

Three mechanisms (`overlap.kernels.tp_overlap.SLOT_METHODS` says which slot may use which):

* ring exchange, all-gather -> GEMM (`ring_all_gather_matmul`): TP steps; at each step the GEMM runs
  on the shard already here while that shard travels on to the next rank and the previous rank's
  arrives. Each output chunk is written in place, and the received shards form the gathered input,
  which the backward's weight gradient reuses. `aggregate` first swaps shards with the pair partner,
  then moves two shards per step in TP/2 steps (bigger GEMMs).
* ring exchange, GEMM -> reduce-scatter (`ring_matmul_reduce_scatter`): at step k a rank computes
  the partial sum for the rank k+1 places behind it, adds the running sum arriving from its
  predecessor and passes it on; the next step's GEMM runs while that sum travels. The last partial
  computed is the rank's own, fully reduced.
* pipeline, GEMM -> reduce-scatter (`pipelined_matmul_reduce_scatter`): the GEMM is cut into
  `num_splits` chunks along the sequence (chunk i holds sub-chunk i of every rank's shard), and
  chunk i's reduce-scatter is in flight while chunk i+1 is computed.
* bulk (in `_AllGatherLinear.backward`): with a bulk dgrad slot only the input shard is kept
  (Megatron's and Transformer Engine's sequence-parallel memory saving, as the plain path does) and
  its all-gather, needed by the weight gradient, runs whole while the dgrad GEMM computes; with a
  bulk wgrad slot the dgrad reduce-scatter runs whole while the wgrad GEMM computes. Without a bulk
  dgrad slot the forward's gathered input is kept: more memory, no second all-gather beside the
  slot's own ring or pipeline transfers.

The two autograd functions replace `all_gather_linear` / `linear_reduce_scatter` of
`layers/tensor_parallel.py` when a linear has a plan; their math is the same GEMMs on the same rows,
only cut and ordered differently (the ring reduce-scatter also sums the ranks' partials in ring
order), so results agree with the plain path to rounding. Every transfer is traced under `tp_ag` /
`tp_rs`, every chunk GEMM is a `tp.gemm` span and every weight-gradient GEMM a `tp.wgrad` span, so
the timeline shows which transfer is in flight while which GEMM computes. Weight gradients go
through the linear's store (its model's `WeightGradStore`: delay_wgrad_compute).
"""

from __future__ import annotations

import torch
from torch.autograd import Function
from torch.distributed import ProcessGroup

from overlap.kernels import BULK, PIPELINE, RING, LinearPlan, SlotPlan
from overlap.layers.linear_functions import linear_weight_grad
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel import comm
from overlap.parallel.ring import Ring, Shift, exchange
from overlap.parallel.trace import recorder

AG_KIND, RS_KIND = "tp_ag", "tp_rs"


def _gemm(a: torch.Tensor, m: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [..., k] @ m [k, n] as one 2-D GEMM (a strided chunk is packed first: a batched matmul over
    a strided view runs ~1.8x slower on CPU than the copy plus one GEMM); written into `out`
    (contiguous) when given."""
    with recorder().span("tp.gemm"):
        a2 = a.reshape(-1, a.shape[-1])
        if out is None:
            return torch.mm(a2, m).view(*a.shape[:-1], m.shape[-1])
        torch.mm(a2, m, out=out.view(-1, m.shape[-1]))
        return out


def ring_all_gather_matmul(
    shard: torch.Tensor, m: torch.Tensor, group: ProcessGroup, aggregate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(shard) @ m, all_gather(shard)) with the gather's transfers hidden behind the
    chunk GEMMs (a `Ring` of the TP group).

    `shard` is [rows, ...] (dim 0: this rank's sequence rows), `m` [k, n]; returns ([tp*rows, ...,
    n], [tp*rows, ...]) in rank order. Every rank sends what it received one step earlier, so each
    step's wait is for one shard's transfer, which the step's GEMM covers."""
    tp, r = comm.group_size(group), comm.group_rank(group)
    if aggregate and (tp < 4 or tp % 2):
        raise ValueError(
            "ring all-gather: aggregate pairs the shards, which needs an even TP of 4 or more "
            f"(TP={tp})"
        )
    gathered = shard.new_empty((tp, *shard.shape))
    gathered[r].copy_(shard)
    out = shard.new_empty((tp, *shard.shape[:-1], m.shape[-1]))
    if aggregate:
        _ring_aggregated(gathered, out, m, group, r)
    else:
        ring = Ring(group, AG_KIND)
        for step in range(tp):
            here, arriving = ring.origin(step), ring.origin(step + 1)
            shift = ring.shift(gathered[here], gathered[arriving]) if step < tp - 1 else None
            _gemm(gathered[here], m, out[here])
            if shift is not None:
                shift.wait()
    return out.flatten(0, 1), gathered.flatten(0, 1)


def _ring_aggregated(
    gathered: torch.Tensor, out: torch.Tensor, m: torch.Tensor, group: ProcessGroup, r: int
) -> None:
    """`aggregate`: swap shards with the pair partner (r xor 1) under the own shard's GEMM, then
    move the pair's two shards together around the ring of pairs (a stride-2 ring: TP/2 - 1 steps),
    one two-shard GEMM per step."""
    partner = r ^ 1
    swap = exchange(gathered[r], gathered[partner], partner, partner, group, AG_KIND)
    _gemm(gathered[r], m, out[r])
    swap.wait()
    ring = Ring(group, AG_KIND, stride=2)
    for step in range(ring.steps):
        here, arriving = ring.origin(step) // 2, ring.origin(step + 1) // 2
        block = slice(2 * here, 2 * here + 2)
        shift = (
            ring.shift(gathered[block], gathered[2 * arriving : 2 * arriving + 2])
            if step < ring.steps - 1
            else None
        )
        if step == 0:
            _gemm(gathered[partner], m, out[partner])  # the own shard's GEMM ran during the swap
        else:
            _gemm(gathered[block], m, out[block])
        if shift is not None:
            shift.wait()


def ring_matmul_reduce_scatter(
    x: torch.Tensor, m: torch.Tensor, group: ProcessGroup
) -> torch.Tensor:
    """reduce_scatter(x @ m) along dim 0 with the partial sums passed around the ring (a `Ring` of
    the TP group) under the next GEMM.

    `x` is [tp*rows, ...]; returns this rank's [rows, ..., n]. Rank r's step k computes the rows
    destined for rank r-1-k: the running sum for those rows arrives from rank r-1 (its step k-1)
    while the GEMM runs."""
    tp = comm.group_size(group)
    _check_rows(x, tp, "ring reduce-scatter")
    chunks = x.reshape(tp, x.shape[0] // tp, *x.shape[1:])
    ring = Ring(group, RS_KIND)
    arriving: Shift | None = None
    for step in range(tp):
        part = _gemm(chunks[ring.origin(step + 1)], m)
        if arriving is not None:
            part += arriving.wait()
        arriving = ring.shift(part, torch.empty_like(part)) if step < tp - 1 else None
    return part


def pipelined_matmul_reduce_scatter(
    x: torch.Tensor, m: torch.Tensor, group: ProcessGroup, num_splits: int
) -> torch.Tensor:
    """reduce_scatter(x @ m) along dim 0, cut into `num_splits` GEMM chunks whose reduce-scatters
    overlap the next chunk's GEMM. Chunk i is sub-chunk i of every rank's rows, so its
    reduce-scatter yields this rank's sub-chunk i."""
    tp = comm.group_size(group)
    _check_rows(x, tp * num_splits, f"pipelined reduce-scatter in {num_splits} chunks")
    rows = x.shape[0] // (tp * num_splits)
    xv = x.reshape(tp, num_splits, rows, *x.shape[1:])
    handles = []
    for i in range(num_splits):
        part = _gemm(xv[:, i], m)
        handles.append(comm.reduce_scatter(part.flatten(0, 1), group, RS_KIND))
    return torch.cat([h.wait() for h in handles])


def _matmul_reduce_scatter(
    x: torch.Tensor, m: torch.Tensor, group: ProcessGroup, plan: SlotPlan | None
) -> torch.Tensor:
    """reduce_scatter(x @ m) by the slot's method (none: the GEMM, then one whole
    reduce-scatter)."""
    if plan is None:
        return comm.reduce_scatter(_gemm(x, m), group, RS_KIND).wait()
    if plan.method == RING:
        return ring_matmul_reduce_scatter(x, m, group)
    if plan.method == PIPELINE:
        return pipelined_matmul_reduce_scatter(x, m, group, plan.num_splits)
    raise ValueError(
        f"a GEMM -> reduce-scatter slot runs ring_exchange or pipeline, not {plan.method}"
    )


def _all_gather_matmul(
    shard: torch.Tensor, m: torch.Tensor, group: ProcessGroup, plan: SlotPlan | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(shard) @ m, all_gather(shard)) by the slot's method (none: one whole all-gather,
    then the GEMM)."""
    if plan is None:
        full = comm.all_gather(shard, group, AG_KIND).wait()
        return _gemm(full, m), full
    if plan.method != RING:
        raise ValueError(f"an all-gather -> GEMM slot runs ring_exchange, not {plan.method}")
    return ring_all_gather_matmul(shard, m, group, plan.aggregate)


def _overlapped_dgrad(
    shard: torch.Tensor, grad: torch.Tensor, w2: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bulk dgrad: (grad @ w2, all_gather(shard)) with the all-gather in flight during the GEMM."""
    gather = comm.all_gather(shard.contiguous(), group, AG_KIND)
    grad_x_full = _gemm(grad, w2)
    return grad_x_full, gather.wait()


def _check_rows(x: torch.Tensor, parts: int, what: str) -> None:
    if x.shape[0] % parts:
        raise ValueError(f"{what}: dim 0 ({x.shape[0]} rows) is not divisible by {parts}")


def _weight_grad(
    weight: torch.Tensor, grad: torch.Tensor, inp: torch.Tensor, store: WeightGradStore | None
) -> torch.Tensor | None:
    """The weight gradient, a `tp.wgrad` span (None when `store` queued it: delay_wgrad_compute)."""
    return linear_weight_grad(weight, grad, inp, "tp.wgrad", store)


class _AllGatherLinear(Function):
    """Column-parallel GEMM of the all-gathered sequence shards: y = all_gather(x) W^T (+ b).

    Forward: the fprop slot (ring exchange or none). With a bulk dgrad slot only the shard is saved,
    as Megatron and Transformer Engine do under sequence parallelism (activation memory / TP), and
    backward gathers it again under the dgrad GEMM; otherwise the gathered input of the forward is
    kept (more memory, no second all-gather beside the slot's own transfers). Backward: dgrad = grad
    W; its reduce-scatter runs under the wgrad GEMM (bulk wgrad), or chunked with the dgrad GEMM
    itself (a pipeline / ring dgrad slot), or whole after it."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: ProcessGroup,
        plan: LinearPlan,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        w2 = weight.reshape(-1, weight.shape[-1])
        y, gathered = _all_gather_matmul(x.contiguous(), w2.t(), group, plan.fprop)
        if bias is not None:
            y = y + bias
        ctx.regather = plan.dgrad is not None and plan.dgrad.method == BULK
        ctx.save_for_backward(x if ctx.regather else gathered)
        ctx.weight, ctx.group, ctx.plan, ctx.has_bias = weight, group, plan, bias is not None
        ctx.store = store
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (saved,) = ctx.saved_tensors
        weight, group, plan, store = ctx.weight, ctx.group, ctx.plan, ctx.store
        grad = grad.contiguous()
        w2 = weight.reshape(-1, weight.shape[-1])
        # a pipeline / ring dgrad slot: the reduce-scatter chunked with the dgrad GEMM
        if plan.dgrad is not None and plan.dgrad.method != BULK:
            grad_x = _matmul_reduce_scatter(grad, w2, group, plan.dgrad)
            grad_w = _weight_grad(weight, grad, saved, store)
        else:
            if ctx.regather:  # bulk dgrad: the input's all-gather runs under the dgrad GEMM
                grad_x_full, x_full = _overlapped_dgrad(saved, grad, w2, group)
            else:
                grad_x_full, x_full = _gemm(grad, w2), saved
            scatter = comm.reduce_scatter(grad_x_full, group, RS_KIND)
            # bulk wgrad: the reduce-scatter in flight under the wgrad GEMM; otherwise waited first.
            # (A delayed wgrad is only queued here, so there is no GEMM to wait under.)
            bulk = plan.wgrad is not None and not (store is not None and store.active)
            grad_x = None if bulk else scatter.wait()
            grad_w = _weight_grad(weight, grad, x_full, store)
            grad_x = scatter.wait() if bulk else grad_x
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


class _LinearReduceScatter(Function):
    """Row-parallel GEMM whose partial sums are reduce-scattered along the sequence: y =
    reduce_scatter(x W^T).

    Forward: the fprop slot (pipeline, ring exchange or none). Backward: the output gradient's
    all-gather feeds the dgrad GEMM (the dgrad slot: ring exchange or none), and the gathered
    gradient feeds the weight gradient."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        group: ProcessGroup,
        plan: LinearPlan,
        store: WeightGradStore | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.group, ctx.plan, ctx.store = weight, group, plan, store
        return _matmul_reduce_scatter(x.contiguous(), weight.t(), group, plan.fprop)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, group, plan = ctx.weight, ctx.group, ctx.plan
        grad_x, grad_full = _all_gather_matmul(grad.contiguous(), weight, group, plan.dgrad)
        return grad_x, _weight_grad(weight, grad_full, x, ctx.store), None, None, None


def all_gather_linear_overlapped(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup,
    plan: LinearPlan,
    store: WeightGradStore | None,
) -> torch.Tensor:
    """`tensor_parallel.all_gather_linear` with the plan's overlap; the weight gradient through
    `store` (None: computed in backward)."""
    return _AllGatherLinear.apply(x, weight, bias, group, plan, store)


def linear_reduce_scatter_overlapped(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: ProcessGroup,
    plan: LinearPlan,
    store: WeightGradStore | None,
) -> torch.Tensor:
    """`tensor_parallel.linear_reduce_scatter` with the plan's overlap; the weight gradient through
    `store` (None: computed in backward)."""
    return _LinearReduceScatter.apply(x, weight, group, plan, store)
