"""Tensor-parallel (TP) and sequence-parallel (SP) building blocks, in Megatron-Core's vocabulary.

Activations are [seq, batch, hidden]. Under sequence parallelism every TP rank holds a 1/tp slice of
the sequence (dim 0) outside the TP regions, so the SP collectives are comm's dim-0 all-gather /
reduce-scatter.

The mappings are autograd functions whose backward is the adjoint of their forward (identity <->
all-reduce, all-gather <-> reduce-scatter, slice <-> all-gather). Every collective goes through
`overlap.parallel.comm`. Over a group of one rank each mapping is the identity, so the same model
code runs at TP=1 without tracing empty collectives.

The two spots where a collective meets a GEMM are one function each: `all_gather_linear` (SP
all-gather feeding the column-parallel GEMM, which keeps only the input's shard for backward and
gathers it again there, under the dgrad GEMM: `linear_functions.Linear`'s `gather`) and
`linear_reduce_scatter` (row-parallel GEMM feeding the SP reduce-scatter). With `tp_comm_overlap` a
linear carries its slots' plan (`overlap.kernels.LinearPlan`) and these two functions
hand over to the chunked, overlapped versions in `overlap.layers.tp_overlap`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Function
from torch.distributed import ProcessGroup, ReduceOp

from overlap.config.mixed_precision import Precision
from overlap.kernels import LinearPlan
from overlap.layers.init import mark_shard
from overlap.layers.linear_functions import linear
from overlap.layers.tp_overlap import all_gather_linear_overlapped, linear_reduce_scatter_overlapped
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel import comm
from overlap.parallel.state import ParallelState


def params_dtype(precision: Precision) -> torch.dtype:
    """The torch dtype of parameters (and therefore of compute) the run's resolved precision names
    (`cfg.resolved.precision`, or `Precision.of(config)` for a model built from a bare config)."""
    return getattr(torch, precision.params_dtype)


def divide(size: int, parts: int, what: str) -> int:
    """`size // parts`, refusing a remainder: a silently truncated shard would give a wrong model,
    not an error."""
    if size % parts:
        raise ValueError(f"{what} ({size}) must be divisible by the tensor-parallel size ({parts})")
    return size // parts


# --------------------------------------------------------------------------------------------------
# Collectives over the TP group (the identity on a group of one)
# --------------------------------------------------------------------------------------------------


def _all_reduce(t: torch.Tensor, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; callers pass a tensor they own."""
    if comm.group_size(group) == 1:
        return t
    return comm.all_reduce(t, group, "tp_ar", op).wait()


