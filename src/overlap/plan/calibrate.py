"""`overlap plan --calibrate`: measure this machine's profile (a `-g cpu` cluster file) in a few
steps.

On a GPU type the planner's fitted numbers are the compute efficiency and a per-kernel overhead;
on CPU ranks there is no published peak either, launches cost nothing apart, and the profile is
measured:
- peak: the rate of one square GEMM in the run's compute dtype on one thread (each local rank
  computes on one thread, `overlap.launch.local`);
- efficiency: the configuration itself run with the link's collectives faked (`--comm-mode
  none:FAMILIES`: the families of `--network model:...,FAMILIES`, else all but the one-scalar
  model-parallel norm sums, which keep the pipeline ranks meeting once per step): its steady step is
  the floor the plan must reproduce, so efficiency = predicted floor at the peak / measured step
  (`fit_efficiency`). Nothing of an overlap switch is fitted: its effect is the communication
  model's and the schedule's doing;
- the link: `--network model:LAT,BW[,FAMILIES]` is the modelled link itself (exact, and only those
  families); for `real`, `tbf:RATE` and `nic:RATE` a short gloo probe over loopback measures the
  per-op latency and bandwidth with the run's number of ranks (`probe_loopback`); under `tbf`
  every rank's traffic crosses one token bucket, so each rank gets RATE / ranks when all send at
  once (the collectives of one step do), and its share of the bucket's depth (`TBF_BURST_BYTES` /
  ranks), which an idle link refills and the next transfer spends at the loopback's rate; under
  `nic:RATE` each rank has a NIC of its own: RATE each way, a bucket of `NIC_BURST_BYTES` per
  direction;
- the overlap slowdown: 0 (gloo's transport threads and a modelled link's sleeps take little CPU
  from the compute thread; what they do take shows in the validation, `bench/plan_vs_bench.py`).

With a GPU type (`-g h100 ...`) on a machine with one such GPU (`calibrate_gpu`,
`bench/gpu_check.sh`), only the efficiency is measured: peak, NVLink and NIC stay those of --cluster
FILE where it exists (a user's own figures), else the published figures of the built-in table. One
GPU cannot hold the plan's layout, so the probe is the plan's model cut to fit it (`gpu_probe`): no
model parallelism (every expert local), PROBE_MICROBATCHES micro-batches of the plan's size per
step, PROBE_STEPS steps, without the plan's overlap switches, checkpoints and timing window. It runs
twice, at each of PROBE_LAYERS layers, and the efficiency is fitted on the difference: the layers'
own time, without the output layer, the embedding and the optimizer step, which would dominate a
two-layer model (Qwen3-30B-A3B: logits 1.87 GFLOP per token against 0.44 per layer). The expert
GEMMs of an EP run see EP times more rows per expert than the probe's, so its efficiency is, if
anything, low for them.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from overlap.config.container import ConfigContainer
from overlap.errors import ConfigError
from overlap.files import write_replace
from overlap.launch.kinds import FAMILIES
from overlap.launch.network import NIC_BURST_BYTES, TBF_BURST_BYTES, Network
from overlap.layout import ParallelLayout
from overlap.plan.hardware import Cluster, Efficiency, Link
from overlap.plan.predict import predict

CPU_SLOWDOWN_SOURCE = (
    "CPU profile: 0 (transport threads and modelled-link sleeps take little CPU from the compute "
    "thread)"
)


def predicted_floor_ms(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    cluster: Cluster,
    faked: tuple[str, ...] | None = None,
) -> float:
    """What a run with the `faked` families' collectives faked (None: all) measures on rank 0,
    predicted at the cluster's peak with no link charged:
    - every collective faked: no rank waits for another, so pipeline rank 0's compute;
    - the pipeline's p2p faked but others real: the busiest pipeline rank's compute (the ranks still
      meet at the step's norm and loss reductions);
    - the pipeline's p2p real: the whole step without the faked families' communication, the bubble
      included.
    All scale as 1 / efficiency."""
    # no link charged
    free = replace(cluster, efficiency=Efficiency(1.0, "the peak"), link_families=())
    times = predict("calibration", [], cfg, layout, free).times
    if faked is None or layout.pp <= 1:
        return times.first_rank_compute_s * 1e3
    if "pp" in faked:
        return times.slowest_rank_compute_s * 1e3
    return times.total_s * 1e3


def fit_efficiency(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    cluster: Cluster,
    floor_ms: float,
    source: str,
    faked: tuple[str, ...] | None = None,
) -> Cluster:
    """The cluster whose efficiency makes `cfg`'s predicted floor (`predicted_floor_ms`) equal
    `floor_ms`, the measured step of a run with the `faked` families' collectives faked (None:
    all)."""
    if not floor_ms > 0:
        raise ConfigError(
            "calibration",
            floor_ms,
            "the measured step must be positive.",
            "re-run the calibration.",
        )
    efficiency = predicted_floor_ms(cfg, layout, cluster, faked) / floor_ms
    # the model outran the GEMM probe (e.g. its GEMMs ran in another dtype): the peak it reached
    if efficiency > 1:
        return replace(
            cluster,
            peak_tflops=cluster.peak_tflops * efficiency,
            efficiency=Efficiency(
                1.0,
                f"{source}; the run outran the GEMM probe by x{efficiency:.2f}, so "
                "the peak is the rate it reached",
            ),
        )
    return replace(cluster, efficiency=Efficiency(efficiency, source))


def cpu_cluster(
    network: Network, ranks: int, peak_tflops: float, precision: str, loopback: Link | None
) -> Cluster:
    """A -g cpu cluster for `ranks` local ranks on `network` (efficiency still to fit); see the
    module docstring."""
    families = None
    if network.kind == "model":
        link = Link(
            network.bandwidth_Bps,
            network.latency_s,
            f"--network {network.text} (the modelled link)",
        )
        families = network.families
    elif loopback is None:
        raise ConfigError(
            "--network", network.text, "a loopback link needs its probe.", "run --calibrate."
        )
    elif network.kind == "tbf":
        link = Link(
            network.rate_Bps / ranks,
            loopback.latency_s,
            f"--network {network.text}: one token bucket shared by {ranks} ranks; latency "
            f"{loopback.source}",
            burst_bytes=TBF_BURST_BYTES / ranks,
            burst_Bps=loopback.bandwidth_Bps,
        )
    elif network.kind == "nic":
        link = Link(
            network.rate_Bps,
            loopback.latency_s,
            f"--network {network.text}: a full-duplex NIC per rank, RATE each way with its own "
            f"64 KiB token bucket; latency {loopback.source}",
            burst_bytes=NIC_BURST_BYTES,
            burst_Bps=loopback.bandwidth_Bps,
        )
    else:
        link = loopback
    return Cluster(
        gpu="cpu",
        peak_tflops=peak_tflops,
        precision=precision,
        gpus_per_node=ranks,
        nvlink=link,
        nic=link,
        efficiency=Efficiency(1.0, "not fitted yet"),
        overlap_slowdown={"ep": 0.0, "other": 0.0},
        source=f"machine profile: {ranks} local ranks, {network.describe()}",
        link_families=families,
        slowdown_source=CPU_SLOWDOWN_SOURCE,
    )


def gemm_peak_tflops(precision: str, n: int = 512, seconds: float = 1.0) -> float:
    """TFLOP/s of an n x n x n GEMM on one thread in the compute dtype (the best of repeated
    timings)."""
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * n**3 / best / 1e12


def _probe_rank(
    rank: int, world: int, store_path: str, sizes: list[int], repeats: int, out: str
) -> None:
    import torch
    import torch.distributed as dist

    from overlap.parallel import comm, teardown

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        times = {}
        for nbytes in sizes:
            x = torch.zeros(max(world, nbytes // 4 // world * world), dtype=torch.float32)
            comm.all_to_all(x, dist.group.WORLD, "dp_probe").wait()
            runs = []
            for _ in range(repeats):
                comm.barrier(dist.group.WORLD)
                t0 = time.perf_counter()
                comm.all_to_all(x, dist.group.WORLD, "dp_probe").wait()
                runs.append(time.perf_counter() - t0)
            times[nbytes] = statistics.median(runs)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        teardown.shutdown()


def probe_loopback(ranks: int, small: int = 1024, large: int = 8 << 20, repeats: int = 10) -> Link:
    """Latency and bandwidth of a gloo all-to-all over loopback among `ranks` local processes:
    latency = the small op's time, bandwidth = the extra bytes each rank moves ((n - 1) / n of the
    large payload) over the extra time."""
    import torch.multiprocessing as mp

    if ranks < 2:
        return Link(float("inf"), 0.0, "one rank: no link")
    with tempfile.TemporaryDirectory(prefix="overlap-probe-") as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(
            _probe_rank,
            args=(ranks, os.path.join(tmp, "store"), [small, large], repeats, out),
            nprocs=ranks,
            start_method="spawn",
        )
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    if times[large] <= times[small]:
        raise ConfigError(
            "--network",
            "real",
            f"the loopback probe's {large >> 20} MiB all-to-all took no longer than its {small} B "
            f"one ({times[large] * 1e3:.2f} vs {times[small] * 1e3:.2f} ms): the "
            "machine was busy.",
            "re-run --calibrate with nothing else running.",
        )
    extra = (large - small) * (ranks - 1) / ranks
    bandwidth = extra / (times[large] - times[small])
    return Link(
        bandwidth,
        times[small],
        f"gloo loopback all-to-all probe, {ranks} ranks: {times[small] * 1e6:.0f} us, "
        f"{bandwidth / 1e9:.2f} GB/s",
    )


PROBE_LAYERS, PROBE_MICROBATCHES, PROBE_STEPS = (2, 4), 8, 8
# What the one-GPU probe keeps of the plan's command line: the model and its numerics. Flags: these,
# with their values (`-rl` at most the probe's layers); every other flag (layout, batch, length,
# timing window, overlap switches, --strict) is the plan's, not the probe's. Overrides: these
# sections, less the keys the probe sets or cannot run.
_PROBE_FLAGS = (
    "-m",
    "--model_family_name",
    "-mr",
    "--model_recipe_name",
    "--task",
    "-g",
    "--gpu",
    "-c",
    "--compute_dtype",
    "-cv",
    "--config_variant",
    "-mb",
    "--micro_batch_size",
    "-sl",
    "--seq_length",
    "--tokenizer_type",
    "--tokenizer_model",
    "--vocab_size",
    "--recompute_modules",
)
_RECOMPUTE_LAYERS = ("-rl", "--recompute_num_layers")
_PROBE_SECTIONS = (
    "model.",
    "mixed_precision.",
    "tokenizer.",
    "dataset.",
    "optimizer.",
    "scheduler.",
    "train.micro_batch_size",
)
_PROBE_DROPPED = (
    "model.tensor_model_parallel_size",
    "model.pipeline_",
    "model.context_parallel_size",
    "model.cp_comm_",
    "model.hierarchical_context_parallel_sizes",
    "model.expert_model_parallel_size",
    "model.expert_tensor_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.num_layers",
    "model.microbatch_group_size",
    "model.moe_layer_freq",
    "model.overlap_",
    "model.batch_p2p_comm",
    "model.tp_comm_",
    "model.delay_wgrad_compute",
    "model.moe_shared_expert_overlap",
    "model.defer_embedding_wgrad",
    "model.wgrad_deferral_limit",
    "model.deallocate_pipeline_outputs",
    "model.moe_token_dispatcher_type",
    "model.moe_flex_dispatcher_backend",
    "model.recompute_num_layers",
    "model.sequence_parallel",
)


def gpu_probe(
    run_options: list[str], overrides: list[str], micro_batch: int, layers: int
) -> tuple[list[str], list[str]]:
    """(run options, overrides) of the one-GPU probe of a plan's command line at `layers` layers
    (module docstring): what `_PROBE_FLAGS` and `_PROBE_SECTIONS` keep, then the probe's own layout
    and length."""
    options: list[str] = []
    items = iter(run_options)
    for item in items:
        flag, eq, value = item.partition("=")
        if not flag.startswith("-"):
            continue
        if flag != "--strict" and not eq:
            value = next(items, "")
        if flag in _PROBE_FLAGS:
            options += [flag, value]
        elif flag in _RECOMPUTE_LAYERS:
            options += [flag, str(min(int(value), layers))]
    options += [
        "-ng",
        "1",
        "-tp",
        "1",
        "-pp",
        "1",
        "-cp",
        "1",
        "-ep",
        "1",
        "-et",
        "1",
        "-vp",
        "None",
        "-gb",
        str(PROBE_MICROBATCHES * micro_batch),
        "-ms",
        str(PROBE_STEPS),
    ]
    kept = []
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.strip()
        if key == "model.recompute_num_layers" and value.strip().isdigit():
            kept.append(f"{key}={min(int(value), layers)}")
        elif key.startswith(_PROBE_SECTIONS) and not key.startswith(_PROBE_DROPPED):
            kept.append(o)
    return options, kept + [f"model.num_layers={layers}"]


def calibrate_gpu(args, job, run_options: list[str], cluster: Cluster) -> Cluster:
    """`overlap plan -g GPU --calibrate`: the compute efficiency of `cluster` (the GPU type's
    figures) fitted on the one-GPU probes of the plan's configuration (module docstring), run on
    this machine's GPU; written to --cluster."""
    import torch

    from overlap.harness import resolve_run
    from overlap.perf.bench import BenchConfig, run_once

    if not torch.cuda.is_available():
        raise ConfigError(
            "--calibrate",
            f"-g {args.gpu}",
            "a GPU profile is measured on one GPU of that type, and this machine has no CUDA "
            "device.",
            "run it where one is (bench/gpu_check.sh), calibrate -g cpu here, or give the "
            "efficiency in --cluster FILE (compute_efficiency).",
        )
    probes = []
    for layers in PROBE_LAYERS:
        options, overrides = gpu_probe(
            run_options, list(args.overrides), job.cfg.train.micro_batch_size, layers
        )
        probe = resolve_run(options, overrides)
        with tempfile.TemporaryDirectory(prefix="overlap-calibrate-") as tmp:
            run = run_once(
                options,
                overrides,
                BenchConfig(f"gpu probe, {layers} layers", [], []),
                Path(tmp) / "probe.jsonl",
            )
        probes.append(
            (layers, run.step_ms, predicted_floor_ms(probe.cfg, probe.resolution.layout, cluster))
        )
    (lo, lo_ms, lo_peak), (hi, hi_ms, hi_peak) = probes
    if hi_ms <= lo_ms:
        raise ConfigError(
            "--calibrate",
            f"-g {args.gpu}",
            f"the {hi}-layer probe was not slower than the {lo}-layer one ({hi_ms:.1f} vs "
            f"{lo_ms:.1f} ms per step): the GPU was busy.",
            "re-run the calibration with nothing else on the GPU.",
        )
    efficiency = (hi_peak - lo_peak) / (hi_ms - lo_ms)
    if efficiency > 1:
        raise ConfigError(
            "-g/--gpu",
            args.gpu,
            f"the probe's layers ran at {efficiency:.2f}x the published peak of {args.gpu} "
            f"({cluster.peak_tflops:.0f} TFLOP/s {cluster.precision}).",
            "give -g the type of this machine's GPU.",
        )
    source = (
        f"fitted on one {torch.cuda.get_device_name()} of this machine: the plan's model without "
        "model "
        f"parallelism, {PROBE_MICROBATCHES} micro-batches of {job.cfg.train.micro_batch_size} x "
        f"{job.resolution.model.seq_length} tokens per step, {lo_ms:.1f} ms per step at {lo} "
        f"layers and {hi_ms:.1f} ms at {hi}; the efficiency of the {hi - lo} layers between "
        "(overlap plan --calibrate)"
    )
    fitted = replace(cluster, efficiency=Efficiency(efficiency, source))
    write_profile(fitted, args.cluster)
    return fitted


