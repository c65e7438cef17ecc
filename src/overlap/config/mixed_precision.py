"""Mixed precision: named presets and their propagation onto the model, DDP and optimizer configs.

As in Megatron-Bridge, `grad_reduce_in_fp32` and `fp8_param_gather` are mixed-precision settings that the DDP config
receives; unlike Bridge, a different value set directly on `ddp` is not overwritten silently: the decision is logged.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from overlap.config.decisions import RULE, DecisionLog
from overlap.errors import ConfigError

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig
    from overlap.config.training import DDPConfig, OptimizerConfig


@dataclass
class MixedPrecisionConfig:
    bf16: bool = False
    fp16: bool = False
    params_dtype: str = "float32"
    grad_reduce_in_fp32: bool = False
    fp8_param_gather: bool = False  # all-gather parameters in float8 (e4m3 + scale) and dequantise
    initial_loss_scale: float = 2.0**32  # fp16 only: dynamic loss scaling
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def finalize(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("mixed_precision.bf16", True, "bf16 and fp16 cannot both be on.",
                              "pick one preset: bf16_mixed or fp16_mixed.")
        want = "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"
        if self.params_dtype != want:
            raise ConfigError("mixed_precision.params_dtype", self.params_dtype,
                              f"it contradicts bf16={self.bf16}, fp16={self.fp16}.", f"use params_dtype={want}.")

    def setup(self, model: "ModelConfig", ddp: "DDPConfig", optimizer: "OptimizerConfig", log: DecisionLog) -> None:
        """Copy precision onto the model and optimizer; grad_reduce_in_fp32 / fp8_param_gather onto DDP (logged)."""
        model.bf16, model.fp16, model.params_dtype = self.bf16, self.fp16, self.params_dtype
        optimizer.bf16, optimizer.fp16 = self.bf16, self.fp16
        for name in ("grad_reduce_in_fp32", "fp8_param_gather"):
            requested = getattr(ddp, name)
            effective = getattr(self, name)
            log.record(f"ddp.{name}", requested, effective, RULE,
                       f"set through mixed_precision.{name} (the mixed-precision preset owns it)",
                       fix=f"set mixed_precision.{name}={requested} instead of ddp.{name}.")
            setattr(ddp, name, effective)


MIXED_PRECISION_PRESETS: dict[str, MixedPrecisionConfig] = {
    "bf16_mixed": MixedPrecisionConfig(bf16=True, params_dtype="bfloat16", grad_reduce_in_fp32=True),
    "fp16_mixed": MixedPrecisionConfig(fp16=True, params_dtype="float16", grad_reduce_in_fp32=False),
    "fp32": MixedPrecisionConfig(),
}


def get_mixed_precision_config(name: str) -> MixedPrecisionConfig:
    if name not in MIXED_PRECISION_PRESETS:
        raise ConfigError("mixed_precision", name, "unknown mixed-precision preset.",
                          f"use one of: {', '.join(MIXED_PRECISION_PRESETS)}.")
    return replace(MIXED_PRECISION_PRESETS[name])
