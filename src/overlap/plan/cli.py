"""`overlap plan`: predict step time with each overlap switch off and on, before booking a cluster.
Nothing runs.

The configuration comes from the same harness flags and overrides as `overlap run`, resolved for the
`-g` target (`prepare(..., describe_target=True)`, as `overlap explain` does: this machine's
hardware is not probed). `--ab` and `--config` mean what they mean in `overlap bench` (its parsers);
without them the plan compares, for every overlap switch the layout can use, the given configuration
with that switch off and on.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from overlap.errors import ConfigError
from overlap.files import write_replace
from overlap.layout.prerequisites import CP_RING_TYPES, ep_overlap_has_experts


@dataclass(frozen=True)
class SwitchCase:
    """One overlap switch the plan judges by itself: its overrides off and on, and when it cannot
    apply."""

    label: str
    off: tuple[str, ...]
    on: tuple[str, ...]


SWITCHES = (
    SwitchCase(
        "EP overlap",
        # delay_wgrad_compute needs EP overlap (a perf recipe may have set it): off goes with it
        (
            "comm_overlap.overlap_moe_expert_parallel_comm=false",
            "comm_overlap.delay_wgrad_compute=false",
        ),
        ("comm_overlap.overlap_moe_expert_parallel_comm=true",),
    ),
    SwitchCase(
        "delay_wgrad",
        (
            "comm_overlap.overlap_moe_expert_parallel_comm=true",
            "comm_overlap.delay_wgrad_compute=false",
        ),
        (
            "comm_overlap.overlap_moe_expert_parallel_comm=true",
            "comm_overlap.delay_wgrad_compute=true",
        ),
    ),
    SwitchCase(
        "DP overlap",
        ("ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=false"),
        ("ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"),
    ),
    SwitchCase(
        "TP overlap",
        ("comm_overlap.tp_comm_overlap=false",),
        ("comm_overlap.tp_comm_overlap=true",),
    ),
    SwitchCase(
        "PP overlap",
        ("comm_overlap.overlap_p2p_comm=false",),
        ("comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"),
    ),
    # overlapped plain 1F1B with a step of slack per transfer, for PP - rank - 1 more activations
    SwitchCase(
        "PP deeper warm-up",
        ("comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"),
        (
            "comm_overlap.overlap_p2p_comm=true",
            "comm_overlap.batch_p2p_comm=false",
            "comm_overlap.p2p_warmup_depth=2",
        ),
    ),
    # the KV ring (p2p, a2a+p2p) serialised vs overlapped (the exchange itself is the same)
    SwitchCase("CP overlap", ("model.cp_comm_overlap=false",), ("model.cp_comm_overlap=true",)),
)


def not_applicable(label: str, layout, cfg) -> str | None:
    """Why a switch has nothing to hide in this layout (None: it applies)."""
    m = cfg.resolved.model
    if label in ("EP overlap", "delay_wgrad"):
        if not m.is_moe or not ep_overlap_has_experts(layout.ep):
            return (
                f"not applicable at EP={layout.ep}" if m.is_moe else "not applicable: dense model"
            )
    if label == "DP overlap" and layout.dp * layout.cp <= 1 and layout.edp <= 1:
        return "not applicable at DP x CP = 1"
    if label == "TP overlap" and layout.tp <= 1:
        return "not applicable at TP=1"
    if label.startswith("PP") and layout.pp <= 1:
        return "not applicable at PP=1"
    if label == "PP deeper warm-up" and layout.vpp > 1:
        return "not applicable with a virtual pipeline (its warm-up has the slack)"
    if label == "CP overlap" and layout.cp <= 1:
        return "not applicable at CP=1"
    if label == "CP overlap" and cfg.resolved.overlap.cp_comm_type not in CP_RING_TYPES:
        return f"not applicable: cp_comm_type={cfg.resolved.overlap.cp_comm_type} has no ring"
    return None


def register(sub: argparse._SubParsersAction) -> None:
    """Add `overlap plan` to the command line (called once from
    `overlap.commands.register_commands`)."""
    from overlap.harness import add_harness_flags
    from overlap.perf.bench import BENCH_FLAGS

    plan = sub.add_parser(
        "plan", help="predict step time with each overlap switch off/on for a cluster; runs nothing"
    )
    add_harness_flags(plan)
    for flags, kwargs in BENCH_FLAGS:
        if flags[0] in ("--ab", "--config", "--json", "--markdown"):
            plan.add_argument(*flags, **kwargs)
    plan.add_argument(
        "--cluster",
        default=None,
        metavar="FILE",
        help="JSON cluster description replacing the built-in figures (required for -g cpu: the "
        "machine profile); docs/planner.md",
    )
    plan.add_argument(
        "--search",
        type=int,
        default=None,
        metavar="N",
        help="search the layouts (TP, PP, VPP, pipeline split, CP, EP, dispatcher, micro-batch, "
        "recompute, each overlap switch) for this model and cluster and print the N fastest "
        "that fit, each with its `overlap run` command (overlap.plan.search); the command "
        "line's own layout flags are replaced",
    )
    plan.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine's profile first and write it to --cluster FILE: -g cpu the "
        "whole profile (a GEMM probe, the configuration run with its modelled collectives faked, "
        "the --network link); a GPU type its compute efficiency, from the configuration cut to one "
        "GPU of this machine (bench/gpu_check.sh)",
    )
    plan.add_argument(
        "--network",
        default=None,
        metavar="SPEC",
        help="with --calibrate: the link to profile, as `overlap run --network` (real | nic:RATE | "
        "tbf:RATE | model:LATENCY,BANDWIDTH[,FAMILIES])",
    )
    plan.set_defaults(func=cmd_plan)


def _job(
    args: argparse.Namespace, extra: list[str], replace_keys: bool = False, quiet: bool = False
):
    """The command line resolved with `extra` overrides (`replace_keys`: in place of the command
    line's own for the same keys); `quiet`: a variant of the plan's own, whose start-up lines
    would repeat the command line's (`harness.start_up_quiet`)."""
    from overlap.harness import prepare, start_up_quiet

    keys = {o.split("=", 1)[0].strip() for o in extra}
    ns = copy.copy(args)
    common = [
        o for o in args.overrides if not (replace_keys and o.split("=", 1)[0].strip() in keys)
    ]
    ns.overrides = common + list(extra)
    with start_up_quiet() if quiet else contextlib.nullcontext():
        return prepare(ns, describe_target=True)


def _plan_precision(args: argparse.Namespace) -> str | None:
    """`-c fp8_*`: the precision the plan prices (the configuration itself resolves at bf16, as the
    reference's FP8 recipes keep BF16 parameters and attention); None for the precisions the
    runtime runs."""
    from overlap.plan.hardware import PLAN_FP8

    if args.compute_dtype == "nvfp4":
        raise ConfigError(
            "-c/--compute_dtype",
            args.compute_dtype,
            "the planner has no FP4 figures or validated runs.",
            "plan with -c bf16, fp8_cs, fp8_ds, fp8_sc or fp8_mx.",
        )
    precision = PLAN_FP8.get(args.compute_dtype or "")
    if precision and args.calibrate:
        raise ConfigError(
            "-c/--compute_dtype",
            args.compute_dtype,
            "--calibrate runs the configuration, and the runtime does not run FP8 compute.",
            "calibrate at -c bf16.",
        )
    return precision


def _cluster(args: argparse.Namespace, cfg):
    from overlap.plan.hardware import builtin_cluster, load_cluster, precision_of

    precision = getattr(args, "plan_precision", None) or precision_of(cfg.resolved.precision)
    if args.cluster:
        return load_cluster(args.cluster, args.gpu, precision, args.gpus_per_node)
    return builtin_cluster(args.gpu, precision, args.gpus_per_node)


def _calibrate(args: argparse.Namespace) -> None:
    """`--calibrate`: measure the machine profile and write it to --cluster
    (overlap.plan.calibrate): -g cpu the whole profile of this machine's ranks, a GPU type its
    compute efficiency on one GPU of this machine."""
    from overlap.launch.paths import check_output_file
    from overlap.perf.bench import RunFailed, common_run_options
    from overlap.plan.calibrate import calibrate, calibrate_gpu

    if not args.cluster:
        raise ConfigError(
            "--calibrate", True, "the profile needs a file to go to.", "add --cluster FILE."
        )
    check_output_file("--cluster", args.cluster)
    run_options = common_run_options(
        args.argv[1:], list(args.overrides), ("--cluster",), ("--calibrate",)
    )
    job = _job(args, [])
    if args.gpu != "cpu":
        if args.network is not None:
            raise ConfigError(
                "--network",
                args.network,
                f"a -g {args.gpu} profile keeps the GPU type's published "
                "links; only its compute efficiency is measured.",
                "drop --network (it profiles -g cpu's loopback).",
            )
        from overlap.plan.hardware import builtin_cluster, precision_of

        # The figures the efficiency joins: an existing --cluster FILE's (a user's own links), else
        # the built-in table.
        base = (
            _cluster(args, job.cfg)
            if Path(args.cluster).is_file()
            else builtin_cluster(
                args.gpu, precision_of(job.cfg.resolved.precision), args.gpus_per_node
            )
        )
    else:
        args.network = args.network or "real"
    try:
        cluster = (
            calibrate_gpu(args, job, run_options, base)
            if args.gpu != "cpu"
            else calibrate(args, job, run_options)
        )
    except RunFailed as exc:
        raise ConfigError(
            "--calibrate",
            exc.error,
            f"a calibration run failed (exit {exc.code}).",
            "fix what that error line says (the same flags with `overlap run` show the whole run).",
        ) from exc
    peak = (
        f"{cluster.peak_tflops * 1e3:.2f} GFLOP/s"
        if args.gpu == "cpu"
        else f"{cluster.peak_tflops:.1f} TFLOP/s ({cluster.source})"
    )
    print(
        f"overlap plan: wrote the machine profile {args.cluster}: peak {peak}, efficiency "
        f"{cluster.efficiency.value:.4f} ({cluster.efficiency.source}); link "
        f"{cluster.nvlink.source}"
    )


def _search(args: argparse.Namespace) -> int:
    """`--search N`: the N fastest layouts that fit (overlap.plan.search), printed and written as
    the plan's table is."""
    from overlap.perf.bench import common_run_options
    from overlap.plan.report import format_search
    from overlap.plan.search import KEEP, search

    for flag, given in (("--ab", args.ab), ("--config", args.configs), ("--calibrate", None)):
        if given is not None or (flag == "--calibrate" and args.calibrate):
            raise ConfigError(
                "--search",
                args.search,
                f"a search picks the layout; {flag} prices configurations the user chose.",
                f"drop {flag} (or --search).",
            )
    if args.search < 1:
        raise ConfigError(
            "--search", args.search, "it is how many layouts to show.", "give --search 5."
        )
    words = common_run_options(
        args.argv[1:], list(args.overrides), ("--cluster", "--search", "--network"), ()
    )
    if args.plan_precision:  # resolved as the runtime runs it; the cluster prices FP8
        words = [
            "bf16" if i and words[i - 1] in ("-c", "--compute_dtype") else w
            for i, w in enumerate(words)
        ]
    base = _job(args, [])
    result = search(
        words,
        list(args.overrides),
        _cluster(args, base.cfg),
        plan_precision=args.plan_precision,
        keep=max(KEEP, args.search),
    )
    text = format_search(result, args.search, shlex.join(["overlap", *args.argv]))
    print(text)
    if args.markdown:
        write_replace(args.markdown, text + "\n")
    if args.json_out:
        doc = {"command": shlex.join(["overlap", *args.argv]), **result.to_json(args.search)}
        write_replace(args.json_out, json.dumps(doc, indent=1) + "\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from overlap.launch.paths import check_output_file
    from overlap.perf.bench import build_configs, parse_ab, parse_named_config
    from overlap.plan.predict import predict
    from overlap.plan.report import format_markdown, plan_json, verdict

    check_output_file("--json", args.json_out)
    check_output_file("--markdown", args.markdown)
    args.plan_precision = _plan_precision(args)
    fp8_note = ""
    if args.plan_precision:
        fp8_note = (
            f"; -c {args.compute_dtype} predicts the reference system's FP8 run "
            "(Megatron-Bridge with Transformer Engine): this runtime refuses FP8 compute"
        )
        # the configuration resolves as the runtime would run it; the plan prices FP8
        args.compute_dtype = "bf16"
    if args.network is not None and not args.calibrate:
        raise ConfigError(
            "--network",
            args.network,
            "only --calibrate uses it: a plan's link comes from --cluster.",
            "add --calibrate (to profile that link), or drop --network.",
        )
    if args.search is not None:
        return _search(args)
    if args.calibrate:
        _calibrate(args)
    if args.ab is not None and args.configs is not None:
        raise ConfigError(
            "--ab/--config",
            args.ab,
            "give --ab KEY=V1,V2 or --config NAME:OVERRIDES, not both.",
            "pass one of the two forms (or neither: every applicable switch off and on).",
        )
    predictions, verdicts = [], []
    if args.ab is not None or args.configs is not None:
        if args.ab is not None:
            key, values = parse_ab(args.ab)
            if any(o.split("=", 1)[0].strip() == key for o in args.overrides):
                raise ConfigError(
                    "--ab", args.ab, f"{key} is also given as an override.", "remove that override."
                )
            configs = build_configs(key, values, False)
        else:
            configs = [parse_named_config(c) for c in args.configs]
            if len(configs) < 2 or len({c.name for c in configs}) != len(configs):
                raise ConfigError(
                    "--config",
                    args.configs,
                    "a comparison needs two or more distinctly named configs.",
                    "repeat --config NAME:OVERRIDES with different names.",
                )
        jobs = [(c.name, c.overrides, _job(args, c.overrides)) for c in configs]
        cluster = _cluster(args, jobs[0][2].cfg)
        for name, overrides, job in jobs:
            predictions.append(predict(name, overrides, job.cfg, job.resolution.layout, cluster))
        verdicts = [verdict(p.name, predictions[0], p) for p in predictions[1:]]
    else:
        base = _job(args, [])
        cluster = _cluster(args, base.cfg)
        predictions.append(predict("as given", [], base.cfg, base.resolution.layout, cluster))
        for case in SWITCHES:
            reason = not_applicable(case.label, base.resolution.layout, base.cfg)
            if reason is None:
                try:
                    pair = [
                        predict(
                            f"{case.label} {state}", list(ov), j.cfg, j.resolution.layout, cluster
                        )
                        for state, ov in (("off", case.off), ("on", case.on))
                        for j in (_job(args, list(ov), replace_keys=True, quiet=True),)
                    ]
                except ConfigError as exc:  # the switch cannot be combined with this configuration
                    verdicts.append(f"{case.label}: not applicable here ({exc.why.rstrip('.')})")
                    continue
                predictions += pair
                verdicts.append(verdict(case.label, *pair))
            else:
                verdicts.append(f"{case.label}: {reason}")
    doc = plan_json(cluster, predictions, verdicts, shlex.join(["overlap", *args.argv]), fp8_note)
    table = format_markdown(doc)
    print(table)
    if args.markdown:  # fresh names renamed into place: never written through a planted link
        write_replace(args.markdown, table + "\n")
    if args.json_out:
        write_replace(args.json_out, json.dumps(doc, indent=1) + "\n")
    return 0