def write_profile(cluster: Cluster, path: str) -> None:
    """The profile as a `--cluster` file (`overlap.plan.hardware.load_cluster` reads it back)."""
    write_replace(path, json.dumps(cluster.to_json(), indent=1) + "\n")


def calibrate(args, job, run_options: list[str]) -> Cluster:
    """Run the calibration for `overlap plan --calibrate` (module docstring) and write the profile
    to --cluster."""
    from overlap.launch.network import parse_network
    from overlap.perf.bench import BenchConfig, run_once
    from overlap.plan.hardware import precision_of

    network = parse_network(args.network)
    layout = job.resolution.layout
    ranks = layout.world_size
    precision = precision_of(job.cfg.resolved.precision)
    # Fake the link's families; everything else runs. Without a family-restricted model link that is
    # every family but the model-parallel norm sums (`mp`, one scalar per step), so the pipeline
    # ranks still meet once per step and rank 0's step is the busiest rank's compute, not its own.
    faked = (
        network.families
        if network.kind == "model" and network.families
        else tuple(f for f in FAMILIES if f not in ("mp", "ctl"))
    )
    mode = "none:" + ",".join(faked)
    loopback = probe_loopback(ranks) if network.kind != "model" else None
    peak = gemm_peak_tflops(precision)
    with tempfile.TemporaryDirectory(prefix="overlap-calibrate-") as tmp:
        floor = run_once(
            run_options,
            list(args.overrides),
            BenchConfig("calibration", [], ["--comm-mode", mode]),
            Path(tmp) / "floor.jsonl",
        )
    source = (
        f"fitted on this machine: the plan's configuration with --comm-mode {mode} ran "
        f"{floor.step_ms:.1f} ms per step (overlap plan --calibrate)"
    )
    cluster = fit_efficiency(
        job.cfg,
        layout,
        cpu_cluster(network, ranks, peak, precision, loopback),
        floor.step_ms,
        source,
        faked,
    )
    write_profile(cluster, args.cluster)
    return cluster
