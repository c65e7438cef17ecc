"""Which parts of a layer a configuration recomputes: the one reading of `recompute_granularity`,
`recompute_modules`, `recompute_method` and `recompute_num_layers`, shared by the layers that act on
it (`overlap.layers.recompute`) and the memory model that counts it (`overlap.launch.resources`).
The values are the finalized configuration's: their rules are `ModelConfig.validate`'s alone."""

from __future__ import annotations


def selective_modules(config) -> frozenset[str]:
    """The parts a layer recomputes under selective recompute (empty for any other granularity)."""
    if config.recompute_granularity != "selective":
        return frozenset()
    return frozenset(config.recompute_modules or ("core_attn",))


def layer_chunks(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """Split layers [0, num_layers) into (start, end, checkpointed) runs for full recompute:
    `recompute_num_layers` layers a chunk (uniform), or the first that many layers each alone
    (block). Without full recompute this is one run that is not checkpointed."""
    if config.recompute_granularity != "full":
        return [(0, num_layers, False)]
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + n, num_layers), True) for start in range(0, num_layers, n)]
    return [(i, i + 1, i < n) for i in range(num_layers)]
