"""What a cluster can do: per-GPU peak FLOP/s, the two links (NVLink inside a node, the NIC between
nodes), and the planner's documented behaviour parameters (compute efficiency and per-kernel
overhead, compute slowdown while overlapping).

Every figure carries its source. The peaks and bandwidths are published or measured by others
(each table entry below names its datasheet or measurement); the compute efficiency and the
per-kernel overhead are ours, fitted on published runs (`overlap.plan.validate`) and named in every
plan's output. A `--cluster FILE` (JSON, `load_cluster`) replaces any of them; for
`-g cpu` it is required: our own CPU ranks have no published figures, only a measured machine
profile.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from overlap.errors import ConfigError
from overlap.launch.kinds import parse_families

if TYPE_CHECKING:
    from overlap.config.mixed_precision import Precision


@dataclass(frozen=True)
class Link:
    """A latency + bandwidth link: a transfer of n bytes (the busbw convention: bytes one GPU moves)
    takes latency_s + n / bandwidth_Bps.

    A rate-limited link (tc's token bucket, `--network tbf:RATE`) also has a bucket: `burst_bytes`
    per GPU that fill at `bandwidth_Bps` while the link is idle, up to that depth, and let as many
    bytes pass at `burst_Bps` (the line under the limiter). A transfer that finds credit in the
    bucket pays only the rest at the limited rate (`TokenBucket` keeps the credit between
    transfers)."""

    bandwidth_Bps: float
    latency_s: float
    source: str
    burst_bytes: float = 0.0
    burst_Bps: float = float("inf")

    def time_s(self, nbytes: float, credit_bytes: float = 0.0) -> float:
        """One transfer of `nbytes`, `credit_bytes` of which the bucket covers."""
        if nbytes <= 0:
            return 0.0
        covered = min(nbytes, credit_bytes)
        return self.latency_s + covered / self.burst_Bps + (nbytes - covered) / self.bandwidth_Bps

    def to_json(self) -> dict:
        doc = {
            "bandwidth_GBps": self.bandwidth_Bps / 1e9,
            "latency_us": self.latency_s * 1e6,
            "source": self.source,
        }
        if self.burst_bytes:
            doc |= {"burst_bytes": self.burst_bytes, "burst_GBps": self.burst_Bps / 1e9}
        return doc


class TokenBucket:
    """A link's bucket between its transfers, in the order the program makes them: `idle(s)` refills
    it (the link rate, up to the depth), `send_s(n)` spends what it holds on a transfer and returns
    the transfer's time. On a link without a bucket (depth 0) every transfer takes
    `Link.time_s(n)`."""

    def __init__(self, link: Link) -> None:
        self.link = link
        # empty: a program's first pass fills it (layer_tp counts the second, the steady state)
        self.credit = 0.0

    def idle(self, seconds: float) -> None:
        if seconds > 0:
            self.credit = min(
                self.link.burst_bytes, self.credit + seconds * self.link.bandwidth_Bps
            )

    def send_s(self, nbytes: float) -> float:
        used = min(max(nbytes, 0.0), self.credit)
        self.credit -= used
        return self.link.time_s(nbytes, used)


@dataclass(frozen=True)
class Transfer:
    """One message of `nbytes` on `link` (a pipeline activation or its gradient), for a simulation
    that keeps the link's bucket between messages (`TokenBucket`)."""

    link: Link
    nbytes: float


@dataclass(frozen=True)
class GpuSpec:
    """Published dense (no sparsity) peaks, memory bandwidth, SM count and the node's NVLink domain
    of one GPU type (what the shape-aware compute model of `overlap.plan.compute` needs)."""

    name: str
    peak_tflops: dict[str, float]  # precision ("bf16", "fp8", "mxfp8", "fp32") -> dense TFLOP/s
    nvlink_GBps: float  # effective NVLink bus bandwidth per GPU (ring, non-allreduce ops), GB/s
    gpus_per_node: int
    source: str
    hbm_TBps: float = 0.0  # HBM bandwidth, TB/s
    sms: int = 0  # streaming multiprocessors


# Section 2.1 of the planner reference (glennklockwood.com processor pages; torchtitan
# get_peak_flops agrees). NVLink effective: NVLink4 ~370 GB/s busbw of 450 line rate (sjeaugey,
# NVIDIA/nccl-tests#212); NVLink5 (900 line rate) ~740 GB/s as DeepEP V2 measured on SM100
# (deepseek-ai/DeepEP README: 726/740 GB/s). fp32 is not a tensor-core training precision on these
# parts: plans at fp32 use the TF32 dense rate, half of bf16. HBM: the same pages (H100 3.35 TB/s,
# H200 4.8, B200 / GB200 8). SMs: H100 132 (glennklockwood.com); Blackwell B200 148 (NVIDIA's
# Blackwell datasheet; GB200's GPUs are the same die). MXFP8 (block-scaled FP8) runs at the FP8 rate
# on Blackwell and does not exist on Hopper.
_NVLINK4 = "NVLink4 busbw: NVIDIA/nccl-tests#212"
_NVLINK5 = "NVLink5: deepseek-ai/DeepEP README (SM100)"
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        "NVIDIA H100 SXM",
        {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "fp32": 494.7},
        370.0,
        8,
        f"glennklockwood.com/garden/processors/h100; {_NVLINK4}",
        3.35,
        132,
    ),
    "h200": GpuSpec(
        "NVIDIA H200 SXM",
        {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 494.5},
        370.0,
        8,
        f"lzwjava.github.io/nvidia-h200-gpu-specs-en; {_NVLINK4}",
        4.8,
        132,
    ),
    "b200": GpuSpec(
        "NVIDIA B200 (HGX, 1000 W)",
        {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "fp32": 1125.0},
        740.0,
        8,
        f"glennklockwood.com/garden/processors/B200; {_NVLINK5}",
        8.0,
        148,
    ),
    "gb200": GpuSpec(
        "NVIDIA GB200",
        {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "fp32": 1250.0},
        740.0,
        72,
        f"glennklockwood.com/garden/processors/B200 (GB200); {_NVLINK5}",
        8.0,
        148,
    ),
    # Blackwell Ultra: the GB300 NVL72 rack's 360 PF dense FP8 for training over 72 GPUs is GB200's
    # 5000 TFLOP/s per GPU (BF16 half of it), 576 TB/s of HBM over 72 GPUs 8 TB/s
    # (glennklockwood.com/garden/processors/B300); 160 SMs (NVIDIA at Hot Chips 2025, as reported
    # by tweaktown.com "NVIDIA details Blackwell Ultra GB300"); the same NVLink5 and NVL72 domain.
    "gb300": GpuSpec(
        "NVIDIA GB300",
        {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "mxfp8": 5000.0, "fp32": 1250.0},
        740.0,
        72,
        "glennklockwood.com/garden/processors/B300 (GB300 NVL72); 160 SMs: NVIDIA Hot Chips "
        f"2025 (tweaktown.com); {_NVLINK5}",
        8.0,
        160,
    ),
}


