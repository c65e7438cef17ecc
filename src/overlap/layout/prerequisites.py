"""What a layout must be for a feature to run: the predicates that the configuration's rules, the
perf recipes' skips, the planner's search and the runtime's guards all ask, so that each condition
is written once (the rule that refuses it, with its message, is the configuration's,
`config/comm_overlap.py`, or the run-time refusal table's, `training/runtime_refusals.py`)."""

from __future__ import annotations

# context parallelism's exchanges of keys and values (`model.cp_comm_type`)
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# the exchanges with a ring, which cp_comm_overlap overlaps (the others are one collective)
CP_RING_TYPES = ("p2p", "a2a+p2p")


def cp_chunks_fit(seq_length: int, cp: int) -> bool:
    """Whether `seq_length` tokens cut into context parallelism's 2 x CP load-balanced chunks (rank
    i holds chunks i and 2CP-1-i, `overlap.parallel.cp_chunks`); at CP = 1 nothing is cut. The CP
    rule's condition, which the planner's search filters its layouts by and the chunking asserts."""
    return cp == 1 or seq_length % (2 * cp) == 0


def ep_overlap_has_experts(ep: int) -> bool:
    """EP overlap's first layout prerequisite (Megatron's): expert parallelism, so that there is an
    all-to-all to overlap. Its rule (`comm_overlap._EP_OVERLAP_NEEDS`), the perf recipes' skip of
    the setting and the planner's "not applicable" ask it."""
    return ep > 1


def ep_overlap_interleaves(pp: int, vp: int, vpp_typed: int | None) -> bool:
    """EP overlap's second layout prerequisite (Megatron's): no pipeline, or a virtual one to
    interleave with (`-vp` typed, or `vp` > 1 from a layout of PP x VPP stages). Its rule
    (`comm_overlap._EP_OVERLAP_NEEDS`) and the perf recipes' skip of the setting ask it."""
    return pp == 1 or vp > 1 or vpp_typed is not None


def keeps_sent_outputs(pp: int, ep_overlap: bool) -> bool:
    """Whether the pipeline keeps every sent output: EP overlap under PP, whose merged steps keep
    each layer piece's output for its own backward, so releasing them
    (`model.deallocate_pipeline_outputs`) is not built. The run-time refusal
    (`overlap.training.runtime_refusals`), the perf recipes' skip of the setting and the pipeline
    executor's guard ask it."""
    return pp > 1 and ep_overlap
