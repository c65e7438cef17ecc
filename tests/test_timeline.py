"""The tracer's device timeline (`overlap.parallel.trace.DeviceTimeline`) on stand-in CUDA streams
and events (tests/stand_in_cuda.py): marks resolve to the device's times after one synchronisation
per drain, a collective's completion is the event recorded on the runtime's timing stream after it
waited for the collective (at launch, or with one hardware queue where the compute stream waits),
and the exposure analysis reads the same from it as from the host clock. The GPU path itself runs
in bench/gpu_check.sh.

Times are exact (the stand-in clock is set by the test), so the checks are equalities up to float
rounding."""

from __future__ import annotations

import pytest

from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel import comm, streams
from overlap.parallel.trace import (
    CommEvent,
    DeviceTimeline,
    HostTimeline,
    Mark,
    Recorder,
    recorder,
    recording,
)
from overlap.profiling.exposed import exposure
from tests.stand_in_cuda import Clock, StandInStreams, StandInWork


@pytest.fixture(autouse=True)
def run_recorder():
    """Each test is a run with a recorder of its own (`trace.recording`)."""
    with recording(Recorder()) as rec:
        yield rec


@pytest.fixture
def standins(run_recorder):
    """The stand-in CUDA surface (tests/stand_in_cuda.py) with a device timeline on the test's
    recorder."""
    api = StandInStreams()
    synced: list[int] = []
    with streams.set_api(api):
        run_recorder.timeline = DeviceTimeline(lambda: api.event(True), lambda: synced.append(1))
        yield api, synced


@pytest.fixture
def device(standins):
    api, synced = standins
    return api.clock, synced


def _collective(
    clock: Clock, finish_at: float | None, kind: str = "ep_dispatch", batched: bool = False
) -> tuple[comm.CommHandle, StandInWork]:
    """A collective (or, `batched`, a batch of p2p ops: its future complete at launch with an empty
    list, as NCCL's coalesced batch) launched now on the stand-in device."""
    event = CommEvent(kind=kind, op="x", group_size=2, nbytes=64, t_launch=recorder().mark())
    recorder().add_comm(event)
    work = StandInWork(streams.api(), future_done_at_launch=batched)
    handle = comm.CommHandle(event, comm._Posted([work]), None)
    if finish_at is not None:
        work.finish(finish_at)
    return handle, work


def test_marks_resolve_to_device_times_after_one_synchronisation(device):
    clock, synced = device
    with recorder().span("forward"):
        clock.t += 0.010
    clock.t += 0.005
    with recorder().span("backward"):
        clock.t += 0.020
    # nothing is known on the host before the drain
    assert isinstance(recorder().spans[0].t_start, Mark)
    _comm, spans = recorder().drain()
    assert synced == [1]
    (fwd, bwd) = spans
    assert fwd.t_end - fwd.t_start == pytest.approx(0.010)
    assert bwd.t_start - fwd.t_end == pytest.approx(0.005)
    assert bwd.t_end - bwd.t_start == pytest.approx(0.020)


def test_a_collective_hidden_behind_compute_reads_hidden(device):
    clock, _ = device
    start = clock.t
    with recorder().span("forward"):
        # done on the device under the compute
        handle, work = _collective(clock, finish_at=start + 0.006)
        clock.t += 0.010
    handle.wait()
    (event,), spans = recorder().drain()
    assert event.t_done - event.t_launch == pytest.approx(0.006)
    assert event.t_wait_end == pytest.approx(event.t_wait_start)  # the stream did not wait
    row = exposure([event], spans)["ep_dispatch"]
    assert row.total_ms == pytest.approx(6.0) and row.exposed_ms == pytest.approx(0.0)


def test_a_collective_longer_than_the_compute_is_exposed_for_the_rest(device):
    clock, _ = device
    start = clock.t
    with recorder().span("forward"):
        handle, work = _collective(clock, finish_at=None)
        clock.t += 0.010
    # the host enqueued the wait long before: the device finishes it at +15 ms
    work.finish(start + 0.015)
    handle.wait()
    (event,), spans = recorder().drain()
    assert event.t_done - event.t_launch == pytest.approx(0.015)
    assert event.t_wait_end - event.t_wait_start == pytest.approx(0.005)
    row = exposure([event], spans)["ep_dispatch"]
    assert row.total_ms == pytest.approx(15.0) and row.exposed_ms == pytest.approx(5.0)


class NoFuture(StandInWork):
    """A work whose future the timing must not use (gloo's reduce-scatter has none; NCCL's batch
    completes its future at launch, and `Future.then` runs on a communicator's pool stream)."""

    def get_future(self):
        raise AssertionError("the device timeline timed a collective through its future")