# Streaming multiprocessors the flex dispatcher's kernels hold while they run (the GEMMs beside them
# get the rest), per backend and version. The reference drives DeepEP's V1 normal kernels through
# Megatron-Core's `moe_deepep_num_sms` (default 20; deepseek-ai/DeepEP docs/legacy.md: DeepSeek's
# trace, 10 channels), and every Megatron-Bridge perf recipe with HybridEP sets
# `moe_hybridep_num_sms` = 32 (`_benchmark_common`, src/megatron/bridge/perf_recipes/_common.py,
# H100 and Blackwell alike; Megatron-Core's own default is 16). DeepEP V2 (NCCL Gin) reaches its
# bandwidth on far fewer: 6 SMs for EP8 x 4 over RDMA (deepseek-ai/DeepEP README, SM90; 4-12 across
# its settings). The default version is what the reference runs; a cluster file picks another
# (`ep_backend_sms`: a version or a count per backend).
DISPATCHER_SMS: dict[str, dict[str, int]] = {
    "deepep": {"v1": 20, "v2": 6},
    "hybridep": {"bridge": 32, "mcore-default": 16},
}
DEFAULT_DISPATCHER_VERSION = {"deepep": "v1", "hybridep": "bridge"}
EP_BACKEND_SMS = {b: DISPATCHER_SMS[b][v] for b, v in DEFAULT_DISPATCHER_VERSION.items()}

