"""The tracer's device timeline (`overlap.parallel.trace.DeviceTimeline`) with stand-in CUDA events:
marks resolve to the device's times after one synchronisation per drain, a collective's completion
is the event recorded in its future's callback (on CUDA: on a stream made to wait for the
collective), and the exposure analysis reads the same from it as from the host clock. The GPU path
itself runs in bench/gpu_check.sh.

Times are exact (the stand-in clock is set by the test), so the checks are equalities up to float
rounding."""

from __future__ import annotations

import pytest
import torch

from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel import comm
from overlap.parallel.trace import RECORDER, CommEvent, DeviceTimeline, HostTimeline, Mark, Recorder
from overlap.profiling.exposed import exposure


class Clock:
    """The device's clock, moved by the test (seconds)."""

    def __init__(self) -> None:
        self.t = 100.0


class StandInEvent:
    """torch.cuda.Event's surface: record() takes the device's time, elapsed_time() is in ms."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.t = clock, None

    def record(self) -> None:
        self.t = self.clock.t

    def elapsed_time(self, other: StandInEvent) -> float:
        return (other.t - self.t) * 1e3


class StandInWork:
    """A collective's work: its future completes when the test says the collective finished on the
    device; wait() (the stream waiting) moves the device's clock to that moment if it is later."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.future, self.done_at = clock, torch.futures.Future(), None

    def finish(self, at: float) -> None:
        self.done_at = at
        saved, self.clock.t = self.clock.t, at
        self.future.set_result(None)  # the callback records the completion event now, at `at`
        self.clock.t = saved

    def get_future(self) -> torch.futures.Future:
        return self.future

    def wait(self, timeout=None) -> None:
        self.clock.t = max(self.clock.t, self.done_at)

    def is_completed(self) -> bool:
        return self.done_at is not None


@pytest.fixture
def device():
    clock, synced = Clock(), []
    timeline = DeviceTimeline(lambda: StandInEvent(clock), lambda: synced.append(1))
    RECORDER.drain()
    RECORDER.timeline = timeline
    try:
        yield clock, synced
    finally:
        RECORDER.timeline = HostTimeline()
        RECORDER.drain()


def _collective(clock: Clock, finish_at: float | None) -> tuple[comm.CommHandle, StandInWork]:
    event = CommEvent(
        kind="ep_dispatch", op="all_to_all", group_size=2, nbytes=64, t_launch=RECORDER.mark()
    )
    RECORDER.add_comm(event)
    work = StandInWork(clock)
    handle = comm.CommHandle(event, work, None)
    if finish_at is not None:
        work.finish(finish_at)
    return handle, work


def test_marks_resolve_to_device_times_after_one_synchronisation(device):
    clock, synced = device
    with RECORDER.span("forward"):
        clock.t += 0.010
    clock.t += 0.005
    with RECORDER.span("backward"):
        clock.t += 0.020
    # nothing is known on the host before the drain
    assert isinstance(RECORDER.spans[0].t_start, Mark)
    _comm, spans = RECORDER.drain()
    assert synced == [1]
    (fwd, bwd) = spans
    assert fwd.t_end - fwd.t_start == pytest.approx(0.010)
    assert bwd.t_start - fwd.t_end == pytest.approx(0.005)
    assert bwd.t_end - bwd.t_start == pytest.approx(0.020)


def test_a_collective_hidden_behind_compute_reads_hidden(device):
    clock, _ = device
    start = clock.t
    with RECORDER.span("forward"):
        # done on the device under the compute
        handle, work = _collective(clock, finish_at=start + 0.006)
        clock.t += 0.010
    handle.wait()
    (event,), spans = RECORDER.drain()
    assert event.t_done - event.t_launch == pytest.approx(0.006)
    assert event.t_wait_end == pytest.approx(event.t_wait_start)  # the stream did not wait
    row = exposure([event], spans)["ep_dispatch"]
    assert row.total_ms == pytest.approx(6.0) and row.exposed_ms == pytest.approx(0.0)


def test_a_collective_longer_than_the_compute_is_exposed_for_the_rest(device):
    clock, _ = device
    start = clock.t
    with RECORDER.span("forward"):
        handle, work = _collective(clock, finish_at=None)
        clock.t += 0.010
    # the host enqueued the wait long before: the device finishes it at +15 ms
    work.finish(start + 0.015)
    handle.wait()
    (event,), spans = RECORDER.drain()
    assert event.t_done - event.t_launch == pytest.approx(0.015)
    assert event.t_wait_end - event.t_wait_start == pytest.approx(0.005)
    row = exposure([event], spans)["ep_dispatch"]
    assert row.total_ms == pytest.approx(15.0) and row.exposed_ms == pytest.approx(5.0)


def test_without_a_future_the_completion_is_the_end_of_the_wait(device):
    clock, _ = device

    class NoFuture(StandInWork):
        def get_future(self):
            raise RuntimeError("Work::getFuture not implemented.")

    event = CommEvent(
        kind="dp_rs", op="reduce_scatter", group_size=2, nbytes=8, t_launch=RECORDER.mark()
    )
    RECORDER.add_comm(event)
    work = NoFuture(clock)
    handle = comm.CommHandle(event, work, None)
    work.done_at = clock.t + 0.004
    handle.wait()
    (event,), _spans = RECORDER.drain()
    assert event.t_done is None and event.t_wait_end - event.t_launch == pytest.approx(0.004)
    assert exposure([event], [])["dp_rs"].total_ms == pytest.approx(4.0)  # up to the wait's end


def test_the_host_never_decides_on_completion_on_a_device_timeline(device):
    """delay_wgrad on a device timeline: every queued weight GEMM is issued before the wait (the GPU
    runs them beside the collective), even for a collective that already finished on the device."""
    clock, _ = device
    assert not comm.completion_visible()
    handle, _work = _collective(clock, finish_at=clock.t)
    store, ran = WeightGradStore(), []
    for i in range(3):
        store.put(lambda i=i: ran.append(i))
    store.wait_filling(handle)
    assert ran == [0, 1, 2] and not store.queue


def test_a_recorder_on_the_host_clock_resolves_nothing():
    recorder, calls = Recorder(), []
    recorder.timeline.synchronize = lambda: calls.append(1)
    with recorder.span("x"):
        pass
    (span,) = recorder.drain()[1]
    assert isinstance(span.t_start, float) and calls == []


def test_a_send_is_dropped_once_the_device_reports_it_complete_without_a_wait(device):
    """`CommHandle.reap`: the pipeline drops the sends of released outputs this way on NCCL - a
    query, never a wait (no stream is made to wait on the send)."""
    clock, _ = device
    handle, work = _collective(clock, finish_at=None)
    waited = []
    work.wait = lambda timeout=None: waited.append(1)
    assert not handle.reap() and handle in comm.outstanding()
    work.finish(clock.t + 0.002)
    assert handle.reap() and handle not in comm.outstanding() and not waited
    assert handle.reap()  # and it stays dropped
