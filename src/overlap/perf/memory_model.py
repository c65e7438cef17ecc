"""The memory model of `overlap explain`, `overlap plan`, the dry run and the run's own checks: one
rank's peak, by component, and whether it fits the GPU.

`rank_memory` is `overlap.launch.resources.estimate_memory` (its every-rank form, `peak_memory`)
fed with each rank's real pipeline program (`overlap.pipeline.schedules.pipeline_steps`, merged
under EP overlap), which the launch layer cannot import: the activations follow the program's
forwards and backwards, so the peak counts the micro-batches the schedule keeps in flight and the
backward running at that moment, as the dry run measures it (`tests/test_memory_model.py` holds
the two within 10% on the guides' layouts).

`fit` compares the peak, plus a stated reserve, with the GPU's memory, and when it does not fit
prices what Megatron users reach for: selective recompute modules, the distributed optimizer, bf16
gradient reduction, a smaller micro-batch, the dropless all-to-all instead of the sync-free
dispatch's padded blocks (`model.moe_expert_rank_capacity_factor`: its rows are factor x the
dropless average), more pipeline stages, a larger expert-parallel group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from overlap.config.container import ConfigContainer
from overlap.config.model import PAGED_STASH_POOL
from overlap.launch.resources import MemoryEstimate, gib, peak_memory
from overlap.layout import ParallelLayout
from overlap.pipeline.schedules import pipeline_steps

_GIB = 2**30

GPU_MEMORY_BYTES: dict[str, int] = {
    "h100": 81559 * 2**20,  # H100 SXM 80 GB: what nvidia-smi reports
    "h200": 143771 * 2**20,  # H200 SXM 141 GB: what nvidia-smi reports
    "b200": 180 * 10**9,  # DGX B200: 1,440 GB over 8 GPUs
    "b300": 288 * 10**9,  # DGX B300: 2.3 TB over 8 GPUs
    "gb200": 186 * 10**9,  # GB200 NVL72: 13.4 TB over 72 GPUs
    "gb300": 288 * 10**9,  # GB300 NVL72: 20.7 TB over 72 GPUs
}
"""Each GPU type's memory (the vendor's figure per GPU; nvidia-smi's total where stated)."""

RESERVE_FIXED = 2 * _GIB
RESERVE_SHARE = 0.05
"""What the estimate leaves out and a GPU still holds: the CUDA context, cuBLAS / cuDNN workspaces
and NCCL's communicator buffers (together about 2 GiB on a Hopper node with a handful of groups),
and the caching allocator's fragmentation (5% of the peak)."""


