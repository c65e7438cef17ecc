"""A lightweight recorder of communication events and compute spans, fed by `comm.py` and the
schedules.

It is always on: one small object per collective and per span costs microseconds, far below the step
times we care about, and it is what lets a run say how much communication was hidden. Analysis lives
in `overlap.profiling`.

Each run owns its `Recorder` and makes it active for its extent (`recording`: `overlap run`, a dry
run, each job of the tests' shared worlds); the runtime records into the active one (`recorder()`),
so two runs in one process never mix their events or their timelines.

Times come from a timeline (`Recorder.timeline`), because what "now" means depends on who runs the
work:
- `HostTimeline` (gloo): the host runs the compute and blocks in `wait()`; a time is the host clock,
  and a collective's completion is taken from its work's future when it fires.
- `DeviceTimeline` (CUDA): the host only enqueues. A time is a CUDA event recorded on the current
  stream, which takes its timestamp when the GPU gets there. A collective's completion is an event
  recorded on the runtime's own timing stream after that stream was made to wait for the collective
  (`work.wait()` there), so it times when the collective finished on the GPU, not when the host
  enqueued it (NCCL's futures complete at enqueue, and `wait()` blocks the stream, not the host).
  Not a callback of the work's future: NCCL completes a coalesced batch's future with an empty
  tensor list, so a callback's stream waits for nothing and a batched p2p would read done at
  launch; and `Future.then` runs on the low-priority stream pool that NCCL's communicators share
  (`overlap.parallel.streams`). With one hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`) a wait put
  on the timing stream at launch would hold every later submission until the collective ended, so
  there the timing wait is issued where the compute stream waits for the collective anyway (and, for
  an op never waited, at the drain): exact when the collective ends after that point, an upper bound
  of a collective that was already hidden. Marks resolve to seconds at `drain`, after one device
  synchronisation per drain (once per training iteration).
- `RulesTimeline` (gloo under NCCL's rules, `comm.CommSession(nccl_rules=True)`): the device
  timeline's code path on the host clock, its completion marks set when gloo's own works complete
  (what the CUDA events would time), since under the rules the futures the runtime sees complete at
  posting; it places its timing waits where the device timeline would, so the recorded program
  shows them.
On the device timelines a collective's completion is not visible to the host before `drain`
(`Timeline.host_sees_completion` is False): nothing in the runtime may decide on it.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from overlap.parallel.run_local import RunLocal


def now() -> float:
    return time.perf_counter()


class Mark:
    """A time not known yet on the host (a device timeline's event); `Timeline.resolve` turns it
    into seconds."""

    __slots__ = ("event", "t")

    def __init__(self, event: Any = None, t: float | None = None) -> None:
        self.event, self.t = event, t


Time = float | Mark | None


@dataclass
class CommEvent:
    """One collective: when it was launched, when its data was complete, and when the caller waited
    for it.

    `t_ready` is when every member had posted it, known on a modelled link only (the launch board
    for collectives, the sender's stamp for a receive): the link carries the data from then on, so a
    wait before it waits for a late peer (load imbalance), not for the link. None where it is not
    known (a real link, a send). On a device timeline the fields hold `Mark`s until the recorder
    drains them."""

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


class Timeline:
    """Where times come from (module docstring): `mark()` now, `resolve()` a mark into seconds after
    `synchronize()`, `settle()` once a drain has resolved everything."""

    name = "host clock"
    host_sees_completion = True
    # device timelines: whether a collective's end is timed at its launch (`_DeviceTiming`)
    times_at_launch = True

    def mark(self) -> Time:
        return now()

    def time_done(self, mark: Time) -> bool:
        """The compute stream now waits for the op of `mark`; whether a timing wait was issued
        here (only a device timeline with one hardware queue does, `_DeviceTiming`)."""
        return False

    def step_end(self, end: float, comm: Sequence[CommEvent]) -> float:
        """When a step that the host finished at `end` ended: on the host clock, then (what the
        host still has in flight is waited for, and paid, by the next step)."""
        return end

    def synchronize(self) -> None:
        pass

    def resolve(self, value: Time) -> float | None:
        return value.t if isinstance(value, Mark) else value

    def settle(self) -> None:
        pass


class HostTimeline(Timeline):
    """The host clock (gloo: the host computes, and blocks in waits); completion from the work's
    future (comm.py)."""


class _DeviceTiming(Timeline, ABC):
    """Where a device timeline times a collective's end (module docstring): at launch, or with one
    hardware queue (`one_queue`) where the compute stream waits for it (`time_done`) and, for an op
    never waited, at the drain. `_issue(mark, posted)` times it."""

    host_sees_completion = False

    def __init__(self, one_queue: bool = False) -> None:
        self.one_queue = one_queue
        # one queue: the ops whose timing wait is not issued yet, by their mark
        self._untimed: dict[int, tuple[Mark, Any]] = {}

    @property
    def times_at_launch(self) -> bool:
        return not self.one_queue

    def done_mark(self, posted: Any) -> Mark | None:
        """The mark of `posted`'s end on the device (`posted`: what comm posted, with its `works`),
        timed now or deferred (class docstring)."""
        mark = self._arm(posted)
        if mark is not None:
            if self.one_queue:
                self._untimed[id(mark)] = (mark, posted)
            else:
                self._issue(mark, posted)
        return mark

    def time_done(self, mark: Time) -> bool:
        """The compute stream has just been made to wait for the op of `mark`: with one queue, time
        it now (no new dependency: everything after this point waits for it anyway). Whether a
        timing wait was issued."""
        entry = self._untimed.pop(id(mark), None) if isinstance(mark, Mark) else None
        if entry is not None:
            self._issue(*entry)
        return entry is not None

    def _flush(self) -> None:
        """The drain: time the ops never waited (sends dropped once complete)."""
        untimed, self._untimed = self._untimed, {}
        for mark, posted in untimed.values():
            self._issue(mark, posted)

    def _arm(self, posted: Any) -> Mark | None:
        return Mark()

    @abstractmethod
    def _issue(self, mark: Mark, posted: Any) -> None:
        """Time `posted`'s end into `mark` (its timing wait is issued here)."""


class DeviceTimeline(_DeviceTiming):
    """CUDA events, resolved at drain (module docstring). `event_factory` makes an event with
    `record()` (on the current stream) and `elapsed_time(other)` (ms), as
    `torch.cuda.Event(enable_timing=True)`; a collective's end is timed on the named "timing" stream
    of `overlap.parallel.streams`, whose CUDA surface tests replace with stand-ins too."""

    name = "GPU timeline (CUDA events)"

    def __init__(
        self,
        event_factory: Callable[[], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
        one_queue: bool = False,
    ) -> None:
        super().__init__(one_queue)
        if event_factory is None:
            import torch

            event_factory = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
            synchronize = synchronize or torch.cuda.synchronize
        self._new, self._sync = event_factory, synchronize or (lambda: None)
        # (reference event, its time): the first event recorded, then after each drain the latest
        # one resolved. Elapsed times between CUDA events are float32 milliseconds, which from one
        # fixed origin would lose microseconds after minutes of a run (0.5 ms steps after an hour).
        self._origin: tuple[Any, float] | None = None
        self._latest: tuple[Any, float] | None = None

    def _record(self) -> Any:
        event = self._new()
        event.record()
        if self._origin is None:
            self._origin = (event, now())
        return event

    def mark(self) -> Mark:
        return Mark(self._record())

    def _issue(self, mark: Mark, posted: Any) -> None:
        """The timing stream waits for every work of the call (one for a whole NCCL batch), then
        records the mark's event: it fires when the collective has ended on the device."""
        from overlap.parallel import streams

        timing = streams.named("timing", None)
        with streams.api().use(timing):
            for work in getattr(posted, "works", [posted]):
                work.wait()
            mark.event = self._record()

    def synchronize(self) -> None:
        self._flush()
        self._sync()

    def step_end(self, end: float, comm: Sequence[CommEvent]) -> float:
        """The latest of the step's last compute event and its collectives' ends: the drain's
        synchronisation completes whatever the step left in flight (the first parameter-gather
        bucket, launched in the optimizer step) before the next step starts, so that time belongs
        to no later step."""
        return max([end, *(e.t_done for e in comm if e.t_done is not None)])

    def resolve(self, value: Time) -> float | None:
        if not isinstance(value, Mark):
            return value
        if value.event is None or self._origin is None:
            return None
        origin, t0 = self._origin
        t = t0 + origin.elapsed_time(value.event) / 1e3
        if self._latest is None or t > self._latest[1]:
            self._latest = (value.event, t)
        return t

    def settle(self) -> None:
        """Move the origin to the latest event resolved: the next drain's events are measured from
        close by."""
        if self._latest is not None:
            self._origin, self._latest = self._latest, None


class RulesTimeline(_DeviceTiming):
    """gloo under NCCL's rules (module docstring): the host clock, and the device timeline's path
    for completion, set when gloo's own works (`works`, the ones behind what the runtime sees)
    complete; its timing waits are placed as the device timeline's (`one_queue`), for the program
    recorder."""

    name = "host clock under NCCL's rules (completion from gloo's works)"

    def _arm(self, posted: Any) -> Mark | None:
        import torch

        works = getattr(posted, "works", [posted])
        try:
            futures = [w.get_future() for w in works]
        except RuntimeError:
            return None  # (a gloo op without a future) completion is known at the wait only
        mark = Mark()

        def record(_fut: Any) -> None:
            mark.t = now()

        # runs on gloo's thread once every work is done (host threads: no stream is involved)
        torch.futures.collect_all(futures).then(record)
        return mark

    def _issue(self, mark: Mark, posted: Any) -> None:
        """Nothing to do on the host clock: gloo's futures set the mark (`_arm`)."""

    def synchronize(self) -> None:
        self._flush()


@dataclass
class Recorder:
    """Collects events until drained. `on_drain`, when set, receives every drained batch: the
    trainer drains once before its first iteration (a reset) and then once per iteration, so an
    instrument that sets a sink (the `overlap run --trace/--metrics` exposure report) sees each
    iteration's events without the trainer knowing it."""

    comm: list[CommEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    on_drain: Callable[[list[CommEvent], list[Span]], None] | None = None
    timeline: Timeline = field(default_factory=HostTimeline)

    def mark(self) -> Time:
        return self.timeline.mark()

    def add_comm(self, event: CommEvent) -> None:
        with self.lock:
            self.comm.append(event)

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        start = self.timeline.mark()
        try:
            yield
        finally:
            self.spans.append(Span(name, start, self.timeline.mark()))

    def drain(self) -> tuple[list[CommEvent], list[Span]]:
        """Return everything recorded since the last drain and start afresh (one step at a time),
        every time in seconds (a device timeline's marks resolved after one synchronisation)."""
        with self.lock:
            comm, spans = self.comm, self.spans
            self.comm, self.spans = [], []
        self._resolve(comm, spans)
        if self.on_drain is not None:
            self.on_drain(comm, spans)
        return comm, spans

    def _resolve(self, comm: Sequence[CommEvent], spans: Sequence[Span]) -> None:
        # exactly the host clock: every time is a float
        if type(self.timeline) is HostTimeline:
            return
        self.timeline.synchronize()
        for item in (*comm, *spans):
            for f in fields(item):
                value = getattr(item, f.name)
                if isinstance(value, Mark):
                    setattr(item, f.name, self.timeline.resolve(value))
        self.timeline.settle()

    def step_seconds(self, start: Time, end: Time, comm: Sequence[CommEvent]) -> float:
        """A step's time from its first event to its last (`Timeline.step_end`): `start` and `end`
        are marks taken around the step's host work, `comm` the step's drained events (call after
        the drain, which resolved them)."""
        first, last = self.timeline.resolve(start), self.timeline.resolve(end)
        return self.timeline.step_end(last, comm) - first

    def discard(self) -> None:
        """Forget what was recorded outside the iterations (a checkpoint's gathers between two
        steps): no step's communication table should count it, and the per-iteration consumers
        (`on_drain`) never see it."""
        with self.lock:
            self.comm, self.spans = [], []


# The active run's recorder (`recording`), found as comm's session is
# (`overlap.parallel.run_local`), so each run - `overlap run`, a dry run, a test's job - records
# into its own, its backward on autograd's device threads included.
_ACTIVE: RunLocal[Recorder] = RunLocal("overlap_recorder")


def recorder() -> Recorder:
    """The active run's recorder; outside any run's `recording`, a new one at each call, whose
    events nobody reads (a model run outside a run records nothing)."""
    active = _ACTIVE.get()
    return Recorder() if active is None else active


def active_recorder() -> Recorder:
    """The active run's recorder, for what must set it up (a timeline); RuntimeError outside a
    run's `recording`, where a setting would be lost."""
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("no run's recorder is active: enter trace.recording(Recorder()) first")
    return active


@contextmanager
def recording(run: Recorder) -> Iterator[Recorder]:
    """Make `run` the active recorder for the `with` block (what was active before comes back)."""
    with _ACTIVE.activate(run):
        yield run
