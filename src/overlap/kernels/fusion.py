"""The elementwise fusions: `model.rms_norm_fusion`, `model.apply_rope_fusion`,
`model.bias_activation_fusion`.

Each elementwise chain of the model - RMSNorm, RoPE, SwiGLU (weighted by the router probabilities in
the routed experts) - is a pair of pure functions, forward and backward, with the tensors backward
needs stated (`overlap.layers.fused.Chain`), that run as written (eager: one kernel per op, each
going through memory) or compiled by `torch.compile` (inductor: one fused kernel forward and one
backward). Megatron-Core names two of these switches (`apply_rope_fusion`, `bias_activation_fusion`,
whose weighted form in the experts also multiplies by the router probabilities); it fuses its norms
inside Transformer Engine, so the norm's switch is ours.

Unset (None), a fusion is on where the ranks compute on CUDA and off on the CPU. On CUDA each chain
is memory-bound and its eager form moves its tensor through memory once per op; Megatron's recipes
run these fused. That default is numerically tested against the eager path on the CPU
(tests/test_fused_elementwise.py), where inductor's C++ backend compiles the same graphs; it has not
been timed on a GPU here. On the CPU, compiling each graph takes tens of seconds, which a CPU-sized
run does not win back. Set, a fusion is honoured on any device; set but unable to take effect
(torch.compile unsupported, no Triton for CUDA, no C++ compiler for the CPU, or nothing to fuse), it
is said as a no-op switch (an error under strict) and the eager function runs. On CUDA, inductor's
Triton kernels need Triton itself and, at the first kernel, a host C compiler and Python's headers
(Triton builds its launcher): a machine without them falls back here, at start-up, with the reason
in the decision table (`choices`), instead of failing inside the first step.
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig

import torch

FUSIONS = {
    "rms_norm_fusion": "RMSNorm",
    "apply_rope_fusion": "RoPE",
    "bias_activation_fusion": "SwiGLU (weighted in the routed experts)",
}
"""Each switch (a ModelConfig field) -> the chains it compiles."""

CPU_DEFAULT = (
    "CPU: eager; compiling each chain takes tens of seconds, which a CPU-sized run does not win "
    "back (set it true to compile anyway)"
)
CUDA_DEFAULT = (
    "CUDA: compiled (torch.compile, one fused kernel per chain, as Megatron's recipes run them); "
    "tested against eager on the CPU, not timed on a GPU here"
)


@functools.cache
def compile_unavailable(device_type: str) -> str | None:
    """Why torch.compile cannot fuse chains on `device_type` tensors here, or None when it can."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python / platform"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor needs Triton for CUDA kernels, not installed"
        return _triton_toolchain_missing()
    if device_type == "cpu":
        from torch._inductor import config as inductor_config

        compilers = [c for c in inductor_config.cpp.cxx if c] + ["g++", "c++", "clang++"]
        if not any(shutil.which(c) for c in compilers):
            return "inductor needs a C++ compiler (g++) for CPU kernels and none is on PATH"
        return None
    return f"no compiled kernels for {device_type} tensors (the eager ops run)"


def _triton_toolchain_missing() -> str | None:
    """What Triton needs on the host at its first kernel and this machine lacks, or None: a C
    compiler ($CC, cc, gcc or clang) and Python's headers (Python.h), with which it builds its
    launcher."""
    compilers = [os.environ.get("CC", ""), "cc", "gcc", "clang"]
    if not any(c and shutil.which(c) for c in compilers):
        return (
            "Triton builds its kernel launcher with a C compiler ($CC, cc, gcc, clang): none on "
            "PATH"
        )
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return (
            f"Triton builds its kernel launcher against Python's headers: no Python.h in {include}"
        )
    return None


def fusion_on(
    requested: bool | None, device_type: str, check_here: bool = True
) -> tuple[bool, str]:
    """Whether a chain whose switch is `requested` (None: unset) runs compiled on `device_type`
    tensors, and why. `check_here=False` describes another machine (`explain -g` for a GPU target):
    compile's requirements are not checked on this one."""
    if requested is False:
        return False, "as asked: eager"
    if requested is None and device_type != "cuda":
        return False, CPU_DEFAULT
    missing = compile_unavailable(device_type) if check_here else None
    if missing is not None:
        return False, missing
    return True, "as asked: compiled" if requested else CUDA_DEFAULT
