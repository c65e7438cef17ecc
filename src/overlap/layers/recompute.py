"""Activation recomputation (checkpointing), Megatron-style.

- selective (`recompute_granularity="selective"`): only the parts named in `recompute_modules` drop their
  activations and recompute them in backward: "core_attn" (the attention product), "mlp" (a dense MLP), "moe" (a
  whole MoE layer, dispatch and combine included), "layernorm" (the input and pre-MLP norms).
- full (`recompute_granularity="full"`): whole layers. "uniform" checkpoints consecutive chunks of
  `recompute_num_layers` layers (only each chunk's input is kept); "block" checkpoints each of the first
  `recompute_num_layers` layers and keeps the rest.

Non-reentrant checkpointing is used: it supports outputs that need no gradient (a None aux loss) and nested use, and
it replays the collectives of the recomputed region in backward in the same order on every rank.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.checkpoint import checkpoint

from overlap.config.container import RECOMPUTE_MODULES as SELECTIVE_MODULES  # one list, owned by the config
from overlap.errors import ConfigError


def maybe_checkpoint(enabled: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, recomputed in backward instead of keeping its inner activations when `enabled`."""
    if enabled:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def selective_modules(config) -> frozenset[str]:
    """The parts a layer recomputes under selective recompute (empty for any other granularity)."""
    if config.recompute_granularity not in (None, "selective", "full"):
        raise ConfigError("model.recompute_granularity", config.recompute_granularity,
                          "it must be null, 'selective' or 'full'.", "pick one of those.")
    if config.recompute_granularity != "selective":
        return frozenset()
    modules = frozenset(config.recompute_modules or ("core_attn",))
    unknown = sorted(modules - set(SELECTIVE_MODULES))
    if unknown:
        raise ConfigError("model.recompute_modules", config.recompute_modules,
                          f"unknown module(s) {unknown}.", f"use a subset of {list(SELECTIVE_MODULES)}.")
    return modules


def layer_chunks(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """Split layers [0, num_layers) into (start, end, checkpointed) runs for full recompute.

    Without full recompute this is one run that is not checkpointed.
    """
    if config.recompute_granularity != "full":
        return [(0, num_layers, False)]
    n = config.recompute_num_layers
    if not n or n < 1:
        raise ConfigError("model.recompute_num_layers", n, "full recompute needs a positive layer count.",
                          "set model.recompute_num_layers (e.g. 1).")
    if config.recompute_method == "uniform":
        return [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]
    if config.recompute_method == "block":
        return [(i, i + 1, i < n) for i in range(num_layers)]
    raise ConfigError("model.recompute_method", config.recompute_method,
                      "full recompute needs method 'uniform' or 'block'.", "set model.recompute_method.")
