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

