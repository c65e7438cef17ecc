"""Where rank 0's per-iteration numbers go: one record, many sinks.

Two producers write one record (a JSON-able dict with an "iteration", numbered from 1) per
iteration: the trainer (loss, grad norm, learning rate, step time, throughput, communication time
and bytes by kind, peak memory) and the exposure collector (exposed and total communication by
kind). Each record goes, unchanged, to every sink of its stream: the `--metrics` JSON-lines files
(`FILE` and `FILE.comm.jsonl`), TensorBoard and Weights & Biases. The last two are shared by both
streams and get the record's numbers as scalars, nested keys joined by "/" (`comm_ms/dp_ar`), at
step = the iteration; strings (the network label) stay in the JSON lines only."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from overlap.config.logger import LoggerConfig, wandb_mode
from overlap.files import create_replacing


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None:
        """Take one iteration's record (it has an "iteration", numbered from 1)."""


class _Owned(MetricsSink, Protocol):
    where: str  # what it writes where, for the start-up log

    def close(self) -> None:
        """Write out what is buffered and release the sink."""


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers, nested keys joined by "/"; the iteration (the step) and non-numbers are
    left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif (
            isinstance(value, (int, float)) and not isinstance(value, bool) and name != "iteration"
        ):
            out[name] = value
    return out


class JsonLines:
    """One JSON object per line, flushed each time: a crashed run keeps every finished iteration."""

    def __init__(self, path: str) -> None:
        self.where = path
        self._file = create_replacing(path)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class _ScalarSink:
    """A sink that keeps every `interval`-th iteration (and the last) as scalars."""

    def __init__(self, interval: int, last: int) -> None:
        self.interval, self.last = interval, last

    def due(self, iteration: int) -> bool:
        return iteration % self.interval == 0 or iteration == self.last


class TensorBoard(_ScalarSink):
    def __init__(self, lg: LoggerConfig, last: int) -> None:
        super().__init__(lg.tensorboard_log_interval, last)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=lg.tensorboard_dir, max_queue=lg.tensorboard_queue_size)
        self.where = f"TensorBoard {lg.tensorboard_dir}"

    def write(self, record: dict[str, Any]) -> None:
        step = record["iteration"]
        if self.due(step):
            for tag, value in scalars(record).items():
                self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


WANDB_OWN_DIRS = {
    "WANDB_CACHE_DIR": "cache",
    "WANDB_DATA_DIR": "data",
    "WANDB_ARTIFACT_DIR": "artifacts",
}


class WandbRun(_ScalarSink):
    """A W&B run named by the logger section, its config the run's configuration (as Bridge); the
    mode is `wandb_mode()` of this process's environment, offline without a key."""

    def __init__(self, lg: LoggerConfig, last: int, run_config: dict[str, Any]) -> None:
        super().__init__(lg.tensorboard_log_interval, last)
        import wandb

        self.mode, why = wandb_mode()
        os.makedirs(lg.wandb_save_dir, exist_ok=True)
        # W&B's cache, staging and artifact folders default to the home folder (~/.cache/wandb,
        # ...): a run keeps them under its own W&B folder instead, unless the user chose them
        for name, sub in WANDB_OWN_DIRS.items():
            os.environ.setdefault(name, os.path.join(lg.wandb_save_dir, "wandb", sub))
        self.run = wandb.init(
            project=lg.wandb_project,
            name=lg.wandb_exp_name,
            entity=lg.wandb_entity,
            dir=lg.wandb_save_dir,
            config=run_config,
            mode=self.mode,
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self.where = (
            f"W&B run {lg.wandb_exp_name!r} ({self.mode}: {why}) in {os.path.dirname(self.run.dir)}"
        )

    def write(self, record: dict[str, Any]) -> None:
        step = record["iteration"]
        if self.due(step):
            self.run.log(scalars(record), step=step)

    def close(self) -> None:
        self.run.finish()


class FanOut:
    """One stream's sinks: each record goes to each of them. Closing is the owner's (`RunSinks`)."""

    def __init__(self, sinks: list[_Owned]) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)


@dataclass
class RunSinks:
    """Rank 0's two streams (None: nothing takes them) and every sink they feed, closed once."""

    metrics: FanOut | None = None
    comm: FanOut | None = None
    owned: list[_Owned] = field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(s.where for s in self.owned) or "the log only"

    def close(self) -> None:
        for sink in self.owned:
            sink.close()


def open_sinks(cfg, metrics_path: str | None) -> RunSinks:
    """Rank 0's sinks: `metrics_path` (--metrics) and its `.comm.jsonl` sibling, and the logger
    section's TensorBoard and W&B (their packages were checked by finalize, on this rank too)."""
    lg: LoggerConfig = cfg.logger
    last = cfg.train.train_iters
    files: list[_Owned | None] = [None, None]
    shared: list[_Owned] = []
    try:
        if metrics_path:
            files = [JsonLines(metrics_path), JsonLines(f"{metrics_path}.comm.jsonl")]
        if lg.tensorboard_dir is not None:
            shared.append(TensorBoard(lg, last))
        if lg.wandb_project is not None:
            shared.append(WandbRun(lg, last, cfg.to_dict()))
    except BaseException:
        RunSinks(owned=[f for f in files if f is not None] + shared).close()
        raise
    owned = [f for f in files if f is not None] + shared
    if not owned:
        return RunSinks()
    metrics, comm = (FanOut([f] + shared if f is not None else shared) for f in files)
    return RunSinks(metrics, comm, owned)
