"""Which kernel the routed experts' GEMMs run, per architecture: torch's grouped GEMM
(`F.grouped_mm`, one call for every expert) or the per-expert loop (one `torch.mm` per expert, on
the host counts the dispatch already has).

The grouped kernel is right and fast only where torch built it for: Hopper (SM90) in bf16. On SM8x
`torch._grouped_mm` falls back to a loop of its own after copying its offsets to the host
(`offs.cpu()`): a host synchronisation per GEMM, six per MoE layer and micro-batch (forward,
input gradient and weight gradient of fc1 and fc2), which drain the queue overlap needs - our loop
needs none. On SM100 and newer its weight gradient gives experts without rows non-zero gradients (an
open PyTorch issue), where the loop gives them zeros. On the CPU it runs every dtype bit-identically
to the loop (tests/test_moe.py) without the Python loop. Fake tensors (the dry run's "meta") take
the loop.

The resolution decides once for the run's GPU (`overlap explain -g GPU` names the target's
architecture, `run` probes its own device; a GPU this machine does not see, as a dry run's, is
taken as Hopper: the dry run's meta stand-ins take their own path, CUDA fakes the grouped kernel),
records it in the "model" section (`choices`) and keeps it as `Kernels.moe_grouped_gemm`, which the
experts' GEMMs run (`overlap.layers.linear_functions.grouped_offsets`). Where it is the loop,
`overlap run` refuses the sync-free dispatch, which never reads the host counts the loop cuts by
(`overlap.layers.moe.moe_layer.unbuilt_dispatch`). The rule depends on facts of the machine alone:
there is no switch to set, and the device script's env step measures both kernels against each
other.
"""

from __future__ import annotations

GROUPED, LOOP = "grouped", "loop"


def grouped_gemm_kernel(device_type: str, major: int | None, dtype: str) -> tuple[str, str]:
    """(GROUPED or LOOP, why) for experts' tensors on `device_type` ("cpu", "cuda", "meta") of
    compute capability `major` (CUDA) in `dtype` ("bfloat16", ...): module docstring."""
    if device_type == "cpu":
        return (
            GROUPED,
            "CPU: torch's grouped GEMM, bit-identical to the loop, without its Python loop",
        )
    if device_type != "cuda":
        return LOOP, f"{device_type} tensors (the dry run's stand-ins): the per-expert loop"
    if dtype != "bfloat16":
        return LOOP, f"CUDA in {dtype}: torch's grouped GEMM runs bf16 only; the per-expert loop"
    if major == 9:
        return GROUPED, "SM90 (Hopper): torch's grouped GEMM, one kernel for every expert"
    if major is None:
        return GROUPED, (
            "a CUDA GPU this machine does not see (a dry run's): torch's grouped GEMM, as on "
            "Hopper; the run on its GPU decides again"
        )
    if major < 9:
        return LOOP, (
            f"SM{major}x: torch's grouped GEMM falls back to a loop after copying its offsets to "
            "the host (a synchronisation per GEMM, six per MoE layer and micro-batch); the "
            "per-expert loop runs on the host counts without one"
        )
    return LOOP, (
        f"SM{major}0: torch's grouped GEMM gives experts without rows non-zero weight gradients "
        "(an open PyTorch issue); the per-expert loop gives them zeros"
    )
