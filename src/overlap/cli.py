"""Command line: `overlap explain | run | bench` with the reference harness flags plus `section.field=value` overrides.

Flags follow Megatron-Bridge's `run_script.py`; its known flaws are fixed on purpose: `--moe_a2a_overlap false`
really turns EP overlap off, and `--moe_a2a_overlap true` turns on EP overlap and nothing else (the reference also
switched on delay_wgrad_compute). Order of application: recipe, then overrides, then flags (flags win, as there).
A user mistake exits with status 2 and a one-paragraph message; no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass

from overlap.config.comm_overlap import CommOverlapConfig
from overlap.config.container import ConfigContainer, Resolution
from overlap.config.flex_dispatcher import apply_flex_dispatcher_backend
from overlap.config.mixed_precision import get_mixed_precision_config
from overlap.config.overrides import apply_overrides
from overlap.config.recipes import RECIPES, get_recipe
from overlap.errors import ConfigError, NotBuiltError
from overlap.launch.env import LaunchEnvInputs, VALID_ACCELERATORS, compute_launch_env, format_launch_env

log = logging.getLogger("overlap")

_KEEP = object()  # "flag not given": keep the recipe's value
COMPUTE_DTYPES = {"bf16": "bf16_mixed", "fp16": "fp16_mixed", "fp32": "fp32"}
REFERENCE_FP8_DTYPES = ("fp8_cs", "fp8_mx", "fp8_sc", "fp8_ds", "nvfp4")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as exit 2 with our message style (no traceback)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


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
    g = p.add_argument_group("harness flags (Megatron-Bridge run_script.py compatible)")
    g.add_argument("-m", "--model_family_name", type=str.lower)
    g.add_argument("-mr", "--model_recipe_name", type=str.lower)
    g.add_argument("--task", default="pretrain", choices=("pretrain", "sft", "peft"))
    g.add_argument("-g", "--gpu", default="cpu", type=str.lower, choices=VALID_ACCELERATORS,
                   help="accelerator type; cpu = local CPU ranks over gloo")
    g.add_argument("-c", "--compute_dtype", default=None, type=str.lower,
                   help="bf16 | fp16 | fp32 (default: the recipe's precision)")
    g.add_argument("-ng", "--num_gpus", type=int, help="world size (ranks)")
    g.add_argument("-gn", "--gpus_per_node", type=int, default=None)
    g.add_argument("-ms", "--max_steps", type=int, default=None)
    g.add_argument("-cv", "--config_variant", default=None)
    g.add_argument("--cuda_graph_impl", choices=("none", "local", "transformer_engine"), default=None)
    g.add_argument("--cuda_graph_scope", default=None, help="comma list")
    g.add_argument("--moe_flex_dispatcher_backend", default=_KEEP,
                   help="torch | deepep | hybridep | None (None: alltoall)")
    g.add_argument("--moe_a2a_overlap", type=bool_arg, default=None,
                   help="true/false: EP all-to-all overlap on/off (and nothing else)")
    g.add_argument("--tokenizer_type", default=None,
                   choices=("NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer"))
    g.add_argument("--vocab_size", type=int, default=None)
    for flag, dest in (("-tp", "tensor_model_parallel_size"), ("-pp", "pipeline_model_parallel_size"),
                       ("-cp", "context_parallel_size"), ("-ep", "expert_model_parallel_size"),
                       ("-et", "expert_tensor_parallel_size")):
        g.add_argument(flag, dest=dest, type=int, default=None)
    g.add_argument("-vp", dest="virtual_pipeline_model_parallel_size", type=int_or_none, default=_KEEP)
    g.add_argument("-gb", "--global_batch_size", type=int, default=None)
    g.add_argument("-mb", "--micro_batch_size", type=int, default=None)
    g.add_argument("-sl", "--seq_length", type=int, default=None)
    g.add_argument("-rl", "--recompute_num_layers", type=int, default=None,
                   help="full recompute of this many layers per chunk (uniform)")
    g.add_argument("--recompute_modules", default=None, help="comma list: selective recompute")
    g.add_argument("--eval_time_start_step", type=int, default=None)
    g.add_argument("--eval_time_end_step", type=int, default=None)
    g.add_argument("--skip_first_percent_time", type=float, default=None)
    g.add_argument("--strict", action="store_true", help="any overlap request that cannot be honoured is an error")
    p.add_argument("overrides", nargs="*", help="section.field=value overrides (e.g. model.num_layers=4)")


@dataclass
class Job:
    """A parsed command line: the finalized config and what it takes to launch it."""

    cfg: ConfigContainer
    resolution: Resolution
    args: argparse.Namespace


def build_config(args: argparse.Namespace) -> ConfigContainer:
    if not args.model_family_name or not args.model_recipe_name:
        raise ConfigError("-m/-mr", None, "a model family and recipe are required.",
                          "pass e.g. -m qwen -mr qwen3_moe_tiny (overlap explain --list-recipes lists them).")
    if args.num_gpus is None:
        raise ConfigError("-ng/--num_gpus", None, "the world size is required.", "pass e.g. -ng 4.")
    if args.task != "pretrain":
        raise NotBuiltError("--task", args.task, "Fine-tuning (sft/peft)", "use --task pretrain.")
    if args.config_variant not in (None, "v1", "v2"):
        raise ConfigError("-cv/--config_variant", args.config_variant, "recipes here have one canonical variant.",
                          "omit -cv, or use v1/v2 (both mean the canonical recipe).")
    cfg = get_recipe(args.model_family_name, args.model_recipe_name).build(args.num_gpus)
    _apply_compute_dtype(cfg, args)  # the preset first, so mixed_precision.* overrides refine it
    overridden = apply_overrides(cfg, args.overrides)
    if args.compute_dtype is not None and "mixed_precision" in overridden:
        raise ConfigError("-c/--compute_dtype", args.compute_dtype,
                          f"it contradicts the override mixed_precision={overridden['mixed_precision']!r}.",
                          "keep one of them.")
    _apply_flags(cfg, args, overridden)
    return cfg


def _apply_compute_dtype(cfg: ConfigContainer, a: argparse.Namespace) -> None:
    if a.compute_dtype is None:
        return
    if a.compute_dtype in REFERENCE_FP8_DTYPES:
        raise NotBuiltError("-c/--compute_dtype", a.compute_dtype, "FP8/FP4 compute (Transformer Engine kernels)",
                            "use -c bf16, fp16 or fp32.")
    if a.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError("-c/--compute_dtype", a.compute_dtype, "unknown compute dtype.",
                          f"use one of {', '.join(COMPUTE_DTYPES)}.")
    cfg.mixed_precision = get_mixed_precision_config(COMPUTE_DTYPES[a.compute_dtype])


def _check_conflict(overridden: dict, key: str, value: object, flag: str) -> None:
    """A flag and an override that ask for different values of one field are a contradiction: say so.

    The reference lets the flag win silently; its documented smoke test even pairs `--moe_a2a_overlap false` (a no-op
    there, bug #6006) with `comm_overlap.overlap_moe_expert_parallel_comm=true`. Here the flag means what it says.
    """
    if key in overridden and overridden[key] != value:
        raise ConfigError(flag, value, f"it contradicts the override {key}={overridden[key]!r} on the same command "
                          "line (here every flag means what it says; in the reference --moe_a2a_overlap false was a "
                          "no-op).", f"remove one of them: keep either the flag or {key}.")


def _apply_flags(cfg: ConfigContainer, a: argparse.Namespace, overridden: dict) -> None:
    """Harness flags win over overrides (as in the reference), but a flag that contradicts an override of the same
    field on the same command line is an error, never a silent winner."""

    def put(section: str, field: str, value: object, flag: str) -> None:
        _check_conflict(overridden, f"{section}.{field}", value, flag)
        setattr(getattr(cfg, section), field, value)

    if a.tensor_model_parallel_size is not None:
        put("model", "tensor_model_parallel_size", a.tensor_model_parallel_size, "-tp")
        if "model.sequence_parallel" not in overridden:  # -tp implies SP (as the reference); an explicit SP wins
            put("model", "sequence_parallel", a.tensor_model_parallel_size > 1, "-tp")
    for name, flag in (("pipeline_model_parallel_size", "-pp"), ("context_parallel_size", "-cp"),
                       ("expert_model_parallel_size", "-ep"), ("expert_tensor_parallel_size", "-et"),
                       ("seq_length", "-sl")):
        if getattr(a, name) is not None:
            put("model", name, getattr(a, name), flag)
    if a.virtual_pipeline_model_parallel_size is not _KEEP:
        put("model", "virtual_pipeline_model_parallel_size", a.virtual_pipeline_model_parallel_size, "-vp")
    if a.cuda_graph_impl is not None:
        put("model", "cuda_graph_impl", a.cuda_graph_impl, "--cuda_graph_impl")
        if a.cuda_graph_impl == "none":
            put("model", "cuda_graph_scope", None, "--cuda_graph_impl")
    if a.cuda_graph_scope is not None:
        put("model", "cuda_graph_scope", [s.strip() for s in a.cuda_graph_scope.split(",") if s.strip()],
            "--cuda_graph_scope")
    if a.recompute_num_layers is not None:
        put("model", "recompute_granularity", "full", "-rl")
        put("model", "recompute_method", "uniform", "-rl")
        put("model", "recompute_num_layers", a.recompute_num_layers, "-rl")
    if a.recompute_modules is not None:
        put("model", "recompute_granularity", "selective", "--recompute_modules")
        put("model", "recompute_modules", [s.strip() for s in a.recompute_modules.split(",") if s.strip()],
            "--recompute_modules")
    if a.moe_flex_dispatcher_backend is not _KEEP:
        backend = a.moe_flex_dispatcher_backend
        backend = None if backend in (None, "None", "none") else backend
        if backend is not None or cfg.model.is_moe:  # "None" on a dense model asks for nothing: no dispatcher
            flag = "--moe_flex_dispatcher_backend"
            _check_conflict(overridden, "model.moe_flex_dispatcher_backend", backend, flag)
            _check_conflict(overridden, "model.moe_token_dispatcher_type", "alltoall" if backend is None else "flex",
                            flag)
            apply_flex_dispatcher_backend(cfg.model, backend)
    if a.moe_a2a_overlap is not None:
        if cfg.comm_overlap is None:
            cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=None)
        _check_conflict(overridden, "model.overlap_moe_expert_parallel_comm", a.moe_a2a_overlap, "--moe_a2a_overlap")
        put("comm_overlap", "overlap_moe_expert_parallel_comm", a.moe_a2a_overlap, "--moe_a2a_overlap")
    if a.strict:
        if cfg.comm_overlap is None:
            cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=None)
        put("comm_overlap", "strict", True, "--strict")
    for section, field, value, flag in (
            ("tokenizer", "tokenizer_type", a.tokenizer_type, "--tokenizer_type"),
            ("tokenizer", "vocab_size", a.vocab_size, "--vocab_size"),
            ("train", "global_batch_size", a.global_batch_size, "-gb"),
            ("train", "micro_batch_size", a.micro_batch_size, "-mb"),
            ("train", "train_iters", a.max_steps, "-ms/--max_steps"),
            ("train", "eval_time_start_step", a.eval_time_start_step, "--eval_time_start_step"),
            ("train", "eval_time_end_step", a.eval_time_end_step, "--eval_time_end_step"),
            ("train", "skip_first_percent_time", a.skip_first_percent_time, "--skip_first_percent_time")):
        if value is not None:
            put(section, field, value, flag)


def launch_env_inputs(cfg: ConfigContainer, res: Resolution, accelerator: str) -> LaunchEnvInputs:
    m = cfg.model
    return LaunchEnvInputs(accelerator=accelerator, tensor_model_parallel_size=res.layout.tp,
                           context_parallel_size=res.layout.cp, pipeline_model_parallel_size=res.layout.pp,
                           data_parallel_size=res.layout.dp, moe_flex_dispatcher_backend=m.moe_flex_dispatcher_backend,
                           moe_token_dispatcher_type=m.moe_token_dispatcher_type,
                           overlap_moe_expert_parallel_comm=bool(m.overlap_moe_expert_parallel_comm))


def describe_layout(res: Resolution) -> str:
    lay = res.layout
    return (f"world {lay.world_size} = TP {lay.tp} x CP {lay.cp} x DP {lay.dp} x PP {lay.pp}; "
            f"experts: EP {lay.ep} x ETP {lay.etp} x expert-DP {lay.edp} per pipeline stage "
            "(rank order tp-cp-dp-pp, tensor parallel fastest)")


def prepare(args: argparse.Namespace) -> Job:
    cfg = build_config(args)
    return Job(cfg, cfg.finalize(args.num_gpus), args)


def cmd_explain(args: argparse.Namespace) -> int:
    if args.list_recipes:
        for r in RECIPES.values():
            print(f"-m {r.family} -mr {r.name:<16} {r.summary}")
        return 0
    job = prepare(args)
    env = compute_launch_env(launch_env_inputs(job.cfg, job.resolution, args.gpu), job.cfg.env_vars, os.environ)
    if args.json:
        print(json.dumps(job.resolution.decisions.to_json(), indent=2))
        return 0
    print(f"recipe {args.model_recipe_name} on {args.num_gpus} x {args.gpu}")
    print(f"\nParallel layout: {describe_layout(job.resolution)}")
    print("\nOverlap decisions:\n" + job.resolution.decisions.format_table())
    print("\nLaunch environment:\n" + format_launch_env(env))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[overlap] %(levelname)s %(message)s", stream=sys.stderr)
    parser = _Parser(prog="overlap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    explain = sub.add_parser("explain", help="resolve the configuration and print every overlap decision")
    add_harness_flags(explain)
    explain.add_argument("--json", action="store_true", help="print the decisions as a JSON list")
    explain.add_argument("--list-recipes", action="store_true")
    explain.set_defaults(func=cmd_explain)
    from overlap.commands import register_commands

    register_commands(sub)
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return args.func(args)
    except _UsageError as exc:
        words = list(sys.argv[1:] if argv is None else argv)
        command = words[0] if words and words[0] in ("explain", "run", "bench") else ""
        print(f"overlap: error: {exc}\nRun 'overlap {command} --help'.".replace("  ", " "), file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: ranks were stopped and cleanup ran on the way out
        print(f"overlap: interrupted ({exc or 'Ctrl-C'}); ranks stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
