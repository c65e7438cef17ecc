"""Stand-ins for the CUDA surface the runtime's streams use
(`overlap.parallel.streams.CudaStreams`), so the CUDA branches run on a CPU with times the test
sets.

One device clock (`Clock`, seconds, moved by the test). The compute stream is where the host's work
goes: waiting there for a work moves the clock to the work's end (the stream stalls). Any other
stream (`new_stream`) keeps what it was made to wait for; an event recorded there fires at the
latest of its recording time and the ends of everything its stream waited for - resolved lazily, as
CUDA resolves it on the device, so a work may finish after the event was recorded. Every wait is
logged with its stream, and every stream says whether it came from the high-priority pool.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from overlap.parallel.streams import CudaStreams


class Clock:
    """The device's clock, moved by the test (seconds)."""

    def __init__(self) -> None:
        self.t = 100.0


class StandInStream:
    def __init__(self, name: str, high_priority: bool) -> None:
        self.name, self.high_priority = name, high_priority
        self.awaited: list[Any] = []  # works and streams' positions this stream waits for


class StandInEvent:
    """torch.cuda.Event's surface: record() on the current (or given) stream, elapsed_time() in
    ms, synchronize(), query()."""

    def __init__(self, streams: StandInStreams) -> None:
        self.streams, self.t_record, self.awaited = streams, None, []

    def record(self, stream: StandInStream | None = None) -> None:
        stream = stream or self.streams.current
        self.t_record, self.awaited = self.streams.clock.t, list(stream.awaited)

    @property
    def t(self) -> float:
        ends = [w.done_at if hasattr(w, "done_at") else w for w in self.awaited]
        if any(e is None for e in ends):
            raise AssertionError("an event resolved before the work it waits for ended")
        return max([self.t_record, *ends])

    def elapsed_time(self, other: StandInEvent) -> float:
        return (other.t - self.t) * 1e3

    def synchronize(self) -> None:
        self.streams.clock.t = max(self.streams.clock.t, self.t)

    def query(self) -> bool:
        return True


class StandInWork:
    """A collective's work. `wait()` orders the current stand-in stream after it: the compute
    stream's clock moves to its end; another stream keeps it. `future_done_at_launch`: its future is
    already complete with an empty list, as NCCL completes a coalesced batch's."""

    def __init__(self, streams: StandInStreams, future_done_at_launch: bool = False) -> None:
        self.streams, self.done_at = streams, None
        self.future = torch.futures.Future()
        if future_done_at_launch:
            self.future.set_result([])

    def finish(self, at: float) -> None:
        self.done_at = at
        if not self.future.done():
            saved, self.streams.clock.t = self.streams.clock.t, at
            self.future.set_result(None)
            self.streams.clock.t = saved

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self, timeout=None) -> None:
        stream = self.streams.current
        self.streams.waits.append((stream.name, self))
        if stream is self.streams.compute:
            self.streams.clock.t = max(self.streams.clock.t, self.done_at)
        else:
            stream.awaited.append(self)

    def is_completed(self) -> bool:
        return self.done_at is not None


class StandInStreams(CudaStreams):
    """`CudaStreams` on the stand-ins (module docstring); `on_device` is True for every tensor, so a
    CPU tensor takes the CUDA branch."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.compute = StandInStream("compute", high_priority=False)
        self.current = self.compute
        self.made: list[StandInStream] = []
        self.waits: list[tuple[str, StandInWork]] = []  # (stream name, work) per wait
        self.kept: list[tuple[torch.Tensor, str]] = []

    def on_device(self, tensor: torch.Tensor) -> bool:
        return True

    def new_stream(self, device: torch.device) -> StandInStream:
        stream = StandInStream(f"pool-high-{len(self.made)}", high_priority=True)
        self.made.append(stream)
        return stream

    @contextmanager
    def use(self, stream: StandInStream) -> Iterator[None]:
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved

    def event(self, timing: bool = False) -> StandInEvent:
        return StandInEvent(self)

    def follow_current(self, stream: StandInStream) -> None:
        stream.awaited.append(self.clock.t)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def keep_for(self, tensor: torch.Tensor, stream: StandInStream) -> None:
        self.kept.append((tensor, stream.name))

    def synchronize(self) -> None:
        pass
