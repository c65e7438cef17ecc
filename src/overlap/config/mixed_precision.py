"""Mixed precision: the named presets (data: `presets/mixed_precision.yaml`), and the one decision
of the precision that runs.

The mixed-precision section is the home of every precision knob; Megatron's copies on the model,
DDP and optimizer configs (`model.bf16`, `ddp.grad_reduce_in_fp32`, `optimizer.loss_scale`, ...)
are its aliases (`overlap.config.aliases`). Finalize decides the frozen `Precision` once
(`resolve_precision`, read by the runtime as `cfg.resolved.precision`) and writes nothing back:
with a preset the preset owns every field, and unlike Bridge a different value typed under an
alias is not beaten silently but logged; without one the aliases' values stand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from overlap.config.aliases import request
from overlap.decisions import DEFAULT, RULE, USER, DecisionLog
from overlap.errors import ConfigError

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig

# params_dtype is a string so overrides stay plain YAML
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class MixedPrecisionConfig:
    bf16: bool = False  # bfloat16 compute
    fp16: bool = False  # float16 compute (with loss scaling)
    params_dtype: str = "float32"  # dtype of the parameters (must agree with bf16 / fp16)
    grad_reduce_in_fp32: bool = False  # reduce gradients in float32 whatever the compute dtype
    fp8_param_gather: bool = False  # all-gather parameters in float8 (e4m3 + scale) and dequantise
    loss_scale: float | None = None  # static, any precision; None: dynamic for fp16
    initial_loss_scale: float = 2.0**32  # fp16 only: dynamic loss scaling
    min_loss_scale: float = 1.0  # fp16 dynamic loss scaling: the scale never goes below this
    loss_scale_window: int = 1000  # fp16 dynamic loss scaling: clean steps before the scale grows
    hysteresis: int = 2  # fp16 dynamic loss scaling: overflows tolerated before the scale shrinks

    def finalize(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError(
                "mixed_precision.bf16",
                True,
                "bf16 and fp16 cannot both be on.",
                "pick one preset: bf16_mixed or fp16_mixed.",
            )
        want = "bfloat16" if self.bf16 else "float16" if self.fp16 else "float32"
        if self.params_dtype != want:
            raise ConfigError(
                "mixed_precision.params_dtype",
                self.params_dtype,
                f"it contradicts bf16={self.bf16}, fp16={self.fp16}.",
                f"use params_dtype={want}.",
            )


@dataclass(frozen=True)
class Precision:
    """The precision that runs, decided once by finalize (`cfg.resolved.precision`): the preset's
    values, or without one the aliases' as typed (`model.bf16`, `ddp.grad_reduce_in_fp32`, ...;
    unset ones at their defaults). The runtime - layers, optimizer, DDP, trainer, the planners -
    reads this, never the sections, so a value is decided in one place."""

    params_dtype: str = "float32"  # dtype of the parameters and of compute
    bf16: bool = False
    fp16: bool = False
    grad_reduce_in_fp32: bool = False
    fp8_param_gather: bool = False
    loss_scale: float | None = None  # static scale; None: dynamic for fp16, none otherwise
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    @classmethod
    def of(cls, model: ModelConfig) -> Precision:
        """The precision of a model built from a bare (never finalized) config, as finalize
        decides it without a preset and with DDP and optimizer defaults: the model's own dtype
        (unchecked: a bare config's model is built as typed)."""
        return _typed_precision(
            {"mixed_precision": None, "model": model, "ddp": None, "optimizer": None}
        )


LOSS_SCALING = (
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
)
DYNAMIC_FIELDS = LOSS_SCALING[1:]


def resolve_precision(
    mp: MixedPrecisionConfig | None, sections: Mapping[str, Any], log: DecisionLog
) -> Precision:
    """The run's precision, decided once: with a preset (`mp`), the preset owns every field (a
    different value typed under a DDP or optimizer alias is logged, the model's and optimizer's
    dtype copies typed on the command line are `harness.check_precision_overrides`'); without one,
    the aliases' values (`sections`: section name -> section) stand and unset ones take the
    defaults. Checks the loss-scaling fields and records which scaler trains in the "precision"
    section."""
    defaults = Precision()
    if mp is not None:
        mp.finalize()
        for name in ("grad_reduce_in_fp32", "fp8_param_gather"):
            requested = getattr(sections["ddp"], name)
            log.record(
                f"ddp.{name}",
                requested,
                getattr(mp, name),
                RULE,
                f"set through mixed_precision.{name} (the mixed-precision preset owns it)",
                fix=f"set mixed_precision.{name}={requested} instead of ddp.{name}.",
            )
        for name in LOSS_SCALING:
            requested = getattr(sections["optimizer"], name)
            if requested is not None:
                log.record(
                    f"optimizer.{name}",
                    requested,
                    getattr(mp, name),
                    RULE,
                    f"set through mixed_precision.{name} (the preset owns it)",
                    fix=f"set mixed_precision.{name}={requested}, not optimizer.{name}.",
                )
        o = Precision(**{f.name: getattr(mp, f.name) for f in fields(Precision)})
        owner = "mixed_precision"
    else:
        o = _typed_precision(sections)
        _check_dtype(o)
        owner = "optimizer"
    _check_loss_scaling(o, owner)
    if o.loss_scale is not None:
        log.record_in(
            "precision",
            "loss scaler",
            None,
            f"static {o.loss_scale:g}",
            USER,
            f"{owner}.loss_scale is set: the loss is multiplied by it before backward "
            "and the gradients divided by it; a step whose gradients overflow is skipped, the "
            "scale never changes",
        )
    elif o.fp16:
        log.record_in(
            "precision",
            "loss scaler",
            None,
            f"dynamic from {o.initial_loss_scale:.10g} (min {o.min_loss_scale:g}, window "
            f"{o.loss_scale_window}, hysteresis {o.hysteresis})",
            RULE,
            "fp16 gradients underflow unscaled: a step whose gradients overflow is skipped "
            "(parameters and Adam state untouched); after "
            f"{o.hysteresis} overflows every overflow halves the scale, {o.loss_scale_window} "
            "clean steps in a row double it",
        )
    else:
        log.record_in(
            "precision",
            "loss scaler",
            None,
            "off",
            DEFAULT,
            f"{'bf16' if o.bf16 else 'fp32'} gradients have fp32's exponent range: "
            "nothing to rescue from underflow",
        )
    if o.fp16 and o.loss_scale is None:
        return o
    for name in DYNAMIC_FIELDS:
        if getattr(o, name) != getattr(defaults, name):
            log.noop(
                f"{owner}.{name}",
                getattr(o, name),
                "the dynamic loss scaler trains only fp16 models without a static loss_scale",
                f"drop {owner}.{name}, or train with fp16_mixed and {owner}.loss_scale=null.",
            )
    return o


def _typed_precision(sections: Mapping[str, Any]) -> Precision:
    """The precision without a preset: each field's alias as typed (`sections`: section name ->
    section, None where there is none), unset ones at their defaults."""
    defaults = Precision()
    chosen = {}
    for f in fields(Precision):
        value = request(sections, f"mixed_precision.{f.name}").value
        chosen[f.name] = getattr(defaults, f.name) if value is None else value
    return Precision(**chosen)


def _check_dtype(o: Precision) -> None:
    """Without a preset, the dtype typed on the model must be one the layers build and agree with
    the bf16 / fp16 flags (checked by finalize; a bare config's model is built as typed)."""
    if o.params_dtype not in DTYPES:
        raise ConfigError(
            "model.params_dtype", o.params_dtype, "unknown dtype.", f"use one of {DTYPES}."
        )
    if (o.bf16, o.fp16) != (o.params_dtype == "bfloat16", o.params_dtype == "float16"):
        raise ConfigError(
            "model.params_dtype",
            o.params_dtype,
            f"it contradicts model.bf16={o.bf16} / model.fp16={o.fp16}.",
            "set precision with -c or mixed_precision=bf16_mixed|fp16_mixed|fp32, not piecemeal.",
        )


def _check_loss_scaling(o: Precision, owner: str) -> None:
    """One clear error per impossible value (Megatron asserts the same bounds)."""
    for name in ("loss_scale", "initial_loss_scale", "min_loss_scale"):
        value = getattr(o, name)
        finite = isinstance(value, (int, float)) and math.isfinite(value)
        if value is not None and not (finite and value > 0):
            default = getattr(MixedPrecisionConfig, name)
            raise ConfigError(
                f"{owner}.{name}",
                value,
                "a loss scale must be finite and above 0.",
                f"set {owner}.{name} > 0 (e.g. 65536), or null for dynamic scaling."
                if default is None
                else f"set {owner}.{name} > 0 (default {default:.10g}).",
            )
    if o.min_loss_scale > o.initial_loss_scale:
        raise ConfigError(
            f"{owner}.min_loss_scale",
            o.min_loss_scale,
            f"it is above initial_loss_scale={o.initial_loss_scale:g}: the scale "
            "would start below its floor.",
            f"set {owner}.min_loss_scale <= {owner}.initial_loss_scale.",
        )
    for name, what in (
        ("loss_scale_window", "clean steps before the scale doubles"),
        ("hysteresis", "overflows before the scale backs off"),
    ):
        value = getattr(o, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            default = getattr(MixedPrecisionConfig, name)
            raise ConfigError(
                f"{owner}.{name}",
                value,
                f"it counts {what}: a whole number of at least 1.",
                f"set {owner}.{name} to 1 or more (default {default}).",
            )


MIXED_PRECISION_PRESETS: dict[str, MixedPrecisionConfig] = {
    name: MixedPrecisionConfig(**values)
    for name, values in yaml.safe_load(
        resources.files("overlap.config").joinpath("presets/mixed_precision.yaml").read_text()
    ).items()
}
"""The presets by name, in the file's order (the error for an unknown name lists them so)."""


def get_mixed_precision_config(name: str) -> MixedPrecisionConfig:
    """A fresh copy of the preset called `name` (the caller may change it); a ConfigError naming
    the presets otherwise."""
    if name not in MIXED_PRECISION_PRESETS:
        raise ConfigError(
            "mixed_precision",
            name,
            "unknown mixed-precision preset.",
            f"use one of: {', '.join(MIXED_PRECISION_PRESETS)}.",
        )
    return replace(MIXED_PRECISION_PRESETS[name])
