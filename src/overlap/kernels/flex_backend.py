"""Flex token dispatch's backends on the run's device: which token dispatcher runs, decided by
finalize from what the model config asks (`moe_token_dispatcher_type`,
`moe_flex_dispatcher_backend`) and recorded in the decision table.

Pitfall the reference's users hit: setting `moe_flex_dispatcher_backend` alone does NOT switch the
dispatcher. Here that case is a logged decision (an error in strict mode), not a silent no-op.
Backends:
- "torch": ours, pure torch.distributed, runs everywhere (CPU/gloo and GPU/NCCL): each token crosses
  the network once per destination rank instead of once per chosen expert, and the receiving rank
  fans it out to its local experts.
- "deepep" / "hybridep": DeepEP's GPU kernels; they need the `deep_ep` library and a supported GPU
  (`device`), otherwise a clear error (never a silent fallback to all-to-all).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from overlap.decisions import RULE, DecisionLog
from overlap.errors import ConfigError
from overlap.kernels import ModelFields
from overlap.kernels.device import DeviceInfo, deepep_supported, hybridep_supported, probe_device

FLEX_BACKENDS = ("torch", "deepep", "hybridep")
GPU_BACKENDS = ("deepep", "hybridep")


def validate_flex_dispatcher_backend(
    model: ModelFields,
    log: DecisionLog,
    device: Callable[[], DeviceInfo | None] = probe_device,
    require_libraries: bool = True,
) -> tuple[str, str | None]:
    """The token dispatcher that runs, (moe_token_dispatcher_type, moe_flex_dispatcher_backend),
    decided by finalize just before the kernels (`choices.resolve_kernels` carries it; the model
    keeps what was asked): flex needs a backend; GPU backends need their device and (unless a
    target is only being described: `require_libraries=False`) their library importable here."""
    kind, backend = model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend
    if kind != "flex":
        if backend is not None:
            log.record(
                "model.moe_flex_dispatcher_backend",
                backend,
                None,
                RULE,
                f"inactive: moe_token_dispatcher_type is '{kind}'; the backend alone does not "
                "switch to flex dispatch",
                fix="also set model.moe_token_dispatcher_type=flex (or use "
                "--moe_flex_dispatcher_backend).",
            )
        return kind, None
    if not model.is_moe:
        return _fall_back(
            backend,
            log,
            "flex dispatch applies only to MoE models (num_moe_experts is not set)",
            "use a MoE recipe, or drop the flex dispatcher settings.",
        )
    if backend is None:
        kind = log.record(
            "model.moe_token_dispatcher_type",
            "flex",
            "alltoall",
            RULE,
            "flex dispatch without a backend falls back to alltoall",
            fix=(
                "set model.moe_flex_dispatcher_backend=torch (runs everywhere), deepep or hybridep."
            ),
        )
        return kind, None
    if backend not in FLEX_BACKENDS:
        raise ConfigError(
            "model.moe_flex_dispatcher_backend",
            backend,
            "unknown flex dispatcher backend.",
            f"use one of {', '.join(FLEX_BACKENDS)}.",
        )
    if backend in GPU_BACKENDS:
        dev = device()
        if dev is None:
            raise ConfigError(
                "model.moe_flex_dispatcher_backend",
                backend,
                f"{backend} runs DeepEP GPU kernels and needs a CUDA GPU; none is visible.",
                "use moe_flex_dispatcher_backend=torch on CPU, or run on a supported GPU.",
            )
        if backend == "deepep" and not deepep_supported(dev):
            return _fall_back(
                backend,
                log,
                "DeepEP is supported for Ampere, Hopper, and Blackwell (B200/B300) GPUs. "
                f"Current GPU: {dev.name}",
                "use moe_flex_dispatcher_backend=torch or hybridep.",
            )
        if backend == "hybridep" and not hybridep_supported(dev):
            return _fall_back(
                backend,
                log,
                "HybridEP is supported for GB200, GB300 with NVL72 and for Ampere, Hopper, "
                f"B200 and B300 GPUs. Current GPU: {dev.name}",
                "use moe_flex_dispatcher_backend=torch.",
            )
        if require_libraries and importlib.util.find_spec("deep_ep") is None:
            raise ConfigError(
                "model.moe_flex_dispatcher_backend",
                backend,
                f"{backend} needs the DeepEP library (python module deep_ep), which is not "
                "installed.",
                "install DeepEP, or use moe_flex_dispatcher_backend=torch.",
            )
    log.record(
        "model.moe_token_dispatcher_type",
        "flex",
        "flex",
        RULE,
        f"flex dispatch with backend '{backend}'",
    )
    return "flex", backend


def _fall_back(backend: str | None, log: DecisionLog, why: str, fix: str) -> tuple[str, str | None]:
    """Flex dispatch (with `backend`) that cannot run here: the alltoall dispatcher, as the
    reference - a decision with a warning, an error under strict mode."""
    field, asked, got = (
        ("model.moe_flex_dispatcher_backend", backend, None)
        if backend is not None
        else ("model.moe_token_dispatcher_type", "flex", "alltoall")
    )
    log.record(field, asked, got, RULE, f"{why}: falling back to the alltoall dispatcher", fix=fix)
    return "alltoall", None
