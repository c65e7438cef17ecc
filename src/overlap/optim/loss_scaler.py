"""Loss scaling for fp16 training (Megatron's grad scalers): the loss is multiplied by `scale`
before backward, so that small gradients do not flush to zero in fp16; the optimizer divides it
out again.

An fp16 gradient that overflowed is inf or NaN, and so is then the global gradient norm, which is
summed over every group that holds other gradients (TP, EP, PP, and DP / expert-DP for the
distributed optimizer's shards) and read on the host anyway for clipping. That one read is the
overflow check: every rank sees the same non-finite norm and takes the same decision, with no
collective and no host read of its own (a device-side skip would still need the norm on the host
for clipping, so it would save nothing). An overflowed step is skipped: parameters, Adam moments
and Adam's step count stay as they were.

Dynamic scaling (Megatron's `DynamicGradScaler`, growth 2, back-off 0.5): each overflow counts the
hysteresis down; once `hysteresis` overflows have been seen since the scale last grew, every
overflow halves the scale (never below `min_scale`). After `window` clean steps in a row the scale
doubles and the hysteresis count starts afresh. A static scale (`optimizer.loss_scale`, Megatron's
`ConstantGradScaler`) never changes; its overflows are still skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.config.mixed_precision import Precision

GROWTH, BACKOFF = 2.0, 0.5


@dataclass
class LossScaler:
    scale: float
    dynamic: bool
    min_scale: float = 1.0
    window: int = 1000
    hysteresis: int = 2
    growth_tracker: int = 0  # clean steps since the last overflow or growth
    hysteresis_tracker: int = 2  # overflows still tolerated before the scale backs off

    @classmethod
    def of(cls, cfg: Precision) -> LossScaler | None:
        """The scaler the run's precision asks for: static with `loss_scale`, dynamic for fp16,
        else none (bf16 and fp32 keep fp32's exponent range: nothing underflows that scaling would
        save)."""
        if cfg.loss_scale is not None:
            return cls(float(cfg.loss_scale), dynamic=False)
        if not cfg.fp16:
            return None
        return cls(
            float(cfg.initial_loss_scale),
            True,
            float(cfg.min_loss_scale),
            int(cfg.loss_scale_window),
            int(cfg.hysteresis),
            0,
            int(cfg.hysteresis),
        )

    def update(self, overflow: bool) -> None:
        """After a step's gradients were checked: back off on overflow (after the hysteresis), grow
        after a window of clean steps."""
        if not self.dynamic:
            return
        if overflow:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * BACKOFF, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.window:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale *= GROWTH

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint keeps (JSON numbers: a float's repr reads back to the same float, so a
        resume is exact)."""
        return {
            "scale": self.scale,
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """A static scale stays the configured one (Megatron's constant scaler keeps no state)."""
        if self.dynamic:
            self.scale = float(state["scale"])
            self.growth_tracker = int(state["growth_tracker"])
            self.hysteresis_tracker = int(state["hysteresis_tracker"])
