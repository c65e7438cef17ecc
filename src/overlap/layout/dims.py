"""The parallel layout: the sizes of every dimension, checked for consistency.

`ConfigContainer.finalize` builds it once from the model's fields (`cfg.resolved.layout`);
`overlap.parallel.state` builds the process groups of a layout, and the runtime reads its sizes
from it rather than from the model section.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from overlap.errors import Rule, check_rules

# why sequence parallelism cannot run at TP 1, and the fix: finalize's decision when it turns a
# typed model.sequence_parallel off, and the layout's rule for one built by hand
SP_WITHOUT_TP_WHY = "TP=1: there is no tensor-parallel group to shard the sequence over"
SP_WITHOUT_TP_FIX = "use -tp 2 or more, or drop sequence_parallel."


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of every parallel dimension; `world_size = tp * cp * dp * pp`, and `ep * etp` divides
    `tp * cp * dp`; each pipeline rank holds `vpp` model chunks; `sequence_parallel` only with
    TP > 1."""

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    # hierarchical CP (cp_comm_type a2a+p2p): the size of the all-to-all groups inside CP
    # (consecutive CP ranks); the p2p ring runs across them. 1: no hierarchy. Its rule (a factor of
    # CP) is the CP resolution's (`config/comm_overlap.py`, the `_CP` switches: [a2a, p2p] whose
    # product is CP).
    cp_a2a: int = 1
    # the virtual pipeline: model chunks per pipeline rank (1: one chunk, Megatron's None). Decided
    # with the stages (`overlap.layout.pipeline`: -vp, or a pipeline_model_parallel_layout's
    # stages / PP), whose resolution checks it; the runtime counts its chunks and schedules by it.
    vpp: int = 1
    # sequence parallelism as it runs: the sequence split over the TP ranks between the TP regions.
    # Decided by finalize (`resolve.resolve_layout`: model.sequence_parallel, off at TP 1, where
    # there is no group to split over, said in the log; the model section keeps what was typed);
    # the runtime, the planner and the memory model read it here. A layout built by hand (tests)
    # names it where it splits; its rule below refuses it at TP 1.
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        """The layout's own rules, named by the model fields and flags that set them (the one
        check of a layout: `ConfigContainer.finalize` builds its layout here)."""
        check_rules(self._rules())

    def _rules(self) -> Iterator[Rule]:
        for name, size in (
            ("tensor_model_parallel_size", self.tp),
            ("pipeline_model_parallel_size", self.pp),
            ("context_parallel_size", self.cp),
            ("expert_model_parallel_size", self.ep),
            ("expert_tensor_parallel_size", self.etp),
        ):
            key = f"model.{name}"
            yield key, size, size >= 1, "parallel sizes are at least 1.", f"set {key} to 1 or more."
        tp, pp, cp, block = self.tp, self.pp, self.cp, self.tp * self.pp * self.cp
        yield (
            "-ng/--num_gpus",
            self.world_size,
            self.world_size % block == 0,
            f"the world size must be a multiple of TP x PP x CP = {tp} x {pp} x {cp} = {block}.",
            f"use a multiple of {block} ranks, or smaller -tp/-pp/-cp.",
        )
        yield (
            "model.expert_model_parallel_size",
            self.ep,
            tp * cp * self.dp % (self.ep * self.etp) == 0,
            f"EP x ETP = {self.ep * self.etp} must divide TP x CP x DP = {tp * cp * self.dp} "
            "(experts are carved out of the data-parallel ranks of each pipeline stage).",
            "choose -ep so that it divides the ranks per pipeline stage.",
        )
        yield (
            "model.sequence_parallel",
            self.sequence_parallel,
            tp > 1 or not self.sequence_parallel,
            f"{SP_WITHOUT_TP_WHY}.",
            SP_WITHOUT_TP_FIX,
        )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """DP x CP: the ranks the dense gradients (and the distributed optimizer's shards, the
        reported loss) are reduced over - CP ranks hold the same weights and saw other tokens of
        the same samples."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert's weights inside one pipeline
        stage."""
        return (self.tp * self.cp * self.dp) // (self.ep * self.etp)
