"""One configuration's predicted step: compute (compute.py) + communication (comm_model.py) laid out
by the schedule (step_times.py), plus the per-GPU peak memory (`overlap.perf.memory_model`, the
model `overlap explain` and the dry run report).

`calibrate_efficiency` fits one measured run: the compute efficiency (the per-kernel overhead
kept) that makes the configuration's predicted step time equal its measured one (bisection; the
step time falls monotonically with the efficiency).
Everything an overlap switch changes is then the communication model's and the schedule's doing.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.config.container import ConfigContainer
from overlap.errors import ConfigError, check_rules
from overlap.kernels.attention import attention_kernel
from overlap.launch.resources import MemoryEstimate
from overlap.layout import ParallelLayout
from overlap.perf.memory_model import fit, rank_memory
from overlap.plan.comm_model import CommPlan, comm_plan, microbatches
from overlap.plan.compute import microbatch_compute
from overlap.plan.hardware import Cluster, with_efficiency
from overlap.plan.step_times import StepTimes, Switches, step_times
from overlap.training.metrics import flops_per_token


@dataclass
class Prediction:
    """A configuration's predicted step on the cluster."""

    name: str
    overrides: list[str]
    times: StepTimes
    comm: CommPlan
    switches: Switches
    tflops_per_gpu: float
    peak_mem_bytes: int
    layout: ParallelLayout
    microbatches: int
    # whether the peak fits the GPU, with its reserve and advice (`overlap.perf.memory_model.fit`)
    fit: str | None = None

    @property
    def step_ms(self) -> float:
        return self.times.total_s * 1e3


def switches_of(cfg: ConfigContainer, layout: ParallelLayout) -> Switches:
    m, o = cfg.resolved.model, cfg.resolved.overlap
    return Switches(
        overlap_moe_expert_parallel_comm=o.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=o.delay_wgrad_compute,
        overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather,
        overlap_p2p_comm=o.overlap_p2p_comm,
        pp=max(1, layout.pp),
        vpp=layout.vpp,
        vp_group=m.microbatch_group_size_per_vp_stage,
        moe_shared_expert_overlap=o.moe_shared_expert_overlap,
        cp_comm_overlap=o.cp_comm_overlap,
        p2p_warmup_depth=o.p2p_warmup_depth,
    )


def check_priced(cfg: ConfigContainer, layout: ParallelLayout, gpu: bool = True) -> None:
    """Refuse what the model would price as another configuration, silently: it prices our runtime
    (not the PyTorch peers `overlap bench` measures beside it), the experts sharded over EP only,
    no multi-token-prediction layers, full recompute of every layer, the alltoall and flex
    dispatchers, and on a GPU the fused elementwise chains and FlashAttention-class attention
    (`gpu`: the cluster is one; a -g cpu profile measures this machine's own kernels)."""
    m, kernels = cfg.resolved.model, cfg.resolved.kernels
    peers = (
        "the planner prices this runtime; the PyTorch peers are measured beside it with "
        "`overlap bench`"
    )
    check_rules(
        [
            (
                "model.pipeline_impl",
                m.pipeline_impl,
                m.pipeline_impl == "overlap",
                f"{peers} (torch.distributed.pipelining batches and waits its p2p).",
                "plan with model.pipeline_impl=overlap.",
            ),
            (
                "model.tensor_parallel_impl",
                m.tensor_parallel_impl,
                m.tensor_parallel_impl == "overlap",
                f"{peers}.",
                "plan with model.tensor_parallel_impl=overlap.",
            ),
            (
                "ddp.impl",
                cfg.ddp.impl,
                cfg.ddp.impl == "overlap",
                f"{peers} (FSDP2 shards the parameters, a memory and traffic the model does not "
                "price).",
                "plan with ddp.impl=overlap.",
            ),
            (
                "model.expert_tensor_parallel_size",
                layout.etp,
                layout.etp <= 1,
                "the planner prices the experts unsharded within EP (expert tensor parallelism "
                "is not modelled, nor built by `overlap run`).",
                "plan with -et 1 (TP still shards the dense layers).",
            ),
            (
                "model.mtp_num_layers",
                m.mtp_num_layers,
                not m.mtp_num_layers,
                "the planner has no cost for multi-token-prediction layers (nor does `overlap "
                "run` build them).",
                "plan with model.mtp_num_layers=null: the step without the MTP layers.",
            ),
            (
                "model.recompute_num_layers",
                m.recompute_num_layers,
                not (
                    m.recompute_granularity == "full"
                    and m.recompute_method == "block"
                    and m.recompute_num_layers
                    < max(s.num_layers for s in cfg.resolved.pipeline.stages)
                ),
                "block recompute of only part of a stage's layers: the planner prices full "
                "recompute as every layer's forward run again.",
                "plan with model.recompute_method=uniform, or recompute_num_layers at least a "
                "stage's layers.",
            ),
            (
                "model.moe_token_dispatcher_type",
                kernels.moe_token_dispatcher_type,
                not m.is_moe or kernels.moe_token_dispatcher_type in ("alltoall", "flex"),
                "the planner prices the alltoall and flex dispatchers' traffic, not allgather's "
                "(every rank's tokens gathered; nor does `overlap run` build it).",
                "plan with model.moe_token_dispatcher_type=alltoall or flex.",
            ),
            *(
                (
                    f"model.{name}",
                    False,
                    # asked off (None is CUDA's fused kernel, whatever this resolution's target)
                    not gpu or getattr(m, name) is not False,
                    f"the planner prices {what} on a GPU; {instead} are not priced.",
                    f"plan with model.{name}=true (or leave it unset).",
                )
                for name, what, instead in (
                    (
                        "rms_norm_fusion",
                        "the fused RMSNorm",
                        "the eager chain's kernels and passes",
                    ),
                    ("apply_rope_fusion", "the fused RoPE", "the eager chain's kernels and passes"),
                    (
                        "bias_activation_fusion",
                        "the fused gated activation",
                        "the eager chain's kernels and passes",
                    ),
                    (
                        "moe_permute_fusion",
                        "the fused token permutation",
                        "the per-expert loop's host syncs",
                    ),
                )
                if name != "moe_permute_fusion" or m.is_moe
            ),
            (
                "model.attention_backend",
                m.attention_backend,
                not gpu
                or attention_kernel(
                    m.attention_backend, True, cfg.resolved.precision.params_dtype, m.seq_length
                )[0]
                != "unfused",
                "the planner prices the attention core as FlashAttention on a GPU; the unfused "
                "kernel's two GEMMs and fp32 softmax are not priced (its memory is).",
                "plan with model.attention_backend=auto, flash or fused.",
            ),
        ]
    )


