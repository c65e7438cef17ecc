"""Which parts of a layer a configuration recomputes: the one reading of `recompute_granularity`,
`recompute_modules`, `recompute_method` and `recompute_num_layers`, shared by the layers that act on
it (`overlap.layers.recompute`) and the memory model that counts it (`overlap.launch.resources`)."""

from __future__ import annotations

# one list, owned by the model's configuration
from overlap.config.model import RECOMPUTE_MODULES as SELECTIVE_MODULES
from overlap.errors import ConfigError


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
