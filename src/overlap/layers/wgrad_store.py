"""Delayed weight-gradient computation (`delay_wgrad_compute`) for the linear layers (`Linear`: attention, MLP and
shared-expert GEMMs) and the routed experts (`GroupedLinear`).

In backward, a layer that supports it computes the input gradient at once (the previous layer waits for it) and, while
`WGRAD_STORE.delaying(True)` is active, queues the weight-gradient GEMM (its inputs and output grad are captured by
a closure) in a FIFO instead of running it. The schedule runs the queue with `flush()` exactly where a slot under an
all-to-all needs filling. A delayed gradient reaches its parameter through `deliver_weight_grad`, which also fires
the parameter's grad-ready hooks, so data-parallel reduction sees it after the delayed GEMM, not before.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from overlap.parallel.trace import RECORDER


def register_grad_ready_hook(param: nn.Parameter, hook: Callable[[nn.Parameter], None]) -> None:
    """Register `hook` to run after a gradient has been accumulated into `param.grad` - by autograd, or by a
    delayed weight-gradient GEMM (which autograd does not see)."""
    param.register_post_accumulate_grad_hook(hook)
    if not hasattr(param, "grad_ready_hooks"):
        param.grad_ready_hooks = []
    param.grad_ready_hooks.append(hook)


def deliver_weight_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Accumulate `grad` into `param.grad` as autograd would, then fire the grad-ready hooks."""
    param.grad = grad if param.grad is None else param.grad + grad
    for hook in getattr(param, "grad_ready_hooks", ()):
        hook(param)


class WeightGradStore:
    def __init__(self) -> None:
        self.queue: deque[Callable[[], None]] = deque()
        self.active = False

    @contextmanager
    def delaying(self, on: bool) -> Iterator[None]:
        previous, self.active = self.active, on
        try:
            yield
        finally:
            self.active = previous

    def put(self, fn: Callable[[], None]) -> None:
        self.queue.append(fn)

    def flush(self) -> None:
        """Run every queued weight-gradient GEMM, oldest first."""
        if not self.queue:
            return
        with RECORDER.span("bwd.delayed_wgrad"), torch.no_grad():
            while self.queue:
                self.queue.popleft()()


WGRAD_STORE = WeightGradStore()


class GroupedLinear(torch.autograd.Function):
    """rows [R, in] grouped by expert (`counts`) x stacked weight [E, out, in] -> [R, out]; the weight gradient can
    be delayed through WGRAD_STORE."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, weight: nn.Parameter, counts: list[int]) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.weight, ctx.counts = weight, counts
        chunks = rows.split(counts)
        return torch.cat([torch.nn.functional.linear(x, weight[e]) for e, x in enumerate(chunks)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rows,) = ctx.saved_tensors
        weight, counts = ctx.weight, ctx.counts
        grads, chunks = grad.split(counts), rows.split(counts)
        grad_rows = torch.cat([g @ weight[e] for e, g in enumerate(grads)])

        def weight_grad() -> torch.Tensor:
            return torch.stack([g.t() @ x for g, x in zip(grads, chunks)])

        if WGRAD_STORE.active:
            WGRAD_STORE.put(lambda: deliver_weight_grad(weight, weight_grad()))
            return grad_rows, None, None
        return grad_rows, weight_grad(), None


class Linear(torch.autograd.Function):
    """y = x W^T + b with W = `weight` viewed as [-1, in] (fused weights keep their own shape); the weight gradient can
    be delayed through WGRAD_STORE, the input and bias gradients never are."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.has_bias = weight, bias is not None
        return torch.nn.functional.linear(x, weight.reshape(-1, weight.shape[-1]), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        grad_x = grad @ weight.reshape(-1, weight.shape[-1])
        grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias else None

        def weight_grad() -> torch.Tensor:
            return (grad_2d.t() @ x_2d).reshape(weight.shape)

        if WGRAD_STORE.active:
            WGRAD_STORE.put(lambda: deliver_weight_grad(weight, weight_grad()))
            return grad_x, None, grad_bias
        return grad_x, weight_grad(), grad_bias


def linear(x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None = None) -> torch.Tensor:
    return Linear.apply(x, weight, bias)