def predict(
    name: str,
    overrides: list[str],
    cfg: ConfigContainer,
    layout: ParallelLayout,
    cluster: Cluster,
    exact: bool = True,
    memory: MemoryEstimate | None = None,
) -> Prediction:
    """The predicted step of `cfg` on `layout` and `cluster`; `exact=False` (the layout search)
    extrapolates a long pipeline program from short ones (`pipeline_sim.simulate`); `memory`: the
    peak `rank_memory` gives for `cfg` on this cluster, where the caller has it (the search walks
    it before pricing)."""
    check_priced(cfg, layout, gpu=cluster.gpu != "cpu")
    compute = microbatch_compute(cfg, layout, cluster)
    comm = comm_plan(cfg, layout, cluster)
    sw = switches_of(cfg, layout)
    m = microbatches(cfg, layout)
    times = step_times(compute, comm, sw, m, cluster.overlap_slowdown, exact)
    tokens = cfg.train.global_batch_size * cfg.resolved.model.seq_length
    tflops = flops_per_token(cfg.resolved.model) * tokens / layout.world_size / times.total_s / 1e12
    memory = memory or rank_memory(
        cfg, layout, cpu=cluster.gpu == "cpu", gemm_precision=cluster.precision
    )
    verdict = fit(cfg, layout, cluster.gpu, memory, cluster.precision)
    return Prediction(
        name,
        overrides,
        times,
        comm,
        sw,
        tflops,
        memory.total,
        layout,
        m,
        verdict.describe() if verdict else None,
    )


def calibrate_efficiency(
    cfg: ConfigContainer, layout: ParallelLayout, cluster: Cluster, measured_ms: float, source: str
) -> Cluster:
    """The cluster with the compute efficiency at which `cfg`'s predicted step equals
    `measured_ms`."""

    def step_ms(eff: float) -> float:
        return predict(
            "calibration", [], cfg, layout, with_efficiency(cluster, eff, source)
        ).step_ms

    lo, hi = 1e-6, 1.0
    if step_ms(hi) > measured_ms:
        raise ConfigError(
            "calibration",
            measured_ms,
            "even at 100% of the peak the predicted step is longer: the communication model alone "
            "exceeds the measured time.",
            "check the cluster's link figures (--cluster) against the measured run.",
        )
    for _ in range(60):
        mid = (lo * hi) ** 0.5
        if step_ms(mid) > measured_ms:
            lo = mid
        else:
            hi = mid
    return with_efficiency(cluster, hi, source)
