"""The one place that calls torch.distributed collectives.

Every call is asynchronous underneath and returns a `CommHandle`; synchronous callers simply `wait()` at once. Every
call is named by *kind* (`tp_ag`, `tp_rs`, `tp_ar`, `ep_dispatch`, `ep_combine`, `dp_rs`, `dp_ar`, `dp_ag`, `pp_send`,
...) and recorded in the tracer with launch, completion (from the work's future, so a transfer that finished long
before anybody waited is not charged as late) and wait times.

Modes (`set_mode`):
- "real": the collective runs.
- "none": no transfer at all; outputs keep the right shapes (inputs are echoed). Losses are meaningless in this mode;
  its only use is the compute-only floor of a benchmark (`T_ideal`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from overlap.parallel.trace import RECORDER, CommEvent, now

_MODES = ("real", "none")
_mode = "real"
_group_sizes: dict[ProcessGroup, int] = {}
_group_ranks: dict[ProcessGroup, int] = {}


def set_mode(mode: str) -> None:
    global _mode
    if mode not in _MODES:
        raise ValueError(f"comm mode must be one of {_MODES}, got {mode!r}")
    _mode = mode


def get_mode() -> str:
    return _mode


def group_size(group: ProcessGroup) -> int:
    if group not in _group_sizes:
        _group_sizes[group] = dist.get_world_size(group)
    return _group_sizes[group]


def group_rank(group: ProcessGroup) -> int:
    if group not in _group_ranks:
        _group_ranks[group] = dist.get_rank(group)
    return _group_ranks[group]


class CommHandle:
    """An in-flight collective. `wait()` blocks until the data is there and returns the output tensor (if any)."""

    def __init__(self, event: CommEvent, work: dist.Work | None, result: torch.Tensor | None,
                 finish: Callable[[], None] | None = None) -> None:
        self.event = event
        self._work = work
        self._result = result
        self._finish = finish
        self._done = work is None
        if work is None:
            event.t_done = now()
        else:
            work.get_future().then(self._mark_done)

    def _mark_done(self, fut: torch.futures.Future) -> None:
        self.event.t_done = now()

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            self.event.t_wait_start = now()
            self._work.wait()
            self.event.t_wait_end = now()
            if self.event.t_done is None:  # the future's callback runs on gloo's thread; it can trail wait() slightly
                self.event.t_done = self.event.t_wait_end
            self._done = True
            if self._finish is not None:
                self._finish()
        return self._result


def _launch(kind: str, op: str, group: ProcessGroup, nbytes: int,
            run: Callable[[], dist.Work | None], result: torch.Tensor | None,
            fake: Callable[[], None] | None = None, finish: Callable[[], None] | None = None) -> CommHandle:
    event = CommEvent(kind=kind, op=op, group_size=group_size(group), nbytes=nbytes, t_launch=now())
    RECORDER.add_comm(event)
    if _mode == "none" or event.group_size == 1:
        if fake is not None:
            fake()
        if finish is not None:
            finish()
        return CommHandle(event, None, result)
    return CommHandle(event, run(), result, finish)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, kind: str, op: ReduceOp = ReduceOp.SUM) -> CommHandle:
    """In-place all-reduce of `tensor` over `group`."""
    return _launch(kind, "all_reduce", group, _nbytes(tensor),
                   lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), tensor)


def all_gather(tensor: torch.Tensor, group: ProcessGroup, kind: str) -> CommHandle:
    """Concatenate every rank's `tensor` along dim 0 (rank order); the handle returns the gathered tensor."""
    size = group_size(group)
    inp = tensor.contiguous()
    out = inp.new_empty((inp.shape[0] * size, *inp.shape[1:]))

    def fake() -> None:
        out.copy_(inp.repeat((size,) + (1,) * (inp.dim() - 1)))

    return _launch(kind, "all_gather", group, _nbytes(inp),
                   lambda: dist.all_gather_single(out, inp, group=group, async_op=True), out, fake)


def reduce_scatter(tensor: torch.Tensor, group: ProcessGroup, kind: str, op: ReduceOp = ReduceOp.SUM) -> CommHandle:
    """Reduce `tensor` over `group` and keep this rank's 1/size slice of dim 0."""
    size = group_size(group)
    inp = tensor.contiguous()
    if inp.shape[0] % size:
        raise ValueError(f"reduce_scatter ({kind}): dim 0 ({inp.shape[0]}) not divisible by group size {size}")
    out = inp.new_empty((inp.shape[0] // size, *inp.shape[1:]))

    def fake() -> None:
        out.copy_(inp.chunk(size)[group_rank(group)])

    return _launch(kind, "reduce_scatter", group, _nbytes(inp),
                   lambda: dist.reduce_scatter_single(out, inp, op=op, group=group, async_op=True), out, fake)


def all_to_all(tensor: torch.Tensor, group: ProcessGroup, kind: str,
               output_split_sizes: Sequence[int] | None = None,
               input_split_sizes: Sequence[int] | None = None) -> CommHandle:
    """All-to-all along dim 0 with optional uneven splits; the handle returns the received tensor."""
    inp = tensor.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes is not None else inp.shape[0]
    out = inp.new_empty((rows, *inp.shape[1:]))

    def fake() -> None:
        if out.shape == inp.shape:
            out.copy_(inp)
        else:
            out.zero_()

    return _launch(kind, "all_to_all", group, _nbytes(inp),
                   lambda: dist.all_to_all_single(out, inp, output_split_sizes=list(output_split_sizes or []) or None,
                                                  input_split_sizes=list(input_split_sizes or []) or None,
                                                  group=group, async_op=True), out, fake)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup, kind: str) -> CommHandle:
    """In-place broadcast from global rank `src`."""
    return _launch(kind, "broadcast", group, _nbytes(tensor),
                   lambda: dist.broadcast(tensor, src=src, group=group, async_op=True), tensor)


def barrier(group: ProcessGroup | None = None) -> None:
    """A plain barrier (start-up and shutdown only; not traced)."""
    dist.barrier(group=group)
