"""The `logger` section (Megatron-Bridge's LoggerConfig names and meanings) and its resolution.

Where a run's numbers go: the iteration line of rank 0's log every `log_interval` iterations, and -
every iteration, from rank 0, the same scalars `--metrics` writes as JSON lines - TensorBoard event
files (`tensorboard_dir`) and a Weights & Biases run (`wandb_project`, `wandb_exp_name`,
`wandb_save_dir`, `wandb_entity`). What the sinks need of the machine - their optional packages
(extras `overlap[tensorboard]`, `overlap[wandb]`) and the W&B mode this environment allows - is
probed by the sinks themselves (`overlap.profiling.sinks.record_sinks`, which the harness runs
after finalize, before a rank trains); here the section is declared, checked and its rows recorded.

Bridge's switches that choose which extra scalars go to TensorBoard are not carried (the set is
fixed: the `--metrics` scalars, always); setting one is refused with the reason, never silently
ignored (`overlap.config.refusals.NOT_CARRIED`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from overlap.decisions import DEFAULT, RULE, USER, DecisionLog
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

    @property
    def cadence(self) -> str:
        """How often TensorBoard and W&B get the scalars, in words."""
        if self.tensorboard_log_interval == 1:
            return "every iteration"
        return f"every {self.tensorboard_log_interval} iterations and the last"


def wandb_save_dir(lg: LoggerConfig, checkpoint_save: str | None) -> tuple[str, str]:
    """(folder, why) of the W&B run (W&B writes <folder>/wandb/<run>/): as set, else Bridge's
    <checkpoint.save>/wandb, else the working folder."""
    if lg.wandb_save_dir:
        return lg.wandb_save_dir, "as set"
    if checkpoint_save:
        return os.path.join(checkpoint_save, "wandb"), "not set: <checkpoint.save>/wandb, as Bridge"
    return os.getcwd(), "not set, and no checkpoint.save: the working folder (W&B's own default)"


def resolve_logger(lg: LoggerConfig, checkpoint_save: str | None, log: DecisionLog) -> None:
    """Check the section, fill in the W&B folder, and record where the metrics go; the rows of a
    sink that is on (its package, the W&B mode) are the sinks' (`record_sinks`)."""
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
    _record_tensorboard(lg, log)
    _record_wandb(lg, checkpoint_save, log)


def _record_tensorboard(lg: LoggerConfig, log: DecisionLog) -> None:
    """TensorBoard's row when it is off; its knobs are no-ops without a folder."""
    if lg.tensorboard_dir is not None:
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


def _record_wandb(lg: LoggerConfig, checkpoint_save: str | None, log: DecisionLog) -> None:
    """The W&B folder (Bridge's rule) of a run that is on; its knobs are no-ops without a
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
    folder, folder_why = wandb_save_dir(lg, checkpoint_save)
    log.record_in(
        "logger",
        "logger.wandb_save_dir",
        lg.wandb_save_dir,
        folder,
        USER if lg.wandb_save_dir else RULE,
        folder_why,
    )
