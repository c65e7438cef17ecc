"""`overlap run --dry-run`: play one rank of a real cluster layout for one training step, in this
process, on fake tensors - no GPU, no memory, no peers - and report what that rank would do.

Why: a layout that is wrong for the model (a device mix-up, a host sync in the step, a rank that
does not fit) should be found on a laptop, before a cluster is booked. The rank runs the runtime's
own code: the trainer builds the model chunks, DDP, the optimizer and the mock data at the real
shapes, and plays one step (its deferred parameter gathers included), with:

- torch.distributed on the fake backend (`torch.testing._internal.distributed.fake_pg`): every
  process group the runtime builds exists, with this rank at its place in the world; collectives
  return at once and move nothing. `comm.py` records the rank's communication program (the dry
  run's own `comm.CommSession`) as on a real run. The host cannot see a collective complete, as on
  NCCL (`RulesTimeline`), so the schedules take their GPU decisions.
- every tensor a FakeTensor (`FakeTensorMode`) on the fake device, which the trainer's
  `ParallelState.device` names as a GPU rank's names its GPU (neither installs a default device):
  "cuda" on a CUDA build of torch (true CUDA fakes), "meta" on a CPU build, where CUDA tensors
  cannot run autograd. On "meta" the code paths that only run on CUDA (an `x.is_cuda` branch) are
  not exercised, but a CPU tensor meeting a device tensor is still caught.
- a dispatch mode (`_StepWatch`) over the fakes that measures the live storage bytes on the fake
  device after every op (the peak is the rank's memory high-water mark: parameters, gradient
  buffers, optimizer states, activations), catches a device mix-up with its op and our source line,
  and answers every host read of device data (`.item()`, `.tolist()`, `float(t)`, `bool(t)`: each
  one a host synchronisation on a GPU) with a stand-in value, recording where in our code it was
  asked. The MoE split sizes are the one read answered otherwise, by balanced routing
  (`overlap.layers.moe.split_sizes`): the all-to-alls then carry the bytes a balanced router would
  send.

Attention on "meta" takes CUDA's kernel choice (the layer treats a meta tensor as the CUDA one it
stands for), and the fused kernels' memory: `overlap.layers.attention.fused_attention_on_meta`.

A real step can have hundreds of micro-batches, and a fake op costs a few hundred microseconds here,
so by default the rank plays the fewest micro-batches that reach its schedule's steady state
(`default_microbatches`): the per micro-batch program repeats after that, and the activations alive
at once are those of the full step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
import warnings
import weakref
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from overlap.config.container import ConfigContainer
from overlap.errors import ConfigError
from overlap.harness import Job, describe_layout
from overlap.launch.resources import MemoryEstimate, gib
from overlap.layers.moe import split_sizes
from overlap.layout import ParallelLayout
from overlap.parallel import comm, teardown
from overlap.parallel.program import Post, ProgramRecorder, summarize
from overlap.parallel.trace import Recorder, RulesTimeline, recording
from overlap.perf.host_syncs import (
    HOST_TENSOR,
    caller,
    host_copy,
    intended_read,
    our_frame,
    package_path,
)
from overlap.perf.memory_model import deferred_microbatches
from overlap.pipeline.schedules import pipeline_steps

log = logging.getLogger("overlap")

SPLIT_SIZES = "the MoE split sizes, needed by the all-to-all (routing assumed balanced)"
LOOP_SELECTIONS = (
    "the loop permutation's selection of one expert's rows (model.moe_permute_fusion=false: a "
    "host sync per expert on a GPU; routing assumed balanced)"
)
_ANSWER_REASONS = {
    split_sizes.SPLIT_SIZE_READ: SPLIT_SIZES,
    split_sizes.LOOP_PERMUTATION: LOOP_SELECTIONS,
}

PEAK_SITES_SHOWN = 8
_STAND_INS = {
    "float": 1.0,
    "int": 0,
    "bool": True,
}  # what a fake host read returns, by the scalar's kind


@dataclass(frozen=True)
class DryRunOptions:
    """The --dry-run flags: which rank, how many micro-batches (None: `default_microbatches`), the
    JSON file."""

    rank: int = 0
    microbatches: int | None = None
    json_path: str | None = None


@dataclass
class HostRead:
    """Host reads of device data from one line of our code."""

    site: str  # file:line, the file relative to the package's parent (overlap/...)
    function: str
    phase: str  # "build" (the trainer being built) or "step" (the training step)
    code: str  # the line's text
    count: int = 0
    answer: str = ""  # what the dry run gave back
    # the torch function that read, when our line calls into torch (an optimizer step)
    via: str | None = None
    intended: str | None = None  # why the step needs it, or None: unintended

    def describe(self) -> str:
        via = f" via {self.via}" if self.via else ""
        return (
            f"{self.phase} {self.site} ({self.function}) x{self.count}: {self.code}{via} -> "
            f"{self.answer}"
        )


@dataclass
class Finding:
    """What stopped the step: a device mix-up, an op the dry run cannot answer, or any other
    failure."""

    kind: str  # "device mix-up" | "unanswerable op" | "failure"
    op: str | None
    site: str | None
    function: str | None
    message: str

    def line(self) -> str:
        where = f" at {self.site} ({self.function})" if self.site else ""
        op = f" in {self.op}" if self.op else ""
        return f"{self.kind}{op}{where}: {self.message}"


@dataclass
class KindTraffic:
    """One kind of the rank's program: operations, bytes it sends (receives for a receive), who it
    talks to."""

    ops: int = 0
    bytes: int = 0
    groups: list[list[int]] = field(default_factory=list)  # the collectives' groups (global ranks)
    peers: list[int] = field(default_factory=list)  # point-to-point peers (global ranks)


@dataclass
class DryRunReport:
    rank: int
    world_size: int
    layout: str
    groups: str  # ParallelState.describe() of the played rank
    fake_device: str
    mesh_device: str
    microbatches_played: int
    microbatches_per_step: int
    microbatches_chosen_by: str
    overrides: list[str]
    program: dict[str, KindTraffic]
    # live on the device when the step starts (parameters, gradient buffers, master weights)
    start_bytes: int
    peak_bytes: int
    # alive at the peak, by the line of our code that made it, largest first
    peak_by_site: list[tuple[str, int]]
    end_bytes: int | None  # None: the step did not get there
    # the memory model's for this rank and these micro-batches (`overlap.perf.memory_model`),
    # which overlap explain and overlap plan show
    estimate: MemoryEstimate
    host_reads: list[HostRead]
    split_size_reads: int
    loop_permutation_reads: int  # model.moe_permute_fusion=false: answered selections
    finding: Finding | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.finding is None

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["estimate"] = {"total_bytes": self.estimate.total, **asdict(self.estimate)}
        doc["peak_over_estimate"] = self.peak_bytes / self.estimate.total
        doc["ok"] = self.ok
        return doc

    def format(self) -> str:
        lines = [
            f"Dry run: rank {self.rank} of {self.world_size}, one training step, on fake tensors "
            f"({self.seconds:.0f} s)",
            f"  layout: {self.layout}",
            *(f"  {line}" for line in self.groups.splitlines()[1:]),
            f"  fake device: {self.fake_device}"
            + (
                " (a CPU build of torch: CUDA-only code paths, e.g. `x.is_cuda` branches, are not "
                "exercised; device mix-ups with the CPU are still caught; attention takes CUDA's "
                "kernel choice, with the fused kernel's memory)"
                if self.fake_device == "meta"
                else ""
            ),
            f"  process groups: the fake backend, meshes on device type {self.mesh_device}",
            f"  micro-batches: {self.microbatches_played} of the step's "
            f"{self.microbatches_per_step} played"
            + (
                f" ({self.microbatches_chosen_by}; the tp/ep/pp operations repeat per micro-batch, "
                "so a full step has about "
                f"{self.microbatches_per_step / self.microbatches_played:.3g}x those)"
                if self.microbatches_played < self.microbatches_per_step
                else ""
            ),
        ]
        if self.overrides:
            lines.append(
                f"  overrides: {' '.join(self.overrides)} (the dry run plays the model as "
                "overridden)"
            )
        if self.split_size_reads or self.loop_permutation_reads:
            loops = (
                f" and {self.loop_permutation_reads} loop-permutation selections"
                if self.loop_permutation_reads
                else ""
            )
            lines.append(
                f"  routing assumed balanced: {self.split_size_reads} MoE split-size reads{loops} "
                "answered with balanced routing (each expert gets tokens x topk / experts rows)"
            )
        lines += [
            "",
            "Communication program (this rank; bytes sent, received for a receive):",
            f"  {'kind':<20} {'ops':>6} {'bytes':>11}  with",
        ]
        for kind, t in sorted(self.program.items()):
            lines.append(f"  {kind:<20} {t.ops:>6} {_size(t.bytes):>11}  {_partners(t)}")
        est = self.estimate
        ratio = f" ({self.peak_bytes / est.total:.2f}x the estimate)"
        lines += [
            "",
            "Memory (live storage on the fake device):",
            f"  at the step's start {_size(self.start_bytes)} (parameters, gradient buffers, "
            "master weights, Adam's moments)",
            f"  peak during the step {_size(self.peak_bytes)}{ratio}, made by:",
            *(f"    {_size(n):>11}  {site}" for site, n in self.peak_by_site[:PEAK_SITES_SHOWN]),
            f"  at the step's end {_size(self.end_bytes)}"
            if self.end_bytes is not None
            else "  at the step's end: not reached",
            f"  the memory model's estimate for this rank (overlap explain's, overlap plan's): "
            f"{gib(est.total)}",
            *est.table(),
        ]
        lines += [
            "",
            "Host reads of device data (each a host synchronisation on a GPU), building the "
            "trainer and in the step:",
        ]
        for r in self.host_reads:
            label = (
                "UNINTENDED"
                if r.intended is None
                else "host"
                if r.intended == HOST_TENSOR
                else "intended"
            )
            lines.append(
                f"  {label:<10} {r.describe()}" + (f" [{r.intended}]" if r.intended else "")
            )
        if not self.host_reads:
            lines.append("  none")
        lines += [
            "",
            f"Result: {self.finding.line()}"
            if self.finding
            else "Result: the step ran; no device mix-up found",
        ]
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _ranks(members: list[int]) -> str:
    """Global ranks, an arithmetic run written as first-last (step s)."""
    if len(members) > 2:
        step = members[1] - members[0]
        if step > 0 and all(b - a == step for a, b in zip(members, members[1:])):
            return f"{members[0]}-{members[-1]}" + (f" step {step}" if step > 1 else "")
    return ",".join(map(str, members))


def _partners(t: KindTraffic) -> str:
    parts = (
        [f"peer{'s' if len(t.peers) > 1 else ''} {','.join(map(str, t.peers))}"] if t.peers else []
    )
    parts += [f"group of {len(g)} ({_ranks(g)})" for g in t.groups]
    return "; ".join(parts)


def program_traffic(entries: list) -> dict[str, KindTraffic]:
    """Per kind: `program.summarize`'s operation counts, with bytes and the groups / peers from the
    posts."""
    out = {kind: KindTraffic(ops=s["ops"]) for kind, s in summarize(entries).items()}
    for entry in entries:
        if not isinstance(entry, Post):
            continue
        for op in entry.ops:
            t = out[op.kind]
            t.bytes += op.numel * getattr(torch, op.dtype).itemsize
            if op.peer is not None:
                if op.peer not in t.peers:
                    t.peers.append(op.peer)
            elif list(entry.members) not in t.groups:
                t.groups.append(list(entry.members))
    for t in out.values():
        t.peers.sort()
    return out


# --- which micro-batches --------------------------------------------------------------------------
def _in_flight(
    layout: ParallelLayout, cfg: ConfigContainer, pp_rank: int, microbatches: int
) -> int:
    """Most (micro-batch, chunk) forwards whose backward has not run yet, over the rank's pipeline
    program: what the schedule keeps alive at its high-water mark
    (`pipeline.schedules.pipeline_steps`)."""
    steps = pipeline_steps(
        layout.pp,
        pp_rank,
        layout.vpp,
        microbatches,
        cfg.resolved.model.microbatch_group_size_per_vp_stage,
        cfg.resolved.overlap.overlap_moe_expert_parallel_comm,
        cfg.resolved.overlap.p2p_warmup_depth,
    )
    alive = most = 0
    for step in steps:
        alive += step.forward is not None
        most = max(most, alive)
        alive -= step.backward is not None
    return most


def _microbatch_problem(
    layout: ParallelLayout, cfg: ConfigContainer, k: int, per_step: int
) -> str | None:
    """Why `k` micro-batches cannot stand for this step's schedule, or None."""
    if not 1 <= k <= per_step:
        return f"a step of this layout has {per_step} micro-batch(es) per data-parallel rank."
    if cfg.resolved.overlap.overlap_moe_expert_parallel_comm and k < 2:
        return "EP overlap interleaves two micro-batches: it needs at least 2."
    if layout.pp > 1 and layout.vpp > 1:
        group = cfg.resolved.model.microbatch_group_size_per_vp_stage or layout.pp
        if k % layout.pp or k < group:
            return (
                f"the interleaved schedule needs a multiple of PP ({layout.pp}) and at least the "
                "group size "
                f"({group})."
            )
    return None