def test_a_collective_is_timed_without_its_future_on_a_named_high_priority_stream(standins):
    """Issue 47 item 6: the timing wait goes on the runtime's own "timing" stream, drawn once from
    the high-priority pool (which NCCL's communicators do not use), never through `Future.then`,
    whose callbacks run on the low-priority pool that the communicators' streams come from."""
    api, _ = standins
    clock = api.clock
    works, start = [], clock.t
    for kind in ("dp_rs", "ep_dispatch", "pp_send_fwd"):
        event = CommEvent(kind=kind, op="x", group_size=2, nbytes=8, t_launch=recorder().mark())
        recorder().add_comm(event)
        work = NoFuture(api)
        works.append((comm.CommHandle(event, comm._Posted([work]), None), work))
        clock.t += 0.001
    for (handle, work), end in zip(works, (0.006, 0.010, 0.014)):
        work.finish(start + end)  # launched at +0, +1, +2 ms
        handle.wait()
    events, _spans = recorder().drain()
    timing = [name for name, _work in api.waits if name != "compute"]
    assert len(timing) == 3 and len(set(timing)) == 1
    (stream,) = api.made
    assert stream.name == timing[0] and stream.high_priority
    assert [round((e.t_done - e.t_launch) * 1e3, 6) for e in events] == [6.0, 9.0, 12.0]
    assert exposure(events, [])["dp_rs"].total_ms == pytest.approx(6.0)


def test_a_batched_p2p_is_timed_to_its_end_on_the_device(device):
    """Issue 47 item 5: NCCL completes a coalesced batch's future with an empty tensor list, at
    launch: a callback on it times the batch at its launch (0 ms, 100% hidden). The timing stream
    waits for the work itself, so the batch's end is its end on the device."""
    clock, _ = device
    start = clock.t
    with recorder().span("forward"):
        handle, work = _collective(clock, None, kind="pp_send_fwd", batched=True)
        clock.t += 0.002
    work.finish(start + 0.009)
    handle.wait()
    (event,), spans = recorder().drain()
    assert event.t_done >= event.t_launch
    assert event.t_done - event.t_launch == pytest.approx(0.009)
    assert exposure([event], spans)["pp_send_fwd"].exposed_ms == pytest.approx(7.0)


def test_with_one_hardware_queue_the_end_is_timed_where_the_compute_stream_waits(standins):
    """CUDA_DEVICE_MAX_CONNECTIONS=1: a timing wait at launch would hold every later submission
    until the collective ended. The timing wait is issued right after the compute stream's own wait
    (nothing new waits), and for an op never waited at the drain."""
    api, _ = standins
    clock = api.clock
    recorder().timeline = DeviceTimeline(lambda: api.event(True), one_queue=True)
    waited, work = _collective(clock, None)
    never, other = _collective(clock, clock.t + 0.001, kind="pp_send_fwd")
    assert api.waits == []  # nothing waits at launch
    clock.t += 0.003
    work.finish(clock.t + 0.005)
    waited.wait()
    assert [name for name, _w in api.waits] == ["compute", api.made[0].name]
    clock.t += 0.002
    events, _spans = recorder().drain()
    assert [name for name, w in api.waits if w is other] == [api.made[0].name]
    first, second = events
    assert first.t_done - first.t_launch == pytest.approx(0.008)  # ended after the wait: exact
    # already done when the drain timed it: an upper bound (the drain's moment)
    assert second.t_done - second.t_launch == pytest.approx(0.010)
    never.wait()  # nothing is left outstanding for the next test


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


def test_a_step_lasts_until_its_last_collective_ends_on_the_device(device):
    """Issue 47 item 9: the optimizer step launches the first parameter-gather bucket, which ends on
    the device after the host finished the step, inside the drain's synchronisation. The step's time
    runs from its first event to its last (`Recorder.step_seconds`), so that bucket is counted; the
    host clock alone left it to no step."""
    clock, _ = device
    start = recorder().mark()
    with recorder().span("optimizer"):
        clock.t += 0.004
        handle, work = _collective(clock, None, kind="dp_ag")
    end = recorder().mark()
    work.finish(clock.t + 0.006)  # on the device, while the host drains
    events, _spans = recorder().drain()
    assert recorder().step_seconds(start, end, events) == pytest.approx(0.010)
    handle.wait()
    assert HostTimeline().step_end(1.0, events) == 1.0  # the host clock: the host's own end
