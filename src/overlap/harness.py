"""The harness command line (Megatron-Bridge `run_script.py` flags + `section.field=value`
overrides) -> a resolved job.

Shared by every subcommand (`explain`, `run`, `bench`), so it lives below all of them: it imports
only the configuration and the launch-environment rules.

Order of application, as in the reference harness: recipe, then the flags, then the perf recipe of
Bridge's performance harness for this model, GPU and precision (`overlap.recipes.perf`: what
a flag set stays the flag's), then the overrides - so an override beats a flag. Unlike the
reference, the disagreement is never silent: every flag/override pair that set one field (or its
`comm_overlap` twin) to different values is a "command line" decision ("the override beats
--moe_a2a_overlap false"), logged at start-up, shown by `explain`, and an error under `--strict`.
Two reference flaws are fixed on purpose: `--moe_a2a_overlap false` really turns EP overlap off, and
`--moe_a2a_overlap true` turns on EP overlap and nothing else (the reference also switched on
delay_wgrad_compute). The same override key twice is an error, not "the last one wins"
(`check_override_repeats`); `prepare` refuses sizes no machine can represent before anything is
built (`overlap.launch.resources`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from overlap.config.aliases import spellings
from overlap.config.comm_overlap import CommOverlapConfig
from overlap.config.container import ConfigContainer, Resolution
from overlap.config.flex_dispatcher import apply_flex_dispatcher_backend
from overlap.config.mixed_precision import get_mixed_precision_config
from overlap.config.model import comma_list
from overlap.config.overrides import apply_override, apply_overrides, check_override_repeats
from overlap.decisions import FLAG, OVERRIDE, RECIPE, Decision
from overlap.errors import ConfigError, NotBuiltError
from overlap.hf.config_json import PRETRAINED, apply_pretrained
from overlap.kernels.device import TARGET_DEVICES, probe_device
from overlap.launch.env import VALID_ACCELERATORS, LaunchEnvInputs
from overlap.launch.path_fields import expand_path_fields
from overlap.launch.resources import MemoryEstimate, check_representable
from overlap.profiling.sinks import record_sinks
from overlap.recipes.models import Recipe, get_recipe
from overlap.recipes.perf import LAYOUT_KEYS, Setting, perf_recipe
from overlap.recipes.perf import SOURCE as PERF_SOURCE

log = logging.getLogger("overlap")

_KEEP = object()  # "flag not given": keep the recipe's value
# a world size past this is a typo, not a cluster (and would be allocated per rank)
MAX_WORLD_SIZE = 2**20
COMPUTE_DTYPES = {"bf16": "bf16_mixed", "fp16": "fp16_mixed", "fp32": "fp32"}
REFERENCE_FP8_DTYPES = ("fp8_cs", "fp8_mx", "fp8_sc", "fp8_ds", "nvfp4")

# Settings that change what the runtime does but are not overlap decisions: `explain` lists them
# with their source.
OTHER_SETTINGS = (
    "mixed_precision",
    "model.sequence_parallel",
    "model.moe_token_dispatcher_type",
    "model.moe_permute_fusion",
    "model.recompute_granularity",
    "model.recompute_modules",
    "model.recompute_num_layers",
    "ddp.use_distributed_optimizer",
    "ddp.grad_reduce_in_fp32",
    "train.global_batch_size",
    "train.micro_batch_size",
    # which implementation runs: ours, or a PyTorch peer (whose collectives the tracer does not see)
    "model.tensor_parallel_impl",
    "model.pipeline_impl",
    "ddp.impl",
)


def bool_arg(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "t", "yes", "y"):
        return True
    if low in ("false", "0", "f", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def int_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def add_harness_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "harness flags (Megatron-Bridge run_script.py compatible; overrides given after them win)"
    )
    g.add_argument("-m", "--model_family_name", type=str.lower, help="model family, e.g. qwen")
    g.add_argument(
        "-mr",
        "--model_recipe_name",
        type=str.lower,
        help="recipe, e.g. qwen3_30b_a3b, qwen3_moe_tiny, dense_tiny (overlap explain "
        "--list-recipes)",
    )
    g.add_argument(
        "--task",
        default="pretrain",
        choices=("pretrain", "sft", "peft"),
        help="pretrain (sft/peft are not built)",
    )
    g.add_argument(
        "-g",
        "--gpu",
        default="cpu",
        type=str.lower,
        choices=VALID_ACCELERATORS,
        help="accelerator type; cpu = local CPU ranks over gloo. explain describes this target; "
        "run checks the device it actually has",
    )
    g.add_argument(
        "-c",
        "--compute_dtype",
        default=None,
        type=str.lower,
        help="bf16 | fp16 | fp32 (default: the recipe's precision)",
    )
    g.add_argument("-ng", "--num_gpus", type=int, help="world size (ranks)")
    g.add_argument(
        "-gn",
        "--gpus_per_node",
        type=int,
        default=None,
        help="ranks per node (default: the GPU's standard node; Slurm scripts)",
    )
    g.add_argument(
        "-ms", "--max_steps", type=int, default=None, help="training iterations (train.train_iters)"
    )
    g.add_argument(
        "-cv", "--config_variant", default=None, help="v1 | v2 (both: the canonical recipe)"
    )
    g.add_argument(
        "--cuda_graph_impl",
        choices=("none", "local", "transformer_engine"),
        default=None,
        help="CUDA-graph implementation (none: no graphs; the runtime does not capture graphs yet)",
    )
    g.add_argument(
        "--cuda_graph_scope",
        default=None,
        help="comma list of CUDA-graph scopes (model.cuda_graph_scope)",
    )
    g.add_argument(
        "--moe_flex_dispatcher_backend",
        default=_KEEP,
        help="torch | deepep | hybridep | None (None: alltoall dispatch)",
    )
    g.add_argument(
        "--moe_a2a_overlap",
        type=bool_arg,
        default=None,
        help="true/false: EP all-to-all overlap on/off (and nothing else)",
    )
    g.add_argument(
        "--use_megatron_fsdp",
        type=bool_arg,
        default=None,
        help="true: Megatron-FSDP sharding optimizer state, gradients and parameters (as Bridge's "
        "harness sets it; priced by overlap plan, refused by overlap run: not built)",
    )
    g.add_argument(
        "--tokenizer_type",
        default=None,
        choices=("NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"),
        help="NullTokenizer: mock data (uniform random tokens)",
    )
    g.add_argument(
        "--tokenizer_model",
        default=None,
        help="HuggingFaceTokenizer: a tokenizer.json or its folder (tokenizer.tokenizer_model)",
    )
    g.add_argument(
        "--vocab_size", type=int, default=None, help="NullTokenizer vocabulary (model.vocab_size)"
    )
    for flag, dest, what in (
        ("-tp", "tensor_model_parallel_size", "tensor-parallel size (implies sequence parallel)"),
        ("-pp", "pipeline_model_parallel_size", "pipeline-parallel size"),
        ("-cp", "context_parallel_size", "context-parallel size"),
        ("-ep", "expert_model_parallel_size", "expert-parallel size"),
        ("-et", "expert_tensor_parallel_size", "expert tensor-parallel size"),
    ):
        g.add_argument(flag, dest=dest, type=int, default=None, help=what)
    g.add_argument(
        "-vp",
        dest="virtual_pipeline_model_parallel_size",
        type=int_or_none,
        default=_KEEP,
        help="virtual pipeline size per rank, or None",
    )
    g.add_argument(
        "-gb", "--global_batch_size", type=int, default=None, help="sequences per optimizer step"
    )
    g.add_argument(
        "-mb", "--micro_batch_size", type=int, default=None, help="sequences per micro-batch"
    )
    g.add_argument("-sl", "--seq_length", type=int, default=None, help="tokens per sequence")
    g.add_argument(
        "-rl",
        "--recompute_num_layers",
        type=int,
        default=None,
        help="full recompute of this many layers per chunk (uniform)",
    )
    g.add_argument("--recompute_modules", default=None, help="comma list: selective recompute")
    g.add_argument(
        "--eval_time_start_step",
        type=int,
        default=None,
        help="first step (0-based index) of the steady-state timing window",
    )
    g.add_argument(
        "--eval_time_end_step",
        type=int,
        default=None,
        help="end (exclusive, 0-based) of that window",
    )
    g.add_argument(
        "--skip_first_percent_time",
        type=float,
        default=None,
        help="window start as a fraction of the steps when --eval_time_start_step is not given",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="any overlap request that cannot be honoured, any switch that would do nothing and "
        "any flag beaten by an override is an error",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="section.field=value overrides (e.g. model.num_layers=4); overlap explain --list-keys "
        "lists them",
    )


@dataclass
class Job:
    """A parsed command line: the finalized config and what it takes to launch it."""

    cfg: ConfigContainer
    resolution: Resolution
    args: argparse.Namespace
    memory: MemoryEstimate | None = None  # per-rank estimate (overlap.launch.resources)


@dataclass
class _FlagWrite:
    flag: str
    value: Any
    # the field's value before the flag wrote it (restored when an override of its twin wins)
    before: Any
    # a value the flag implies (SP from -tp), which an explicit override refines without dispute
    implied: bool
    # the flag's value as the user typed it, when that is not the field's value (-c bf16)
    typed: Any = _KEEP


@dataclass
class CommandLine:
    """What the flags wrote, and what the overrides set, for provenance and flag/override
    reconciliation."""

    flags: dict[str, _FlagWrite] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    # key -> the Bridge perf recipe that set it
    perf: dict[str, str] = field(default_factory=dict)
    # the perf recipe's section of the decision table
    perf_rows: list[Decision] = field(default_factory=list)

    def source(self, key: str) -> str:
        if key in self.overrides:
            return OVERRIDE
        if key in self.flags:
            return f"{FLAG} {self.flags[key].flag}"
        if key in self.perf:
            return f"{PERF_RECIPE} {self.perf[key]}"
        return RECIPE


def _get(cfg: ConfigContainer, key: str) -> Any:
    section, _, name = key.partition(".")
    target = getattr(cfg, section)
    return target if not name else getattr(target, name)


def _as_run(cfg: ConfigContainer, res: Resolution, key: str, precision_name: str) -> Any:
    """The value `key` runs with, for the "other settings" rows: the preset's name, the resolved
    gradient reduce dtype (`ddp.grad_reduce_in_fp32` is an alias, kept as typed), the resolved
    token dispatcher, distributed optimizer (either spelling turns it on) and sequence parallelism
    (the layout's: off at TP 1 whatever was typed), else the section's field."""
    if key == "mixed_precision":
        return precision_name
    if key == "ddp.use_distributed_optimizer":
        return res.overlap.use_distributed_optimizer
    if key == "ddp.grad_reduce_in_fp32":
        return res.precision.grad_reduce_in_fp32
    if key == "model.moe_token_dispatcher_type":
        return res.kernels.moe_token_dispatcher_type
    if key == "model.sequence_parallel":
        return res.layout.sequence_parallel
    return _get(cfg, key)


def _set(cfg: ConfigContainer, key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    if not name:
        setattr(cfg, section, value)
    else:
        setattr(getattr(cfg, section), name, value)


def build_config(args: argparse.Namespace) -> tuple[ConfigContainer, list[Decision], CommandLine]:
    """Recipe -> flags -> overrides; returns the config, the command-line decisions and the
    provenance."""
    if not args.model_family_name or not args.model_recipe_name:
        raise ConfigError(
            "-m/-mr",
            None,
            "a model family and recipe are required.",
            "pass e.g. -m qwen -mr qwen3_moe_tiny (overlap explain --list-recipes lists them).",
        )
    if args.num_gpus is None:
        raise ConfigError("-ng/--num_gpus", None, "the world size is required.", "pass e.g. -ng 4.")
    if args.num_gpus > MAX_WORLD_SIZE:
        raise ConfigError(
            "-ng/--num_gpus",
            args.num_gpus,
            f"more than {MAX_WORLD_SIZE:,} ranks: no cluster has that many (a typo?).",
            "pass the number of GPUs (or local CPU ranks) the job uses.",
        )
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise ConfigError(
            "-gn/--gpus_per_node",
            args.gpus_per_node,
            "a node runs at least one rank.",
            "pass -gn 1 or more (e.g. -gn 8), or omit -gn for the GPU's standard node.",
        )
    if args.task != "pretrain":
        raise NotBuiltError("--task", args.task, "Fine-tuning (sft/peft)", "use --task pretrain.")
    if args.config_variant not in (None, "v1", "v2"):
        raise ConfigError(
            "-cv/--config_variant",
            args.config_variant,
            "recipes here have one canonical variant.",
            "omit -cv, or use v1/v2 (both mean the canonical recipe).",
        )
    recipe = get_recipe(args.model_family_name, args.model_recipe_name)
    cfg = recipe.build(args.num_gpus)
    line = CommandLine()
    _apply_flags(cfg, args, line)
    check_override_repeats(args.overrides)
    _apply_perf_recipe(cfg, args, line)
    line.overrides = apply_overrides(cfg, args.overrides)
    decisions = _reconcile(cfg, line)
    decisions += _apply_recipe_rules(cfg, recipe, args.num_gpus, line)
    decisions += _explicit_false_distributed_optimizer(cfg, line)
    expand_path_fields(cfg)  # once, before anything reads a path (launch/path_fields.py)
    return cfg, decisions, line


PERF_RECIPE = "perf recipe"


def _apply_perf_recipe(cfg: ConfigContainer, args: argparse.Namespace, line: CommandLine) -> None:
    """Bridge's perf recipe for this model, GPU and precision (`overlap.recipes.perf`): its
    settings, after the flags (what a flag set stays the flag's) and before the overrides (which
    win), each a row of the "perf recipe" section with the recipe it came from; the layout and
    batch only at the GPU count it was published for; what the runtime cannot carry, listed."""
    if args.gpu == "cpu":
        return
    precision = args.compute_dtype or _PRECISION_NAMES.get(_preset_name(cfg.mixed_precision))
    found = perf_recipe(args.model_recipe_name, args.gpu, precision, args.num_gpus)
    if found is None:
        return
    overridden = {item.split("=", 1)[0].strip() for item in args.overrides}
    rows = line.perf_rows
    rows.append(
        Decision(
            "perf recipe",
            None,
            found.name,
            PERF_RECIPE,
            f"Megatron-Bridge's performance harness for {args.model_recipe_name} on "
            f"{args.gpu} in {precision} ({PERF_SOURCE}): applied after the flags, before the "
            "overrides",
        )
    )
    settings = [
        Setting(key, value, "the published layout and batch") for key, value in found.layout
    ]
    chosen = sorted(k for k in LAYOUT_KEYS if k in line.flags or k in overridden)
    why_not = (
        f"it was published for {found.num_gpus} GPUs and -ng is {args.num_gpus}"
        if found.num_gpus != args.num_gpus
        else f"the command line chooses the layout ({', '.join(chosen)})"
        if chosen
        else None
    )
    if why_not is not None:
        rows.append(
            Decision(
                "layout",
                f"{found.name}'s",
                "not applied",
                PERF_RECIPE,
                f"{why_not}: the model recipe's layout rule stays (set one with "
                "-tp/-pp/-vp/-cp/-ep)",
            )
        )
        settings = [s for s in settings if s.key not in LAYOUT_KEYS]
    settings += [Setting(*s) for s in found.settings]
    for key, value, why, skip in settings:
        if any(k in line.flags or k in overridden for k in spellings(key) or (key,)):
            # the flag's (or the override's, applied next), in either of the knob's spellings:
            # said in their rows
            continue
        reason = skip(cfg) if skip is not None else None
        if reason is not None:
            rows.append(Decision(key, value, "not applied", PERF_RECIPE, f"{why}; {reason}"))
            continue
        applied = apply_override(cfg, f"{key}={value}")[1]
        line.perf[key] = found.name
        rows.append(Decision(key, None, applied, PERF_RECIPE, why))
    hybridep = (
        cfg.model.moe_token_dispatcher_type == "flex"
        and cfg.model.moe_flex_dispatcher_backend == "hybridep"
    )
    # run_script derives the connections again when -tp, -cp or --moe_a2a_overlap is given
    rederive = any(
        key in line.flags
        for key in (
            "model.tensor_model_parallel_size",
            "model.context_parallel_size",
            "comm_overlap.overlap_moe_expert_parallel_comm",
        )
    )
    env = list(found.env) + (list(found.hybridep_env) if hybridep else [])
    for name, value in env:
        key = f"env_vars.{name}"
        if key in overridden:
            continue
        if name == "CUDA_DEVICE_MAX_CONNECTIONS" and rederive:
            rows.append(
                Decision(
                    key,
                    value,
                    "the launch rule's",
                    PERF_RECIPE,
                    "-tp, -cp or --moe_a2a_overlap is given: the launch rule derives it again, as "
                    "run_script does",
                )
            )
            continue
        cfg.env_vars[name] = value
        line.perf[key] = found.name
        rows.append(Decision(key, None, value, PERF_RECIPE, "its environment"))
    if found.hybridep_env and not hybridep:
        rows.append(
            Decision(
                "env_vars (HybridEP)",
                " ".join(f"{n}={v}" for n, v in found.hybridep_env),
                "not applied",
                PERF_RECIPE,
                "its HybridEP dispatcher's environment; the dispatcher that runs is another "
                "(the launch rules set the connections for it)",
            )
        )
    for setting, why in found.not_carried:
        rows.append(Decision(setting, "set", "not applied", PERF_RECIPE, why))
    log.info(
        "perf recipe %s (%s): %d settings applied, %d not carried (overlap explain lists them)",
        found.name,
        PERF_SOURCE,
        len(line.perf),
        len(found.not_carried),
    )


_PRECISION_NAMES = {"bf16_mixed": "bf16", "fp16_mixed": "fp16", "fp32": "fp32"}


def _preset_name(precision: Any) -> str | None:
    """The preset a mixed-precision section was made from (a name, or a preset's config)."""
    if precision is None or isinstance(precision, str):
        return precision
    from overlap.config.mixed_precision import MIXED_PRECISION_PRESETS

    for name, preset in MIXED_PRECISION_PRESETS.items():
        if preset == precision:
            return name
    return None


def _explicit_false_distributed_optimizer(
    cfg: ConfigContainer, line: CommandLine
) -> list[Decision]:
    """ddp.use_distributed_optimizer and its alias optimizer.use_distributed_optimizer are one knob
    (either true turns it on, as the reference: `aliases.ANY_TRUE`): a `false` the user typed for
    one while the other is true is a request that is not honoured - a warning, an error under
    --strict (`overlap.decisions`)."""
    out = []
    for mine, other in (("ddp", "optimizer"), ("optimizer", "ddp")):
        key = f"{mine}.use_distributed_optimizer"
        if line.overrides.get(key, True) is False and _get(
            cfg, f"{other}.use_distributed_optimizer"
        ):
            why = (
                f"{other}.use_distributed_optimizer is true and the two are kept in sync: the "
                "distributed optimizer is on"
            )
            # strict: the decision log refuses it
            if not (cfg.comm_overlap and cfg.comm_overlap.strict):
                log.warning("%s=false: %s", key, why)
            out.append(Decision(key, False, True, OVERRIDE, why))
    return out


def _reconcile(cfg: ConfigContainer, line: CommandLine) -> list[Decision]:
    """Every field a flag wrote and an override set differently: the override wins (it came later),
    said aloud."""
    out = []
    for key, write in line.flags.items():
        for other in spellings(key) or (key,):
            if other not in line.overrides or line.overrides[other] == write.value:
                continue
            value = line.overrides[other]
            # another spelling of the flag's knob: undo the flag so the override counts, whichever
            # spelling ranks first
            if other != key:
                _set(cfg, key, write.before)
            typed = write.value if write.typed is _KEEP else write.typed
            sets = (
                ""
                if _word(typed) == _word(write.value)
                else f", which set {key}={_word(write.value)}"
            )
            if write.implied:
                shown = write.flag if write.typed is _KEEP else f"{write.flag} {_word(typed)}"
                out.append(
                    Decision(
                        key,
                        None,
                        value,
                        OVERRIDE,
                        f"{shown} implies {key}={_word(write.value)}; the explicit override "
                        f"{other}={_word(value)} refines it",
                    )
                )
                continue
            dropped = ""
            if (
                write.flag == "--moe_flex_dispatcher_backend"
                and key == "model.moe_token_dispatcher_type"
            ):
                # The flag asked for flex dispatch with a backend; the override chose another
                # dispatcher, so the backend goes with the flag (left in place it would only be
                # reported as "inactive").
                backend = line.flags.get("model.moe_flex_dispatcher_backend")
                if (
                    backend is not None
                    and "model.moe_flex_dispatcher_backend" not in line.overrides
                ):
                    _set(cfg, "model.moe_flex_dispatcher_backend", backend.before)
                    dropped = f"; the backend {_word(typed)} is dropped with it"
            out.append(
                Decision(
                    key,
                    write.value,
                    value,
                    OVERRIDE,
                    f"the override {other}={_word(value)} beats {write.flag} {_word(typed)}{sets}"
                    f"{dropped} (flags apply first, overrides after, as in the reference harness)",
                )
            )
    return out


def _word(value: Any) -> str:
    """A value as the user typed it on the command line."""
    return (
        "true"
        if value is True
        else "false"
        if value is False
        else "null"
        if value is None
        else str(value)
    )


def _apply_recipe_rules(
    cfg: ConfigContainer, recipe: Recipe, world: int, line: CommandLine
) -> list[Decision]:
    """Recipe values that depend on the layout, re-derived once the flags and overrides have fixed
    it."""
    key = "model.expert_model_parallel_size"
    if recipe.max_ep is None or key in line.flags or key in line.overrides:
        return []
    pp = max(1, cfg.model.pipeline_model_parallel_size)
    per_stage = max(1, world // pp)
    ep = recipe.ep_for(per_stage)
    cfg.model.expert_model_parallel_size = ep
    return [
        Decision(
            key,
            None,
            ep,
            RECIPE,
            f"recipe {recipe.name}: EP = gcd(ranks per pipeline stage {per_stage}, "
            f"{recipe.max_ep}) "
            ""
            f"= {ep} "
            "(experts are carved out of each stage's ranks); override with -ep",
        )
    ]


def _apply_flags(cfg: ConfigContainer, a: argparse.Namespace, line: CommandLine) -> None:
    """Write every given flag into the config, remembering each write for provenance and
    reconciliation."""

    def put(key: str, value: Any, flag: str, implied: bool = False, typed: Any = _KEEP) -> None:
        line.flags[key] = _FlagWrite(flag, value, _get(cfg, key), implied, typed)
        _set(cfg, key, value)

    if a.compute_dtype is not None:
        if a.compute_dtype in REFERENCE_FP8_DTYPES:
            raise NotBuiltError(
                "-c/--compute_dtype",
                a.compute_dtype,
                "FP8/FP4 compute (Transformer Engine kernels)",
                "use -c bf16, fp16 or fp32.",
            )
        if a.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                "-c/--compute_dtype",
                a.compute_dtype,
                "unknown compute dtype.",
                f"use one of {', '.join(COMPUTE_DTYPES)}.",
            )
        put(
            "mixed_precision",
            get_mixed_precision_config(COMPUTE_DTYPES[a.compute_dtype]),
            "-c",
            typed=a.compute_dtype,
        )
        # compared with a preset name
        line.flags["mixed_precision"].value = COMPUTE_DTYPES[a.compute_dtype]
    if a.tensor_model_parallel_size is not None:
        put("model.tensor_model_parallel_size", a.tensor_model_parallel_size, "-tp")
        put(
            "model.sequence_parallel",
            a.tensor_model_parallel_size > 1,
            "-tp",
            implied=True,
            typed=a.tensor_model_parallel_size,
        )
    for name, flag in (
        ("pipeline_model_parallel_size", "-pp"),
        ("context_parallel_size", "-cp"),
        ("expert_model_parallel_size", "-ep"),
        ("expert_tensor_parallel_size", "-et"),
        ("seq_length", "-sl"),
    ):
        if getattr(a, name) is not None:
            put(f"model.{name}", getattr(a, name), flag)
    if a.virtual_pipeline_model_parallel_size is not _KEEP:
        put(
            "model.virtual_pipeline_model_parallel_size",
            a.virtual_pipeline_model_parallel_size,
            "-vp",
        )
    if a.cuda_graph_impl is not None:
        put("model.cuda_graph_impl", a.cuda_graph_impl, "--cuda_graph_impl")
        if a.cuda_graph_impl == "none":
            put("model.cuda_graph_scope", None, "--cuda_graph_impl", implied=True)
    if a.cuda_graph_scope is not None:
        put(
            "model.cuda_graph_scope",
            comma_list(a.cuda_graph_scope),
            "--cuda_graph_scope",
        )
    if a.recompute_num_layers is not None:
        put("model.recompute_granularity", "full", "-rl", implied=True)
        put("model.recompute_method", "uniform", "-rl", implied=True)
        put("model.recompute_num_layers", a.recompute_num_layers, "-rl")
    if a.recompute_modules is not None:
        put("model.recompute_granularity", "selective", "--recompute_modules", implied=True)
        put(
            "model.recompute_modules",
            comma_list(a.recompute_modules),
            "--recompute_modules",
        )
    if a.moe_flex_dispatcher_backend is not _KEEP:
        backend = a.moe_flex_dispatcher_backend
        backend = None if backend in (None, "None", "none") else backend
        # "None" on a dense model asks for nothing: no dispatcher
        if backend is not None or cfg.model.is_moe:
            flag = "--moe_flex_dispatcher_backend"
            before = {
                k: _get(cfg, k)
                for k in (
                    "model.moe_flex_dispatcher_backend",
                    "model.moe_token_dispatcher_type",
                    "model.moe_shared_expert_overlap",
                )
            }
            apply_flex_dispatcher_backend(cfg.model, backend)
            for key, old in before.items():
                line.flags[key] = _FlagWrite(
                    flag, _get(cfg, key), old, implied=key.endswith("overlap"), typed=_word(backend)
                )
            if before["model.moe_shared_expert_overlap"] == _get(
                cfg, "model.moe_shared_expert_overlap"
            ):
                del line.flags["model.moe_shared_expert_overlap"]  # untouched: not the flag's
    # Bridge's _set_megatron_fsdp_overrides (false: nothing), except that a deferred output-layer
    # weight gradient is refused by the configuration's rule, naming it, not turned off
    if a.use_megatron_fsdp:
        put("ddp.use_megatron_fsdp", True, "--use_megatron_fsdp")
        for key, value in (
            ("ddp.data_parallel_sharding_strategy", "optim_grads_params"),
            ("ddp.average_in_collective", False),
        ):
            put(key, value, "--use_megatron_fsdp", implied=True, typed=True)
    if a.moe_a2a_overlap is not None:
        if cfg.comm_overlap is None:
            cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=None)
        put("comm_overlap.overlap_moe_expert_parallel_comm", a.moe_a2a_overlap, "--moe_a2a_overlap")
    if a.strict:
        if cfg.comm_overlap is None:
            cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=None)
        put("comm_overlap.strict", True, "--strict")
    for key, value, flag in (
        ("tokenizer.tokenizer_type", a.tokenizer_type, "--tokenizer_type"),
        ("tokenizer.tokenizer_model", a.tokenizer_model, "--tokenizer_model"),
        ("tokenizer.vocab_size", a.vocab_size, "--vocab_size"),
        ("train.global_batch_size", a.global_batch_size, "-gb"),
        ("train.micro_batch_size", a.micro_batch_size, "-mb"),
        ("train.train_iters", a.max_steps, "-ms/--max_steps"),
        ("train.eval_time_start_step", a.eval_time_start_step, "--eval_time_start_step"),
        ("train.eval_time_end_step", a.eval_time_end_step, "--eval_time_end_step"),
        ("train.skip_first_percent_time", a.skip_first_percent_time, "--skip_first_percent_time"),
    ):
        if value is not None:
            put(key, value, flag)


