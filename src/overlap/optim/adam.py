"""Adam with fp32 main parameters, global-norm gradient clipping and the warm-up + decay
learning-rate schedule.

Gradients arrive in `param.main_grad` (already reduced across data parallel). With bf16 / fp16
parameters the optimizer keeps fp32 master copies and writes the update back in the parameters'
dtype; with fp32 parameters the master *is* the parameter. Under loss scaling (`loss_scaler.py`)
the gradients arrive multiplied by the loss scale: the norm is divided by it, the step multiplies
the gradients by (clipping factor / loss scale) - in place, or inside fused AdamW through its
`grad_scale`, never into a copy of the fp32 gradients - and an overflowed step is skipped.

The Adam core works on "slots" so that the distributed optimizer
(`overlap.data_parallel.distributed_optimizer`) reuses it on the shards a rank owns. The gradient
norm counts every logical parameter once: tensor-parallel replicas (norms, router) only on TP rank
0, expert shards summed over the expert-parallel group.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_scalar_dtype
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from overlap.config.mixed_precision import Precision
from overlap.config.training import OptimizerConfig, SchedulerConfig
from overlap.optim.loss_scaler import LossScaler
from overlap.parallel import comm
from overlap.parallel.state import ParallelState


def learning_rate(it: int, opt: OptimizerConfig, sched: SchedulerConfig, train_iters: int) -> float:
    """Linear warm-up to `lr`, then cosine / linear decay to `min_lr` (Megatron's schedule); `it`
    counts from 0."""
    warm = sched.lr_warmup_iters
    if warm and it < warm:
        return opt.lr * (it + 1) / warm
    if sched.lr_decay_style == "constant":
        return opt.lr
    decay = (sched.lr_decay_iters or train_iters) - warm
    frac = min(1.0, (it - warm) / decay) if decay > 0 else 1.0
    if sched.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
    return opt.min_lr + coeff * (opt.lr - opt.min_lr)


@dataclass
class Slot:
    """One tensor the optimizer updates: an fp32 `master`, its gradient view, and where the update
    is written.

    The plain optimizer has one slot per parameter (`grad` = main_grad, `out` = the parameter); the
    distributed optimizer has one per (parameter, bucket shard) piece that this rank owns. `master`,
    `grad` and `out` share one shape (the step casts, scales and copies back with multi-tensor ops).
    `param` carries the attributes the gradient-norm rule needs (`is_expert`, `shard`); `decay` is
    False for 1-D parameters (norms), as Megatron.
    """

    param: nn.Parameter
    master: torch.Tensor
    grad: torch.Tensor
    out: torch.Tensor
    decay: bool
    # the slot's elements of the flattened parameter (None: all of it)
    span: tuple[int, int] | None = None

    @property
    def elements(self) -> tuple[int, int]:
        return self.span if self.span is not None else (0, self.param.numel())


# The optimizer state a checkpoint keeps per parameter, in the parameter's own (this rank's TP/EP
# shard) shape: "exp_avg" and "exp_avg_sq" always, "master" only for parameters that are not fp32
# themselves (an fp32 parameter is its own master). Keeping it in parameter space, not in the
# distributed optimizer's bucket shards, is what lets a checkpoint load at another data-parallel
# size or with the distributed optimizer switched on or off.
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
ParamStates = dict[nn.Parameter, dict[str, torch.Tensor]]


def keeps_master(param: nn.Parameter) -> bool:
    return param.dtype != torch.float32


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp32 sum of squares of `grads` from one multi-tensor norm per (device, dtype) group and
    one reduction: a per-tensor `pow(2).sum()` is two kernels per gradient, thousands per step on a
    big model. `device` holds the zero of an empty list (a rank without expert gradients still takes
    part in the expert all-reduce)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    groups = _group_tensors_by_device_and_dtype([grads])
    norms = [
        n
        for ([tensors], _) in groups.values()
        for n in torch._foreach_norm(tensors, 2, dtype=torch.float32)
    ]
    return torch.stack(norms).square().sum()


def grad_norm_sq_local(slots: list[Slot], ps: ParallelState) -> tuple[torch.Tensor, torch.Tensor]:
    """(dense, expert) local sums of squared gradients, each logical element counted once after
    reduction: tensor-parallel replicas (norms, router) only on TP rank 0, expert shards summed over
    the expert-parallel group."""
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for s in slots:
        # the last stage's copy of the tied embedding: counted once, as the embedding
        if hasattr(s.param, "tied_to"):
            continue
        if getattr(s.param, "is_expert", False):
            expert.append(s.grad)
        elif hasattr(s.param, "shard") or ps.tp_rank == 0:
            dense.append(s.grad)
    return _sum_of_squares(dense, ps.device), _sum_of_squares(expert, ps.device)


def global_grad_norm(
    slots: list[Slot],
    ps: ParallelState,
    sharded_over_dp: bool,
    fold: torch.Tensor | None = None,
) -> float | None:
    """The global L2 norm; with `sharded_over_dp` each rank holds only its DP x CP (dense) /
    expert-DP (expert) shard of every gradient, so those partial sums are first added up over
    them.

    `fold`: a [1] count already summed over data and pipeline parallelism (the trainer's loss
    reductions carry it: the sync-free MoE dispatch's overflow, `overlap.layers.moe.rank_capacity`),
    which rides the norm's own reductions as a second element, so every rank learns whether its sum
    over all ranks is > 0 in the norm's one host read: then None (the norm is not needed, the step
    is re-run), else the norm. A sum of squares is never negative, so the read carries both as one
    number: the squares, or -1 where the count is > 0."""
    dense, expert = grad_norm_sq_local(slots, ps)
    if fold is not None:
        # over tensor parallelism with the dense squares (the loss reductions had DP and PP)
        dense, expert = torch.cat([dense.view(1), fold]), torch.cat([expert.view(1), fold * 0])
    if sharded_over_dp:
        comm.all_reduce(dense, ps.dp_cp_group, "dp_norm").wait()
        comm.all_reduce(expert, ps.edp_group, "dp_norm").wait()
    comm.all_reduce(dense, ps.tp_group, "mp_norm").wait()
    comm.all_reduce(expert, ps.ep_group, "mp_norm").wait()
    total = dense + expert
    if ps.layout.pp > 1:  # every pipeline stage holds other layers: their squares add up
        comm.all_reduce(total, ps.pp_group, "mp_norm").wait()
    if fold is not None:
        total = torch.where(total[1] > 0, -1.0, total[0])
    total = float(total)
    return None if total < 0 else math.sqrt(total)


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def multi_tensor_impl(params: list[torch.Tensor]) -> dict[str, bool]:
    """torch.optim's implementation switch for `params`: `fused=True` when every one is a CUDA
    floating tensor (a handful of kernels for the whole update, `step` kept on the GPU so nothing is
    read back), else `foreach=True` (CPU and anything else: multi-tensor ops whose per-element
    arithmetic is that of the single-tensor loop, so CPU results are bit-identical to it). On
    `meta`, which stands for CUDA in a dry run (`overlap.perf.dry_run`) and has no fused kernel,
    the single-tensor loop: its temporaries are one tensor's at a time, as near as torch's
    implementations come to the fused kernel's none (the multi-tensor ops' are the whole update's,
    a second copy of the fp32 state the GPU never allocates)."""
    if params and all(p.is_cuda and p.dtype in FUSED_DTYPES for p in params):
        return {"fused": True}
    if params and all(p.device.type == "meta" for p in params):
        return {"foreach": False}
    return {"foreach": True}


class MixedPrecisionAdam:
    """AdamW over fp32 master slots (torch's functional AdamW on its multi-tensor or fused path,
    elementwise, so every element sees the reference's arithmetic whichever way the slots cut the
    parameters); no weight decay on 1-D parameters.

    The state (`step`, `exp_avg`, `exp_avg_sq` per master) is kept here and made as torch's AdamW
    makes it on a parameter's first step; the update is `torch.optim.adamw.adamw`, what the class's
    `step` calls. The class would add nothing this uses (its parameter groups, the `.grad` it reads
    the gradients from), and its first `add_param_group` imports torch._dynamo: 0.7 s of every
    rank's start-up on this project's CPU machine."""

    def __init__(self, slots: list[Slot], cfg: OptimizerConfig) -> None:
        if cfg.optimizer != "adam":
            raise ValueError(f"optimizer.optimizer={cfg.optimizer!r}: only adam is built")
        self.slots = slots
        self.cfg = cfg
        impl = multi_tensor_impl([s.master for s in slots])
        self.fused, self.foreach = impl.get("fused", False), impl.get("foreach", False)
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.clip = cfg.clip_grad

    @classmethod
    def for_params(cls, params: list[nn.Parameter], cfg: OptimizerConfig) -> MixedPrecisionAdam:
        """One slot per parameter; an fp32 parameter is its own master."""
        return cls(
            [
                Slot(
                    p,
                    p if p.dtype == torch.float32 else p.detach().float(),
                    p.main_grad,
                    p,
                    p.dim() > 1,
                )
                for p in params
            ],
            cfg,
        )

    @torch.no_grad()
    def step(
        self,
        lr: float,
        grad_norm: float,
        first: tuple[Callable[[Slot], bool], Callable[[], None]] | None = None,
        unscale: float = 1.0,
    ) -> None:
        """Update every slot. With `first = (select, then)`, the selected slots are updated (and
        written out) before the others and `then()` runs in between: the distributed optimizer
        launches the next forward's first parameter gather there, so it travels while the rest of
        the step computes. Each slot is updated (its step counted, its decay applied) in exactly one
        of them, so the two partial steps are one full step. `grad_norm` is the norm of the
        true gradients, `unscale` what the stored ones are multiplied by to get them (1 / loss
        scale)."""
        # The norm is already on the host (global_grad_norm's one read), so the clipping factor
        # costs no sync here.
        scale = (min(1.0, self.clip / (grad_norm + 1e-6)) if self.clip > 0 else 1.0) * unscale
        if first is None:
            self._update(self.slots, lr, scale)
            return
        select, then = first
        early = [select(s) for s in self.slots]
        self._update([s for s, e in zip(self.slots, early) if e], lr, scale)
        then()
        self._update([s for s, e in zip(self.slots, early) if not e], lr, scale)

    @torch.no_grad()
    def create_states(self) -> None:
        """Give every slot its Adam state now, as its first step would (zero moments, step 0):
        the memory a steady-state step holds, before any step (the dry run's)."""
        for slot in self.slots:
            self._state(slot.master)

    def _state(self, master: torch.Tensor) -> dict[str, torch.Tensor]:
        """The master's Adam state, made as torch's AdamW makes it on the first step (`Adam.
        _init_group`: zero moments, step 0) if it has none."""
        state = self.state.get(master)
        if state is None:
            state = self.state[master] = {
                "step": self._step_state(0, master),
                "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format),
            }
        return state

    def steps_taken(self) -> int:
        """How many optimizer steps the slots have seen (every slot gets a gradient every step). The
        counts are stacked and read once: fused Adam keeps them on the GPU, where a read per slot
        would sync per slot."""
        steps = [st["step"] for st in self.state.values()]
        counts = {int(c) for c in torch.stack(steps).tolist()} if steps else set()
        if len(counts) > 1:
            raise RuntimeError(f"optimizer slots disagree on the step count: {sorted(counts)}")
        return counts.pop() if counts else 0

    def export_slot(self, slot: Slot) -> dict[str, torch.Tensor]:
        """The slot's fp32 state (flattened): master, exp_avg, exp_avg_sq (zeros before the first
        step)."""
        state = self.state.get(slot.master, {})
        zeros = torch.zeros_like(slot.master, dtype=torch.float32)
        return {
            "master": slot.master.detach().float().reshape(-1),
            "exp_avg": state.get("exp_avg", zeros).reshape(-1),
            "exp_avg_sq": state.get("exp_avg_sq", zeros).reshape(-1),
        }

    def import_param_states(self, states: ParamStates, step: int) -> None:
        """Set every slot from parameter-space states (`STATE_KEYS`, each in its parameter's shape,
        on any device: a checkpoint's are read into host memory): a missing master is taken from
        the (just loaded) parameter, missing moments reset the state (weights-only loads)."""
        for slot in self.slots:
            lo, hi = slot.elements
            values = {
                k: v.reshape(-1)[lo:hi].float() for k, v in states.get(slot.param, {}).items()
            }
            values.setdefault("master", slot.param.detach().float().reshape(-1)[lo:hi])
            self._import_slot(slot, values, step)

    @torch.no_grad()
    def _import_slot(self, slot: Slot, values: dict[str, torch.Tensor], step: int) -> None:
        slot.master.view(-1).copy_(values["master"])
        if slot.out is not slot.master:
            slot.out.copy_(slot.master.view_as(slot.out))
        if "exp_avg" not in values:
            self.state.pop(slot.master, None)
            return
        self.state[slot.master] = {
            "step": self._step_state(step, slot.master),
            "exp_avg": torch.empty_like(slot.master).copy_(values["exp_avg"].view_as(slot.master)),
            "exp_avg_sq": torch.empty_like(slot.master).copy_(
                values["exp_avg_sq"].view_as(slot.master)
            ),
        }

    def _step_state(self, step: int, master: torch.Tensor) -> torch.Tensor:
        """`step` as torch's Adam creates it (`Adam._init_group`): fp32 on the parameter's device
        when fused (or capturable, never asked for here), else a CPU scalar. Never the default
        device: a CUDA `step` on the foreach / single-tensor path is read back with `.item()` per
        slot per step."""
        if self.fused:
            return torch.full(
                (), float(step), dtype=_get_scalar_dtype(is_fused=True), device=master.device
            )
        return torch.tensor(float(step), dtype=_get_scalar_dtype(), device="cpu")

    def _update(self, slots: list[Slot], lr: float, scale: float) -> None:
        """One AdamW step over `slots`: their gradients in fp32 times the clipping `scale`
        (`_masters_grads`), then the updated masters copied into the parameters. The weight-decayed
        slots and the others are two calls, as the class's two parameter groups are. A partial
        step may have no slots (every one selected first): nothing to do, and foreach ops refuse
        empty lists."""
        if not slots:
            return
        grads, grad_scale = self._masters_grads(slots, scale)
        cfg = self.cfg
        for decay in (True, False):
            group = [(s, g) for s, g in zip(slots, grads) if s.decay == decay]
            if not group:
                continue
            states = [self._state(s.master) for s, _ in group]
            adamw(
                [s.master for s, _ in group],
                [g for _, g in group],
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                [],
                [st["step"] for st in states],
                foreach=self.foreach,
                fused=self.fused,
                grad_scale=grad_scale,
                amsgrad=False,
                beta1=cfg.adam_beta1,
                beta2=cfg.adam_beta2,
                lr=lr,
                weight_decay=cfg.weight_decay if decay else 0.0,
                eps=cfg.adam_eps,
                maximize=False,
            )
        outs = [s for s in slots if s.out is not s.master]
        if outs:
            torch._foreach_copy_([s.out for s in outs], [s.master for s in outs])

    def _masters_grads(
        self, slots: list[Slot], scale: float
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """(the masters' gradients, fused AdamW's `grad_scale`): `float(grad) * scale` per slot,
        without a copy of gradients that are fp32 already. Fused AdamW (CUDA) divides them by its
        `grad_scale` (1 / scale) as it reads them; the foreach path multiplies them in place. Either
        way the reduced gradients end the step unscaled and clipped, in place: nothing reads them
        after the step, and the next step zeroes them before its backward. Low-precision gradients
        are cast by one multi-tensor copy into fp32 tensors (the copy the update needs anyway),
        then scaled there."""
        grads = [s.grad for s in slots]
        if not all(g.dtype == s.master.dtype for g, s in zip(grads, slots)):
            wide = [torch.empty_like(s.master) for s in slots]
            torch._foreach_copy_(wide, grads)
            if scale != 1.0:
                torch._foreach_mul_(wide, scale)
            return wide, None
        if scale == 1.0:
            return grads, None
        if self.fused:
            return grads, torch.full((), 1.0 / scale, dtype=torch.float32, device=grads[0].device)
        torch._foreach_mul_(grads, scale)
        return grads, None


class SlotOptimizer(ABC):
    """What both optimizers share around their `MixedPrecisionAdam`: loss scaling and the overflow
    skip, loading a checkpoint's parameter-space state (every slot takes its own elements of it)
    and the step count. A subclass gives `_grad_norm` (of the gradients as stored) and `_step`
    (the update itself)."""

    adam: MixedPrecisionAdam
    ps: ParallelState

    def __init__(self, precision: Precision) -> None:
        self.scaler = LossScaler.of(precision)
        self.skipped = 0  # steps skipped for an overflow (the lr schedule counts only the others)
        self.overflowed = False  # whether the last step was skipped

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without a scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def grad_norm(self, fold: torch.Tensor | None = None) -> float | None:
        """The global L2 norm of the true (unscaled) gradients: non-finite if any rank's gradients
        overflowed. `fold`: a count to sum over every rank in the same reductions and read
        (`global_grad_norm`); None when that sum is > 0."""
        norm = self._grad_norm(fold)
        return None if norm is None else norm / self.loss_scale

    def step(self, lr: float, grad_norm: float) -> bool:
        """Clip and update, or, under loss scaling with a non-finite `grad_norm` (the same on every
        rank, see `loss_scaler.py`), skip the step and let the scaler back off. Returns whether the
        parameters changed."""
        unscale = 1.0 / self.loss_scale
        self.overflowed = self.scaler is not None and not math.isfinite(grad_norm)
        if self.scaler is not None:
            self.scaler.update(self.overflowed)
        if self.overflowed:
            self.skipped += 1
            return False
        self._step(lr, grad_norm, unscale)
        return True

    @abstractmethod
    def _grad_norm(self, fold: torch.Tensor | None) -> float | None:
        """The global L2 norm of the gradients as stored (scaled), `fold` as `global_grad_norm`
        takes it."""

    @abstractmethod
    def _step(self, lr: float, grad_norm: float, unscale: float) -> None:
        """Clip, unscale and apply the update."""

    def scaling_state(self) -> dict:
        """The loss scaler's state and the skipped-step count, for a checkpoint's train state."""
        return {
            "skipped_iterations": self.skipped,
            "loss_scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_scaling_state(self, state: dict, with_scaler: bool) -> None:
        """Resume the skipped-step count (the schedule's position) and, with `with_scaler` (the
        optimizer state is loaded), the scaler's state; a checkpoint without one (another
        precision) leaves the scaler fresh."""
        self.skipped = int(state.get("skipped_iterations", 0))
        saved = state.get("loss_scaler")
        if with_scaler and saved is not None and self.scaler is not None:
            self.scaler.load_state_dict(saved)

    def load_param_states(self, states: ParamStates, step: int) -> None:
        self.adam.import_param_states(states, step)

    def create_states(self) -> None:
        """Every slot's Adam state, as the first step would make it (`MixedPrecisionAdam`)."""
        self.adam.create_states()

    def steps_taken(self) -> int:
        return self.adam.steps_taken()


class LocalOptimizer(SlotOptimizer):
    """The non-distributed optimizer: every rank updates every parameter from the all-reduced
    gradients."""

    def __init__(
        self,
        params: list[nn.Parameter],
        cfg: OptimizerConfig,
        precision: Precision,
        ps: ParallelState,
    ) -> None:
        super().__init__(precision)
        self.ps = ps
        self.adam = MixedPrecisionAdam.for_params(params, cfg)

    def _grad_norm(self, fold: torch.Tensor | None) -> float | None:
        return global_grad_norm(self.adam.slots, self.ps, sharded_over_dp=False, fold=fold)

    def _step(self, lr: float, grad_norm: float, unscale: float) -> None:
        self.adam.step(lr, grad_norm, unscale=unscale)

    def finish_param_sync(self) -> None:
        """Nothing to gather: parameters are updated in place on every rank."""

    def param_states(self) -> ParamStates:
        """Every parameter's optimizer state in parameter space (`STATE_KEYS`), for a checkpoint."""
        out: ParamStates = {}
        for s in self.adam.slots:
            flat = self.adam.export_slot(s)
            out[s.param] = {
                k: v.view(s.param.shape)
                for k, v in flat.items()
                if k != "master" or keeps_master(s.param)
            }
        return out
