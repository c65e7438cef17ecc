"""A schedulable piece of one micro-batch's model, with autograd cut at its boundary.

`forward(*inputs)` runs the piece on detached copies of its inputs (gradients still flow into those
copies) and keeps the outputs; `backward(*grads)` runs autograd over just this piece and returns the
gradients of its inputs, which the schedule hands to the previous piece whenever it chooses. That is
what lets a schedule run micro-batch i's forward pieces between micro-batch i-1's backward pieces
(Megatron-Core's `ScheduleNode`, `megatron/core/pipeline_parallel/utils.py`, cuts autograd the same
way). Parameter gradients accumulate as usual, so data-parallel gradient hooks fire as the pieces
finish.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from overlap.parallel.trace import RECORDER


def _detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad or x.is_floating_point())
    return x


class ScheduleNode:
    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self.inputs: tuple[Any, ...] = ()
        self.outputs: tuple[Any, ...] = ()

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        """Run on detached inputs; returns the outputs (detached: the next piece owns its own
        graph)."""
        self.inputs = tuple(_detach(x) for x in inputs)
        with RECORDER.span(f"fwd.{self.name}"), torch.enable_grad():
            out = self.fn(*self.inputs)
        self.outputs = out if isinstance(out, tuple) else (out,)
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in self.outputs)

    def backward(self, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Backpropagate `grads` (one per output; None = no gradient) through this piece; returns
        input grads."""
        pairs = [
            (o, g)
            for o, g in zip(self.outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            with RECORDER.span(f"bwd.{self.name}"):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        result = tuple(x.grad if isinstance(x, torch.Tensor) else None for x in self.inputs)
        self.inputs, self.outputs = (
            (),
            (),
        )  # free this piece's activations as soon as its backward is done
        return result