def _all_reduce_copy(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """All-reduce of a copy: autograd may share `t` with other consumers (a residual add passes one
    gradient tensor to both branches), so it must not change in place."""
    if comm.group_size(group) == 1:
        return t
    return _all_reduce(t.clone(memory_format=torch.contiguous_format), group)


def _all_gather(t: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    if comm.group_size(group) == 1:
        return t
    return comm.all_gather(t.movedim(dim, 0), group, "tp_ag").wait().movedim(0, dim)


def _reduce_scatter(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if comm.group_size(group) == 1:
        return t
    return comm.reduce_scatter(t, group, "tp_rs").wait()


def _own_slice(t: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    size = comm.group_size(group)
    if size == 1:
        return t
    divide(t.shape[dim], size, f"dimension {dim} of a tensor split over TP")
    return t.chunk(size, dim)[comm.group_rank(group)].contiguous()


# --------------------------------------------------------------------------------------------------
# Autograd mappings (the functions below them skip the autograd node on a group of one: an identity
# both ways, and two Python nodes per layer on the TP=1 path, ~2 ms per step in
# bench/hf_compute_bench.py's dense model)
# --------------------------------------------------------------------------------------------------


class _CopyToTP(Function):
    """Enter a TP region with a replicated input: each rank's input-gradient is partial, so backward
    sums them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_copy(grad, ctx.group), None


class _ReduceFromTP(Function):
    """Leave a TP region by summing the ranks' partial outputs; the gradient of a sum is replicated
    as is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return _all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ReduceScatterToSP(Function):
    """Partial full-sequence outputs -> summed sequence shards; backward all-gathers the shard
    gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group, 0), None


class _Split(Function):
    """Keep this rank's slice of a replicated tensor along `dim`; backward reassembles the full
    gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class _Gather(Function):
    """Concatenate the ranks' slices along `dim` into a replicated tensor; backward keeps this
    rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _own_slice(grad, ctx.group, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward identity, backward all-reduce over `group`."""
    return x if comm.group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward all-reduce over `group`, backward identity."""
    return x if comm.group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward reduce-scatter along the sequence (dim 0), backward all-gather."""
    return x if comm.group_size(group) == 1 else _ReduceScatterToSP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward all-gather along the last (feature) dim, backward keep this rank's feature slice."""
    return x if comm.group_size(group) == 1 else _Gather.apply(x, group, -1)


def scatter_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward keep this rank's feature slice (last dim), backward all-gather."""
    return x if comm.group_size(group) == 1 else _Split.apply(x, group, -1)


# --------------------------------------------------------------------------------------------------
# Collective + GEMM pairs: the two functions TP overlap replaces
# --------------------------------------------------------------------------------------------------


def all_gather_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group: ProcessGroup,
    plan: LinearPlan | None = None,
    store: WeightGradStore | None = None,
    split: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Sequence-parallel all-gather of `x` followed by the column-parallel GEMM (overlapped by
    `plan`, if any). `store`: where the weight gradient may be queued (see
    `ColumnParallelLinear.wgrad_store`); `split`: a fused weight's outputs one by one (see
    `ColumnParallelLinear.forward`)."""
    if plan is not None:
        y = all_gather_linear_overlapped(x, weight, bias, group, plan, store)
        return y.chunk(weight.shape[0], dim=-1) if split else y
    gather = group if comm.group_size(group) > 1 else None
    return linear(x, weight, bias, store, split, gather)


def linear_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    group: ProcessGroup,
    plan: LinearPlan | None = None,
    store: WeightGradStore | None = None,
) -> torch.Tensor:
    """Row-parallel GEMM followed by the sequence-parallel reduce-scatter of its partial sums
    (overlapped by `plan`, if any); the weight gradient through `store` (as `all_gather_linear`'s).
    """
    if plan is not None:
        return linear_reduce_scatter_overlapped(x, weight, group, plan, store)
    return reduce_scatter_to_sp(linear(x, weight, store=store), group)


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


def _sp_only(plan: LinearPlan | None, sequence_parallel: bool, layer: str) -> LinearPlan | None:
    """TP overlap hides the sequence-parallel collectives; without sequence parallelism there are
    none to hide (the configuration gate refuses the combination, so this only guards direct
    construction)."""
    if plan is not None and not sequence_parallel:
        raise ValueError(f"{layer}: a TP-overlap plan needs sequence parallelism")
    return plan


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along its output rows over TP (each rank computes out/tp output
    features).

    With sequence parallelism the input is this rank's sequence shard and is all-gathered first;
    without it the input is replicated and enters through `copy_to_tp`. The output stays
    feature-sharded unless `gather_output`.

    `num_fused` > 1 fuses that many equally sized linears into one GEMM (SwiGLU's gate and up
    projections). The weight is then [num_fused, out/(num_fused*tp), in], sharded along dim 1, so
    every rank holds a slice of *each* fused linear and the logical full weight [num_fused,
    out/num_fused, in] does not depend on TP.

    `overlap` (sequence parallel only): the TP-overlap plan of this linear's slots (see
    `all_gather_linear`).

    `wgrad_store`: the store the weight gradient goes through (`overlap.layers.wgrad_store`; None:
    computed in backward). The model's layers get the model's store (delay_wgrad_compute, the
    pipeline's queued weight gradients); the output layer gets one of its own with
    `defer_embedding_wgrad_compute` (the pipeline executor defers its weight-gradient GEMMs to the
    flush through it, `overlap.pipeline.output_wgrad`), and none when it is tied to the embedding
    (`overlap.model.gpt`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        sequence_parallel: bool,
        gather_output: bool = False,
        bias: bool = False,
        num_fused: int = 1,
        params_dtype: torch.dtype = torch.float32,
        overlap: LinearPlan | None = None,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        self.group = ps.tp_group
        self.sequence_parallel = sequence_parallel
        self.overlap = _sp_only(overlap, sequence_parallel, "ColumnParallelLinear")
        self.wgrad_store = wgrad_store
        self.gather_output = gather_output
        tp = ps.layout.tp
        per_linear = divide(
            out_features, num_fused, "ColumnParallelLinear output size over num_fused"
        )
        local = divide(per_linear, tp, "ColumnParallelLinear output size")
        shape = (local, in_features) if num_fused == 1 else (num_fused, local, in_features)
        shard_dim = 0 if num_fused == 1 else 1
        self.weight = mark_shard(
            nn.Parameter(torch.empty(shape, dtype=params_dtype, device=ps.device)),
            shard_dim,
            ps.tp_rank,
            tp,
        )
        self.bias = None
        if bias:
            self.bias = mark_shard(
                nn.Parameter(torch.empty(shape[:-1], dtype=params_dtype, device=ps.device)),
                shard_dim,
                ps.tp_rank,
                tp,
            )

    def forward(
        self, x: torch.Tensor, split: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """`split` (num_fused > 1, no gather_output): the fused linears' outputs (this rank's slice
        of each), one tensor per linear, contiguous, one GEMM each (`linear`'s `split`; SwiGLU's
        gate and up). Under a TP-overlap plan, whose chunked ring GEMMs fill one fused output, they
        are that output's views. Called through the module (not a second method) so that forward
        pre-hooks - the distributed optimizer's parameter all-gather wait - run before the weight is
        read."""
        if split and (self.weight.dim() != 3 or self.gather_output):
            raise ValueError(
                "ColumnParallelLinear(split=True) needs num_fused > 1 and gather_output=False"
            )
        bias = None if self.bias is None else self.bias.reshape(-1)
        if self.sequence_parallel:
            y = all_gather_linear(
                x, self.weight, bias, self.group, self.overlap, self.wgrad_store, split
            )
        else:
            y = linear(copy_to_tp(x, self.group), self.weight, bias, self.wgrad_store, split)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along its input columns over TP: each rank's GEMM yields a partial
    sum.

    The partial sums are reduce-scattered along the sequence under sequence parallelism, all-reduced
    otherwise. The input is normally already feature-sharded (the output of a ColumnParallelLinear);
    `input_is_parallel=False` takes a replicated input and keeps this rank's slice. The bias is
    added once, after the reduction; under sequence parallelism each rank's bias gradient covers
    only its sequence shard, hence `bias.sequence_parallel`.

    `overlap` (sequence parallel only): the TP-overlap plan of this linear's slots (see
    `linear_reduce_scatter`). `wgrad_store`: as `ColumnParallelLinear`'s.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        ps: ParallelState,
        sequence_parallel: bool,
        input_is_parallel: bool = True,
        bias: bool = False,
        params_dtype: torch.dtype = torch.float32,
        overlap: LinearPlan | None = None,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "RowParallelLinear with sequence parallelism needs a feature-sharded input "
                "(input_is_parallel=True)"
            )
        self.group = ps.tp_group
        self.sequence_parallel = sequence_parallel
        self.overlap = _sp_only(overlap, sequence_parallel, "RowParallelLinear")
        self.input_is_parallel = input_is_parallel
        self.wgrad_store = wgrad_store
        local = divide(in_features, ps.layout.tp, "RowParallelLinear input size")
        self.weight = mark_shard(
            nn.Parameter(torch.empty(out_features, local, dtype=params_dtype, device=ps.device)),
            1,
            ps.tp_rank,
            ps.layout.tp,
        )
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=params_dtype, device=ps.device)
            )
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        if self.sequence_parallel:
            y = linear_reduce_scatter(x, self.weight, self.group, self.overlap, self.wgrad_store)
        else:
            y = reduce_from_tp(linear(x, self.weight, store=self.wgrad_store), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over TP.

    Each rank looks up the tokens that fall in its vocabulary range and writes zeros for the others;
    summing over TP (an all-reduce, or a reduce-scatter along the sequence under sequence
    parallelism) completes every row. Input token ids are [seq, batch] so the sequence-parallel
    reduce-scatter cuts dim 0.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        ps: ParallelState,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.group = ps.tp_group
        self.sequence_parallel = sequence_parallel
        local = divide(num_embeddings, ps.layout.tp, "VocabParallelEmbedding vocabulary size")
        self.vocab_start = ps.tp_rank * local
        self.weight = mark_shard(
            nn.Parameter(torch.empty(local, embedding_dim, dtype=params_dtype, device=ps.device)),
            0,
            ps.tp_rank,
            ps.layout.tp,
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if comm.group_size(self.group) == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(
            outside.unsqueeze(-1), 0.0
        )
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group)
        return reduce_from_tp(out, self.group)