def program(
    cfg: ConfigContainer, layout: ParallelLayout, pp_rank: int, microbatches: int | None = None
) -> list[tuple[int | None, int | None]]:
    """Pipeline rank `pp_rank`'s steps as (forward chunk, backward chunk) pairs, for `microbatches`
    micro-batches (None: the step's, global batch / (micro-batch x DP)), or as many as show the
    same peak (`steady_microbatches`) - all of them on the rank holding the output layer when its
    weight gradients are deferred (each micro-batch's then waits for the flush: the peak grows
    with the count)."""
    m, t = cfg.resolved.model, cfg.train
    count = microbatches or max(1, t.global_batch_size // (t.micro_batch_size * max(1, layout.dp)))
    pp, vpp = max(1, layout.pp), layout.vpp
    group = m.microbatch_group_size_per_vp_stage
    plan = cfg.resolved.overlap
    depth = plan.p2p_warmup_depth
    steady = (
        count
        if deferred_microbatches(cfg, layout, pp_rank, count)
        else steady_microbatches(pp, vpp, group, count, depth)
    )
    merged = plan.overlap_moe_expert_parallel_comm
    return list(_chunk_program(pp, pp_rank, vpp, steady, group, merged, depth))


def deferred_microbatches(
    cfg: ConfigContainer, layout: ParallelLayout, pp_rank: int, count: int
) -> int:
    """How many of `count` micro-batches' output-layer weight gradients wait for the flush on
    pipeline rank `pp_rank` (`defer_embedding_wgrad_compute`: the first `wgrad_deferral_limit`, or
    all; none off the output layer's rank), each keeping its inputs alive until then."""
    plan = cfg.resolved.overlap
    if not plan.defer_embedding_wgrad_compute or pp_rank != max(1, layout.pp) - 1:
        return 0
    limit = plan.wgrad_deferral_limit
    return min(limit, count) if limit > 0 else count


@functools.lru_cache(maxsize=4096)
def _chunk_program(
    pp: int, rank: int, vpp: int, count: int, group: int | None, merged: bool, depth: int
) -> tuple[tuple[int | None, int | None], ...]:
    """`pipeline_steps` as (forward chunk, backward chunk) pairs; cached, since the layout search
    walks the memory of thousands of candidates over a few dozen distinct programs."""
    return tuple(
        (
            None if s.forward is None else s.forward.chunk,
            None if s.backward is None else s.backward.chunk,
        )
        for s in pipeline_steps(pp, rank, vpp, count, group, merged, depth)
    )


def steady_microbatches(pp: int, vpp: int, group: int | None, count: int, warmup_depth: int) -> int:
    """As few micro-batches as give a `count`-micro-batch program's memory walk the same peak:
    whole groups of the interleaved table covering the warm-up (at most max(2, warmup_depth) x PP +
    (VPP - 1) x group forwards, one more merged) and two groups of steady steps, after which every
    group repeats the one before, plus the same last partial group as `count` (its chunks end the
    table)."""
    size = group or pp
    warmup = max(2, warmup_depth) * pp + (vpp - 1) * size + 1
    short = size * (-(-warmup // size) + 2) + count % size
    return min(count, short)


def rank_memory(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    cpu: bool = False,
    pp_rank: int | None = None,
    microbatches: int | None = None,
    gemm_precision: str | None = None,
) -> MemoryEstimate:
    """The peak of pipeline rank `pp_rank` (None: the rank whose peak is highest) over one step of
    `microbatches` micro-batches (None: the step's), by component (module docstring);
    `gemm_precision`: the planner's ("fp8" / "mxfp8": the linears keep FP8 copies of their inputs,
    `overlap.launch.activations.SAVED_INPUT_BYTES`; None: the run's own precision)."""
    plan = cfg.resolved.overlap
    merged = plan.overlap_moe_expert_parallel_comm
    # overlapped p2p in plain 1F1B: the first stage runs each backward's weight gradients after
    # its next task, the others right after the gradient's send (`overlap.pipeline.executor`)
    late = plan.overlap_p2p_comm and layout.pp > 1 and not merged and layout.vpp == 1
    ranks = range(max(1, layout.pp)) if pp_rank is None else (pp_rank,)
    programs = {r: program(cfg, layout, r, microbatches) for r in ranks}
    return peak_memory(
        cfg, layout, cpu, programs, merged, {0} if late else frozenset(), gemm_precision
    )


@dataclass(frozen=True)
class Fit:
    """The verdict of one rank's peak against its GPU: the memory, the reserve held back, what is
    left (negative: short by that much), and what would make it fit (each with what it saves)."""

    gpu: str
    device_bytes: int
    peak_bytes: int
    reserve_bytes: int
    advice: tuple[str, ...] = ()

    @property
    def margin_bytes(self) -> int:
        return self.device_bytes - self.peak_bytes - self.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.margin_bytes >= 0

    def describe(self) -> str:
        head = (
            f"{gib(self.peak_bytes)} + a reserve of {gib(self.reserve_bytes)} (CUDA context, "
            f"NCCL buffers, {RESERVE_SHARE:.0%} allocator fragmentation) on {self.gpu.upper()}'s "
            f"{gib(self.device_bytes)}: "
        )
        if self.fits:
            return head + f"fits, {gib(self.margin_bytes)} to spare"
        return (
            head
            + f"does NOT fit, short by {gib(-self.margin_bytes)}"
            + "".join(f"\n    - {a}" for a in self.advice)
        )


def reserve_bytes(peak: int) -> int:
    """What is held back beside the peak: the CUDA context, NCCL's buffers, the allocator's
    fragmentation."""
    return RESERVE_FIXED + int(RESERVE_SHARE * peak)


def fit(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    gpu: str,
    est: MemoryEstimate | None = None,
    gemm_precision: str | None = None,
) -> Fit | None:
    """`rank_memory`'s peak (`est`, when the caller has it) against `gpu`'s memory (None for a GPU
    type without a known size, or CPU ranks); the advice prices each alternative with the same
    model (`gemm_precision`: `rank_memory`'s)."""
    device = GPU_MEMORY_BYTES.get(gpu)
    if device is None:
        return None
    est = est or rank_memory(cfg, layout, gemm_precision=gemm_precision)
    verdict = Fit(gpu, device, est.total, reserve_bytes(est.total))
    if verdict.fits:
        return verdict
    return replace(verdict, advice=tuple(_advice(cfg, layout, est, gemm_precision)))


def _advice(
    cfg: ConfigContainer, layout: ParallelLayout, est: MemoryEstimate, gemm_precision: str | None
) -> list[str]:
    """Each alternative the model can price on this layout, with the peak it would have; then the
    layout changes (more pipeline stages, a larger EP group), which need a new layout."""
    m = cfg.resolved.model
    options: list[tuple[str, ConfigContainer]] = []
    recomputed = set(m.recompute_modules or ()) if m.recompute_granularity == "selective" else set()
    for modules in (["moe_act"], ["moe_act", "layernorm"], ["core_attn", "mlp"]):
        if m.recompute_granularity == "full" or set(modules) <= recomputed:
            continue
        if "moe_act" in modules and not m.is_moe:
            continue
        chosen = sorted(recomputed | set(modules))
        options.append(
            (
                "model.recompute_granularity=selective "
                f"model.recompute_modules=[{','.join(chosen)}]",
                _with_model(cfg, recompute_granularity="selective", recompute_modules=chosen),
            )
        )
    o, prec = cfg.resolved.overlap, cfg.resolved.precision
    if not o.use_distributed_optimizer and layout.dp * max(1, layout.cp) > 1:  # shards over DP x CP
        sharded = replace(o, use_distributed_optimizer=True)
        options.append(("ddp.use_distributed_optimizer=true", _resolved_with(cfg, overlap=sharded)))
    if prec.grad_reduce_in_fp32:
        plain = replace(prec, grad_reduce_in_fp32=False)
        options.append(
            ("mixed_precision.grad_reduce_in_fp32=false", _resolved_with(cfg, precision=plain))
        )
    if o.p2p_warmup_depth > 1:
        # overlapped 1F1B's deeper warm-up: slack for its transfers bought with micro-batches alive
        shallow = replace(o, p2p_warmup_depth=1)
        options.append(("comm_overlap.p2p_warmup_depth=1", _resolved_with(cfg, overlap=shallow)))
    if cfg.train.micro_batch_size > 1:
        cut = replace(cfg.train, micro_batch_size=1)
        options.append(("-mb 1", _with(cfg, train=cut)))
    if m.moe_expert_rank_capacity_factor is not None:
        # the sync-free dispatch's padded blocks: memory bought to avoid the host reads (its paged
        # stash goes with it)
        stash = " model.moe_paged_stash=false" if m.moe_paged_stash else ""
        options.append(
            (
                f"model.moe_expert_rank_capacity_factor=null{stash} (dropless all-to-all: unpadded "
                "rows, the split sizes read on the host per MoE layer and micro-batch)",
                _with_model(
                    cfg,
                    moe_expert_rank_capacity_factor=None,
                    moe_paged_stash=False,
                    moe_paged_stash_buffer_size_factor_cuda=PAGED_STASH_POOL,
                ),
            )
        )
    advice = []
    for flag, alternative in options:
        peak = rank_memory(alternative, layout, gemm_precision=gemm_precision).total
        if peak < est.total:
            advice.append(f"{flag}: {gib(peak)} (saves {gib(est.total - peak)})")
    share = est.param_bytes + est.grad_bytes + est.optimizer_bytes + est.activation_bytes
    advice.append(
        f"more pipeline stages (-pp): parameters, gradients, optimizer state and activations "
        f"({gib(share)} here) divide over the stages"
    )
    if m.is_moe:
        advice.append(
            f"a larger expert-parallel group (-ep): the routed experts' {est.expert_params:,} "
            "parameters and their gradients and optimizer state divide over it"
        )
    return advice


def _with(cfg: ConfigContainer, **sections) -> ConfigContainer:
    """`cfg` with sections replaced, its resolution (the overlap plan) kept."""
    return replace(cfg, **sections)


def _with_model(cfg: ConfigContainer, **fields) -> ConfigContainer:
    return _resolved_with(cfg, model=replace(cfg.resolved.model, **fields))


def _resolved_with(cfg: ConfigContainer, **parts) -> ConfigContainer:
    """`cfg` with parts of its resolution replaced (the estimate reads the resolved distributed
    optimizer and precision, not the sections)."""
    return replace(cfg, _resolution=replace(cfg.resolved, **parts))