def launch_env_inputs(res: Resolution, accelerator: str) -> LaunchEnvInputs:
    """What the launch environment's rules read of the resolved run."""
    return LaunchEnvInputs(
        accelerator=accelerator,
        layout=res.layout,
        moe_flex_dispatcher_backend=res.kernels.moe_flex_dispatcher_backend,
        moe_token_dispatcher_type=res.kernels.moe_token_dispatcher_type,
        overlap_moe_expert_parallel_comm=(res.overlap.overlap_moe_expert_parallel_comm),
    )


def describe_layout(res: Resolution) -> str:
    lay = res.layout
    return (
        f"world {lay.world_size} = TP {lay.tp} x CP {lay.cp} x DP {lay.dp} x PP {lay.pp}; experts: "
        f"EP {lay.ep} x ETP {lay.etp} x expert-DP {lay.edp} per pipeline stage "
        "(rank order tp-cp-dp-pp, tensor parallel fastest)"
    )


@contextlib.contextmanager
def start_up_quiet() -> Iterator[None]:
    """Hold back the start-up log lines a resolution writes (the perf recipe's summary, a no-op
    switch's warning): for the variants a planner resolves of a command line the user already saw
    resolved, which would repeat them (the decision table keeps every one)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def resolve_run(words: list[str], overrides: list[str], model_noops: bool = True) -> Job:
    """The resolved job of an `overlap run` command line (harness flags `words`, then `overrides`),
    for the `-g` target as given (`prepare(..., describe_target=True)`: this machine is not probed):
    what the planner and its calibration re-plan a run from. `model_noops`: whether to build the
    (meta) model to find single-bucket no-op switches (a warning; the planner's layout search, which
    resolves hundreds of candidates, skips it)."""
    return prepare(_run_parser().parse_args(words + overrides), True, model_noops)


@functools.lru_cache(maxsize=1)
def _run_parser() -> argparse.ArgumentParser:
    """The harness flags' parser, built once (parsing leaves it as it was): the layout search
    resolves thousands of command lines, and building it took a tenth of each."""
    parser = argparse.ArgumentParser()
    add_harness_flags(parser)
    return parser


def prepare(
    args: argparse.Namespace, describe_target: bool = False, model_noops: bool = True
) -> Job:
    """Parse, resolve and check a command line. `describe_target` (explain): resolve for the GPU
    named by -g instead of probing this machine's device, and leave the runtime's own limits to
    `run` (listed, not raised); `model_noops`: build the meta model where the single-bucket no-op
    check needs it (`resolve_run`)."""
    from overlap.training.dp_overlap_noops import detect_model_noops

    cfg, command_line, line = build_config(args)
    # a preset name, or the preset (the flag's or the override's name is recorded)
    precision = cfg.mixed_precision
    precision_name = line.overrides.get(
        "mixed_precision",
        line.flags["mixed_precision"].value if "mixed_precision" in line.flags else precision,
    )
    device = (lambda: TARGET_DEVICES[args.gpu]) if describe_target else probe_device
    res = cfg.finalize(
        args.num_gpus,
        device=device,
        require_libraries=not describe_target,
        command_line=command_line,
        on_cuda=args.gpu != "cpu",
        pretrained=apply_pretrained,
    )  # as `run` places its ranks
    record_sinks(cfg.logger, res.decisions, require_libraries=not describe_target)
    check_pretrained_overrides(res, line)
    check_precision_overrides(cfg, res, line)
    # before anything builds even a meta-device model
    estimate = check_representable(cfg, res.layout)
    if model_noops and _buckets_need_model(cfg, res, estimate):
        detect_model_noops(cfg, res)
    res.decisions.attribute(line.source)
    if line.perf_rows:
        res.decisions.sections["perf recipe"] = line.perf_rows
    res.decisions.other = [
        Decision(
            key,
            None,
            _as_run(cfg, res, key, precision_name),
            line.source(key),
            "",
        )
        for key in OTHER_SETTINGS
    ]
    return Job(cfg, res, args, estimate)


def check_pretrained_overrides(res: Resolution, line: CommandLine) -> None:
    """A Hugging Face pretrained checkpoint's config.json replaces the recipe's architecture
    (finalize); a value the user set on the command line that it would replace is a contradiction,
    refused rather than silently beaten."""
    for d in res.decisions.sections.get("checkpoint", []):
        if d.reason.startswith(PRETRAINED) and (d.field in line.overrides or d.field in line.flags):
            raise ConfigError(
                d.field,
                d.requested,
                f"the pretrained checkpoint's config.json has {d.effective!r}, and "
                "a run from a Hugging Face folder takes its architecture from there.",
                f"drop the {line.source(d.field)} of {d.field}, or load a checkpoint of that "
                "shape.",
            )


# The precision aliases on the model and optimizer that a mixed-precision preset owns without a row
# of its own at finalize (`mixed_precision.resolve_precision` logs the DDP and loss-scaling ones).
_PRESET_COPIES = (
    "model.bf16",
    "model.fp16",
    "model.params_dtype",
    "optimizer.bf16",
    "optimizer.fp16",
)


def check_precision_overrides(cfg: ConfigContainer, res: Resolution, line: CommandLine) -> None:
    """A precision field typed on the model or optimizer that the mixed-precision preset then
    replaced (as Bridge's preset does) is a request not honoured: a row of the decision table and a
    warning, an error under strict - never silently beaten. With a preset the precision that runs
    is the preset's (its name or its config, as typed)."""
    if cfg.mixed_precision is None:
        return
    preset = res.precision
    for key in _PRESET_COPIES:
        name = key.partition(".")[2]
        if key in line.overrides and line.overrides[key] != getattr(preset, name):
            res.decisions.record(
                key,
                line.overrides[key],
                getattr(preset, name),
                OVERRIDE,
                f"set through mixed_precision.{name} (the mixed-precision preset owns it)",
                fix=f"set mixed_precision.{name}={_word(line.overrides[key])} with a consistent "
                "params_dtype (or pick another -c preset) instead of "
                f"{key}.",
            )


def _buckets_need_model(cfg: ConfigContainer, res: Resolution, est: MemoryEstimate) -> bool:
    """Whether the single-bucket no-op check must build the (meta) model: not when a communicating
    buffer is certainly cut into several buckets (the switch then does something), which the
    estimate's counts settle without building an absurdly deep model layer by layer."""
    bucket = res.overlap.bucket_size
    if bucket is None:
        return True
    chunks = res.layout.vpp
    counts = [(res.layout.dp, est.params - est.expert_params), (res.layout.edp, est.expert_params)]
    return not any(size > 1 and count // chunks >= 2 * bucket for size, count in counts)
