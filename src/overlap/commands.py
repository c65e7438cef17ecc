"""`overlap run`: launch local ranks, join an external torchrun world, or write a Slurm script; then train."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

from overlap.errors import ConfigError, RankFailure

log = logging.getLogger("overlap")


def register_commands(sub: argparse._SubParsersAction) -> None:
    from overlap.cli import add_harness_flags

    run = sub.add_parser("run", help="train: -g cpu -ng N starts N local ranks; under torchrun joins that world")
    add_harness_flags(run)
    run.add_argument("--metrics", default=None, help="write one JSON object per iteration to this file (rank 0)")
    run.add_argument("--emit-slurm", default=None, metavar="FILE", help="write an sbatch script instead of running")
    run.set_defaults(func=cmd_run)


def _own_argv(argv: list[str]) -> list[str]:
    """The command line minus --emit-slurm (the ranks must not re-emit)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == "--emit-slurm":
            skip = True
            continue
        if item.startswith("--emit-slurm="):
            continue
        out.append(item)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from overlap.cli import launch_env_inputs, prepare
    from overlap.launch.env import apply_launch_env, compute_launch_env, default_gpus_per_node, format_launch_env
    from overlap.training.support import check_runtime_support

    if os.environ.get("RANK", "0") != "0":
        logging.getLogger().setLevel(logging.ERROR)  # rank 0 reports the decisions; the others stay quiet
    job = prepare(args)  # resolves and validates before anything starts: a bad config never spawns ranks
    env_settings = compute_launch_env(launch_env_inputs(job.cfg, job.resolution, args.gpu), job.cfg.env_vars,
                                      os.environ)
    argv = _own_argv(args.argv)
    if args.emit_slurm:
        from overlap.launch.slurm import render_sbatch

        per_node = args.gpus_per_node or default_gpus_per_node(args.gpu, args.num_gpus)
        env = {s.name: s.value for s in env_settings if s.value is not None and s.source != "user environment"}
        script = render_sbatch(job_name=f"overlap-{args.model_recipe_name}",
                               num_nodes=math.ceil(args.num_gpus / per_node), gpus_per_node=per_node,
                               overlap_args=argv[1:], env=env)
        Path(args.emit_slurm).write_text(script)
        print(f"wrote {args.emit_slurm}: submit it with sbatch")
        return 0
    check_runtime_support(job.cfg)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_rank(job, args)
    if args.gpu != "cpu":
        raise ConfigError("-g/--gpu", args.gpu, "GPU runs are started by torchrun or Slurm, one process per GPU.",
                          "run under torchrun (torchrun --nproc-per-node=N -m overlap.cli run ...), write a Slurm "
                          "script with --emit-slurm FILE, or use -g cpu for local CPU ranks.")
    from overlap.launch.local import launch_local, python_module_command

    print(f"Launch environment:\n{format_launch_env(env_settings)}", flush=True)
    worker_env = dict(os.environ)
    apply_launch_env(env_settings, worker_env)
    try:
        launch_local(python_module_command("overlap.cli", argv), args.num_gpus, worker_env)
    except RankFailure as exc:
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_rank(job, args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from overlap.cli import describe_layout
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.getLogger().handlers[0].setFormatter(logging.Formatter(f"[overlap rank {rank}] %(levelname)s %(message)s"))
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if world != args.num_gpus:
        raise ConfigError("-ng/--num_gpus", args.num_gpus, f"the launcher started {world} ranks.",
                          f"pass -ng {world}, or launch {args.num_gpus} ranks.")
    use_cuda = args.gpu != "cpu"
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.set_default_device(device)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = job.cfg
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=cfg.train.comm_timeout_s))
    try:
        ps = ParallelState(job.resolution.layout, "cuda" if use_cuda else "cpu")
        if rank == 0:
            log.info("Overlap decisions:\n%s", job.resolution.decisions.format_table())
            log.info("Parallel layout: %s\n%s", describe_layout(job.resolution), ps.describe())
        trainer = Trainer(cfg, ps)
        metrics = open(args.metrics, "w") if args.metrics and rank == 0 else None
        try:
            summary = trainer.train(metrics)
        finally:
            if metrics is not None:
                metrics.close()
        if rank == 0:
            start, end = summary.window
            log.info("steady-state step time over iterations [%d, %d): %.1f ms (Step Time : %.3fs) | peak memory "
                     "(rank 0): %.0f MB", start + 1, end + 1, summary.steady_step_ms, summary.steady_step_ms / 1e3,
                     summary.peak_memory_mb)
            if summary.comm_ms:
                log.info("communication time by kind over the run (ms, launch to completion): %s",
                         ", ".join(f"{k} {v:.0f}" for k, v in sorted(summary.comm_ms.items())))
    finally:
        dist.destroy_process_group()
    return 0