def default_microbatches(layout: ParallelLayout, cfg: ConfigContainer, pp_rank: int) -> int:
    """The fewest micro-batches (at least 2 when the step has 2) that the schedule accepts and whose
    pipeline program keeps as many forwards alive as the full step's: the activation high-water mark
    is then the real one, and every later micro-batch repeats the same program. On the rank holding
    the output layer under `defer_embedding_wgrad_compute`, at least as many as are deferred."""
    per_step = microbatches_per_step(layout, cfg)
    target = _in_flight(layout, cfg, pp_rank, per_step)
    # the output layer's deferred weight gradients wait for the flush: each adds to the peak
    deferred = deferred_microbatches(cfg, layout, pp_rank, per_step)
    for k in range(max(min(2, per_step), deferred), per_step):
        if (
            _microbatch_problem(layout, cfg, k, per_step) is None
            and _in_flight(layout, cfg, pp_rank, k) == target
        ):
            return k
    return per_step


def microbatches_per_step(layout: ParallelLayout, cfg: ConfigContainer) -> int:
    t = cfg.train
    return t.global_batch_size // (t.micro_batch_size * layout.dp)


# --- refusals -------------------------------------------------------------------------------------
def check_dry_run(job: Job, args: argparse.Namespace, env=os.environ) -> DryRunOptions:
    """What a dry run cannot be combined with, each a ConfigError before anything is built; the
    options."""
    layout, cfg = job.resolution.layout, job.cfg
    if "RANK" in env and "WORLD_SIZE" in env:
        raise ConfigError(
            "--dry-run",
            True,
            "one process plays one rank of the layout; under torchrun or srun every process would "
            "play one.",
            "run `overlap run ... --dry-run` alone, without a launcher.",
        )
    if args.gpu == "cpu":
        raise ConfigError(
            "--dry-run",
            True,
            "it plays a GPU rank on this machine, and a -g cpu layout runs for real here.",
            "name the cluster's GPU (-g h100, ...), or drop --dry-run.",
        )
    for flag, given in (
        ("--emit-slurm", args.emit_slurm),
        ("--metrics", args.metrics),
        ("--trace", args.trace),
        ("--nccl-rules", args.nccl_rules or None),
    ):
        if given is not None:
            raise ConfigError(
                flag,
                given,
                "a dry run trains nothing and times nothing: it writes its report (and "
                "--dry-run-json FILE).",
                f"drop {flag} with --dry-run.",
            )
    if args.comm_mode != "real":
        raise ConfigError(
            "--comm-mode",
            args.comm_mode,
            "the dry run records the communication program, which a free communication mode would "
            "leave out.",
            "drop --comm-mode with --dry-run.",
        )
    ck = cfg.checkpoint
    for key, value in (
        ("checkpoint.load", ck.load),
        ("checkpoint.save", ck.save),
        ("checkpoint.pretrained_checkpoint", ck.pretrained_checkpoint),
    ):
        if value:
            raise ConfigError(
                key,
                value,
                "a dry run has no weights: fake tensors hold no values to load or save.",
                f"drop {key} for the dry run (the shapes come from the recipe and the overrides).",
            )
    rank = args.dry_run_rank or 0
    if not 0 <= rank < layout.world_size:
        raise ConfigError(
            "--dry-run-rank",
            rank,
            f"the layout has ranks 0-{layout.world_size - 1}.",
            f"pick a rank in 0-{layout.world_size - 1}.",
        )
    k = args.dry_run_microbatches
    if k is not None:
        problem = _microbatch_problem(layout, cfg, k, microbatches_per_step(layout, cfg))
        if problem:
            raise ConfigError(
                "--dry-run-microbatches",
                k,
                problem,
                "choose a count the step's schedule accepts, or omit the flag (the default reaches "
                "the schedule's steady state).",
            )
    from overlap.launch.paths import check_output_file

    check_output_file("--dry-run-json", args.dry_run_json)
    return DryRunOptions(rank, k, args.dry_run_json)