# One NDR 400 Gb/s NIC (ConnectX-7) per GPU, through NCCL: 46-48 GB/s (AddyLaddy,
# NVIDIA/nccl-tests#290); we take the low end. Latencies: Calculon's H100 system
# (systems/h100_80g_nvl8.json): NVLink 10 us, InfiniBand 20 us.
NIC = Link(
    46e9,
    20e-6,
    "NDR 400G NIC via NCCL 46 GB/s (NVIDIA/nccl-tests#290); 20 us (Calculon h100_80g_nvl8)",
)
NVLINK_LATENCY_S = 10e-6  # Calculon h100_80g_nvl8.json

# Compute slowdown while communication runs beside it: each second of hidden transfer costs the
# compute beside it `slowdown` seconds (the share of its rate the transfer takes; DeepEP / HybridEP
# use their SM share instead). arXiv 2507.03114 (A100/H100, GPT and LLaMA): overlapped compute runs
# 18.9% slower on average, 40.0% at worst. We take the worst case for NCCL all-to-alls that cross
# nodes (every expert-parallel rank talks to every other, so the kernels hold the most channels/SMs
# and HBM bandwidth of any collective; Calculon's 15%-of-SMs NVLink figure alone already gives 18%)
# and the average for the rest (DP / TP / PP overlap). Said plainly: the worst-case value for EP was
# chosen after seeing the published Qwen3-30B-A3B pair (tests/test_plan_published.py); that pair
# therefore does not validate it independently - a second measured EP pair must.
OVERLAP_SLOWDOWN = {"ep": 0.40, "other": 0.189}
SLOWDOWN_SOURCE = (
    "arXiv 2507.03114: +18.9% average, +40.0% worst; ep uses the worst case, the others the average"
)


@dataclass(frozen=True)
class Efficiency:
    """Achieved share of the dense peak for the model's compute (GEMMs, attention, everything that
    is not communication), and where the number comes from."""

    value: float
    source: str
    # seconds the host takes to launch one kernel of an eager run: the least a kernel outside a
    # CUDA graph costs on the GPU's timeline (`overlap.plan.compute`), fitted with `value` on the
    # same runs; 0 where the efficiency alone was calibrated
    kernel_overhead_s: float = 0.0


def expected_error(gpu: str) -> tuple[float, float] | None:
    """(median, worst) relative step-time error of the GPU type's fit under leave-one-out
    (`overlap.plan.fitted`)."""
    from overlap.plan.fitted import FITTED

    fit = FITTED.get("h100" if gpu == "h200" else gpu)
    return None if fit is None else (fit["median_error"], fit["worst_error"])


def calibrated_efficiency(gpu: str) -> Efficiency | None:
    """The GPU type's fitted compute efficiency (`overlap.plan.fitted`, written by `python -m
    overlap.plan.validate --write`: the median in log of the efficiencies of the published runs it
    names), or None for a type without one. H200 has the H100's compute die and clocks, so it takes
    the H100's, and says so."""
    from overlap.plan.fitted import FITTED

    key = "h100" if gpu == "h200" else gpu
    fit = FITTED.get(key)
    if fit is None:
        return None
    borrowed = " (H200: the H100's, same compute die)" if gpu != key else ""
    runs = f"{len(fit['fit_rows'])} published {fit['group']} runs"
    return Efficiency(
        fit["efficiency"],
        f"fitted on {runs}{borrowed}, docs/planner.md 'Validation'",
        fit["kernel_overhead_us"] * 1e-6,
    )


