"""`overlap run`: launch local ranks, join an external torchrun world, or write a Slurm script; then
train. `overlap bench`: A/B runs of `overlap run` alternating configurations, with exposed
communication and overlap efficiency.

Instruments of `overlap run` (every rank): `--network` picks the link (real, emulated full-duplex
NICs `nic:RATE` or shared loopback `tbf:RATE`, modelled `model:LAT,BW`, see
`overlap.launch.network`); a `Collector` on the tracer measures exposed
communication per iteration, and rank 0 prints its table for the steady-state window. `--metrics
FILE` also writes `FILE.comm.jsonl` (per iteration: exposed_comm_ms / total_comm_ms by kind, rank
0's view) and `FILE.summary.json` (window means, peak memory, network: what `overlap bench` reads).
`--trace DIR`: every rank writes `DIR/rank<r>.events.json` (its raw events by iteration); after a
barrier rank 0 merges them into `DIR/trace.json` (Chrome trace, one process per rank) and draws
`DIR/timeline.png` (last iteration).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from overlap.errors import ConfigError, RankFailure
from overlap.files import write_replace

log = logging.getLogger("overlap")


def register_commands(sub: argparse._SubParsersAction) -> None:
    from overlap.harness import add_harness_flags

    run = sub.add_parser(
        "run", help="train: -g cpu -ng N starts N local ranks; under torchrun joins that world"
    )
    add_harness_flags(run)
    run.add_argument(
        "--metrics", default=None, help="write one JSON object per iteration to this file (rank 0)"
    )
    run.add_argument(
        "--emit-slurm",
        default=None,
        metavar="FILE",
        help="write an sbatch script instead of running",
    )
    from overlap.launch.slurm import SLURM_FLAGS

    for flags, kwargs in SLURM_FLAGS:
        run.add_argument(*flags, **kwargs)
    _add_instrument_flags(run)
    run.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write per-rank events, a merged Chrome trace (trace.json) and timeline.png into DIR",
    )
    # real | none | none:FAMILY[,FAMILY]: the benchmark floors (`overlap bench
    # --ideal/--ideal-family`); see comm.py
    run.add_argument("--comm-mode", default="real", help=argparse.SUPPRESS)
    run.add_argument(
        "--nccl-rules",
        action="store_true",
        help="-g cpu: run gloo under NCCL's rules (one work per batch, completion hidden from the "
        "host, tags ignored) and replay every rank's communication program with NCCL's streams at "
        "the end: a mismatched collective or a program that would hang on GPUs fails here (keep "
        "-ms small: every operation of the run is recorded)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="play one rank of this (GPU) layout for one training step in this process, on fake "
        "tensors (no GPU, no memory): its communication program, peak memory next to the estimate, "
        "device mix-ups and host reads of device data (overlap.perf.dry_run)",
    )
    run.add_argument(
        "--dry-run-rank",
        type=int,
        default=None,
        metavar="R",
        help="--dry-run: the rank to play (0)",
    )
    run.add_argument(
        "--dry-run-microbatches",
        type=int,
        default=None,
        metavar="K",
        help="--dry-run: micro-batches to play (default: the fewest that reach the schedule's "
        "steady state; the report names the cut)",
    )
    run.add_argument(
        "--dry-run-json",
        default=None,
        metavar="FILE",
        help="--dry-run: also write the report as JSON",
    )
    run.set_defaults(func=cmd_run)

    from overlap.perf.bench import BENCH_FLAGS

    bench = sub.add_parser(
        "bench", help="A/B benchmark: alternate `overlap run` over the values of one setting"
    )
    add_harness_flags(bench)
    _add_instrument_flags(bench)
    for flags, kwargs in BENCH_FLAGS:
        bench.add_argument(*flags, **kwargs)
    bench.set_defaults(func=cmd_bench)
    from overlap.plan.cli import register as register_plan

    register_plan(sub)  # overlap plan
    _register_convert(sub)
    from overlap.data.preprocess import register as register_preprocess

    register_preprocess(sub)  # overlap preprocess


def _add_instrument_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--network",
        default="real",
        metavar="SPEC",
        help="real (default) | nic:RATE (each rank in its own netns with a full-duplex NIC of RATE "
        "each way, e.g. nic:200mbit; root + iproute2) | tbf:RATE (ranks in one netns with a "
        "rate-limited loopback, one queue for all, e.g. tbf:800mbit; root + iproute2) | "
        "model:LATENCY,BANDWIDTH[,FAMILIES] (modelled link, e.g. "
        "model:100us,1GB/s; model:1ms,10MB/s,ep: only the ep collectives use it)",
    )


_SCRIPT_ONLY = ("--emit-slurm", "-t", "--time_limit", "-a", "--account", "-p", "--partition")


def _own_argv(argv: list[str]) -> list[str]:
    """The command line minus --emit-slurm and the script's own options (the ranks must not
    re-emit)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if not _script_only(name):
            out.append(item)
        elif "=" not in item:
            skip = True
    return out


