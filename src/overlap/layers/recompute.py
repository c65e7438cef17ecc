"""Activation recomputation (checkpointing), Megatron-style.

- selective (`recompute_granularity="selective"`): only the parts named in `recompute_modules` drop
  their activations and recompute them in backward: "core_attn" (the attention product), "mlp" (a
  dense MLP), "moe" (a whole MoE layer, dispatch and combine included), "layernorm" (the input and
  pre-MLP norms), "moe_act" (the routed experts' SwiGLU: neither its intermediate nor its output is
  kept, `discarding_output`), "shared_experts" (the MoE layers' shared expert). "mla_up_proj" and
  the other modules of architectures not built here are refused by the configuration
  (`ModelConfig.validate`).
- full (`recompute_granularity="full"`): whole layers. "uniform" checkpoints consecutive chunks of
  `recompute_num_layers` layers (only each chunk's input is kept); "block" checkpoints each of the
  first `recompute_num_layers` layers and keeps the rest.

Which parts a configuration recomputes is read in one place, `overlap.config.recompute`, shared with
the memory model; this module is how they are recomputed.

Non-reentrant checkpointing is used: it supports outputs that need no gradient (a None aux loss) and
nested use, and it replays the collectives of the recomputed region in backward in the same order on
every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import checkpoint


def maybe_checkpoint(enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, recomputed in backward instead of keeping its inner activations when
    `enabled`."""
    if enabled:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class _Recomputed:
    """What a consumer saved in place of `fn(*inputs)`: the recipe to make it again."""

    __slots__ = ("fn", "inputs")

    def __init__(self, fn: Callable[..., torch.Tensor], inputs: tuple[Any, ...]) -> None:
        self.fn, self.inputs = fn, inputs


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def discarding_output(
    fn: Callable[..., torch.Tensor],
    inputs: tuple[Any, ...],
    consumer: Callable[[torch.Tensor], Any],
) -> Any:
    """`consumer(fn(*inputs))` keeping neither `fn`'s intermediates nor its output for backward,
    only its inputs (Megatron's output-discarding checkpoint, for a cheap elementwise `fn` between
    two GEMMs).

    `fn` runs under a non-reentrant checkpoint (its backward recomputes it from the inputs), and
    where the consumer saves `fn`'s output for its own backward (a GEMM keeps its input for the
    weight gradient) a saved-tensor hook stores the recipe instead, which its backward turns back
    into the tensor. The recomputation repeats the forward's operations, so values and gradients
    are bit-identical to the plain `consumer(fn(*inputs))`."""
    out = checkpoint(fn, *inputs, use_reentrant=False)
    target = weakref.ref(out)  # the saved tensor keeps its hooks, so they must not keep `out` alive

    def pack(t: torch.Tensor) -> Any:
        return _Recomputed(fn, inputs) if t is target() else t

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recomputed):
            with torch.no_grad():
                return saved.fn(*(_detached(x) for x in saved.inputs))
        return saved

    with saved_tensors_hooks(pack, unpack):
        return consumer(out)
