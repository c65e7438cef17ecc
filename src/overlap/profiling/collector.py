"""Per-iteration capture of the tracer's events, for the exposure report, the metrics side file and
the traces.

`Collector` is installed as the run recorder's `on_drain` by `overlap run`. The trainer drains the
recorder once before its first iteration (a reset: start-up traffic is not part of any iteration)
and then once after every iteration, so the collector ignores the first drain and numbers the rest
0, 1, 2, ... `check_iterations` compares that count with the trainer's own at the end of the run, so
a change in the trainer's draining cannot silently shift iterations."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from overlap.files import write_replace
from overlap.parallel.trace import CommEvent, Span
from overlap.profiling.exposed import KindExposure, exposure, mean_exposure
from overlap.profiling.sinks import MetricsSink


@dataclass
class IterationTrace:
    iteration: int  # 0-based, as the trainer's StepRecord
    comm: list[CommEvent]
    spans: list[Span]


@dataclass
class RankTrace:
    """Everything one rank recorded, by iteration; the input of the Chrome trace and the
    timeline."""

    rank: int
    network: str
    iterations: list[IterationTrace] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "network": self.network,
            "iterations": [
                {
                    "iteration": it.iteration,
                    "comm": [asdict(e) for e in it.comm],
                    "spans": [asdict(s) for s in it.spans],
                }
                for it in self.iterations
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> RankTrace:
        return cls(
            data["rank"],
            data["network"],
            [
                IterationTrace(
                    it["iteration"],
                    [CommEvent(**e) for e in it["comm"]],
                    [Span(**s) for s in it["spans"]],
                )
                for it in data["iterations"]
            ],
        )

    def write(self, path: Path) -> None:
        write_replace(path, json.dumps(self.to_json()))

    @classmethod
    def read(cls, path: Path) -> RankTrace:
        return cls.from_json(json.loads(path.read_text()))


class Collector:
    """The recorder sink: per-iteration exposure (always), events kept for tracing (when asked), and
    one record per iteration to `comm_metrics` (when given: `FILE.comm.jsonl`, TensorBoard, W&B),
    its iteration counted from `first_iteration` (a resumed run's checkpoint) + 1 as the
    trainer's."""

    def __init__(
        self,
        rank: int,
        network: str,
        keep_events: bool,
        comm_metrics: MetricsSink | None = None,
        first_iteration: int = 0,
    ) -> None:
        self.trace = RankTrace(rank, network)
        self.keep_events = keep_events
        self.comm_metrics = comm_metrics
        self.first_iteration = first_iteration
        self.per_iteration: list[dict[str, KindExposure]] = []
        self._reset_seen = False

    def __call__(self, events: list[CommEvent], spans: list[Span]) -> None:
        if not self._reset_seen:
            self._reset_seen = True
            return
        iteration = len(self.per_iteration)
        rows = exposure(events, spans)
        self.per_iteration.append(rows)
        if self.keep_events:
            self.trace.iterations.append(IterationTrace(iteration, events, spans))
        if self.comm_metrics is not None:
            self.comm_metrics.write(
                {
                    "iteration": self.first_iteration + iteration + 1,
                    "network": self.trace.network,
                    "exposed_comm_ms": {k: round(r.exposed_ms, 4) for k, r in rows.items()},
                    "exposed_peer_wait_ms": {
                        k: round(r.peer_wait_ms, 4)
                        for k, r in rows.items()
                        if r.peer_wait_ms is not None
                    },
                    "total_comm_ms": {k: round(r.total_ms, 4) for k, r in rows.items()},
                }
            )

    def check_iterations(self, expected: int) -> None:
        if len(self.per_iteration) != expected:
            raise RuntimeError(
                f"the exposure collector saw {len(self.per_iteration)} iterations, the trainer ran "
                f"{expected}: the trainer's recorder drain pattern changed (see "
                "overlap.profiling.collector)"
            )

    def window_mean(self, window: tuple[int, int]) -> dict[str, KindExposure]:
        return mean_exposure(self.per_iteration[window[0] : window[1]])