def _script_only(name: str) -> bool:
    """`name` is one of _SCRIPT_ONLY, or an abbreviation argparse accepted for one (--emit for
    --emit-slurm)."""
    return name in _SCRIPT_ONLY or (
        name.startswith("--")
        and len(name) > 3
        and any(o.startswith(name) for o in _SCRIPT_ONLY if o.startswith("--"))
    )


# `overlap run`'s flags that name a path: (option, argparse dest); the config's path settings are
# expanded by `harness.build_config`
PATH_FLAGS = (("--metrics", "metrics"), ("--trace", "trace"), ("--emit-slurm", "emit_slurm"))


def _expand_path_flags(args: argparse.Namespace, flags: tuple[tuple[str, str], ...]) -> None:
    """Expand a command's path `flags` ((option, dest) pairs) once, as the config's path fields
    are."""
    from overlap.launch.path_fields import expand_path

    for option, dest in flags:
        value = getattr(args, dest, None)
        if isinstance(value, str) and value.strip():
            setattr(args, dest, expand_path(option, value))


def _path_word(key: str, value) -> str:
    """An override word that sets `key` to `value` exactly (JSON is YAML: quoted strings, lists)."""
    import json

    from overlap.config.overrides import parse_value

    word = f"{key}={json.dumps(value)}"
    if parse_value(key, json.dumps(value)) != value:
        raise ConfigError(
            key,
            value,
            "the expanded path cannot be written back as an override for the ranks.",
            "use a path without characters that YAML or omegaconf treat specially.",
        )
    return word


def _expanded_words(words: list[str], cfg, args: argparse.Namespace) -> list[str]:
    """`words` (a run's command line) with every word that sets a path saying the expanded value:
    override words of the config's path fields, and the values of the path flags
    (`--tokenizer_model` included, as the config's value it sets), in any spelling argparse
    accepts (`--flag V`, `--flag=V`, an unambiguous prefix)."""
    from overlap.launch.path_fields import BLEND_FIELD, PATH_FIELDS

    def config_value(key: str):
        section, name = key.split(".")
        return getattr(getattr(cfg, section), name)

    flags = {option: getattr(args, dest, None) for option, dest in PATH_FLAGS}
    flags["--tokenizer_model"] = cfg.tokenizer.tokenizer_model
    overrides = set(getattr(args, "overrides", ()))
    out, pending = [], None
    for word in words:
        if pending is not None:
            out.append(str(flags[pending]))
            pending = None
            continue
        name, eq, _value = word.partition("=")
        option = _path_option(name, flags) if word.startswith("--") else None
        if option is not None:
            out.append(f"{option}={flags[option]}" if eq else option)
            pending = None if eq else option
        elif word in overrides and name in (*PATH_FIELDS, BLEND_FIELD):
            value = config_value(name)
            out.append(word if value is None else _path_word(name, value))
        else:
            out.append(word)
    return out


def _path_option(name: str, flags: dict) -> str | None:
    """The path flag `name` spells (exactly, or as the unambiguous prefix argparse accepted)."""
    if name in flags:
        return name
    matches = [o for o in flags if len(name) > 3 and o.startswith(name)]
    return matches[0] if len(matches) == 1 else None


