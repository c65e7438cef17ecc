"""The parallel layout as configuration: the sizes of every dimension, checked for consistency.

It lives with the configuration because `finalize` resolves it; `overlap.parallel.state` builds the process groups of
a layout (and re-exports it for its users).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.errors import ConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension; `world_size = tp * cp * dp * pp`, and `ep * etp` divides `tp * cp * dp`."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        block = self.tp * self.pp * self.cp
        if self.world_size % block:
            raise ConfigError(
                "world size", self.world_size,
                f"it must be a multiple of tensor x pipeline x context parallel = {self.tp}x{self.pp}x{self.cp} = {block}.",
                "change -ng/--num_gpus or the -tp/-pp/-cp sizes so that they divide the world size.",
            )
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise ConfigError(
                "model.expert_model_parallel_size", self.ep,
                f"expert parallel x expert tensor parallel ({self.ep}x{self.etp}) must divide "
                f"tensor x context x data parallel ({self.tp}x{self.cp}x{self.dp}); experts are carved out of that block.",
                "choose -ep so that it divides the number of ranks per pipeline stage.",
            )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert's weights inside one pipeline stage."""
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)


def pipeline_layer_ranges(num_layers: int, pp: int, vpp: int | None = None, first: int | None = None,
                          last: int | None = None) -> list[list[tuple[int, int]]]:
    """[pp_rank][chunk] -> (start, end) of the layers that model chunk holds, as Megatron-Core assigns them.

    The model is cut into PP x VPP virtual stages in layer order; virtual stage v = chunk x PP + pp_rank, so rank r
    holds virtual stages r, r + PP, r + 2 PP, ... Each pipeline stage gets num_layers / PP layers (or `first` /
    `last` for the first / last stage and an even split of the rest for the middle ones), divided evenly over its
    VPP chunks. An indivisible split is a ConfigError naming the fields.
    """
    vpp = vpp or 1
    if (first is not None or last is not None) and pp == 1:
        raise ConfigError("model.num_layers_in_first_pipeline_stage", first if first is not None else last,
                          "uneven first/last pipeline stages need pipeline parallelism.", "use -pp 2 or more, or "
                          "drop num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage.")
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise ConfigError(f"model.num_layers_in_{name}_pipeline_stage", value, "a stage holds at least one layer.",
                              "use 1 or more, or null for an even split.")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0) or (middle_stages and (
            middle_layers < middle_stages or middle_layers % middle_stages)):
        raise ConfigError("model.num_layers", num_layers,
                          f"{middle_layers} layers do not split evenly over the {middle_stages} pipeline stage(s) "
                          f"left after num_layers_in_first_pipeline_stage={first} and "
                          f"num_layers_in_last_pipeline_stage={last} (PP={pp}).",
                          "choose -pp, num_layers and the first/last stage sizes so that the rest divides evenly.")
    per_stage = [middle_layers // middle_stages if middle_stages else 0] * pp
    if first is not None:
        per_stage[0] = first
    if last is not None:
        per_stage[-1] = last
    for rank, count in enumerate(per_stage):
        if count % vpp or count == 0:
            raise ConfigError("model.virtual_pipeline_model_parallel_size", vpp,
                              f"pipeline stage {rank} has {count} layers, which do not split into {vpp} equal "
                              "virtual-pipeline chunks of at least one layer.",
                              "choose -pp/-vp (and the first/last stage sizes) so that every stage's layer count "
                              "is a multiple of VPP.")
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    start = 0
    for chunk in range(vpp):
        for rank in range(pp):
            size = per_stage[rank] // vpp
            ranges[rank].append((start, start + size))
            start += size
    return ranges
