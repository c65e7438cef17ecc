"""Stopping a run on purpose: on SIGTERM or a time limit (with a checkpoint), or on a NaN/Inf
(without one).

Preemption: Slurm (and our local launcher, forwarding its own SIGTERM) sends SIGTERM before it kills
a job. With `train.exit_signal_handler` the handler only raises a flag; at the next step boundary
every rank learns whether any rank was signalled or the `train.exit_duration_in_mins` budget is
spent (one all-reduce of two numbers, MAX, and only when one of the two is configured), so all ranks
stop after the same iteration, save, and exit 0.

NaN/Inf (`ddp.check_for_nan_in_grad`): the global gradient norm is all-reduced anyway, so a
non-finite value anywhere shows on every rank at no extra cost; then (only then) the ranks exchange
which of them hold the non-finite values, and every rank stops before the optimizer step with one
message naming the iteration, the ranks and the tensors. Under loss scaling (fp16) a non-finite
gradient is an overflow that the loss scaler handles by skipping the step; the check then stops the
run only if the loss itself is not finite (which no loss scale can fix).
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from overlap.config.training import TrainConfig
from overlap.errors import NonFiniteError, agreed
from overlap.parallel import comm

log = logging.getLogger("overlap.train")


class ExitWatch:
    def __init__(self, t: TrainConfig, device: torch.device) -> None:
        """`device`: where the exit flags are all-reduced (the rank's device: NCCL reduces only GPU
        tensors)."""
        self.device = device
        self.minutes = t.exit_duration_in_mins
        self.handler = t.exit_signal_handler
        self.enabled = self.handler or self.minutes is not None
        self.signalled: int | None = None
        self.start = time.monotonic()
        self._previous = None
        if self.handler and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = signum

    def reason(self) -> str | None:
        """Collective (when enabled): why every rank stops after this iteration, or None to go
        on."""
        if not self.enabled:
            return None
        elapsed_min = (time.monotonic() - self.start) / 60.0
        flags = torch.tensor(
            [1.0 if self.signalled is not None else 0.0, elapsed_min],
            dtype=torch.float64,
            device=self.device,
        )
        comm.all_reduce(flags, dist.group.WORLD, "ctl_exit", dist.ReduceOp.MAX).wait()
        if flags[0] > 0:
            return "SIGTERM received (train.exit_signal_handler)"
        if self.minutes is not None and float(flags[1]) >= self.minutes:
            return (
                f"train.exit_duration_in_mins={self.minutes:g} reached ({float(flags[1]):.2f} min)"
            )
        return None

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def check_finite(
    iteration: int,
    norm: float,
    loss: torch.Tensor,
    named_params: Iterable[tuple[str, nn.Parameter]],
    rank: int,
    last_checkpoint: int | None,
    loss_scaling: bool = False,
    suspect: str = "",
) -> None:
    """Raise NonFiniteError on every rank if the (global) gradient norm is not finite - with
    `loss_scaling`, only if some rank's loss is not finite either. Collective only then.
    `suspect`: `NonFiniteCount.suspect`'s note for this iteration."""
    if math.isfinite(norm):
        return
    # a tied embedding's copy on the last stage is named with what it is (its gradient has the
    # embedding's in it)
    bad = [
        name if not hasattr(p, "tied_to") else f"{name} (the tied copy of {p.tied_to})"
        for name, p in named_params
        if getattr(p, "main_grad", None) is not None and not bool(torch.isfinite(p.main_grad).all())
    ]
    mine = []
    loss_bad = not bool(torch.isfinite(loss).all())
    if loss_bad:
        mine.append("the lm loss")
    if bad:
        mine.append(
            "gradients of "
            + ", ".join(bad[:3])
            + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        )
    reports = comm.all_gather_object((rank, "; ".join(mine), loss_bad), None)
    if loss_scaling and not any(lost for _r, _what, lost in reports):
        return  # a gradient overflow: the loss scaler skips the step
    where = (
        "; ".join(f"rank {r}: {what}" for r, what, _lost in reports if what)
        or "no rank holds a non-finite gradient (the norm itself overflowed)"
    )
    kept = (
        f"the last checkpoint (iteration {last_checkpoint}) is untouched"
        if last_checkpoint is not None
        else "no checkpoint was written"
    )
    raise agreed(
        NonFiniteError(
            "ddp.check_for_nan_in_grad",
            True,
            f"iteration {iteration + 1}: the gradient norm is {norm}: {where}. Training stopped "
            f"before the optimizer step (nothing was updated); {kept}{suspect}.",
            "resume from the last checkpoint with a lower learning rate (or more warm-up), check "
            "the data; set ddp.check_for_nan_in_grad=false only to train through it.",
        )
    )


class NonFiniteCount:
    """Training on through NaN/Inf (`ddp.check_for_nan_in_grad=false`) is the user's choice, but
    never a silent one: the first non-finite loss or gradient norm is warned about at once, and the
    run's count at its end. The loss and norm are the host numbers the iteration logs anyway: no
    extra device sync. A non-finite norm on a step the fp16 loss scaler skipped is an overflow
    handled as designed (nothing was updated), not a non-finite run.

    Every rank counts (the loss and norm are the same everywhere): the first non-finite iteration
    goes into each checkpoint saved after it, and retention keeps the last one saved before it
    (`checkpoint_format.prune`). A run that turns non-finite on its first iteration after a load
    says that the checkpoint is suspect."""

    def __init__(
        self, checked: bool, rank: int, loaded: str | None = None, first_iteration: int = 0
    ) -> None:
        # checked: the first non-finite value stops the run (check_finite); rank 0 speaks
        self.quiet = checked or rank != 0
        self.loaded, self.first_iteration = loaded, first_iteration
        self.iterations: list[int] = []

    @property
    def first(self) -> int | None:
        """The first non-finite iteration of this run (1-based), None while it has none."""
        return self.iterations[0] if self.iterations else None

    def suspect(self, iteration: int) -> str:
        """What to add to a report of a non-finite `iteration` (0-based): that the checkpoint just
        loaded is suspect, when it is the first iteration after the load."""
        if self.loaded is None or iteration != self.first_iteration:
            return ""
        return (
            f"; it is the first iteration after loading {self.loaded}: that checkpoint is suspect "
            "(corrupt, or saved from a run that was already diverging) - resume from an earlier "
            "one"
        )

    def see(self, iteration: int, loss: float, norm: float, skipped: bool = False) -> None:
        """`skipped`: the loss scaler skipped this step for an overflow (the parameters are as they
        were)."""
        if math.isfinite(loss) and (math.isfinite(norm) or skipped):
            return
        if not self.iterations and not self.quiet:
            log.warning(
                "iteration %d: lm loss %s, gradient norm %s - training goes on because "
                "ddp.check_for_nan_in_grad=false (%s)%s; set it to true to stop at the first one",
                iteration + 1,
                loss,
                norm,
                "the loss scaler skipped the step: the parameters are unchanged"
                if skipped
                else "the parameters may now be NaN",
                self.suspect(iteration),
            )
        self.iterations.append(iteration + 1)

    def report(self) -> None:
        if self.iterations and not self.quiet:
            log.warning(
                "%d iteration(s) had a non-finite lm loss or gradient norm (first: %d, last: %d)",
                len(self.iterations),
                self.iterations[0],
                self.iterations[-1],
            )
