"""Chrome trace JSON (chrome://tracing, https://ui.perfetto.dev) of compute spans and collectives,
one process per rank.

Tracks of rank r (pid r): "compute" holds the compute spans with the blocking waits nested inside
them ("wait <kind>"), so exposed waiting is visible where it interrupts compute; "iteration" marks
each iteration's extent; one track per communication kind holds its ops from launch to completion.
Ops of one kind that are in flight together get extra lanes ("<kind> #2", ...) because a trace track
cannot show overlapping slices. Times are microseconds from the earliest event of any rank (ranks of
a local run share one monotonic clock).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from overlap.files import write_replace
from overlap.profiling.collector import RankTrace
from overlap.profiling.exposed import comm_interval


def _origin(traces: Sequence[RankTrace]) -> float:
    starts = [e.t_launch for t in traces for it in t.iterations for e in it.comm]
    starts += [s.t_start for t in traces for it in t.iterations for s in it.spans]
    return min(starts, default=0.0)


class _Tracks:
    """Integer thread ids with names, and lanes so that slices on one track never overlap."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.names: dict[str, int] = {}
        self.lane_ends: dict[str, list[float]] = {}

    def tid(self, name: str) -> int:
        return self.names.setdefault(name, len(self.names))

    def lane(self, kind: str, start: float, end: float) -> int:
        ends = self.lane_ends.setdefault(kind, [])
        for i, busy_until in enumerate(ends):
            if busy_until <= start:
                ends[i] = end
                return self.tid(kind if i == 0 else f"{kind} #{i + 1}")
        ends.append(end)
        return self.tid(kind if len(ends) == 1 else f"{kind} #{len(ends)}")

    def metadata(self) -> list[dict]:
        meta = [
            {
                "ph": "M",
                "name": "process_name",
                "pid": self.pid,
                "args": {"name": f"rank {self.pid}"},
            },
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": self.pid,
                "args": {"sort_index": self.pid},
            },
        ]
        for name, tid in self.names.items():
            meta.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"name": name},
                }
            )
            meta.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": self.pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        return meta


def _slice(name: str, pid: int, tid: int, start: float, end: float, origin: float, **args) -> dict:
    return {
        "name": name,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": (start - origin) * 1e6,
        "dur": max(end - start, 0.0) * 1e6,
        "args": args,
    }


def rank_events(trace: RankTrace, origin: float) -> list[dict]:
    tracks = _Tracks(trace.rank)
    compute, iteration_tid = tracks.tid("compute"), tracks.tid("iteration")
    out: list[dict] = []
    for it in trace.iterations:
        stamps = (
            [s.t_start for s in it.spans]
            + [s.t_end for s in it.spans]
            + [e.t_launch for e in it.comm]
        )
        stamps += [iv[1] for iv in map(comm_interval, it.comm) if iv is not None]
        if stamps:
            out.append(
                _slice(
                    f"iteration {it.iteration + 1}",
                    trace.rank,
                    iteration_tid,
                    min(stamps),
                    max(stamps),
                    origin,
                )
            )
        for s in it.spans:
            out.append(_slice(s.name, trace.rank, compute, s.t_start, s.t_end, origin))
        for e in sorted(it.comm, key=lambda e: e.t_launch):
            # Where the link knew when every member had posted this op: how long of this wait, and
            # of the op, was for them. Per op: the exposure report's peer wait is per kind
            # (profiling/exposed.py), net of the time other ops of the kind were on the link, so
            # these do not add up to it.
            ready = (
                {}
                if e.t_ready is None
                else {"ready_after_launch_ms": (e.t_ready - e.t_launch) * 1e3}
            )
            if e.t_wait_start is not None and e.t_wait_end is not None:
                peer = (
                    {}
                    if e.t_ready is None
                    else {
                        "for_late_peer_ms": max(min(e.t_ready, e.t_wait_end) - e.t_wait_start, 0.0)
                        * 1e3
                    }
                )
                out.append(
                    _slice(
                        f"wait {e.kind}",
                        trace.rank,
                        compute,
                        e.t_wait_start,
                        e.t_wait_end,
                        origin,
                        **peer,
                    )
                )
            interval = comm_interval(e)
            if interval is not None:
                out.append(
                    _slice(
                        e.op,
                        trace.rank,
                        tracks.lane(e.kind, *interval),
                        *interval,
                        origin,
                        kind=e.kind,
                        bytes=e.nbytes,
                        group_size=e.group_size,
                        **ready,
                    )
                )
    return tracks.metadata() + out


def write_chrome_trace(traces: Sequence[RankTrace], path: Path) -> None:
    origin = _origin(traces)
    events = [ev for t in sorted(traces, key=lambda t: t.rank) for ev in rank_events(t, origin)]
    networks = sorted({t.network for t in traces})
    write_replace(
        path,
        json.dumps(
            {
                "traceEvents": events,
                "displayTimeUnit": "ms",
                "otherData": {"network": "; ".join(networks), "ranks": len(traces)},
            }
        ),
    )
