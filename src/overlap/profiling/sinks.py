"""Where rank 0's per-iteration numbers go: one record, many sinks.

Two producers write one record (a JSON-able dict with an "iteration", numbered from 1) per
iteration: the trainer (loss, grad norm, learning rate, step time, throughput, communication time
and bytes by kind, peak memory) and the exposure collector (exposed and total communication by
kind). Each record goes, unchanged, to every sink of its stream: the `--metrics` JSON-lines files
(`FILE` and `FILE.comm.jsonl`), TensorBoard and Weights & Biases. The last two are shared by both
streams and get the record's numbers as scalars, nested keys joined by "/" (`comm_ms/dp_ar`), at
step = the iteration; strings (the network label) stay in the JSON lines only.

What a sink needs of this machine is probed here too: its package (the extras
`overlap[tensorboard]`, `overlap[wandb]`; one asked for and not installed is an error at start-up,
before a rank trains) and the W&B mode this environment allows (offline unless it can upload, so a
machine without network or key still gets its run on disk, to upload later with `wandb sync`).
`record_sinks` says both in the logger section of the decision table."""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlparse

from overlap.config.logger import LoggerConfig, wandb_save_dir
from overlap.decisions import USER, DecisionLog
from overlap.errors import ConfigError
from overlap.files import create_replacing

# Which package each sink needs, and the extra that installs it.
EXTRAS = {"tensorboard_dir": ("tensorboard", "tensorboard"), "wandb_project": ("wandb", "wandb")}
WANDB_MODES = ("online", "offline", "disabled")


def wandb_mode(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(mode, why) for a W&B run started in `env` (this process's environment by default):
    WANDB_MODE when set, online with an API key (WANDB_API_KEY, or the netrc entry `wandb login`
    writes), offline otherwise."""
    env = os.environ if env is None else env
    mode = env.get("WANDB_MODE", "").strip()
    if mode:
        aliases = {"dryrun": "offline", "run": "online"}
        if aliases.get(mode, mode) not in WANDB_MODES:
            raise ConfigError(
                "WANDB_MODE",
                mode,
                "W&B does not know this mode.",
                f"set WANDB_MODE to one of {', '.join(WANDB_MODES)}, or unset it.",
            )
        return aliases.get(mode, mode), "WANDB_MODE is set"
    if env.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        if netrc.netrc(env.get("NETRC")).authenticators(host):
            return "online", f"an API key for {host} is in the netrc file (wandb login)"
    except (OSError, netrc.NetrcParseError):
        pass  # no netrc file (or an unreadable one): no key from there
    return (
        "offline",
        "no W&B API key here (no WANDB_API_KEY, no wandb login); upload later with wandb sync",
    )


def check_extra(field: str, value: str) -> None:
    """The package the sink of `field` needs is importable, else one error naming the field and the
    install."""
    module, extra = EXTRAS[field]
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"logger.{field}",
            value,
            f"it needs the {module} package, which is not installed here.",
            f"pip install 'overlap[{extra}]' (or pip install {module}), or unset logger.{field}.",
        )


def _available(field: str, value: str, require: bool) -> str:
    """'' when the sink's package is importable (or an error, when required); else a note for the
    table."""
    if require:
        check_extra(field, value)
        return ""
    module, extra = EXTRAS[field]
    return (
        "" if importlib.util.find_spec(module) else f" (needs overlap[{extra}], not installed here)"
    )


def record_sinks(lg: LoggerConfig, log: DecisionLog, require_libraries: bool) -> None:
    """The rows of the sinks a resolved logger section turns on (`log`: the run's decisions, after
    `overlap.config.logger.resolve_logger`): each one's package, importable here (an error when
    `require_libraries`, the run; a note otherwise, `explain` for another machine), and the W&B
    run's mode in this environment."""
    if lg.tensorboard_dir is not None:
        installed = _available("tensorboard_dir", lg.tensorboard_dir, require_libraries)
        log.record_in(
            "logger",
            "logger.tensorboard_dir",
            lg.tensorboard_dir,
            lg.tensorboard_dir,
            USER,
            f"rank 0 writes the --metrics scalars as TensorBoard scalars, {lg.cadence}{installed}",
        )
    if lg.wandb_project is None:
        return
    installed = _available("wandb_project", lg.wandb_project, require_libraries)
    mode, why = wandb_mode()
    if mode == "disabled":
        log.noop(
            "logger.wandb_project",
            lg.wandb_project,
            "WANDB_MODE=disabled: W&B writes nothing",
            "unset WANDB_MODE (or set it to offline or online), or drop logger.wandb_project.",
        )
    entity = f", entity {lg.wandb_entity}" if lg.wandb_entity else ""
    log.record_in(
        "logger",
        "logger.wandb_project",
        lg.wandb_project,
        lg.wandb_project,
        USER,
        f"rank 0 logs the --metrics scalars to run {lg.wandb_exp_name!r}{entity}, {lg.cadence}; "
        f"mode {mode}: {why} (rank 0's environment decides){installed}",
    )


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
    """A W&B run named by the logger section in `folder` (`config.logger.wandb_save_dir`'s rule),
    its config the run's configuration (as Bridge); the mode is `wandb_mode()` of this process's
    environment, offline without a key."""

    def __init__(
        self, lg: LoggerConfig, folder: str, last: int, run_config: dict[str, Any]
    ) -> None:
        super().__init__(lg.tensorboard_log_interval, last)
        import wandb

        self.mode, why = wandb_mode()
        os.makedirs(folder, exist_ok=True)
        # W&B's cache, staging and artifact folders default to the home folder (~/.cache/wandb,
        # ...): a run keeps them under its own W&B folder instead, unless the user chose them
        for name, sub in WANDB_OWN_DIRS.items():
            os.environ.setdefault(name, os.path.join(folder, "wandb", sub))
        self.run = wandb.init(
            project=lg.wandb_project,
            name=lg.wandb_exp_name,
            entity=lg.wandb_entity,
            dir=folder,
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
            folder = wandb_save_dir(lg, cfg.checkpoint.save)[0]
            shared.append(WandbRun(lg, folder, last, cfg.to_dict()))
    except BaseException:
        RunSinks(owned=[f for f in files if f is not None] + shared).close()
        raise
    owned = [f for f in files if f is not None] + shared
    if not owned:
        return RunSinks()
    metrics, comm = (FanOut([f] + shared if f is not None else shared) for f in files)
    return RunSinks(metrics, comm, owned)
