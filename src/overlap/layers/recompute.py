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

# one list, owned by the config
from overlap.config.model import RECOMPUTE_MODULES as SELECTIVE_MODULES
from overlap.errors import ConfigError


def maybe_checkpoint(enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, recomputed in backward instead of keeping its inner activations when
    `enabled`."""
    if enabled:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


class _Recomputed:
    """What a consumer saved in place of `fn(x)`: the recipe to make it again."""

    __slots__ = ("fn", "x")

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
        self.fn, self.x = fn, x


def discarding_output(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    consumer: Callable[[torch.Tensor], Any],
) -> Any:
    """`consumer(fn(x))` keeping neither `fn`'s intermediates nor its output for backward, only `x`
    (Megatron's output-discarding checkpoint, for a cheap elementwise `fn` between two GEMMs).

    `fn` runs under a non-reentrant checkpoint (its backward recomputes it from `x`), and where the
    consumer saves `fn(x)` for its own backward (a GEMM keeps its input for the weight gradient) a
    saved-tensor hook stores the recipe instead, which its backward turns back into the tensor. The
    recomputation repeats the forward's operations, so values and gradients are bit-identical to
    the plain `consumer(fn(x))`."""
    out = checkpoint(fn, x, use_reentrant=False)
    target = weakref.ref(out)  # the saved tensor keeps its hooks, so they must not keep `out` alive

    def pack(t: torch.Tensor) -> Any:
        return _Recomputed(fn, x) if t is target() else t

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recomputed):
            with torch.no_grad():
                return saved.fn(saved.x.detach())
        return saved

    with saved_tensors_hooks(pack, unpack):
        return consumer(out)


def selective_modules(config) -> frozenset[str]:
    """The parts a layer recomputes under selective recompute (empty for any other granularity)."""
    if config.recompute_granularity not in (None, "selective", "full"):
        raise ConfigError(
            "model.recompute_granularity",
            config.recompute_granularity,
            "it must be null, 'selective' or 'full'.",
            "pick one of those.",
        )
    if config.recompute_granularity != "selective":
        return frozenset()
    modules = frozenset(config.recompute_modules or ("core_attn",))
    unknown = sorted(modules - set(SELECTIVE_MODULES))
    if unknown:
        raise ConfigError(
            "model.recompute_modules",
            config.recompute_modules,
            f"unknown module(s) {unknown}.",
            f"use a subset of {list(SELECTIVE_MODULES)}.",
        )
    return modules


def layer_chunks(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """Split layers [0, num_layers) into (start, end, checkpointed) runs for full recompute.

    Without full recompute this is one run that is not checkpointed.
    """
    if config.recompute_granularity != "full":
        return [(0, num_layers, False)]
    n = config.recompute_num_layers
    if not n or n < 1:
        raise ConfigError(
            "model.recompute_num_layers",
            n,
            "full recompute needs a positive layer count.",
            "set model.recompute_num_layers (e.g. 1).",
        )
    if config.recompute_method == "uniform":
        return [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]
    if config.recompute_method == "block":
        return [(i, i + 1, i < n) for i in range(num_layers)]
    raise ConfigError(
        "model.recompute_method",
        config.recompute_method,
        "full recompute needs method 'uniform' or 'block'.",
        "set model.recompute_method.",
    )