# --- the watch over the step's ops ----------------------------------------------------------------
def _fake_errors() -> tuple[type | tuple[()], type, tuple[type, ...]]:
    """(the device mix-up's error, the data-dependent op's, the unanswerable ops'). torch 2.11 has
    no error type of its own for a device mix-up (it raises a plain RuntimeError, "Unhandled
    FakeTensor Device Propagation ..."): there the mix-up is reported as the step's failure, with
    that message, instead of as a "device mix-up" finding."""
    from torch._subclasses import fake_tensor
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )

    return (
        getattr(fake_tensor, "FakeTensorDeviceMismatchError", ()),
        DataDependentOutputException,
        (DynamicOutputShapeException, UnsupportedOperatorException),
    )


class _StepWatch(TorchDispatchMode):
    """Entered inside the FakeTensorMode: sees every op before the fakes run it (module
    docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        # id of a live storage on the fake device -> (bytes, made where)
        self.live: dict[int, tuple[int, str]] = {}
        self.current = self.peak = 0
        # live bytes by the line of our code that made them
        self.by_site: dict[str, int] = defaultdict(int)
        self.peak_by_site: dict[str, int] = {}
        self.reads: dict[tuple[str, str, str], HostRead] = {}
        self.phase = "build"
        self.finding: Finding | None = None
        self.mismatch, self.data_dependent, self.unanswerable = _fake_errors()
        from torch._subclasses.fake_tensor import FakeTensor

        self.fake = FakeTensor
        self.local_scalar = torch.ops.aten._local_scalar_dense.default
        self.equal = torch.ops.aten.equal.default
        self.device_op = torch.ops.prim.device.default

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # autograd asks for every tensor's device: the hot path, nothing to watch
        if func is self.device_op:
            return func(*args, **kwargs)
        if self._on_host(args, kwargs):
            # Only real host tensors (a device mesh's table of ranks, made before the fakes; a
            # literal such as torch.tensor(0.0) on the CPU) and staying there: host values, computed
            # for real
            with _disable_current_modes():
                return func(*args, **kwargs)
        if func is self.local_scalar or func is self.equal:
            return self._answer(func, args[0])
        if host_copy(func, args, kwargs):
            self.record_read(caller(), "copied (fake data)")
        try:
            out = func(*args, **kwargs)
        except self.mismatch as exc:
            self._found(
                "device mix-up",
                func,
                f"a {exc.device} tensor meets a {exc.common_device} tensor "
                "(on a GPU: the same error, mid-step)",
            )
            raise
        except (self.data_dependent, *self.unanswerable) as exc:
            self._found(
                "unanswerable op",
                func,
                f"{type(exc).__name__}: its result depends on the values (on a GPU "
                "a host synchronisation); the dry run cannot answer it",
            )
            raise
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._track(t.untyped_storage(), func)
        return out

    def _on_host(self, args, kwargs) -> bool:
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        target = kwargs.get("device")
        return (
            bool(tensors)
            and (target is None or torch.device(target).type == "cpu")
            and all(not isinstance(t, self.fake) and t.device.type == "cpu" for t in tensors)
        )

    def _track(self, storage, func) -> None:
        key = id(storage)
        if key in self.live:
            return
        nbytes = storage.nbytes()
        frame = our_frame(sys._getframe(2))
        site = (
            f"{package_path(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"
            if frame is not None
            else f"autograd ({func.name()})"
        )
        self.live[key] = (nbytes, site)
        self.by_site[site] += nbytes
        self.current += nbytes
        if self.current > self.peak:
            self.peak, self.peak_by_site = self.current, dict(self.by_site)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        nbytes, site = self.live.pop(key)
        self.by_site[site] -= nbytes
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak, self.peak_by_site = self.current, dict(self.by_site)

    def _answer(self, func, tensor: torch.Tensor):
        kind = (
            "bool"
            if tensor.dtype == torch.bool or func is self.equal
            else ("float" if tensor.dtype.is_floating_point or tensor.dtype.is_complex else "int")
        )
        value = _STAND_INS[kind]
        self.record_read(
            caller(), f"stand-in {value!r}", HOST_TENSOR if tensor.device.type == "cpu" else None
        )
        return value

    def record_read(
        self,
        where: tuple[str, str, str, str | None] | None,
        answer: str,
        intended: str | None = None,
    ) -> None:
        site, function, code, via = where or ("(no line of ours on the stack)", "-", "", None)
        read = self.reads.get((self.phase, site, function))
        if read is None:
            read = self.reads[(self.phase, site, function)] = HostRead(
                site,
                function,
                self.phase,
                code,
                answer=answer,
                via=via,
                intended=intended or intended_read(site, function, code),
            )
        read.count += 1

    def _found(self, kind: str, func, message: str) -> None:
        if self.finding is None:
            site, function, _code, _via = caller() or (None, None, None, None)
            self.finding = Finding(kind, str(func), site, function, message)


# --- the run --------------------------------------------------------------------------------------
def fake_device() -> torch.device:
    """ "cuda" fakes on a CUDA build of torch; "meta" on a CPU build (module docstring)."""
    return torch.device("cuda", 0) if torch.backends.cuda.is_built() else torch.device("meta")


def _mesh_device(device: torch.device) -> str:
    """The meshes' device type: a CUDA mesh needs a GPU to bind, and without one only its groups
    matter here."""
    if device.type == "cuda":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.type


def run_dry(job: Job, options: DryRunOptions) -> DryRunReport:
    """Play rank `options.rank` of the job's layout for one step (module docstring), with a recorder
    of the dry run's own whose timeline hides completion from the host, as on NCCL (the schedules
    take their GPU decisions); its events go with it."""
    with recording(Recorder(timeline=RulesTimeline())):
        return _play(job, options)


def _play(job: Job, options: DryRunOptions) -> DryRunReport:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from overlap.parallel.state import ParallelState
    from overlap.perf.memory_model import rank_memory
    from overlap.training.trainer import Trainer

    cfg, layout = job.cfg, job.resolution.layout
    per_step = microbatches_per_step(layout, cfg)
    device = fake_device()
    mesh_device = _mesh_device(device)
    started = time.perf_counter()
    # meta:fake too: point-to-point batches of meta tensors look their backend up by device type
    dist.init_process_group(
        "cpu:fake,cuda:fake,meta:fake",
        store=FakeStore(),
        rank=options.rank,
        world_size=layout.world_size,
    )
    # torch names the default backend of a device-mapped world only for plugins it finds under their
    # registered name ("FAKE" is looked up as "fake" and missed), and its teardown then warns that
    # it has none
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    watch = _StepWatch(device)
    program = ProgramRecorder(enabled=True)  # the step's communication program
    trainer = ps = None
    try:
        ps = ParallelState(layout, device, mesh_device)
        played = options.microbatches or default_microbatches(layout, cfg, ps.pp_rank)
        estimate = rank_memory(cfg, layout, pp_rank=ps.pp_rank, microbatches=played)
        cfg.train.global_batch_size = played * cfg.train.micro_batch_size * layout.dp
        log.info(
            "dry run: rank %d of %d, %d of %d micro-batches, fake device %s",
            options.rank,
            layout.world_size,
            played,
            per_step,
            device.type,
        )
        answer = split_sizes.balanced_routing(
            lambda what: watch.record_read(caller(), "balanced routing", _ANSWER_REASONS[what])
        )
        with answer, FakeTensorMode(allow_non_fake_inputs=True), watch, warnings.catch_warnings():
            # The pipeline compares storage addresses to count a sent copy in its own memory
            # statistic, which the dry run does not read (it measures every storage itself); fakes
            # have none, and torch warns.
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            start, end = 0, None
            try:
                trainer = Trainer(cfg, ps)
                # a steady-state step's memory: Adam's moments exist from the first step on
                trainer.optimizer.create_states()
                watch.phase = "step"
                start = watch.current
                watch.reset_peak()
                with comm.using(comm.CommSession(program=program)):
                    trainer.train_step(0)
                    # the step's parameter gathers deferred into the next forward
                    trainer.finish_param_sync()
                end = watch.current
            except ConfigError:
                raise  # a user's mistake the runtime found while building: exit 2, as a real run
            except Exception as exc:  # any other failure of the step is the report's finding
                watch.finding = watch.finding or _failure(exc)
            entries = program.stop()
        reads = sorted(watch.reads.values(), key=lambda r: (r.intended is None, r.phase, r.site))
        split_reads = sum(r.count for r in reads if r.intended == SPLIT_SIZES)
        loop_reads = sum(r.count for r in reads if r.intended == LOOP_SELECTIONS)
        return DryRunReport(
            rank=options.rank,
            world_size=layout.world_size,
            layout=describe_layout(job.resolution),
            groups=ps.describe(),
            fake_device=device.type,
            mesh_device=mesh_device,
            microbatches_played=played,
            microbatches_per_step=per_step,
            microbatches_chosen_by="--dry-run-microbatches"
            if options.microbatches
            else "the default: the fewest that reach the schedule's steady state, as many "
            "activations alive",
            overrides=list(getattr(job.args, "overrides", None) or []),
            program=program_traffic(entries),
            start_bytes=start,
            peak_bytes=watch.peak,
            peak_by_site=sorted(
                ((k, n) for k, n in watch.peak_by_site.items() if n), key=lambda kv: -kv[1]
            ),
            end_bytes=end,
            estimate=estimate,
            host_reads=reads,
            split_size_reads=split_reads,
            loop_permutation_reads=loop_reads,
            finding=watch.finding,
            seconds=time.perf_counter() - started,
        )
    finally:
        trainer = ps = None
        teardown.shutdown(failing=sys.exc_info()[0] is not None)


def _failure(exc: BaseException) -> Finding:
    """Any other failure of the step, named by the innermost line of our code in its traceback."""
    site = function = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if package_path(frame.f_code.co_filename) is not None:
            site, function = (
                f"{package_path(frame.f_code.co_filename)}:{line}",
                frame.f_code.co_name,
            )
    message = str(exc).splitlines()[0] if str(exc) else ""
    return Finding("failure", None, site, function, f"{type(exc).__name__}: {message}")
