"""Contiguous parameter and gradient buffers, cut into buckets: the unit of data-parallel
communication.

Parameters that are reduced together (same dtype, same reduction group: data parallel for dense
weights, expert-data parallel for routed experts) share one buffer. Every parameter becomes a view
into the buffer's `param_data` and gets `main_grad`, a view into its `grad_data` (fp32 when
`grad_reduce_in_fp32`, else the parameter dtype), so a bucket is a plain slice that one collective
can reduce or gather without packing.

Parameters are laid out in reverse registration order, because backward produces gradients roughly
in that order: bucket 0 (the output layer's end of the model) completes first and its reduction
starts earliest. A bucket is closed once it holds at least `bucket_size` parameters (elements, not
bytes; None = one bucket) and its end is padded so that its length divides by the group size: each
rank's reduce-scatter shard (and all-gather contribution) is then an equal, contiguous slice of
every bucket. A tied embedding under pipeline parallelism (`tied_embedding`: the first stage's
embedding and the last stage's copy) is a bucket of its own, as Megatron lays it out: padded alike
on both stages, so that every DP rank's shard covers the same elements of both, and summing the two
stages' reduced gradients (the trainer, after the DP reduction) is right in every shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup

from overlap.parallel import comm


@dataclass
class Bucket:
    """Slice [start, end) of its buffer (end padded to a multiple of the group size) and the params
    inside it."""

    index: int
    params: list[nn.Parameter]
    start: int
    end: int
    grad_data: torch.Tensor
    param_data: torch.Tensor

    def shard_bounds(self, rank: int, size: int) -> tuple[int, int]:
        """Buffer coordinates of `rank`'s equal share of this bucket."""
        step = (self.end - self.start) // size
        return self.start + rank * step, self.start + (rank + 1) * step


@dataclass
class GradBuffer:
    """All parameters of one (dtype, reduction group): contiguous storage, per-parameter ranges,
    buckets."""

    group: ProcessGroup
    prefix: str  # communication kind prefix: "dp" or "edp"
    param_data: torch.Tensor
    grad_data: torch.Tensor
    ranges: dict[nn.Parameter, tuple[int, int]]
    buckets: list[Bucket] = field(default_factory=list)

    @property
    def group_size(self) -> int:
        return comm.group_size(self.group)

    @property
    def group_rank(self) -> int:
        return comm.group_rank(self.group)

    def local_shard(self, bucket: Bucket) -> tuple[int, int]:
        """Buffer coordinates of this rank's shard of `bucket`."""
        return bucket.shard_bounds(self.group_rank, self.group_size)


def _cut_buckets(
    params: list[nn.Parameter], bucket_size: int | None, align: int
) -> tuple[dict[nn.Parameter, tuple[int, int]], list[tuple[list[nn.Parameter], int, int]], int]:
    """Lay `params` out back to front; return their ranges, the buckets (params, start, padded end)
    and the total."""
    ranges: dict[nn.Parameter, tuple[int, int]] = {}
    cuts: list[tuple[list[nn.Parameter], int, int]] = []
    members: list[nn.Parameter] = []
    offset = start = 0

    def close() -> None:  # the open bucket ends here, padded to the alignment
        nonlocal members, offset, start
        end = -(-offset // align) * align
        cuts.append((members, start, end))
        members, offset, start = [], end, end

    for p in reversed(params):
        alone = getattr(p, "tied_embedding", False)
        if alone and members:
            close()
        ranges[p] = (offset, offset + p.numel())
        offset += p.numel()
        members.append(p)
        if alone or bucket_size is not None and offset - start >= bucket_size:
            close()
    if members:
        close()
    return ranges, cuts, offset


def build_buffer(
    params: list[nn.Parameter],
    grad_dtype: torch.dtype,
    bucket_size: int | None,
    group: ProcessGroup,
    prefix: str,
) -> GradBuffer:
    """Move `params` (registration order, one dtype) into a new buffer and attach their `main_grad`
    views."""
    ranges, cuts, total = _cut_buckets(params, bucket_size, comm.group_size(group))
    param_data = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
    grad_data = torch.zeros(total, dtype=grad_dtype, device=params[0].device)
    for p, (lo, hi) in ranges.items():
        view = param_data[lo:hi].view_as(p)
        view.copy_(p.detach())
        p.data = view
        p.main_grad = grad_data[lo:hi].view_as(p)
    buffer = GradBuffer(group, prefix, param_data, grad_data, ranges)
    buffer.buckets = [
        Bucket(i, members, lo, hi, grad_data[lo:hi], param_data[lo:hi])
        for i, (members, lo, hi) in enumerate(cuts)
    ]
    return buffer


def bucket_sizes(params: list[nn.Parameter], bucket_size: int | None, align: int) -> list[int]:
    """Padded element count of each bucket `build_buffer` would cut from `params` (works on meta
    tensors too: the configuration check counts buckets without allocating the model)."""
    return [end - start for _members, start, end in _cut_buckets(params, bucket_size, align)[1]]
