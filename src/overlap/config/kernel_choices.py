"""The kernel choices of a run, recorded by the resolution in the "model" section of the decision
table: which attention kernel, MoE permutation, experts' GEMM and elementwise fusions run on the
run's device. The rules (and the probes of what the machine can run) are `overlap.kernels`', the
layers apply the same rules at call time; here each choice becomes a decision, a no-op switch or a
refusal. The model keeps the requested values."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from overlap.config.decisions import DEFAULT, MODEL_CONFIG, DecisionLog
from overlap.errors import NotBuiltError
from overlap.kernels.attention import attention_kernel
from overlap.kernels.device import DeviceInfo
from overlap.kernels.fusion import FUSIONS, fusion_on
from overlap.kernels.grouped_gemm import LOOP, grouped_gemm_kernel
from overlap.kernels.moe_permute import LOOP_ON_CUDA, permute_fused

if TYPE_CHECKING:
    from overlap.config.mixed_precision import Precision
    from overlap.config.model import ModelConfig

_log = logging.getLogger("overlap.config")

ROW = "experts' GEMM kernel (per architecture)"


def resolve_attention_backend(
    model: ModelConfig, precision: Precision, log: DecisionLog, on_cuda: bool
) -> None:
    """Record, in the "model" section, which kernel the configured backend runs on the run's device
    in the run's precision (the model keeps the requested value; the layer applies the same
    rule)."""
    backend = model.attention_backend
    kernel, why = attention_kernel(backend, on_cuda, precision.params_dtype, model.seq_length)
    if backend == "auto":
        log.record_in("model", "model.attention_backend", None, kernel, DEFAULT, why)
    else:
        log.record_in(
            "model",
            "model.attention_backend",
            backend,
            backend,
            MODEL_CONFIG,
            why if kernel != backend else f"the {kernel} kernel, as asked",
        )


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
        _log.warning(
            "model.moe_permute_fusion=false on CUDA: %s. Fix: leave it unset or set it true (the "
            "fused permutation gives the same rows bit for bit).",
            LOOP_ON_CUDA,
        )


def _nothing_to_fuse(model: ModelConfig, field: str) -> str | None:
    if field == "bias_activation_fusion" and not model.gated_linear_unit and not model.is_moe:
        return "a dense GELU MLP has no chain to fuse (GELU is one kernel already)"
    return None


def resolve_elementwise_fusion(
    model: ModelConfig, decisions: DecisionLog, on_cuda: bool, check_here: bool = True
) -> None:
    """Record, in the "model" section, whether each fusion runs on the run's device (the model keeps
    the requested values; the layers apply the same rule at call time). A fusion asked for that
    cannot take effect is a no-op switch: warned (and in `overlap explain`), or an error under
    strict. `check_here=False`: the run is described for another machine (`fusion_on`)."""
    device_type = "cuda" if on_cuda else "cpu"
    for field, chains in FUSIONS.items():
        requested = getattr(model, field)
        on, why = fusion_on(requested, device_type, check_here)
        idle = _nothing_to_fuse(model, field)
        if idle is not None:
            on, why = False, idle
        decisions.record_in(
            "model",
            f"model.{field}",
            requested,
            on,
            DEFAULT if requested is None else MODEL_CONFIG,
            f"{chains}: {why}",
        )
        if requested and not on:
            decisions.noop(
                f"model.{field}",
                True,
                f"{chains} cannot be compiled: {why}",
                f"set model.{field}=false (or leave it unset), or make torch.compile available.",
            )


def resolve_grouped_gemm(
    model: ModelConfig,
    precision: Precision,
    decisions: DecisionLog,
    on_cuda: bool,
    device: Callable[[], DeviceInfo | None],
) -> None:
    """Record, in the "model" section, the experts' GEMM kernel on the run's GPU (`device`: the
    target -g names, or this machine's) or on the CPU."""
    if not model.num_moe_experts:
        return
    info = device() if on_cuda else None
    kernel, why = grouped_gemm_kernel(
        "cuda" if on_cuda else "cpu",
        info.major if info is not None else None,
        precision.params_dtype,
    )
    decisions.record_in("model", ROW, None, kernel, DEFAULT, why)
    factor = model.moe_expert_rank_capacity_factor
    # the loop cuts the rows by host counts, which the sync-free dispatch never reads; a bf16 run on
    # a GPU this machine cannot see (a dry run) is left to the experts' own check at first use
    unknown_gpu = on_cuda and info is None and precision.params_dtype == "bfloat16"
    if factor is not None and kernel == LOOP and not unknown_gpu:
        raise NotBuiltError(
            "model.moe_expert_rank_capacity_factor",
            factor,
            f"The sync-free dispatch where the experts' GEMMs take the per-expert loop ({why})",
            "drop model.moe_expert_rank_capacity_factor (the all-to-all reads the split sizes), "
            "or run on Hopper in bf16 or on the CPU, where the grouped kernel runs.",
        )
