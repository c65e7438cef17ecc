"""Data-parallel gradient reduction over bucketed buffers, optionally overlapped with backward.

Every parameter gets a post-accumulate-grad hook that adds the fresh `.grad` into `main_grad` (so
micro-batches accumulate in the buffer's dtype) and drops `.grad`. With `overlap_grad_reduce`,
during the backward of the LAST micro-batch only, the hook also marks the parameter ready in its
bucket; a complete bucket's collective is launched at once (asynchronously) and runs while backward
keeps computing earlier layers. Earlier micro-batches communicate nothing: their gradients simply
accumulate. Buckets are launched strictly in bucket order within each buffer, so every rank issues
the same collectives in the same order even if gradients become ready in a different order.

The collective is a reduce-scatter (distributed optimizer: each rank needs only its shard of the
summed gradient) or an all-reduce, both SUMs, over DP x CP (context-parallel ranks saw other tokens
of the same samples): the loss is pre-scaled by 1 / (micro-batches x DP x CP), so the sum is the
reference gradient. Sequence-parallel replicas (norm weights, router) saw only this rank's sequence
shard, so their gradients are first summed over tensor parallel (synchronously, when
their bucket launches). `finish_grad_sync()` launches whatever was not launched (everything, without
overlap) and waits for all of it; the optimizer steps after it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from overlap.config.comm_overlap import OverlapPlan
from overlap.config.training import DDPConfig
from overlap.data_parallel.grad_buffer import Bucket, GradBuffer, build_buffer
from overlap.layers.wgrad_store import register_grad_ready_hook
from overlap.parallel import comm
from overlap.parallel.comm import CommHandle
from overlap.parallel.state import ParallelState


class _BufferSync:
    """Per-buffer launch state of one step: which params are ready per bucket, the next bucket to
    launch, handles."""

    def __init__(self, buffer: GradBuffer) -> None:
        self.buffer = buffer
        self.bucket_of = {p: b for b in buffer.buckets for p in b.params}
        self.reset()

    def reset(self) -> None:
        self.ready: list[set[nn.Parameter]] = [set() for _ in self.buffer.buckets]
        self.handles: list[CommHandle | None] = []

    def launchable(self) -> bool:
        """The next bucket in order has every gradient."""
        i = len(self.handles)
        return i < len(self.buffer.buckets) and len(self.ready[i]) == len(
            self.buffer.buckets[i].params
        )


def buffer_members(params: list[nn.Parameter]) -> list[tuple[str, list[nn.Parameter]]]:
    """The parameters of each gradient buffer, in registration order: one buffer per (reduction
    group, dtype), dense weights over data parallel ("dp") first, routed experts over expert-data
    parallel ("edp")."""
    out = []
    for expert, prefix in ((False, "dp"), (True, "edp")):
        members = [p for p in params if getattr(p, "is_expert", False) == expert]
        for dtype in dict.fromkeys(p.dtype for p in members):
            out.append((prefix, [p for p in members if p.dtype == dtype]))
    return out


class DistributedDataParallel:
    """Owns the gradient buffers and their reduction; the trainer marks the last micro-batch and
    finishes the sync. `grad_reduce_in_fp32` is the run's precision's (`cfg.resolved.precision`):
    the buffers hold and reduce fp32 gradients, else the parameters' dtype."""

    def __init__(
        self,
        model: nn.Module,
        cfg: DDPConfig,
        plan: OverlapPlan,
        grad_reduce_in_fp32: bool,
        ps: ParallelState,
    ) -> None:
        self.ps = ps
        self.overlap = plan.overlap_grad_reduce
        self.scatter = plan.use_distributed_optimizer
        self.reduce_sp_over_tp = ps.layout.sequence_parallel
        params = [p for p in model.parameters() if p.requires_grad]
        # dense gradients over DP x CP (Megatron's data-parallel group with CP: the CP ranks saw
        # other tokens of the same samples), experts over expert-DP (which counts CP already)
        groups = {"dp": ps.dp_cp_group, "edp": ps.edp_group}
        self.buffers: list[GradBuffer] = [
            build_buffer(
                same,
                torch.float32 if grad_reduce_in_fp32 else same[0].dtype,
                plan.bucket_size,
                groups[prefix],
                prefix,
            )
            for prefix, same in buffer_members(params)
        ]
        self._syncs = [_BufferSync(b) for b in self.buffers]
        self._sync_of = {p: s for s in self._syncs for p in s.bucket_of}
        self._last_micro_batch = True
        for p in params:
            register_grad_ready_hook(p, self._weak_hook())  # also fired by delayed wgrad GEMMs

    def _weak_hook(self) -> Callable[[nn.Parameter], None]:
        """The grad-ready hook through a weak reference: a parameter hook holding this object would
        keep it, the parallel state and its process groups alive for good (the garbage collector
        does not see through post-accumulate-grad hooks), and gloo's worker threads live as long as
        their group does - past interpreter shutdown, where freeing a finished op aborts the process
        (see `teardown.shutdown`)."""
        ref = weakref.WeakMethod(self._on_grad_ready)

        def hook(param: nn.Parameter) -> None:
            method = ref()
            if method is not None:
                method(param)

        return hook

    def zero_grad(self) -> None:
        """Start a step: zero the gradient buffers and forget last step's readiness and handles."""
        for s in self._syncs:
            s.buffer.grad_data.zero_()
            s.reset()

    def set_last_micro_batch(self, is_last: bool) -> None:
        """Tell the hooks whether the coming backward is the step's last (the only one that
        communicates)."""
        self._last_micro_batch = is_last

    def reduced_grad(self, param: nn.Parameter) -> torch.Tensor:
        """What of `param`'s gradient this rank holds reduced after `finish_grad_sync`: all of
        `main_grad`, or with the distributed optimizer the part of its shard of the bucket (a flat
        view of the buffer, maybe empty)."""
        if not self.scatter:
            return param.main_grad
        s = self._sync_of[param]
        lo, hi = s.buffer.local_shard(s.bucket_of[param])
        p_lo, p_hi = s.buffer.ranges[param]
        first = max(lo, p_lo)
        return s.buffer.grad_data[first : max(first, min(hi, p_hi))]

    def finish_grad_sync(self) -> None:
        """Launch every bucket not yet launched, in order, then wait for all; reduced grads are then
        in main_grad (with the distributed optimizer: in this rank's shard of every bucket)."""
        for s in self._syncs:
            while len(s.handles) < len(s.buffer.buckets):
                self._launch(s)
        for s in self._syncs:
            for handle in s.handles:
                if handle is not None:
                    handle.wait()  # reduced in place (this rank's shard of the bucket)

    # --- hooks and launches -----------------------------------------------------------------------
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:
            # Autograd still runs the hook when a delayed weight-gradient GEMM took this parameter's
            # gradient (delay_wgrad_compute); the real gradient arrives later through
            # deliver_weight_grad.
            return
        param.main_grad.add_(param.grad)
        param.grad = None
        if not (self.overlap and self._last_micro_batch):
            return
        s = self._sync_of[param]
        # a set: a param counts once however often it fires
        s.ready[s.bucket_of[param].index].add(param)
        while s.launchable():
            self._launch(s)

    def _launch(self, s: _BufferSync) -> None:
        bucket = s.buffer.buckets[len(s.handles)]
        if self.reduce_sp_over_tp:
            self._reduce_sequence_parallel(bucket)
        if s.buffer.group_size == 1:
            s.handles.append(None)
        elif self.scatter:
            lo, hi = s.buffer.local_shard(bucket)
            s.handles.append(
                comm.reduce_scatter(
                    bucket.grad_data,
                    s.buffer.group,
                    f"{s.buffer.prefix}_rs",
                    into=s.buffer.grad_data[lo:hi],
                )
            )
        else:
            s.handles.append(
                comm.all_reduce(bucket.grad_data, s.buffer.group, f"{s.buffer.prefix}_ar")
            )

    def _reduce_sequence_parallel(self, bucket: Bucket) -> None:
        """Sum the gradients of this bucket's sequence-parallel replicas over TP (before the DP
        collective)."""
        members = [p for p in bucket.params if getattr(p, "sequence_parallel", False)]
        if not members:
            return
        flat = torch.cat([p.main_grad.reshape(-1) for p in members])
        comm.all_reduce(flat, self.ps.tp_group, "tp_ar_sp").wait()
        offset = 0
        for p in members:
            p.main_grad.copy_(flat[offset : offset + p.numel()].view_as(p.main_grad))
            offset += p.numel()