@dataclass(frozen=True)
class Cluster:
    """Everything the planner knows about the machine: the GPU, how many share a node, the two
    links, the compute efficiency and the overlap slowdowns."""

    gpu: str
    peak_tflops: float  # for the plan's precision
    precision: str
    gpus_per_node: int
    nvlink: Link
    nic: Link
    efficiency: Efficiency
    overlap_slowdown: dict[str, float] = field(default_factory=lambda: dict(OVERLAP_SLOWDOWN))
    source: str = "built-in table (overlap.plan.hardware)"
    # Only these kind families' collectives use the links (None: all). The others cost nothing in
    # the plan: a machine profile of `--network model:LAT,BW,FAMILIES` leaves them on the plain
    # loopback, where the calibration run measured them as part of the compute.
    link_families: tuple[str, ...] | None = None
    slowdown_source: str = SLOWDOWN_SOURCE
    # The shape-aware compute model's figures (`overlap.plan.compute`); 0 where unknown (a -g cpu
    # profile): then every FLOP costs the same, peak x efficiency.
    # the attention core's rate (the reference's FP8 recipes keep it in BF16)
    bf16_peak_tflops: float = 0.0
    hbm_Bps: float = 0.0
    sms: int = 0
    # The step-time error to expect, (median, worst) of the leave-one-out validation on published
    # runs (`overlap.plan.validate`); None where the efficiency is not that fit's (a cluster file, a
    # -g cpu profile).
    expected_error: tuple[float, float] | None = None
    # SMs each flex dispatcher backend's kernels hold (`DISPATCHER_SMS`, the default versions)
    ep_backend_sms: dict[str, int] = field(default_factory=lambda: dict(EP_BACKEND_SMS))

    def slowdown(self, family: str) -> float:
        return self.overlap_slowdown.get(family, self.overlap_slowdown.get("other", 0.0))

    def carries(self, family: str) -> bool:
        return self.link_families is None or family in self.link_families

    def to_json(self) -> dict:
        return {
            "gpu": self.gpu,
            "precision": self.precision,
            "peak_tflops": self.peak_tflops,
            "gpus_per_node": self.gpus_per_node,
            "nvlink": self.nvlink.to_json(),
            "nic": self.nic.to_json(),
            "compute_efficiency": self.efficiency.value,
            "compute_efficiency_source": self.efficiency.source,
            "kernel_overhead_us": self.efficiency.kernel_overhead_s * 1e6,
            "overlap_slowdown": dict(self.overlap_slowdown),
            "overlap_slowdown_source": self.slowdown_source,
            "ep_backend_sms": dict(self.ep_backend_sms),
            "source": self.source,
            **(
                {"link_families": list(self.link_families)}
                if self.link_families is not None
                else {}
            ),
        }


def precision_of(precision: Precision) -> str:
    """The compute precision of a resolved run (`cfg.resolved.precision`): bf16 / fp16 mixed
    precision, else fp32
    (FP8 compute is refused by the harness: `-c fp8_*` is not built; `overlap plan` plans it,
    `PLAN_FP8`)."""
    return "bf16" if precision.bf16 else "fp16" if precision.fp16 else "fp32"


# `overlap plan -c`: the reference's FP8 recipes, planned at the FP8 rate (the runtime refuses FP8
# compute, so such a plan predicts the reference system's run): per-tensor / delayed / sub-channel
# scaling -> "fp8", MX block scaling -> "mxfp8" (Blackwell only).
PLAN_FP8 = {"fp8_cs": "fp8", "fp8_ds": "fp8", "fp8_sc": "fp8", "fp8_mx": "mxfp8"}


def builtin_cluster(
    gpu: str, precision: str, gpus_per_node: int | None, efficiency: Efficiency | None = None
) -> Cluster:
    """The cluster from the built-in table for a `-g` GPU type, at its fitted efficiency (or
    `efficiency`: the validation fits it); a ConfigError for one without published figures."""
    spec = GPUS.get(gpu)
    if spec is None:
        known = ", ".join(GPUS)
        if gpu == "cpu":
            raise ConfigError(
                "-g/--gpu",
                gpu,
                "CPU ranks have no published peak or link figures: a plan for them needs this "
                "machine's measured profile.",
                "pass --cluster FILE with the profile (see docs/planner.md, 'Calibration').",
            )
        raise ConfigError(
            "-g/--gpu",
            gpu,
            "the planner has no published peak FLOP/s and NVLink figures for it (it knows "
            f"{known}).",
            "pick one of those, or describe the GPU in --cluster FILE (peak_tflops, nvlink, nic, "
            "gpus_per_node; docs/planner.md).",
        )
    if precision not in spec.peak_tflops:
        raise ConfigError(
            "-c/--compute_dtype",
            precision,
            f"{spec.name} has no {precision} tensor cores.",
            f"plan it with one of {', '.join(spec.peak_tflops)}.",
        )
    eff = efficiency or calibrated_efficiency(gpu)
    if eff is None:  # a GPU type added to GPUS without a validated fit
        raise ConfigError(
            "-g/--gpu",
            gpu,
            "no fitted compute efficiency for it.",
            "give compute_efficiency in --cluster FILE.",
        )
    return Cluster(
        gpu=gpu,
        peak_tflops=spec.peak_tflops[precision],
        precision=precision,
        gpus_per_node=gpus_per_node or spec.gpus_per_node,
        nvlink=Link(spec.nvlink_GBps * 1e9, NVLINK_LATENCY_S, spec.source),
        nic=NIC,
        efficiency=eff,
        source=f"built-in table: {spec.source}",
        bf16_peak_tflops=spec.peak_tflops["bf16"],
        hbm_Bps=spec.hbm_TBps * 1e12,
        sms=spec.sms,
        expected_error=None if efficiency else expected_error(gpu),
    )


