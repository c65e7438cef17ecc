"""`model.moe_permute_fusion`: which MoE token permutation runs, the fused one or the per-expert
loop.

Both give the same rows bit for bit (`overlap.layers.moe.permute`). The loop is the readable
reference, but each of its per-expert steps has an output size that depends on the routing
(`torch.where(mask)`, boolean indexing, a host list of counts copied back to the device): on a GPU
each one makes the host wait for the device, several times per expert per MoE layer per micro-batch,
which drains the queue that overlap depends on. On a CPU those ops wait for nothing.

So unset (None), the permutation is the loop where the ranks compute on the CPU and the fused one
elsewhere (CUDA; also the dry run's "meta", which stands for CUDA). Set, it is honoured on any
device: the loop on CUDA is still correct (a reference to check the fused kernels against on the
GPU), and it is said at start-up with its cost, never silently. The resolution records the decision
in the "model" section; the dispatcher asks the same rule at call time (`permute_fused`), so a model
built without `finalize` behaves the same.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from overlap.config.decisions import DEFAULT, MODEL_CONFIG, DecisionLog

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig

log = logging.getLogger("overlap.config")

LOOP_ON_CUDA = (
    "the per-expert loop synchronises the host with the GPU several times per expert, MoE layer "
    "and micro-batch (torch.where, boolean indexing, counts copied from the host)"
)


def permute_fused(requested: bool | None, on_cpu: bool) -> tuple[bool, str]:
    """Whether the fused permutation runs for `requested` (the config value; None: unset) on tensors
    that live on the CPU (`on_cpu`) or not, and why."""
    if requested is not None:
        return (
            requested,
            "as asked" if requested or on_cpu else f"as asked, although {LOOP_ON_CUDA}",
        )
    if on_cpu:
        return (
            False,
            "CPU: the per-expert loop, the readable reference (bit-identical to the fused one)",
        )
    return True, f"CUDA: the fused permutation, because {LOOP_ON_CUDA}"


def resolve_moe_permute_fusion(model: ModelConfig, decisions: DecisionLog, on_cuda: bool) -> None:
    """Record, in the "model" section, which permutation an MoE model runs on the run's device (the
    model keeps the requested value; the dispatcher applies the same rule). The loop asked for on
    CUDA is logged as a warning."""
    if not model.num_moe_experts:
        return
    requested = model.moe_permute_fusion
    fused, why = permute_fused(requested, not on_cuda)
    decisions.record_in(
        "model",
        "model.moe_permute_fusion",
        requested,
        fused,
        DEFAULT if requested is None else MODEL_CONFIG,
        why,
    )
    if on_cuda and not fused:
        log.warning(
            "model.moe_permute_fusion=false on CUDA: %s. Fix: leave it unset or set it true (the "
            "fused permutation gives the same rows bit for bit).",
            LOOP_ON_CUDA,
        )
