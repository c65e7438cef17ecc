"""Elementwise chains that save only what their backward needs, run eager or compiled.

A `Chain` is a pair of pure functions of tensors and Python scalars: `forward(*args) -> (output,
*extras)` and `backward(grad, *saved) -> one gradient per argument` (None where there is none),
with the arguments it keeps for backward named (`saves`). `chain(fusion, *args)` runs it as one
autograd node whose saved set is exactly those arguments plus the extras, so what an activation
costs is decided here, in the open, and is the same eager, compiled (the fusion switches,
`overlap.kernels.fusion`) or on a dry run's fake tensors: RMSNorm keeps its input and the fp32
reciprocal RMS, RoPE nothing but its tables, SwiGLU its two inputs (Transformer Engine's and
Megatron-Core's fused kernels keep the same). Left to autograd, the same expressions would keep
their fp32 intermediates: twice the bytes of the bf16 tensors they come from.

Compiled, each function is `torch.compile(fn, fullgraph=True)`: one fused kernel forward and one
backward, no graph break (a break is an error). Only the row dimension is symbolic: the argument
tensors whose first dimension is the first argument's are marked dynamic there, so token counts
(the MoE rows per expert change every step) share one graph, while hidden and head sizes stay
constants the kernel is specialised for. Fewer than `MIN_COMPILED_ROWS` rows run eager (dynamo
specialises sizes 0 and 1 into graphs of their own, and there is nothing to fuse). Every other
shape or dtype is a variant that compiles once; a function keeps at most torch's recompile limit of
variants, and a shape past it runs eager with a warning (`fullgraph` would otherwise turn the next
recompile into an error mid-run).

Whether a chain compiles is decided once, for the run's device (`Kernels`' fusion fields,
`overlap.kernels.fusion`); a layer passes that decision as `fusion`. Stand-in tensors ("meta")
and calls under a `TorchDispatchMode` (the host-sync recorder, the dry run's fake tensors) run the
eager functions whatever it says: dynamo does not trace under such a mode, and the eager ops are
exactly what the mode is there to see (the compiled graph is made of them); the saved set is the
same either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

log = logging.getLogger("overlap")

BACKEND = "inductor"
MIN_COMPILED_ROWS = 2

_compiled: dict[tuple[Callable, str], Callable] = {}
_variants: dict[Callable, set[tuple]] = {}


def fp32_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` in fp32, always a new tensor: for the chains' math to work in place on (`t.float()` of an
    fp32 tensor is the tensor itself, an input or a gradient that is not the chain's to change)."""
    return t.to(torch.float32, copy=True)


def fp32_product(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`t` in fp32 times `other`, a new tensor made in one allocation: a low-precision `t` is
    converted and multiplied in place, an fp32 one multiplied out of place (no copy to
    overwrite)."""
    if t.dtype == torch.float32:
        return t * other
    return t.float().mul_(other)


def compiled(fn: Callable, backend: str = BACKEND) -> Callable:
    """`fn` compiled whole (fullgraph), made on first use and kept; the row dimension is marked
    dynamic per call (`run`)."""
    key = (fn, backend)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    return _compiled[key]


def compiling(fusion: bool, x: torch.Tensor) -> bool:
    """Whether a chain whose fusion is on (`fusion`, the run's decision) runs compiled on `x`:
    not on a stand-in tensor ("meta": nothing compiles for it) or under a dispatch mode (module
    docstring)."""
    return fusion and x.device.type != "meta" and not is_in_torch_dispatch_mode()


def _variant_limit() -> int:
    config = torch._dynamo.config
    return int(getattr(config, "recompile_limit", None) or getattr(config, "cache_size_limit", 8))


def _admit(fn: Callable, args: Sequence[Any], rows: int) -> bool:
    """Mark the row dimension dynamic and say whether this call's variant may compile (module
    docstring)."""
    variant = tuple(
        (a.dtype, a.device.type, tuple(a.shape[1:]), a.shape[0] == rows)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    )
    seen = _variants.setdefault(fn, set())
    if variant not in seen:
        if len(seen) >= _variant_limit():
            log.warning(
                "fusion: %s has compiled %d shape variants (torch's recompile limit); %s runs "
                "eager",
                fn.__qualname__,
                len(seen),
                variant,
            )
            return False
        seen.add(variant)
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == rows:
            torch._dynamo.maybe_mark_dynamic(a, 0)
    return True


def run(fn: Callable, fusion: bool, x: torch.Tensor, *args: Any) -> Any:
    """`fn(x, *args)`, compiled when the fusion is on for `x` (`compiling`) and the call has rows
    enough to fuse; `x`'s first dimension is the row dimension."""
    call = (x, *args)
    rows = x.shape[0] if x.dim() else 0
    if compiling(fusion, x) and x.numel() and rows >= MIN_COMPILED_ROWS and _admit(fn, call, rows):
        return compiled(fn)(*call)
    return fn(*call)


@dataclass(frozen=True)
class Chain:
    """An elementwise chain with its saved set stated (module docstring).

    `forward(*args)` returns (output, *extras); `backward(grad, *saved)` gets the arguments at
    positions `saves` (in that order; an optional tensor there may be None), then the extras, then
    the other positions' non-tensor arguments (Python scalars, in order), and returns one gradient
    per argument. `name` is what the chain is called in tables and tests.
    """

    name: str
    forward: Callable[..., tuple[torch.Tensor, ...]]
    backward: Callable[..., tuple[torch.Tensor | None, ...]]
    saves: tuple[int, ...]

    def __call__(self, fusion: bool, *args: Any) -> torch.Tensor:
        """Run the chain as one autograd node, compiled where `fusion` (the run's decision for its
        switch) is on."""
        return _ChainFunction.apply(self, fusion, *args)


class _ChainFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chain: Chain, fusion: bool, *args: Any) -> torch.Tensor:
        out, *extras = run(chain.forward, fusion, *args)
        ctx.chain, ctx.fusion = chain, fusion
        ctx.constants = tuple(
            a
            for i, a in enumerate(args)
            if i not in chain.saves and not isinstance(a, torch.Tensor)
        )
        ctx.save_for_backward(*(args[i] for i in chain.saves), *extras)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads = run(
            ctx.chain.backward,
            ctx.fusion,
            grad.contiguous(),
            *ctx.saved_tensors,
            *ctx.constants,
        )
        needed = ctx.needs_input_grad[2:]
        return (None, None, *(g if need else None for g, need in zip(grads, needed)))
