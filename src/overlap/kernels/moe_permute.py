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
GPU), and it is said at start-up with its cost, never silently. The resolution decides once for the
run's device, records it in the "model" section (`choices`) and keeps it as
`Kernels.moe_permute_fusion`, which the dispatcher runs.
"""

from __future__ import annotations

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