_CLUSTER_KEYS = {
    "gpu",
    "gpus_per_node",
    "peak_tflops",
    "precision",
    "nvlink",
    "nic",
    "compute_efficiency",
    "compute_efficiency_source",
    "overlap_slowdown",
    "source",
    "overlap_slowdown_source",
    "link_families",
    "kernel_overhead_us",
    "ep_backend_sms",
}


def load_cluster(path: str, gpu: str, precision: str, gpus_per_node: int | None) -> Cluster:
    """A cluster file (JSON): the GPU type plus any of the figures to replace. Required: `gpu`
    (matching -g) and, for a GPU type without built-in figures (cpu included), `peak_tflops`,
    `gpus_per_node`, `nvlink` and `nic` (each `{"bandwidth_GBps": x, "latency_us": y}`) and
    `compute_efficiency`. A missing or malformed field is a ConfigError naming it."""
    file = Path(path)
    try:
        doc = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(
            "--cluster", path, f"cannot read it ({exc.strerror}).", "pass an existing JSON file."
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            "--cluster",
            path,
            f"not JSON ({exc.msg}, line {exc.lineno}).",
            "write the cluster as one JSON object (docs/planner.md).",
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(
            "--cluster",
            path,
            "the file holds no JSON object.",
            "write one object (docs/planner.md).",
        )
    unknown = sorted(set(doc) - _CLUSTER_KEYS)
    if unknown:
        raise ConfigError(
            f"--cluster {unknown[0]}",
            doc[unknown[0]],
            "unknown cluster field.",
            f"use only {', '.join(sorted(_CLUSTER_KEYS))}.",
        )
    if doc.get("gpu") != gpu:
        raise ConfigError(
            "--cluster gpu",
            doc.get("gpu"),
            f"the plan is for -g {gpu}.",
            f'set "gpu": "{gpu}" in the file, or plan with -g {doc.get("gpu")}.',
        )
    base = None if gpu not in GPUS else builtin_cluster(gpu, precision, gpus_per_node)
    required = ("peak_tflops", "gpus_per_node", "nvlink", "nic", "compute_efficiency")
    missing = [k for k in required if k not in doc] if base is None else []
    if missing:
        raise ConfigError(
            f"--cluster {missing[0]}",
            None,
            f"{gpu} has no built-in figures, so the file must give {', '.join(required)}.",
            f"add {', '.join(missing)} (docs/planner.md, 'Cluster file').",
        )

    def number(key: str, value: object, minimum: float = 0.0) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > minimum:
            raise ConfigError(
                f"--cluster {key}",
                value,
                f"expected a number above {minimum:g}.",
                f"set {key} to a positive number.",
            )
        return float(value)

    def link(key: str, default: Link | None) -> Link:
        if key not in doc:
            return default
        value = doc[key]
        if (
            not isinstance(value, dict)
            or "bandwidth_GBps" not in value
            or "latency_us" not in value
        ):
            raise ConfigError(
                f"--cluster {key}",
                value,
                "a link needs bandwidth_GBps and latency_us.",
                f'e.g. "{key}": {{"bandwidth_GBps": 46, "latency_us": 20}}.',
            )
        burst = {}
        if "burst_bytes" in value:  # a token bucket (a calibrated `--network tbf:RATE` profile)
            burst = {
                "burst_bytes": number(f"{key}.burst_bytes", value["burst_bytes"]),
                "burst_Bps": number(f"{key}.burst_GBps", value.get("burst_GBps"), 0.0) * 1e9,
            }
        return Link(
            number(f"{key}.bandwidth_GBps", value["bandwidth_GBps"]) * 1e9,
            number(f"{key}.latency_us", value["latency_us"], -1e-12) * 1e-6,
            value.get("source", str(file)),
            **burst,
        )

    # without its own, a file's efficiency keeps the built-in per-kernel overhead (a calibration
    # fits the efficiency beside it)
    tau = (
        number("kernel_overhead_us", doc["kernel_overhead_us"], -1e-12) * 1e-6
        if "kernel_overhead_us" in doc
        else base.efficiency.kernel_overhead_s
        if base
        else 0.0
    )
    eff = (
        Efficiency(
            number("compute_efficiency", doc["compute_efficiency"]),
            doc.get("compute_efficiency_source", f"cluster file {file}"),
            tau,
        )
        if "compute_efficiency" in doc
        else replace(base.efficiency, kernel_overhead_s=tau)
    )
    if eff.value > 1:
        raise ConfigError(
            "--cluster compute_efficiency",
            eff.value,
            "a share of the peak is at most 1.",
            "give the achieved share of peak_tflops (e.g. 0.4).",
        )
    slowdown = dict(OVERLAP_SLOWDOWN)
    for fam, value in (doc.get("overlap_slowdown") or {}).items():
        slowdown[fam] = number(f"overlap_slowdown.{fam}", value, -1e-12)
        if slowdown[fam] >= 1:
            raise ConfigError(
                f"--cluster overlap_slowdown.{fam}",
                value,
                "a transfer takes a share of the compute's rate beside it: below 1.",
                "give the share (e.g. 0.189).",
            )
    per_node = gpus_per_node or (
        int(number("gpus_per_node", doc["gpus_per_node"]))
        if "gpus_per_node" in doc
        else base.gpus_per_node
    )
    peak = number("peak_tflops", doc["peak_tflops"]) if "peak_tflops" in doc else base.peak_tflops
    families = doc.get("link_families")
    if families is not None:
        if not isinstance(families, list) or not all(isinstance(f, str) for f in families):
            raise ConfigError(
                "--cluster link_families",
                families,
                "expected a list of kind families.",
                'e.g. "link_families": ["ep"].',
            )
        families = parse_families("--cluster link_families", families, ",".join(families))
    backend_sms = dict(EP_BACKEND_SMS)
    chosen = doc.get("ep_backend_sms") or {}
    if not isinstance(chosen, dict):
        raise ConfigError(
            "--cluster ep_backend_sms",
            chosen,
            "expected an object of backend: version or SM count.",
            'e.g. "ep_backend_sms": {"deepep": "v2"}.',
        )
    for backend, value in chosen.items():
        versions = DISPATCHER_SMS.get(backend)
        if versions is None:
            raise ConfigError(
                f"--cluster ep_backend_sms.{backend}",
                value,
                "not a flex dispatcher backend with SMs of its own.",
                f"name one of {', '.join(DISPATCHER_SMS)}.",
            )
        if not isinstance(value, str):
            backend_sms[backend] = int(number(f"ep_backend_sms.{backend}", value))
        elif value in versions:
            backend_sms[backend] = versions[value]
        else:
            raise ConfigError(
                f"--cluster ep_backend_sms.{backend}",
                value,
                f"no {backend} version with a known SM count.",
                f"give one of {', '.join(versions)} or a number of SMs.",
            )
    cluster = Cluster(
        gpu=gpu,
        peak_tflops=peak,
        precision=precision,
        gpus_per_node=per_node,
        nvlink=link("nvlink", base.nvlink if base else None),
        nic=link("nic", base.nic if base else None),
        efficiency=eff,
        overlap_slowdown=slowdown,
        source=doc.get("source", f"cluster file {file}"),
        link_families=families,
        slowdown_source=doc.get("overlap_slowdown_source", SLOWDOWN_SOURCE),
        ep_backend_sms=backend_sms,
        **(
            {}
            if base is None
            else {
                "bf16_peak_tflops": base.bf16_peak_tflops,
                "hbm_Bps": base.hbm_Bps,
                "sms": base.sms,
            }
        ),
        # the validation's error holds only for the validated efficiency
        expected_error=(
            None
            if base is None or "compute_efficiency" in doc or "kernel_overhead_us" in doc
            else base.expected_error
        ),
    )
    return cluster


def with_efficiency(
    cluster: Cluster, value: float, source: str, kernel_overhead_s: float | None = None
) -> Cluster:
    """The cluster at another efficiency (and per-kernel overhead: None keeps the cluster's)."""
    tau = cluster.efficiency.kernel_overhead_s if kernel_overhead_s is None else kernel_overhead_s
    return replace(cluster, efficiency=Efficiency(value, source, tau))
