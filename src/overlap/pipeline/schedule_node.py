"""A schedulable piece of one micro-batch's model, with autograd cut at its boundary.

`forward(*inputs)` runs the piece on its inputs cut from their producers' graphs (gradients still
flow into them) and keeps the graph's roots; `backward(*grads)` runs autograd over just this piece
and returns the gradients of its inputs, which the schedule hands to the previous piece whenever it
chooses. That is what lets a schedule run micro-batch i's forward pieces between micro-batch i-1's
backward pieces (Megatron-Core's `ScheduleNode`, `megatron/core/pipeline_parallel/utils.py`, cuts
autograd the same way). Parameter gradients accumulate as usual, so data-parallel gradient hooks
fire as the pieces finish.

A cut costs no memory: a piece keeps exactly what its own operations save for backward, as the
uncut model would. Its inputs enter through `_Entry` (an alias whose gradient goes to a slot), not
as detached leaves, which autograd's gradient accumulator would keep alive until backward - the
received rows of an all-to-all, which the experts' piece copies into expert order at once, would
otherwise stay alive for the whole step, a hidden-wide row per routed token per layer. Its outputs,
once the next piece holds them, give back their storage unless the piece's own operations saved
them (`release_roots`): only their place as the roots of the graph is needed, and backward enters
the engine directly from them (`backward_from_released`, as a released pipeline output does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from overlap.parallel.trace import recorder
from overlap.pipeline.output_memory import backward_from_released


class _Slot:
    """Where an entry's gradient lands."""

    __slots__ = ("grad",)

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _Entry(torch.autograd.Function):
    """`x` as it is (an alias, no copy) starting a piece's graph; backward hands its gradient to
    `slot`. `anchor` is an empty 0-dim tensor that requires grad (never read, no kernel to make
    it), so the alias does even though `x` (detached) does not."""

    @staticmethod
    def forward(ctx, slot: _Slot, anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.slot = slot
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.slot.grad = grad
        return None, None, None


def _enter(x: Any) -> tuple[Any, _Slot | None]:
    """The piece's view of input `x` and the slot its gradient will land in (None: no gradient)."""
    if not isinstance(x, torch.Tensor):
        return x, None
    if not (x.requires_grad or x.is_floating_point()):
        return x.detach(), None
    slot = _Slot()
    anchor = torch.empty((), device=x.device, requires_grad=True)
    return _Entry.apply(slot, anchor, x.detach()), slot


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def release_roots(outputs: tuple[Any, ...], saved: set[int]) -> None:
    """Give back the storage of each output whose data only its consumers need: a graph root keeps
    its place in the graph (`backward_from_released` starts from it), the consumer its own alias.
    Left alone: an output whose storage the piece's own operations saved (`saved`: storage keys; an
    output that is also a later operation's input, the attention block's result before the MLP's
    norm), and a view (freeing it would free nothing)."""
    for o in outputs:
        if (
            isinstance(o, torch.Tensor)
            and o.grad_fn is not None
            and o._base is None
            and _storage_key(o) not in saved
        ):
            o.data = torch.empty((1,), dtype=o.dtype, device=o.device)


class ScheduleNode:
    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self.slots: tuple[_Slot | None, ...] = ()
        self.outputs: tuple[Any, ...] = ()

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        """Run on the cut inputs; returns the outputs (detached: the next piece owns its own
        graph)."""
        entered = [_enter(x) for x in inputs]
        self.slots = tuple(slot for _x, slot in entered)
        saved: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(_storage_key(t))
            return t

        with (
            recorder().span(f"fwd.{self.name}"),
            torch.enable_grad(),
            saved_tensors_hooks(pack, lambda t: t),
        ):
            out = self.fn(*(x for x, _slot in entered))
        self.outputs = out if isinstance(out, tuple) else (out,)
        detached = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in self.outputs)
        release_roots(self.outputs, saved)
        return detached

    def backward(self, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """Backpropagate `grads` (one per output; None = no gradient) through this piece; returns
        input grads."""
        pairs = [
            (o, g)
            for o, g in zip(self.outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            with recorder().span(f"bwd.{self.name}"):
                backward_from_released([o for o, _ in pairs], [g for _, g in pairs])
        result = tuple(None if slot is None else slot.grad for slot in self.slots)
        # this piece's activations go as soon as its backward is done
        self.slots, self.outputs = (), ()
        return result
