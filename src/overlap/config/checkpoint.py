"""The `checkpoint` section (Megatron-Bridge's CheckpointConfig names and defaults) and its
resolution.

Only what the runtime does is accepted: `ckpt_format` is `torch_dist` (DCP shards + metadata,
layout-independent tensor names); the reference's other formats, replication, non-persistent and
local checkpoints are refused with a clear error rather than silently written as something else.
Every resolved setting is a decision in `explain` and in the start-up log (its own "Checkpoint
decisions" section), including "nothing is saved" when `save` is unset.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.config.refusals import one_of
from overlap.config.training import SchedulerConfig
from overlap.decisions import DEFAULT, RULE, USER, DecisionLog
from overlap.errors import check_rules

FORMATS = ("torch_dist",)


@dataclass
class CheckpointConfig:
    """Where and when checkpoints are written and read. Directories are base folders
    (`<save>/iter_0000010/` inside), as in Megatron; `load` is usually the same folder as `save`, so
    a restarted job resumes where it stopped."""

    save: str | None = None  # base folder checkpoints are written to; None: no saving
    load: str | None = None  # base folder to resume from; None: start from scratch
    save_interval: int | None = None  # iterations between saves (None: only at the end of training)
    most_recent_k: int = -1  # keep only the k newest checkpoints of `save` (-1: keep all)
    # torch_dist (DCP shards, loadable at any layout); others are refused
    ckpt_format: str = "torch_dist"
    ckpt_step: int | None = None  # load iter_<ckpt_step> instead of the tracker's latest
    async_save: bool = False  # write checkpoints in the background while training goes on
    save_optim: bool = True  # save the optimizer state
    load_optim: bool = True  # load the optimizer state
    save_rng: bool = True  # save the random-number generator states
    load_rng: bool = True  # load the random-number generator states
    finetune: bool = False  # load weights only and start at iteration 0
    # weights to start from when `load` holds no checkpoint
    pretrained_checkpoint: str | None = None
    # `load` set but empty: fail instead of starting from scratch
    exit_on_missing_checkpoint: bool = False
    # Ours, not the reference's: save into a folder whose checkpoints are another model's (refused
    # by default)
    allow_other_model_in_save: bool = False


def resolve_checkpoint(
    ck: CheckpointConfig, log: DecisionLog, sched: SchedulerConfig | None = None
) -> None:
    """Check the section (and the scheduler's resume switches) and record what a run will do with
    it."""
    sched = sched or SchedulerConfig()
    paths = {name: getattr(ck, name) for name in ("save", "load", "pretrained_checkpoint")}
    check_rules(
        [
            (
                "scheduler.use_checkpoint_opt_param_scheduler",
                True,
                not (
                    sched.override_opt_param_scheduler and sched.use_checkpoint_opt_param_scheduler
                ),
                "it contradicts scheduler.override_opt_param_scheduler=true (the checkpoint's "
                "schedule or this run's).",
                "set at most one of the two.",
            ),
            one_of(
                "checkpoint.ckpt_format",
                ck.ckpt_format,
                FORMATS,
                "unknown checkpoint format.",
                "use checkpoint.ckpt_format=torch_dist.",
                "use checkpoint.ckpt_format=torch_dist (DCP shards, loadable at any layout).",
            ),
            *(
                (
                    f"checkpoint.{name}",
                    value,
                    value is None or (isinstance(value, str) and value.strip()),
                    "a checkpoint folder must be a non-empty path.",
                    f"set checkpoint.{name}=/path/to/folder, or null.",
                )
                for name, value in paths.items()
            ),
            (
                "checkpoint.save_interval",
                ck.save_interval,
                ck.save_interval is None or ck.save_interval >= 1,
                "it counts iterations between saves.",
                "use a positive integer, or null to save only at the end of training.",
            ),
            (
                "checkpoint.most_recent_k",
                ck.most_recent_k,
                ck.most_recent_k == -1 or ck.most_recent_k > 0,
                "it is how many of the newest checkpoints to keep (-1: all).",
                "use -1 or a positive integer.",
            ),
            (
                "checkpoint.ckpt_step",
                ck.ckpt_step,
                ck.ckpt_step is None or (ck.load is not None and ck.ckpt_step >= 0),
                "it picks iter_<ckpt_step> inside checkpoint.load (which must be set).",
                "set checkpoint.load too, and a ckpt_step >= 0.",
            ),
        ]
    )
    # what only a save acts on, set to other than its default (earlier rules refused 0 and -1)
    for name in ("save_interval", "async_save", "most_recent_k", "allow_other_model_in_save"):
        if ck.save is None and getattr(ck, name) not in (None, False, -1):
            log.noop(
                f"checkpoint.{name}",
                getattr(ck, name),
                "nothing is saved without checkpoint.save",
                "set checkpoint.save=/path/to/folder, or drop it.",
            )
    for name in ("override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler"):
        if getattr(sched, name) and (ck.load is None or ck.finetune):
            log.noop(
                f"scheduler.{name}",
                True,
                "it decides a resume's learning-rate schedule, and this run resumes nothing "
                "(checkpoint.load unset, or finetune)",
                f"drop scheduler.{name}.",
            )
    if ck.load is None and ck.finetune:
        if ck.pretrained_checkpoint is None:
            log.noop(
                "checkpoint.finetune",
                True,
                "there is nothing to load (checkpoint.load and checkpoint.pretrained_checkpoint "
                "are unset)",
                "set checkpoint.load, or drop finetune.",
            )

    def rec(*decision) -> None:
        log.record_in("checkpoint", *decision)

    if ck.save is None:
        rec("checkpoint.save", None, None, DEFAULT, "not set: this run writes no checkpoint")
    else:
        when = (
            f"every {ck.save_interval} iterations and at the end of training"
            if ck.save_interval
            else "at the end of training only (checkpoint.save_interval unset)"
        )
        rec(
            "checkpoint.save",
            ck.save,
            ck.save,
            USER,
            f"DCP checkpoints {when}, written to a temporary folder and "
            "renamed, the tracker updated last",
        )
        rec(
            "checkpoint.async_save",
            ck.async_save or None,
            ck.async_save,
            USER if ck.async_save else DEFAULT,
            "written by a background thread from a snapshot taken at the step boundary; the next "
            "save and the end of the run wait for it"
            if ck.async_save
            else "the save blocks training until written",
        )
        parts = [p for p, on in (("optimizer", ck.save_optim), ("RNG", ck.save_rng)) if on]
        rec(
            "checkpoint.save_optim",
            None,
            ck.save_optim,
            DEFAULT if ck.save_optim else USER,
            "model weights" + "".join(f" + {p} state" for p in parts) + " + training state",
        )
        if ck.most_recent_k > 0:
            rec(
                "checkpoint.most_recent_k",
                ck.most_recent_k,
                ck.most_recent_k,
                USER,
                f"after each save, this run's lineage keeps its {ck.most_recent_k} newest written "
                "checkpoints; the one just saved, the one loaded and other runs' are never deleted",
            )
        rec(
            "checkpoint.allow_other_model_in_save",
            ck.allow_other_model_in_save or None,
            ck.allow_other_model_in_save,
            USER if ck.allow_other_model_in_save else DEFAULT,
            "the folder is locked while this run owns it; checkpoints newer than where it starts "
            "are refused, and "
            + (
                "another model's are kept beside this run's"
                if ck.allow_other_model_in_save
                else "so are another model's"
            ),
        )
    if ck.load is not None:
        weights_only = ck.finetune
        rec(
            "checkpoint.load",
            ck.load,
            ck.load,
            USER,
            (
                "weights only, training starts at iteration 0 (finetune)"
                if weights_only
                else "resume: weights"
                + (" + optimizer" if ck.load_optim else "")
                + (" + RNG (same layout only)" if ck.load_rng else "")
                + " + iteration; a base folder (its tracker, else its newest complete iter_*) or "
                "an iter_* folder; one holding no checkpoint "
                + (
                    "is an error (exit_on_missing_checkpoint)"
                    if ck.exit_on_missing_checkpoint
                    else "starts from scratch only if it is checkpoint.save"
                )
            ),
        )
        if not weights_only:
            rule = (
                "this run's values (override_opt_param_scheduler)"
                if sched.override_opt_param_scheduler
                else "the checkpoint's values (use_checkpoint_opt_param_scheduler)"
                if sched.use_checkpoint_opt_param_scheduler
                else "must equal the checkpoint's: a difference is refused"
            )
            rec(
                "scheduler.override_opt_param_scheduler",
                sched.override_opt_param_scheduler or None,
                sched.override_opt_param_scheduler,
                USER if sched.override_opt_param_scheduler else DEFAULT,
                "resume: the learning-rate schedule (lr, min_lr, warm-up, decay iterations and "
                f"style) {rule}",
            )
    if ck.pretrained_checkpoint is not None:
        rec(
            "checkpoint.pretrained_checkpoint",
            ck.pretrained_checkpoint,
            ck.pretrained_checkpoint,
            USER,
            "initial weights (weights only, iteration 0), used when checkpoint.load holds no "
            "checkpoint",
        )
    if ck.load is None and ck.pretrained_checkpoint is None:
        rec(
            "checkpoint.load",
            None,
            None,
            RULE if ck.save else DEFAULT,
            "not set: training starts from the layout-independent random initialisation",
        )
