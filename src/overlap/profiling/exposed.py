"""Exposed communication: how much of each kind of collective the compute thread actually had to sit
through.

For one rank and one stretch of time (an iteration):
- communication of a kind occupies the union of its ops' [t_launch, t_done] intervals (its *total*
  time);
- the compute thread is *busy* during the union of compute spans minus the union of wait intervals
  [t_wait_start, t_wait_end]: a span that contains a blocking wait is not computing while it waits;
- *exposed* time of a kind is the part of its total time during which the compute thread was not
  busy.
So a synchronous collective inside a compute span is fully exposed, an asynchronous one launched
before compute and waited for after it is hidden for as long as the compute ran, and time outside
every span (Python glue that no span covers) counts as not busy: an overlap claim never rests on
time nobody accounted for.

On a modelled link the events also say when every member had posted an op (`CommEvent.t_ready`).
Exposed time of a kind during which one of its ops was still waiting for a member to post, and none
of its ops was on the link, is *peer wait*: the rank sat idle because a peer was behind (load
imbalance: an untrained router that gives one rank's experts more rows), which no overlap of
communication with compute can hide - the run without overlap pays it as a wait too. The rest of the
exposed time is the link's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from overlap.parallel.trace import CommEvent, Span

Interval = tuple[float, float]
ALL = "all"  # the row that unions every kind (overlapping kinds are not double counted)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points; empty and reversed intervals are
    dropped."""
    merged: list[Interval] = []
    for start, end in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def subtract(base: Sequence[Interval], cut: Sequence[Interval]) -> list[Interval]:
    """`base` minus `cut`, both sorted and disjoint (as `union` returns them)."""
    out: list[Interval] = []
    j = 0
    for start, end in base:
        while j < len(cut) and cut[j][1] <= start:
            j += 1
        k = j
        cursor = start
        while k < len(cut) and cut[k][0] < end:
            if cut[k][0] > cursor:
                out.append((cursor, cut[k][0]))
            cursor = max(cursor, cut[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def comm_interval(event: CommEvent) -> Interval | None:
    """[launch, completion] of one op; None if it never completed (nobody waited and no completion
    was seen)."""
    end = event.t_done if event.t_done is not None else event.t_wait_end
    return None if end is None else (event.t_launch, end)


def busy_intervals(spans: Iterable[Span], events: Iterable[CommEvent]) -> list[Interval]:
    waits = union(
        (e.t_wait_start, e.t_wait_end)
        for e in events
        if e.t_wait_start is not None and e.t_wait_end is not None
    )
    return subtract(union((s.t_start, s.t_end) for s in spans), waits)


@dataclass
class KindExposure:
    total_ms: float = 0.0
    exposed_ms: float = 0.0
    count: int = 0
    nbytes: int = 0
    # The part of exposed_ms spent waiting for a late peer (see the module docstring); None where no
    # op of the kind knew its ready time (a real link): unknown, not zero.
    peer_wait_ms: float | None = None

    @property
    def hidden_pct(self) -> float:
        return 100.0 * (1.0 - self.exposed_ms / self.total_ms) if self.total_ms > 0 else 100.0

    def add(self, other: KindExposure) -> None:
        self.total_ms += other.total_ms
        self.exposed_ms += other.exposed_ms
        self.count += other.count
        self.nbytes += other.nbytes
        if other.peer_wait_ms is not None:
            self.peer_wait_ms = (self.peer_wait_ms or 0.0) + other.peer_wait_ms


def exposure(events: Sequence[CommEvent], spans: Sequence[Span]) -> dict[str, KindExposure]:
    """Total and exposed communication per kind, plus the `ALL` row, for one rank's events and
    spans."""
    busy = busy_intervals(spans, events)
    by_kind: dict[str, list[CommEvent]] = {}
    for e in events:
        by_kind.setdefault(e.kind, []).append(e)
    out: dict[str, KindExposure] = {}
    groups = [(kind, evs) for kind, evs in sorted(by_kind.items())]
    if events:
        groups.append((ALL, list(events)))
    for kind, evs in groups:
        occupied = union(iv for iv in map(comm_interval, evs) if iv is not None)
        out[kind] = KindExposure(
            total_ms=length(occupied) * 1e3,
            exposed_ms=length(subtract(occupied, busy)) * 1e3,
            count=len(evs),
            nbytes=sum(e.nbytes for e in evs),
            peer_wait_ms=_peer_wait_ms(evs, busy),
        )
    return out


def _peer_wait_ms(events: Sequence[CommEvent], busy: Sequence[Interval]) -> float | None:
    """Exposed time while some op was waiting for a member to post and no op was on the link (module
    docstring); None if no op knew its ready time. An op whose ready time is unknown (a send: the
    receiver's posting time does not travel back) counts as on the link from its launch, so where
    sends share a kind with receives (the TP ring) or fly beside them (the `all` row), this is a
    lower bound."""
    ready = [e for e in events if e.t_ready is not None]
    if not ready:
        return None
    waiting = union((e.t_launch, e.t_ready) for e in ready)
    on_link = union(
        ((e.t_ready, iv[1]) if e.t_ready is not None else iv)
        for e, iv in ((e, comm_interval(e)) for e in events)
        if iv is not None
    )
    return length(subtract(subtract(waiting, on_link), busy)) * 1e3


def mean_exposure(per_iteration: Sequence[dict[str, KindExposure]]) -> dict[str, KindExposure]:
    """Per-iteration mean of each kind (a kind absent from an iteration counts as zero there)."""
    total: dict[str, KindExposure] = {}
    for it in per_iteration:
        for kind, k in it.items():
            total.setdefault(kind, KindExposure()).add(k)
    n = max(len(per_iteration), 1)
    return {
        kind: KindExposure(
            k.total_ms / n,
            k.exposed_ms / n,
            round(k.count / n),
            round(k.nbytes / n),
            None if k.peer_wait_ms is None else k.peer_wait_ms / n,
        )
        for kind, k in total.items()
    }


def format_table(rows: dict[str, KindExposure], title: str) -> str:
    """A table of kind, ops, MB, total ms, exposed ms, hidden % (and, where the link knew when every
    member had posted, the exposed ms that were peer wait): every column as wide as its header or
    its widest cell, so it stays aligned for any kind name and any magnitude."""
    peers = any(r.peer_wait_ms is not None for r in rows.values())
    header = ("kind", "ops", "MB", "total ms", "exposed ms", "hidden %") + (
        ("of it peer wait ms",) if peers else ()
    )
    body = [
        (
            kind,
            str(r.count),
            f"{r.nbytes / 1e6:.2f}",
            f"{r.total_ms:.2f}",
            f"{r.exposed_ms:.2f}",
            f"{r.hidden_pct:.0f}%",
        )
        + ((("-" if r.peer_wait_ms is None else f"{r.peer_wait_ms:.2f}"),) if peers else ())
        for kind, r in ((k, rows[k]) for k in sorted(rows, key=lambda k: (k == ALL, k)))
    ]
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:  # the kind left-aligned, numbers right-aligned
        return " ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        )

    return "\n".join([title, line(header), *map(line, body)])