def _preflight(job, args: argparse.Namespace) -> dict:
    """Before a script is written or a rank starts: every output path (overlap.launch.paths), what
    this host or device can hold (overlap.launch.resources), and the Slurm script's own options
    (returned)."""
    from overlap.launch.paths import check_checkpoint_paths, check_logger_paths, check_run_outputs
    from overlap.launch.resources import check_run_resources
    from overlap.launch.slurm import slurm_options

    slurm = slurm_options(args)
    check_run_outputs(args)
    if not args.emit_slurm:  # a Slurm job's checkpoint and logging folders are paths on the cluster
        check_checkpoint_paths(job.cfg.checkpoint)
        check_logger_paths(job.cfg.logger, job.cfg.checkpoint.save)
    from overlap.perf.memory_model import rank_memory

    check_run_resources(
        job.cfg,
        job.resolution.layout,
        args,
        estimate=lambda cpu: rank_memory(job.cfg, job.resolution.layout, cpu=cpu),
    )
    return slurm


def cmd_run(args: argparse.Namespace) -> int:
    from overlap.harness import launch_env_inputs, prepare
    from overlap.launch.env import (
        apply_launch_env,
        compute_launch_env,
        default_gpus_per_node,
        format_launch_env,
    )
    from overlap.training.runtime_refusals import check_runtime_support

    if os.environ.get("RANK", "0") != "0":
        # rank 0 reports the decisions; the others stay quiet
        logging.getLogger().setLevel(logging.ERROR)
    _expand_path_flags(args, PATH_FLAGS)
    # resolves and validates before anything starts: a bad config never spawns ranks
    job = prepare(args)
    from overlap.launch.network import EMULATED, check_network_for, parse_network

    network = parse_network(args.network)
    _check_comm_mode(args.comm_mode)
    env_settings = compute_launch_env(
        launch_env_inputs(job.resolution, args.gpu), job.cfg.env_vars, os.environ
    )
    # the ranks and a Slurm script get the expanded paths (launch/path_fields.py)
    argv = _expanded_words(_own_argv(args.argv), job.cfg, args)
    check_network_for(network, args.gpu)
    if args.nccl_rules:
        _check_nccl_rules(job.cfg, args, network)
    if args.emit_slurm and network.kind in EMULATED:
        raise ConfigError(
            "--network",
            args.network,
            "the emulated interconnect is a local (-g cpu) launch feature.",
            "on a cluster use the real network (omit --network); CPU ranks may use a modelled link "
            "(model:LAT,BW).",
        )
    # before a script is queued or a rank starts
    check_runtime_support(job.cfg, gpu=args.gpu != "cpu")
    if args.dry_run:
        return _dry_run(job, args)
    for flag, value in (
        ("--dry-run-rank", args.dry_run_rank),
        ("--dry-run-microbatches", args.dry_run_microbatches),
        ("--dry-run-json", args.dry_run_json),
    ):
        if value is not None:
            raise ConfigError(
                flag,
                value,
                "it shapes a dry run, and this command trains.",
                f"add --dry-run, or drop {flag}.",
            )
    slurm = _preflight(job, args)
    if args.emit_slurm:
        from overlap.launch.slurm import render_sbatch

        per_node = args.gpus_per_node or default_gpus_per_node(args.gpu, args.num_gpus)
        if args.num_gpus % per_node:
            raise ConfigError(
                "-ng/--num_gpus",
                args.num_gpus,
                f"a Slurm job runs whole nodes of {per_node} ranks.",
                f"use a multiple of {per_node} ranks, or set -gn/--gpus_per_node to divide -ng.",
            )
        env = {
            s.name: s.value
            for s in env_settings
            if s.value is not None and s.source != "user environment"
        }
        script = render_sbatch(
            job_name=f"overlap-{args.model_recipe_name}",
            num_nodes=math.ceil(args.num_gpus / per_node),
            gpus_per_node=per_node,
            overlap_args=argv[1:],
            env=env,
            gpus=args.gpu != "cpu",
            **slurm,
        )
        write_replace(args.emit_slurm, script)
        print(f"wrote {args.emit_slurm}: submit it with sbatch")
        return 0
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if os.environ["RANK"] == "0" and "OVERLAP_LAUNCHED" not in os.environ:
            # Under an external launcher (torchrun, srun) the environment was fixed before we
            # started: show what the rules ask for and what is in effect, so a missing
            # CUDA_DEVICE_MAX_CONNECTIONS is not silent.
            log.info(
                "Launch environment (rules; set them in the launching environment, e.g. with "
                "--emit-slurm):\n%s",
                format_launch_env(env_settings),
            )
            for s in env_settings:
                if s.value is not None and os.environ.get(s.name) != s.value:
                    log.warning(
                        "%s is %r here but the launch rules ask for %r (%s)",
                        s.name,
                        os.environ.get(s.name),
                        s.value,
                        s.reason,
                    )
        return _run_rank(job, args, network)
    if args.gpu != "cpu":
        raise ConfigError(
            "-g/--gpu",
            args.gpu,
            "GPU runs are started by torchrun or Slurm, one process per GPU.",
            "run under torchrun (torchrun --nproc-per-node=N -m overlap.cli run ...), write a "
            "Slurm script with --emit-slurm FILE, or use -g cpu for local CPU ranks.",
        )
    from overlap.launch.local import launch_local, python_module_command

    print(f"Launch environment:\n{format_launch_env(env_settings)}", flush=True)
    worker_env = dict(os.environ)
    apply_launch_env(env_settings, worker_env)
    # our own launcher already applied and printed the launch environment
    worker_env["OVERLAP_LAUNCHED"] = "1"
    command = python_module_command("overlap.cli", argv)
    # train.exit_signal_handler: a SIGTERM to us is a preemption the ranks answer with a checkpoint
    # (they get the communication timeout to save and exit) rather than a stop.
    grace = job.cfg.train.comm_timeout_s if job.cfg.train.exit_signal_handler else None
    try:
        if network.kind in EMULATED:
            from overlap.launch.network import emulated_ranks

            with emulated_ranks(network, args.num_gpus) as ranks:
                print(f"Network: {network.describe()}; namespace {ranks.namespace}", flush=True)
                launch_local(
                    command,
                    args.num_gpus,
                    {**worker_env, **ranks.env},
                    addr=ranks.master_addr,
                    prefixes=ranks.prefixes,
                    term_grace_s=grace,
                )
        else:
            print(f"Network: {network.describe()}", flush=True)
            launch_local(command, args.num_gpus, worker_env, term_grace_s=grace)
    except RankFailure as exc:
        print(f"overlap: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


def _dry_run(job, args: argparse.Namespace) -> int:
    """--dry-run: one rank played here, no launcher (overlap.perf.dry_run); its report on stdout,
    exit 1 with the finding when the step did not run through."""
    import json

    from overlap.perf.dry_run import check_dry_run, run_dry

    options = check_dry_run(job, args)
    report = run_dry(job, options)
    print(report.format(), flush=True)
    if options.json_path:
        write_replace(options.json_path, json.dumps(report.to_json(), indent=1))
    if not report.ok:
        print(
            f"overlap: error: dry run of rank {report.rank}: {report.finding.line()}",
            file=sys.stderr,
        )
        return 1
    return 0


def _check_nccl_rules(cfg, args: argparse.Namespace, network) -> None:
    """--nccl-rules checks what goes through our comm layer, on CPU ranks, on the real link."""
    if args.gpu != "cpu":
        raise ConfigError(
            "--nccl-rules",
            True,
            "it makes gloo follow NCCL's rules on CPU ranks; GPU ranks run NCCL itself.",
            f"drop --nccl-rules for -g {args.gpu}, or use -g cpu.",
        )
    if network.kind == "model":
        raise ConfigError(
            "--network",
            network.text,
            "the modelled link delays the host and matches messages by tag, and NCCL's rules hide "
            "completion from the host and ignore tags.",
            "drop --network with --nccl-rules (nic:RATE, tbf:RATE and real are fine).",
        )
    m, d = cfg.resolved.model, cfg.ddp
    for field, value, peer in (
        ("ddp.impl", d.impl, d.impl != "overlap"),
        ("model.pipeline_impl", m.pipeline_impl, m.pipeline_impl != "overlap"),
        ("model.tensor_parallel_impl", m.tensor_parallel_impl, m.tensor_parallel_impl != "overlap"),
    ):
        if peer:
            raise ConfigError(
                field,
                value,
                "the PyTorch peers communicate through torch's own code, which our comm layer "
                "neither records nor holds to NCCL's rules: the replay would check only part of "
                "the run.",
                f"drop --nccl-rules, or use {field}=overlap.",
            )


def _check_comm_mode(comm_mode: str) -> None:
    from overlap.parallel.comm import parse_mode

    parse_mode(comm_mode)  # a ConfigError naming --comm-mode, before any rank starts


def _network_label(network, comm_mode: str) -> str:
    if comm_mode == "none":
        return "none (comm mode none: no transfers, the compute-only floor; losses meaningless)"
    if comm_mode.startswith("none:"):
        families = comm_mode.partition(":")[2]
        return (
            f"{network.describe()}; {families} communication free (comm mode {comm_mode}: the "
            "floor without "
            f"it; losses meaningless)"
        )
    return network.describe()


def _modelled_link(network):
    """The run's modelled link (`comm.CommSession(link=...)`; None: the links are real), once this
    rank is known to be where `network` can be had."""
    from overlap.launch.network import EMULATED, NETNS_ENV
    from overlap.parallel import link_model

    if network.kind in EMULATED and NETNS_ENV not in os.environ:
        raise ConfigError(
            "--network",
            network.text,
            "this rank is not inside the emulated interconnect: only the local launcher (-g cpu, "
            "no torchrun) builds the network namespace.",
            "launch with -g cpu without torchrun, or use a modelled link (model:LAT,BW).",
        )
    if network.kind != "model":
        return None
    return link_model.LinkModel(network.latency_s, network.bandwidth_Bps, network.families)


def _choose_gloo_interface() -> str | None:
    """CPU ranks across nodes: set GLOO_SOCKET_IFNAME before the process group reads it
    (overlap.launch.interfaces); returns this rank's address on it (None: one node, or the user's
    own GLOO_SOCKET_IFNAME)."""
    from overlap.launch.interfaces import GLOO_IFNAME, gloo_interface

    chosen = gloo_interface(os.environ)
    if chosen is None:
        return None
    os.environ[GLOO_IFNAME] = chosen.name
    log.info("%s=%s: %s", GLOO_IFNAME, chosen.name, chosen.reason)  # shown by rank 0 only
    return chosen.address


def _rank_hosts(address: str | None) -> dict[str, list[int]]:
    """Address -> ranks there, gathered once at start-up (a control message), so that a lost
    connection can name the ranks it led to."""
    from overlap.parallel import comm

    if address is None:
        return {}
    hosts: dict[str, list[int]] = {}
    for r, addr in enumerate(comm.all_gather_object(address)):
        hosts.setdefault(addr, []).append(r)
    return hosts


def _run_rank(job, args: argparse.Namespace, network) -> int:
    """This rank's run, under the run's communication session - its --comm-mode, its modelled link
    (--network model:...), and on CPU ranks NCCL's rules with --nccl-rules (the program it records
    is replayed at the end) - and with its own recorder (the tracer's events: the exposure report,
    --trace, --metrics)."""
    from overlap.parallel import comm
    from overlap.parallel.trace import Recorder, recording

    run_comm = comm.CommSession(
        args.comm_mode,
        nccl_rules=args.nccl_rules and args.gpu == "cpu",
        link=_modelled_link(network),
    )
    with recording(Recorder()) as run_trace, comm.using(run_comm):
        return _train_on_rank(job, args, network, run_comm, run_trace)


def _train_on_rank(job, args: argparse.Namespace, network, run_comm, run_trace) -> int:
    import torch

    from overlap.harness import describe_layout
    from overlap.parallel.state import ParallelState
    from overlap.profiling.collector import Collector
    from overlap.profiling.sinks import RunSinks, open_sinks
    from overlap.training.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.getLogger().handlers[0].setFormatter(
        logging.Formatter(f"[overlap rank {rank}] %(levelname)s %(message)s")
    )
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if world != args.num_gpus:
        raise ConfigError(
            "-ng/--num_gpus",
            args.num_gpus,
            f"the launcher started {world} ranks.",
            f"pass -ng {world}, or launch {args.num_gpus} ranks.",
        )
    use_cuda = args.gpu != "cpu"
    device, address = None, None
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        address = _choose_gloo_interface()
    cfg = job.cfg
    from overlap.parallel import comm, groups, streams
    from overlap.parallel.trace import DeviceTimeline

    groups.init_world("nccl" if use_cuda else "gloo", cfg.train.comm_timeout_s, device)
    if rank == 0:
        comm.log_torch_apis()
    if use_cuda:
        # times on the GPU (overlap.parallel.trace), placed for one hardware queue where the launch
        # set CUDA_DEVICE_MAX_CONNECTIONS=1
        run_trace.timeline = DeviceTimeline(one_queue=streams.one_queue())
    hosts: dict[str, list[int]] = {}
    try:
        hosts = _rank_hosts(address)
        ps = ParallelState(job.resolution.layout, device or "cpu")
        if rank == 0:
            log.info("%s", job.resolution.decisions.format_sections())
            log.info("Parallel layout: %s\n%s", describe_layout(job.resolution), ps.describe())
        if cfg.ddp.impl == "overlap":
            trainer = Trainer(cfg, ps)
        else:
            from overlap.perf.peers import PeerTrainer

            trainer = PeerTrainer(cfg, ps)
        label = _network_label(network, args.comm_mode)
        if rank == 0:
            log.info("Network: %s", label)
        # --metrics, TensorBoard, W&B
        sinks = open_sinks(cfg, args.metrics) if rank == 0 else RunSinks()
        if rank == 0:
            log.info("Metrics (rank 0) go to: %s", sinks.describe())
        collector = Collector(
            rank,
            label,
            keep_events=args.trace is not None,
            comm_metrics=sinks.comm,
            first_iteration=trainer.start_iteration,
        )
        run_trace.on_drain = collector
        try:
            with _progress(rank == 0, cfg.train.train_iters) as advance:
                summary = trainer.train(sinks.metrics, advance)
        finally:
            run_trace.on_drain = None
            sinks.close()
        collector.check_iterations(len(summary.records))
        if args.nccl_rules:
            _replay_programs(rank, run_comm.program)
        if rank == 0:
            _report_exposure(collector, summary, label, args)
        if args.trace:
            _write_traces(collector, Path(args.trace), rank, world)
        if rank == 0 and summary.records:
            start, end = summary.window
            log.info(
                "steady-state step time over iterations %d-%d: %.1f ms (Step Time : %.3fs) | peak "
                "memory (rank 0): %.0f MB",
                start + 1,
                end,
                summary.steady_step_ms,
                summary.steady_step_ms / 1e3,
                summary.peak_memory_mb,
            )  # 0-based [start, end) -> 1-based first-last (training/metrics.py)
            if summary.pipeline_output_peak_bytes:
                log.info(
                    "pipeline stage outputs alive at once (rank 0, max over steps): %.1f KB (%s)",
                    summary.pipeline_output_peak_bytes / 1e3,
                    "released once sent: model.deallocate_pipeline_outputs"
                    if cfg.resolved.model.deallocate_pipeline_outputs
                    else "kept until their backward; model.deallocate_pipeline_outputs=true "
                    "releases them",
                )
            if summary.comm_ms:
                log.info(
                    "communication time by kind over the run (ms, launch to completion): %s",
                    ", ".join(f"{k} {v:.0f}" for k, v in sorted(summary.comm_ms.items())),
                )
    except RuntimeError as exc:
        from overlap.launch.interfaces import lost_peer

        # Under torchrun or srun a peer's death reaches this rank as a transport error: said in one
        # line. Under our own launcher the launcher names the cause for all ranks at once.
        ours = os.environ.get("OVERLAP_LAUNCHED")
        line = None if ours else lost_peer(str(exc), rank, world, hosts)
        if line is None:
            raise
        raise RankFailure(line) from exc
    finally:
        from overlap.parallel import teardown

        # The trainer and the parallel state hold the process groups: dropped here, so that
        # teardown.shutdown() can free the groups (which joins gloo's worker threads) once nothing
        # else holds them. The order: teardown.shutdown. An error every rank raised together
        # (`overlap.errors.agreed`) leaves with peers alive and in step: the ordinary teardown.
        trainer = ps = None
        error = sys.exc_info()[1]
        teardown.shutdown(failing=error is not None and not getattr(error, "agreed", False))
    return 0


def _replay_programs(rank: int, program) -> None:
    """--nccl-rules: every rank's recorded program, replayed with NCCL's streams on every rank (each
    one stops with the same finding); the findings that would hang or corrupt a GPU run end it with
    an error."""
    from overlap.errors import ProgramError
    from overlap.parallel import comm
    from overlap.parallel.program import early_send_waits, replay

    entries = program.stop()
    programs = dict(enumerate(comm.all_gather_object(entries)))
    problems = replay(programs)
    if problems:
        raise ProgramError(
            "under NCCL's rules this run would fail on GPUs:\n" + "\n".join(problems)
        )
    stalls = early_send_waits(programs)
    if rank == 0:
        log.info(
            "NCCL's rules: every rank's program (%d operations on rank 0) replays with NCCL's "
            "streams: collectives match, every message meets its receive, nothing deadlocks",
            len(entries),
        )
        for line in stalls:
            log.warning("NCCL's rules: %s: the compute stream would wait for that send", line)


@contextmanager
def _progress(show: bool, total: int) -> Iterator[Callable[[int, int, float], None] | None]:
    """A live progress bar on rank 0 when stderr is a terminal; logs then go through the same rich
    console, so the bar and the iteration lines never garble each other. Other ranks log only
    warnings, as whole lines. Under the local launcher stderr is the rank's log file, which the
    launcher forwards to its terminal (STDERR_TTY_ENV)."""
    from overlap.launch.local import STDERR_TTY_ENV

    forwarded = os.environ.get(STDERR_TTY_ENV) == "1"
    if not (show and (sys.stderr.isatty() or forwarded)):
        yield None
        return
    from rich.console import Console
    from rich.logging import RichHandler
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    console = Console(stderr=True, force_terminal=True if forwarded else None)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [RichHandler(console=console, show_path=False, show_time=False)]
    try:
        with Progress(
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("lm loss {task.fields[loss]}"),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("train", total=total, loss="-")
            yield lambda done, _total, loss: bar.update(task, completed=done, loss=f"{loss:.4f}")
    finally:
        root.handlers = saved


def _report_exposure(collector, summary, network_label: str, args: argparse.Namespace) -> None:
    """Rank 0: the exposed-communication table for the steady-state window, and the run summary
    file."""
    import json

    from overlap.profiling.exposed import format_table
    from overlap.training.metrics import window_iterations

    first, last = window_iterations(summary.window)  # 1-based, both included (training/metrics.py)
    rows = collector.window_mean(
        (
            summary.window[0] - summary.first_iteration,  # the collector counts this run's
            summary.window[1] - summary.first_iteration,
        )
    )  # iterations from 0
    from overlap.parallel.trace import recorder

    timeline = recorder().timeline.name
    if rows:
        log.info(
            "%s",
            format_table(
                rows,
                f"exposed communication, rank 0, mean per iteration over iterations {first}-{last} "
                f"| network: {network_label} | timeline: {timeline}",
            ),
        )
    if args.metrics:
        # valid JSON or nothing: a NaN here would be a bug to see, not a file readers choke on
        write_replace(
            f"{args.metrics}.summary.json",
            json.dumps(
                {
                    "network": network_label,
                    "timeline": timeline,
                    "comm_mode": args.comm_mode,
                    "window_iterations": [first, last],
                    "steady_step_ms": summary.steady_step_ms,
                    "peak_mem_mb": summary.peak_memory_mb,
                    "exposed_comm_ms": {k: r.exposed_ms for k, r in rows.items()},
                    "exposed_peer_wait_ms": {
                        k: r.peer_wait_ms for k, r in rows.items() if r.peer_wait_ms is not None
                    },
                    "total_comm_ms": {k: r.total_ms for k, r in rows.items()},
                    "comm_mb": {k: r.nbytes / 1e6 for k, r in rows.items()},
                    "first_iteration": summary.first_iteration + 1,
                    "stopped": summary.stopped,
                    # fp16: the iterations whose step a gradient overflow skipped
                    # (optim/loss_scaler.py)
                    "overflow_skipped_iterations": [
                        r.iteration + 1 for r in summary.records if r.skipped_to is not None
                    ],
                    # sync-free MoE dispatch (model.moe_expert_rank_capacity_factor): the
                    # iterations re-run dropless after a block overflowed
                    "moe_rerun_iterations": [
                        r.iteration + 1 for r in summary.records if r.moe_reruns
                    ],
                    # ... and the largest factor one of its blocks needed (null: not that mode)
                    "moe_needed_rank_capacity_factor": summary.moe_needed_rank_capacity_factor,
                    "checkpoint": summary.checkpoint,
                    "pipeline_output_peak_bytes": summary.pipeline_output_peak_bytes,
                },
                indent=1,
                allow_nan=False,
            ),
        )


def _write_traces(collector, trace_dir: Path, rank: int, world: int) -> None:
    """Every rank writes its events; after a barrier rank 0 merges whatever rank files it can see
    (on several nodes DIR must be shared storage, else it says which ranks are missing) into
    trace.json and timeline.png."""
    from overlap.parallel import comm
    from overlap.profiling.chrome_trace import write_chrome_trace
    from overlap.profiling.collector import RankTrace
    from overlap.profiling.timeline import MissingPlotting, plot_timeline

    trace_dir.mkdir(parents=True, exist_ok=True)
    collector.trace.write(trace_dir / f"rank{rank}.events.json")
    comm.barrier()
    if rank != 0:
        return
    paths = [trace_dir / f"rank{r}.events.json" for r in range(world)]
    missing = [r for r, p in enumerate(paths) if not p.exists()]
    if missing:
        log.warning(
            "trace: no event files from ranks %s in %s (not shared storage?); merging the others",
            missing,
            trace_dir,
        )
    traces = [RankTrace.read(p) for p in paths if p.exists()]
    write_chrome_trace(traces, trace_dir / "trace.json")
    written = [f"{trace_dir / 'trace.json'} (open in https://ui.perfetto.dev or chrome://tracing)"]
    timeline = trace_dir / "timeline.png"
    # a picture left by an earlier run must not pass for this one's
    timeline.unlink(missing_ok=True)
    try:
        plot_timeline(
            traces,
            timeline,
            title=f"last iteration, {len(traces)} ranks | network: "
            f"{traces[0].network.split(' (')[0]}",
        )
    except MissingPlotting as exc:
        log.error("timeline.png not drawn: %s", exc)
    if timeline.exists():
        written.append(str(timeline))
    log.info("trace: %s", ", ".join(written))


def cmd_bench(args: argparse.Namespace) -> int:
    from overlap.perf.bench import run_bench_command

    _expand_path_flags(args, (("--json", "json_out"), ("--markdown", "markdown")))

    return run_bench_command(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from overlap.convert import export_hf, import_hf, roundtrip

    if args.action == "import":
        folder = import_hf(args.hf, args.out, args.seq_length)
        print(f"imported {args.hf} -> {folder}")
    elif args.action == "export":
        files = export_hf(args.load, args.hf, args.dtype)
        print(f"exported {args.load} -> {args.hf} ({', '.join(files)})")
    else:
        count, diffs = roundtrip(args.hf, args.work)
        if diffs:
            print(f"round trip of {args.hf}: {len(diffs)} difference(s)")
            for line in diffs:
                print(f"  {line}")
            return 1
        print(f"round trip of {args.hf}: all {count} tensors bit-identical")
    return 0


def _register_convert(sub: argparse._SubParsersAction) -> None:
    """`overlap convert {import,export,roundtrip}`; the work is `overlap.convert`'s, imported when
    the command runs (it brings torch.distributed.checkpoint, about a second of start-up every other
    command would pay)."""
    convert = sub.add_parser(
        "convert", help="Hugging Face Qwen3 / Qwen3-MoE folder <-> overlap checkpoint"
    )
    actions = convert.add_subparsers(dest="action", required=True)
    imp = actions.add_parser(
        "import", help="HF folder -> overlap checkpoint (weights, iteration 0)"
    )
    imp.add_argument("--hf", required=True, help="folder with config.json and safetensors")
    imp.add_argument(
        "--out", required=True, help="checkpoint base folder to write (iter_0000000 inside)"
    )
    imp.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="model.seq_length to record (default: min(4096, max_position_embeddings))",
    )
    exp = actions.add_parser("export", help="overlap checkpoint -> HF folder (per-expert names)")
    exp.add_argument(
        "--load", required=True, help="checkpoint base folder (its latest) or an iter_N folder"
    )
    exp.add_argument(
        "--hf",
        required=True,
        help="a new or empty folder to write config.json and safetensors into",
    )
    exp.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="tensor dtype (default: the imported checkpoint's, else float32)",
    )
    rt = actions.add_parser("roundtrip", help="import, export and compare every tensor bit-exactly")
    rt.add_argument("--hf", required=True, help="folder with config.json and safetensors")
    rt.add_argument(
        "--work",
        default=None,
        help="keep the intermediate checkpoint and export here (a new or empty folder)",
    )
    convert.set_defaults(func=cmd_convert)
