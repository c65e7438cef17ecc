"""The store of deferred weight-gradient GEMMs: delayed weight-gradient computation
(`delay_wgrad_compute`) for the linear layers and routed experts of
`overlap.layers.linear_functions` (`Linear`: attention, MLP and shared-expert GEMMs;
`GroupedLinear`: the routed experts), and the grad-ready hooks a delayed gradient fires.

A run's store belongs to its model: `GPTModel` holds one (`wgrad_store`; the chunks of one rank
share theirs, `model_chunks`) and hands it to each layer it builds, the pipeline executor reads it
from the chunks it runs. No store is process-wide, so two models alive in one process (the tests'
worlds, a dry run beside a run) never see each other's queued GEMMs. A layer built without a store
computes its weight gradients in backward.

In backward, a layer with a store computes the input gradient at once (the previous layer waits for
it) and, while its store's `delaying(True)` is active, queues the weight-gradient GEMM (its inputs
and output grad are captured by a closure) in a FIFO instead of running it. The schedule
drains the queue with `wait_filling(handle)`: while a collective it has to wait for is still in
flight, the queued GEMMs run one by one, so a wait for a slower peer or a slow link becomes
weight-gradient work instead of idle time (what the reference systems get from a CUDA stream of
their own that runs the expert wgrad GEMMs beside the communication); on a GPU, where the host
cannot see a collective complete, every queued GEMM is issued before the wait and the device runs
them beside it. `end_phase()` lets what is left of one schedule phase fill the next phase's waits
(and runs what the phase before left), `flush()` runs everything where the schedule needs every
gradient delivered. A delayed gradient reaches its parameter through `deliver_weight_grad`, which
also fires the parameter's grad-ready hooks, so data-parallel reduction sees it after the delayed
GEMM, not before.

A second instance defers the output layer's weight gradients to the pipeline flush
(`defer_embedding_wgrad_compute`): a `Linear` takes the store it queues into at forward time
(`linear(..., store=)`; the output layer's own store instead of its model's), so the pipeline
executor can switch deferral on for the output layer alone and drain it with
`flush(before_each=...)`, which lets it decide, GEMM by GEMM, when data parallelism may treat the
weight's gradient as complete.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from overlap.parallel import comm
from overlap.parallel.trace import CommEvent, now, recorder


class InFlight(Protocol):
    """A collective in flight (`comm.CommHandle`, `comm.ManyHandle`)."""

    event: CommEvent

    def wait(self) -> Any: ...


def arrived(handle: InFlight) -> bool:
    """The collective's data is complete: its completion was observed and (modelled link) its time
    has come. Read from the handle's event, whose `t_done` comm.py sets from the work's future - on
    a host timeline only (`comm.completion_visible`); on a device timeline the host never knows, and
    this is False."""
    done = handle.event.t_done
    return comm.completion_visible() and isinstance(done, float) and now() >= done


def register_grad_ready_hook(param: nn.Parameter, hook: Callable[[nn.Parameter], None]) -> None:
    """Register `hook` to run after a gradient has been accumulated into `param.grad` - by autograd,
    or by a delayed weight-gradient GEMM (which autograd does not see)."""
    param.register_post_accumulate_grad_hook(hook)
    if not hasattr(param, "grad_ready_hooks"):
        param.grad_ready_hooks = []
    param.grad_ready_hooks.append(hook)


def deliver_weight_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Accumulate `grad` into `param.grad` as autograd would, then fire the grad-ready hooks."""
    param.grad = grad if param.grad is None else param.grad + grad
    for hook in getattr(param, "grad_ready_hooks", ()):
        hook(param)


def take_weight_grad(
    store: WeightGradStore | None,
    weight: nn.Parameter,
    weight_grad: Callable[[], torch.Tensor],
) -> torch.Tensor | None:
    """A backward's weight gradient through `store.take` (returned now, or queued while that store
    delays: None); computed now where the layer has no store."""
    return weight_grad() if store is None else store.take(weight, weight_grad)


class WeightGradStore:
    """One model's queue of deferred weight-gradient GEMMs and its delaying switch (module notes);
    `span` names each GEMM on the timeline when it runs."""

    def __init__(self, span: str = "bwd.delayed_wgrad") -> None:
        self.queue: deque[Callable[[], None]] = deque()
        self.active = False
        self.span = span  # the timeline name of each queued GEMM when it runs
        # how many of the oldest queued items a previous phase left (see end_phase)
        self._carried = 0

    @contextmanager
    def delaying(self, on: bool) -> Iterator[None]:
        previous, self.active = self.active, on
        try:
            yield
        finally:
            self.active = previous

    def put(self, fn: Callable[[], None]) -> None:
        self.queue.append(fn)

    def take(
        self, weight: nn.Parameter, weight_grad: Callable[[], torch.Tensor]
    ) -> torch.Tensor | None:
        """A backward's weight gradient: computed now and returned (autograd accumulates it), or,
        while delaying, queued - it reaches `weight` later through `deliver_weight_grad` - and None
        returned."""
        if self.active:
            self.put(lambda: deliver_weight_grad(weight, weight_grad()))
            return None
        return weight_grad()

    def flush(self, before_each: Callable[[int], None] | None = None) -> None:
        """Run every queued weight-gradient GEMM, oldest first. `before_each(left)`, if given, is
        called before each one with the number of GEMMs left, this one included (1: the last)."""
        while self.queue:
            if before_each is not None:
                before_each(len(self.queue))
            self._run_oldest()

    def drain(self, count: int) -> None:
        """Run the `count` oldest queued weight-gradient GEMMs (what one backward queued, which its
        caller counted), leaving any queued after them."""
        for _ in range(min(count, len(self.queue))):
            self._run_oldest()

    def end_phase(self) -> None:
        """End of a schedule phase: run what the previous phase left, keep this phase's leftovers
        for the next phase's waits. A rank that was behind its peers all phase then does not pay its
        whole backlog at the boundary, where the peers would wait for it; memory stays bounded to
        two phases' worth of queued GEMMs."""
        while self._carried:
            self._run_oldest()
        self._carried = len(self.queue)

    def wait_filling(self, handle: InFlight) -> Any:
        """Wait for `handle`, running queued weight-gradient GEMMs (oldest first, one at a time) for
        as long as it is in flight; returns what `handle.wait()` returns. With an empty queue this
        is a plain wait.

        Where the host sees completion (gloo) it runs them while the collective is not complete. On
        a device timeline (NCCL: a collective completes on the GPU while the host enqueues ahead,
        and `wait()` only orders the stream) every queued GEMM is issued before the wait, so the GPU
        computes them beside the collective, as the reference's weight-gradient stream does; what
        runs where is then fixed by the program, the same on every rank."""
        if not comm.completion_visible():
            while self.queue:
                self._run_oldest()
        while self.queue and not arrived(handle):
            self._run_oldest()
        return handle.wait()

    def _run_oldest(self) -> None:
        self._carried = max(self._carried - 1, 0)
        with recorder().span(self.span), torch.no_grad():
            self.queue.popleft()()
