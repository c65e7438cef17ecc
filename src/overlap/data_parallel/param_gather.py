"""All-gather of the updated parameter shards after a distributed-optimizer step, optionally hidden
behind forward.

Each rank updated only its shard of every bucket; a bucket-wise all-gather makes the replicas whole
again. Without `overlap_param_gather` this happens right after the step. With it, only the first
bucket (in forward order) is launched at the step, as soon as the optimizer has updated that
bucket's shards, to fly under the rest of the step; forward pre-hooks of the NEXT step drive the
others (Megatron's scheme): before a module runs, the bucket(s) holding its parameters are waited
for (launched first if needed) and the next bucket in forward order is launched, one bucket of
look-ahead, so the gather of layer k+1's weights runs while layer k computes. Forward order is the
order in which the buckets' parameters were registered (the reverse of the buffer layout).
`finish()` completes everything still pending; call it before anything else reads the parameters
(end of training, checkpointing, evaluation).

Model chunks (a virtual pipeline): the buckets of every chunk are in one forward order, chunk 0's
first. Without `align_param_gather` each chunk's gathers are driven by its own first forward (the
first bucket of chunk 0 launched at the step, the others by the look-ahead as the forwards reach
them); with it (Megatron's `align_param_gather`) the first bucket of *every* chunk is launched at
the step, so every pipeline stage starts its chunks' gathers at the same moment instead of when its
own schedule first reaches each chunk.

`fp8`: shards travel as float8 e4m3 with one scale per bucket (amax / 448, the amax all-reduced MAX
over the group first so every rank dequantises every shard identically); every replica, this rank's
own shard included, is then the dequantised value, so replicas stay bit-identical. The fp32 master
copies in the optimizer are not affected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed import ReduceOp

from overlap.data_parallel.grad_buffer import Bucket, GradBuffer
from overlap.parallel import comm
from overlap.parallel.comm import CommHandle

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class ParamGather:
    """Bucket-wise parameter all-gather in forward order; eager, or deferred to forward
    pre-hooks."""

    def __init__(
        self,
        buffers: list[GradBuffer],
        chunks: Sequence[nn.Module],
        overlap: bool,
        fp8: bool,
        align: bool = False,
    ) -> None:
        model = nn.ModuleList(chunks)
        order = {p: i for i, p in enumerate(model.parameters())}
        pairs = [(buf, b) for buf in buffers if buf.group_size > 1 for b in buf.buckets]
        self.order = sorted(pairs, key=lambda pair: min(order[p] for p in pair[1].params))
        self.overlap, self.fp8 = overlap, fp8
        chunk_of = {p: c for c, chunk in enumerate(chunks) for p in chunk.parameters()}
        firsts: dict[int, int] = {}
        for i, (_, bucket) in enumerate(self.order):
            firsts.setdefault(chunk_of[bucket.params[0]], i)
        # The gathers `start()` launches during the step: chunk 0's first bucket, or every chunk's
        # (align).
        self.launch_at_step = sorted(firsts.values()) if align else [0]
        self.scales: list[torch.Tensor | None] = [None] * len(self.order)
        self.handles: dict[int, CommHandle] = {}  # position in forward order -> its gather
        self.done = len(self.order)
        if overlap:
            position = {p: i for i, (_, b) in enumerate(self.order) for p in b.params}
            for module in model.modules():
                mine = sorted(
                    {position[p] for p in module.parameters(recurse=False) if p in position}
                )
                if mine:
                    module.register_forward_pre_hook(
                        lambda _m, _args, mine=mine: self._before_forward(mine)
                    )

    def start(self) -> None:
        """The optimizer wrote new shards: gather them now, or arm the forward pre-hooks."""
        self.handles, self.done = {}, 0
        if self.fp8:
            self._agree_on_scales()
        if not self.overlap:
            self.finish()
        elif self.order:
            # they fly under the rest of the step (as Megatron dispatches them)
            for i in self.launch_at_step:
                self._launch(i)

    def early_params(self) -> set[nn.Parameter]:
        """The parameters whose shards the optimizer should update first, so that `start()` can
        launch its gathers in the middle of the step (`MixedPrecisionAdam.step(first=...)`): the
        buckets `start()` launches when the gather is overlapped; none with fp8 (the scales need
        every shard) or without overlap (everything is gathered at once)."""
        if not (self.overlap and self.order) or self.fp8:
            return set()
        return {p for i in self.launch_at_step for p in self.order[i][1].params}

    def finish(self) -> None:
        """Complete every pending gather, in order."""
        if self.order:
            self._wait_through(len(self.order) - 1)

    # --- internals --------------------------------------------------------------------------------
    def _before_forward(self, positions: list[int]) -> None:
        if self.done == len(self.order):
            return
        self._wait_through(positions[-1])
        following = next(
            (i for i in range(self.done, len(self.order)) if i not in self.handles), None
        )
        if following is not None:  # one bucket of look-ahead
            self._launch(following)

    def _wait_through(self, last: int) -> None:
        """Launch (if needed) and wait for every bucket up to `last` in forward order."""
        for i in range(self.done, last + 1):
            if i not in self.handles:
                self._launch(i)
        while self.done <= last:
            bucket = self.order[self.done][1]
            gathered = self.handles[self.done].wait()
            scale = self.scales[self.done]
            if scale is not None:  # (without fp8 the gather wrote the bucket in place)
                bucket.param_data.copy_(gathered.view(FP8).float() * scale)
            self.done += 1

    def _launch(self, i: int) -> None:
        """Gather bucket `i`: in place into the bucket's parameters (this rank's shard is a slice of
        them), or with fp8 as float8 bytes into a fresh buffer, dequantised at the wait."""
        buf, bucket = self.order[i]
        shard = self._shard(buf, bucket)
        scale = self.scales[i]
        kind = f"{buf.prefix}_ag"
        if scale is None:
            self.handles[i] = comm.all_gather(shard, buf.group, kind, into=bucket.param_data)
            return
        # gloo has no float8 type: the bytes travel as uint8
        shard = (shard.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        self.handles[i] = comm.all_gather(shard, buf.group, kind)

    def _agree_on_scales(self) -> None:
        """One MAX all-reduce of the per-bucket shard amaxes per group; scale = amax / 448 (1 for an
        all-zero bucket)."""
        by_buffer: dict[int, list[int]] = {}
        for i, (buf, _) in enumerate(self.order):
            by_buffer.setdefault(id(buf), []).append(i)
        for positions in by_buffer.values():
            buf = self.order[positions[0]][0]
            amax = torch.stack(
                [self._shard(buf, self.order[i][1]).abs().max().float() for i in positions]
            )
            comm.all_reduce(amax, buf.group, f"{buf.prefix}_ag", op=ReduceOp.MAX).wait()
            scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            for i, s in zip(positions, scales):
                self.scales[i] = s

    @staticmethod
    def _shard(buf: GradBuffer, bucket: Bucket) -> torch.Tensor:
        lo, hi = buf.local_shard(bucket)
        return buf.param_data[lo:hi]
