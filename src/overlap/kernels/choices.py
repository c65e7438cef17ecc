"""The kernel choices of a run, decided once by the resolution for the run's device: which attention
kernel, MoE permutation, experts' GEMM and elementwise fusions run, beside the token dispatcher the
flex rules decided (`flex_backend`). Each choice is recorded in the "model" section of the decision
table (a decision, a no-op switch or a refusal) and kept, as what runs, in `Kernels`
(`cfg.resolved.kernels`), which the layers read; the model section keeps the requested values.
The rules (and the probes of what the machine can run) are this package's other modules; finalize
(`overlap.config.container`) hands in the model config it resolves, read as `ModelFields`."""

from __future__ import annotations

import logging
from collections.abc import Callable

from overlap.decisions import DEFAULT, MODEL_CONFIG, DecisionLog
from overlap.kernels import Kernels, ModelFields
from overlap.kernels.attention import attention_kernel
from overlap.kernels.device import DeviceInfo
from overlap.kernels.fusion import FUSIONS, fusion_on
from overlap.kernels.grouped_gemm import GROUPED, grouped_gemm_kernel
from overlap.kernels.moe_permute import LOOP_ON_CUDA, permute_fused

_log = logging.getLogger("overlap.config")

ROW = "experts' GEMM kernel (per architecture)"


def resolve_attention_backend(
    model: ModelFields, params_dtype: str, log: DecisionLog, on_cuda: bool
) -> str:
    """The kernel the configured backend runs on the run's device in the run's precision
    (`params_dtype`), recorded in the "model" section."""
    backend = model.attention_backend
    kernel, why = attention_kernel(backend, on_cuda, params_dtype, model.seq_length)
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
    return kernel


def resolve_moe_permute_fusion(model: ModelFields, decisions: DecisionLog, on_cuda: bool) -> bool:
    """Whether the fused permutation runs on the run's device, recorded in the "model" section for
    an MoE model. The loop asked for on CUDA is logged as a warning."""
    requested = model.moe_permute_fusion
    fused, why = permute_fused(requested, not on_cuda)
    if not model.num_moe_experts:
        return fused
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
    return fused


def _nothing_to_fuse(model: ModelFields, field: str) -> str | None:
    if field == "bias_activation_fusion" and not model.gated_linear_unit and not model.is_moe:
        return "a dense GELU MLP has no chain to fuse (GELU is one kernel already)"
    return None


def resolve_elementwise_fusion(
    model: ModelFields, decisions: DecisionLog, on_cuda: bool, check_here: bool = True
) -> dict[str, bool]:
    """Whether each fusion (by its field) runs on the run's device, recorded in the "model" section.
    A fusion asked for that cannot take effect is a no-op switch: warned (and in `overlap
    explain`), or an error under strict. `check_here=False`: the run is described for another
    machine (`fusion_on`)."""
    device_type = "cuda" if on_cuda else "cpu"
    runs = {}
    for field, chains in FUSIONS.items():
        requested = getattr(model, field)
        on, why = fusion_on(requested, device_type, check_here)
        idle = _nothing_to_fuse(model, field)
        if idle is not None:
            on, why = False, idle
        runs[field] = on
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
    return runs


def resolve_grouped_gemm(
    model: ModelFields,
    params_dtype: str,
    decisions: DecisionLog,
    on_cuda: bool,
    device: Callable[[], DeviceInfo | None],
) -> bool:
    """Whether the experts' GEMMs run torch's grouped kernel on the run's GPU (`device`: the target
    -g names, or this machine's) or on the CPU in the run's precision (`params_dtype`), recorded in
    the "model" section for an MoE model."""
    if not model.num_moe_experts:
        return False
    info = device() if on_cuda else None
    kernel, why = grouped_gemm_kernel(
        "cuda" if on_cuda else "cpu",
        info.major if info is not None else None,
        params_dtype,
    )
    decisions.record_in("model", ROW, None, kernel, DEFAULT, why)
    return kernel == GROUPED


def resolve_kernels(
    model: ModelFields,
    params_dtype: str,
    log: DecisionLog,
    on_cuda: bool,
    device: Callable[[], DeviceInfo | None],
    dispatcher: tuple[str, str | None],
    require_libraries: bool,
) -> Kernels:
    """Every kernel choice of the run (the last step of finalize), decided once for the run's
    device in its precision (`params_dtype`) and recorded: the attention kernel, the MoE
    permutation, the experts' GEMM (`device`'s GPU) and the elementwise fusions (compile's
    requirements checked here unless the run is described for another machine:
    `require_libraries=False`), beside `dispatcher`, the token dispatcher finalize decided by the
    flex rules (`flex_backend.validate_flex_dispatcher_backend`)."""
    return Kernels(
        attention_backend=resolve_attention_backend(model, params_dtype, log, on_cuda),
        moe_permute_fusion=resolve_moe_permute_fusion(model, log, on_cuda),
        moe_grouped_gemm=resolve_grouped_gemm(model, params_dtype, log, on_cuda, device),
        **resolve_elementwise_fusion(model, log, on_cuda, require_libraries),
        moe_token_dispatcher_type=dispatcher[0],
        moe_flex_dispatcher_backend=dispatcher[1],
    )
