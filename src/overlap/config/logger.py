"""The `logger` section (Megatron-Bridge's LoggerConfig names and meanings) and its resolution.

Where a run's numbers go: the iteration line of rank 0's log every `log_interval` iterations, and -
every iteration, from rank 0, the same scalars `--metrics` writes as JSON lines - TensorBoard event
files (`tensorboard_dir`) and a Weights & Biases run (`wandb_project`, `wandb_exp_name`,
`wandb_save_dir`, `wandb_entity`). Both are optional dependencies (extras `overlap[tensorboard]`,
`overlap[wandb]`); one asked for and not installed is an error at start-up, before a rank trains.
W&B runs offline unless this environment can upload (`wandb_mode`), so a machine without network or
key still gets its run on disk, to upload later with `wandb sync`.

Bridge's switches that choose which extra scalars go to TensorBoard are not carried (the set is
fixed: the `--metrics` scalars, always); setting one is refused with the reason, never silently
ignored (`overlap.config.refusals.NOT_CARRIED`)."""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from overlap.config.decisions import DEFAULT, RULE, USER, DecisionLog
from overlap.errors import ConfigError


@dataclass
class LoggerConfig:
    """Bridge's LoggerConfig fields that the runtime honours (the others are refused:
    `overlap.config.refusals.NOT_CARRIED`)."""

    # the iteration line every N iterations (Bridge's default is 100; --metrics is per step)
    log_interval: int = 1
    tensorboard_dir: str | None = None  # TensorBoard event folder; None: no TensorBoard
    tensorboard_log_interval: int = 1  # TensorBoard and W&B get every N-th iteration and the last
    tensorboard_queue_size: int = 1000  # events buffered before the writer flushes (max_queue)
    wandb_project: str | None = None  # Weights & Biases project; None: no W&B
    wandb_exp_name: str | None = None  # W&B run name
    # W&B files; None: <checkpoint.save>/wandb (Bridge's rule), else the working folder
    wandb_save_dir: str | None = None
    wandb_entity: str | None = None  # W&B team or user

    def validate(self) -> None:
        """Intervals of at least one; no empty names or paths."""
        for name in ("log_interval", "tensorboard_log_interval", "tensorboard_queue_size"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"logger.{name}",
                    getattr(self, name),
                    "it must be >= 1.",
                    f"set logger.{name}=1 or more.",
                )
        for name in (
            "tensorboard_dir",
            "wandb_project",
            "wandb_exp_name",
            "wandb_save_dir",
            "wandb_entity",
        ):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(
                    f"logger.{name}",
                    value,
                    "an empty name or path says nothing.",
                    f"give a value, or set logger.{name}=null.",
                )


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


def wandb_save_dir(lg: LoggerConfig, checkpoint_save: str | None) -> tuple[str, str]:
    """(folder, why) of the W&B run (W&B writes <folder>/wandb/<run>/): as set, else Bridge's
    <checkpoint.save>/wandb, else the working folder."""
    if lg.wandb_save_dir:
        return lg.wandb_save_dir, "as set"
    if checkpoint_save:
        return os.path.join(checkpoint_save, "wandb"), "not set: <checkpoint.save>/wandb, as Bridge"
    return os.getcwd(), "not set, and no checkpoint.save: the working folder (W&B's own default)"


def resolve_logger(
    lg: LoggerConfig, checkpoint_save: str | None, log: DecisionLog, require_libraries: bool
) -> None:
    """Check the section, fill in the W&B folder, and record where the metrics go.
    `require_libraries`: a sink's missing package is an error (run); otherwise (explain for another
    machine) it is said in the table."""
    lg.validate()
    log.record_in(
        "logger",
        "logger.log_interval",
        None,
        lg.log_interval,
        DEFAULT if lg.log_interval == 1 else USER,
        "the iteration line of rank 0's log every N iterations (and the last); --metrics FILE gets "
        "every iteration",
    )
    every = (
        "every iteration"
        if lg.tensorboard_log_interval == 1
        else f"every {lg.tensorboard_log_interval} iterations and the last"
    )
    _record_tensorboard(lg, log, require_libraries, every)
    _record_wandb(lg, checkpoint_save, log, require_libraries, every)


def _record_tensorboard(lg: LoggerConfig, log: DecisionLog, require: bool, every: str) -> None:
    """TensorBoard's row; its knobs are no-ops without a folder."""
    if lg.tensorboard_dir is not None:
        installed = _available("tensorboard_dir", lg.tensorboard_dir, require)
        log.record_in(
            "logger",
            "logger.tensorboard_dir",
            lg.tensorboard_dir,
            lg.tensorboard_dir,
            USER,
            f"rank 0 writes the --metrics scalars as TensorBoard scalars, {every}{installed}",
        )
        return
    log.record_in(
        "logger",
        "logger.tensorboard_dir",
        None,
        None,
        DEFAULT,
        "not set: no TensorBoard event files",
    )
    if lg.tensorboard_queue_size != 1000:
        log.noop(
            "logger.tensorboard_queue_size",
            lg.tensorboard_queue_size,
            "no TensorBoard writer without logger.tensorboard_dir",
            "set logger.tensorboard_dir=DIR, or drop it.",
        )
    if lg.tensorboard_log_interval != 1 and lg.wandb_project is None:
        log.noop(
            "logger.tensorboard_log_interval",
            lg.tensorboard_log_interval,
            "neither TensorBoard nor W&B is on",
            "set logger.tensorboard_dir or logger.wandb_project, or drop it.",
        )


def _record_wandb(
    lg: LoggerConfig, checkpoint_save: str | None, log: DecisionLog, require: bool, every: str
) -> None:
    """The W&B rows: its folder (Bridge's rule) and the run; its knobs are no-ops without a
    project."""
    if lg.wandb_project is None:
        for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
            if getattr(lg, name) is not None:
                log.noop(
                    f"logger.{name}",
                    getattr(lg, name),
                    "no W&B run without logger.wandb_project",
                    "set logger.wandb_project=NAME, or drop it.",
                )
        log.record_in(
            "logger",
            "logger.wandb_project",
            None,
            None,
            DEFAULT,
            "not set: no Weights & Biases run",
        )
        return
    if not lg.wandb_exp_name:
        raise ConfigError(
            "logger.wandb_exp_name",
            lg.wandb_exp_name,
            "a W&B run needs a name (as in Bridge).",
            "set logger.wandb_exp_name=NAME.",
        )
    installed = _available("wandb_project", lg.wandb_project, require)
    mode, why = wandb_mode()
    if mode == "disabled":
        log.noop(
            "logger.wandb_project",
            lg.wandb_project,
            "WANDB_MODE=disabled: W&B writes nothing",
            "unset WANDB_MODE (or set it to offline or online), or drop logger.wandb_project.",
        )
    folder, folder_why = wandb_save_dir(lg, checkpoint_save)
    log.record_in(
        "logger",
        "logger.wandb_save_dir",
        lg.wandb_save_dir,
        folder,
        USER if lg.wandb_save_dir else RULE,
        folder_why,
    )
    lg.wandb_save_dir = folder
    entity = f", entity {lg.wandb_entity}" if lg.wandb_entity else ""
    log.record_in(
        "logger",
        "logger.wandb_project",
        lg.wandb_project,
        lg.wandb_project,
        USER,
        f"rank 0 logs the --metrics scalars to run {lg.wandb_exp_name!r}{entity}, {every}; mode "
        f"{mode}: {why} (rank 0's environment decides){installed}",
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
