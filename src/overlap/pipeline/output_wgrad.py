"""Deferred output-layer weight gradients (`defer_embedding_wgrad_compute`).

On the last virtual stage the output layer's weight-gradient GEMMs go into its own `WeightGradStore`
(`ColumnParallelLinear.wgrad_store`) instead of running in each micro-batch's backward, and all run
at the pipeline flush, after the program, before the trainer's gradient reduction.
`wgrad_deferral_limit` > 0 caps how many micro-batches are deferred (Megatron: the first `limit`
ones; later ones compute in their own backward); -1 or 0: all. Data parallelism sees the output
weight's gradient as complete only with the last deferred GEMM: the flush tells it, GEMM by GEMM,
which one is last, and when a capped micro-batch computes the step's last gradient before the flush,
that backward is not reported as the last one (the chunk's buckets are then reduced by
`finish_grad_sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

from overlap.layers.wgrad_store import WeightGradStore
from overlap.pipeline.schedules import StageRing, Task


class OutputWgradDeferral:
    """One step's deferral of the output layer's weight gradients, and the data-parallel
    announcement of each chunk's last micro-batch that goes with it. `before_backward(chunk,
    is_last)` is data parallelism's hook; `defer`: whether the deferral is on (it acts only on the
    rank holding the last virtual stage); `limit`: `wgrad_deferral_limit`."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        ring: StageRing,
        num_micro: int,
        before_backward: Callable[[int, bool], None],
        defer: bool,
        limit: int | None,
    ) -> None:
        self.num_micro = num_micro
        self.before_backward = before_backward
        self.limit = limit if limit and limit > 0 else None
        self.deferred = 0  # micro-batches whose output-layer weight gradient is queued this step
        # the last-micro-batch flag the last backward's announcement gave data parallelism
        self.announced = False
        self.chunk: int | None = None
        self.store: WeightGradStore | None = None
        last = [c for c in range(ring.vpp) if ring.is_last(c)]
        if defer and last:
            store = getattr(chunks[last[0]].output_layer, "wgrad_store", None)
            if store is None:
                raise RuntimeError(
                    "defer_embedding_wgrad_compute: the output layer has no weight-gradient store; "
                    "build the model with an overlap plan whose defer_embedding_wgrad_compute is on"
                )
            if store.queue:
                raise RuntimeError(
                    f"defer_embedding_wgrad_compute: {len(store.queue)} output-layer weight "
                    "gradients left over from an earlier step"
                )
            self.chunk, self.store = last[0], store

    def before(self, task: Task) -> AbstractContextManager:
        """Before a backward: tells data parallelism whether it is its chunk's last micro-batch (not
        while deferred output-layer GEMMs are still to come); returns the context the backward runs
        in (deferring the output layer's weight gradient, or not)."""
        c, mb = task.chunk, task.microbatch
        last = mb == self.num_micro - 1
        defer = False
        if c == self.chunk:
            defer = self.limit is None or self.deferred < self.limit
            self.deferred += defer
            if last and not defer and self.store.queue:
                # deferred GEMMs are still to come: DP must not take this as the weight's last grad
                last = False
        self.before_backward(c, last)
        self.announced = last
        return self.store.delaying(defer) if c == self.chunk else nullcontext()

    def flush(self) -> None:
        """The pipeline flush of the deferred weight gradients, oldest first. Each one reaches the
        weight through its grad-ready hooks; only the last is reported to data parallelism as the
        chunk's last micro-batch, so (overlap_grad_reduce) the output layer's bucket is launched
        after every one of them."""
        if self.store is None:
            return
        c = self.chunk
        self.store.flush(before_each=lambda left: self.before_backward(c, left == 1))
