"""A lightweight recorder of communication events and compute spans, fed by `comm.py` and the schedules.

It is always on: one small object per collective and per span costs microseconds, far below the step times we care
about, and it is what lets a run say how much communication was hidden. Analysis lives in `overlap.profiling`.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator


def now() -> float:
    return time.perf_counter()


@dataclass
class CommEvent:
    """One collective: when it was launched, when its data was complete, and when the caller waited for it.

    `t_ready` is when every member had posted it, known on a modelled link only (the launch board for collectives,
    the sender's stamp for a receive): the link carries the data from then on, so a wait before it waits for a late
    peer (load imbalance), not for the link. None where it is not known (a real link, a send)."""

    kind: str
    op: str
    group_size: int
    nbytes: int
    t_launch: float
    t_done: float | None = None
    t_wait_start: float | None = None
    t_wait_end: float | None = None
    t_ready: float | None = None


@dataclass
class Span:
    """A compute interval (forward/backward of a part, optimizer step, ...)."""

    name: str
    t_start: float
    t_end: float


DrainSink = Callable[[list[CommEvent], list[Span]], None]


@dataclass
class Recorder:
    """Collects events until drained. `on_drain`, when set, receives every drained batch: the trainer drains once
    before its first iteration (a reset) and then once per iteration, so an instrument that sets a sink (the
    `overlap run --trace/--metrics` exposure report) sees each iteration's events without the trainer knowing it."""

    comm: list[CommEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    on_drain: DrainSink | None = None

    def add_comm(self, event: CommEvent) -> None:
        with self.lock:
            self.comm.append(event)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = now()
        try:
            yield
        finally:
            self.spans.append(Span(name, start, now()))

    def drain(self) -> tuple[list[CommEvent], list[Span]]:
        """Return everything recorded since the last drain and start afresh (one step at a time)."""
        with self.lock:
            comm, spans = self.comm, self.spans
            self.comm, self.spans = [], []
        if self.on_drain is not None:
            self.on_drain(comm, spans)
        return comm, spans

    def discard(self) -> None:
        """Forget what was recorded outside the iterations (a checkpoint's gathers between two steps): no step's
        communication table should count it, and the per-iteration consumers (`on_drain`) never see it."""
        with self.lock:
            self.comm, self.spans = [], []


RECORDER = Recorder()
