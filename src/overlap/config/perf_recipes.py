"""What Megatron-Bridge's performance harness builds for a model, GPU and precision: the settings of
its perf recipes, as data, which `overlap.harness` applies the same way.

Bridge's `scripts/performance/run_script.py` picks a flat recipe by name -
`{model}_pretrain_{N}gpu_{gpu}_{precision}_config` in `src/megatron/bridge/perf_recipes/` - built on
the library recipe, then `_benchmark_common` (50 iterations, bf16 gradient reduction, RoPE fusion,
...), then the command line's flags and overrides. Here the model recipe (`overlap.config.recipes`)
is the library recipe and this table is the perf layer: each entry's settings are applied after the
harness flags (a setting a flag wrote is left to the flag) and before the overrides, each a row in
the decision table naming the Bridge recipe it came from. The parallel layout and the batch sizes
are the published run's, applied when `-ng` is its GPU count; at another count the model recipe's
layout rule stays (Bridge would take its largest recipe and scale the batch).

What the runtime cannot carry is listed per entry (`not_carried`) and shown, not applied: HybridEP
and DeepEP dispatch, CUDA graphs, Megatron-FSDP, Transformer Engine's own fusions (ours have no
switch: the cross-entropy is always the chunked one, `overlap.layers.cross_entropy`). Where we
differ on purpose the README says so.

Read from NVIDIA-NeMo/Megatron-Bridge at 067f987df (2026-08-22): `perf_recipes/_common.py`
(`_benchmark_common`, `_perf_precision`, `_enable_overlap_param_gather_with_optimizer_step`),
`perf_recipes/{qwen,llama}/<gpu>/*.py`, `scripts/performance/run_script.py`; the model bridges
(`models/model_bridge.py`, `models/llama/llama_bridge.py`) for what every converted model gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

SOURCE = "Megatron-Bridge perf_recipes @067f987df"


class Setting(NamedTuple):
    """One setting of a perf recipe: `key=value` as an override writes it, why, and (optional) why
    it does not apply to this command's layout (a function of the config after the flags, None
    where it applies): a setting that would do nothing here, or that the layout the flags chose
    cannot take, is listed, not applied."""

    key: str
    value: str
    why: str
    skip: Callable[[Any], str | None] | None = None


def _released_outputs(cfg: Any) -> str | None:
    """deallocate_pipeline_outputs: nothing to release at PP 1, and not built with EP overlap
    under PP (`overlap.training.runtime_refusals`)."""
    if _pp(cfg) == 1:
        return "PP = 1: there is no pipeline send to release"
    co = cfg.comm_overlap
    if co is not None and co.overlap_moe_expert_parallel_comm:
        return "releasing sent outputs under EP overlap with PP > 1 is not built here"
    return None


def _ep_overlap_layout(cfg: Any) -> str | None:
    """EP overlap needs EP > 1 and, under PP, a virtual pipeline (Megatron's rules): the layout the
    command line chose may have neither."""
    if cfg.model.expert_model_parallel_size <= 1:
        return "this layout has EP 1: there is no all-to-all to overlap"
    if _pp(cfg) > 1 and not cfg.model.virtual_pipeline_model_parallel_size:
        return "this layout has PP > 1 without VPP, where EP overlap cannot interleave"
    return None


def _pp(cfg: Any) -> int:
    return cfg.model.pipeline_model_parallel_size


# _benchmark_common and run_script for every BF16 perf recipe
_COMMON = (
    ("train.train_iters", "50", "_benchmark_common: 50 iterations"),
    ("scheduler.lr_warmup_iters", "10", "_benchmark_common"),
    ("scheduler.lr_decay_iters", "50", "_benchmark_common"),
    ("logger.log_interval", "1", "_benchmark_common"),
    ("ddp.check_for_nan_in_grad", "false", "_benchmark_common: NaN checks off"),
    (
        "mixed_precision.grad_reduce_in_fp32",
        "false",
        "_perf_precision: bf16_mixed with gradients reduced in bf16",
    ),
    Setting(
        "model.deallocate_pipeline_outputs",
        "true",
        "every model Bridge converts from Hugging Face "
        "(model_bridge.hf_config_to_model_config_kwargs)",
        _released_outputs,
    ),
)
_FUSIONS_DEFAULT = (
    "the default here: unset, the elementwise fusions are compiled on CUDA "
    "(overlap.config.fusion), and this machine's toolchain is checked where the run is"
)
_COMMON_NOT_CARRIED = (
    ("model.apply_rope_fusion=true", _FUSIONS_DEFAULT),
    ("model.cross_entropy_fusion_impl=te", "the cross-entropy is always the chunked one here"),
    ("train.manual_gc=true (interval 100)", "Python's collector runs as configured by Python"),
    (
        "optimizer.use_precision_aware_optimizer=true",
        "run_script forces it for bf16 + Adam; here master weights and moments are fp32 as its "
        "defaults keep them, with no switch",
    ),
)
_MOE = (("model.moe_router_force_load_balancing", "true", "every MoE perf recipe"),)
_BIAS_ACTIVATION = ("model.bias_activation_fusion=true", _FUSIONS_DEFAULT)
_MOE_NOT_CARRIED = (
    _BIAS_ACTIVATION,
    ("model.moe_router_fusion=true", "the router's fp32 top-k has no separate fused kernel here"),
)
_ENV_COMMON = (
    ("TORCH_NCCL_HIGH_PRIORITY", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("NCCL_GRAPH_REGISTER", "0"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    ("TORCH_NCCL_AVOID_RECORD_STREAMS", "1"),
)


@dataclass(frozen=True)
class PerfRecipe:
    """One Bridge perf recipe: its name, the GPU count it was published for, the layout and batch
    (applied at that count), the other settings, the environment it sets, the environment its
    HybridEP dispatcher needs (applied only where that dispatcher is what runs: the user chose it,
    and the run then refuses it), and what the runtime cannot carry (setting, why)."""

    name: str
    num_gpus: int
    layout: tuple[tuple[str, str], ...]
    settings: tuple[Setting | tuple[str, str, str], ...]
    env: tuple[tuple[str, str], ...]
    not_carried: tuple[tuple[str, str], ...] = ()
    hybridep_env: tuple[tuple[str, str], ...] = ()


def _layout(tp, pp, vpp, cp, ep, gbs, mbs, seq) -> tuple[tuple[str, str], ...]:
    out = [
        ("model.tensor_model_parallel_size", str(tp)),
        ("model.sequence_parallel", "true" if tp > 1 else "false"),
        ("model.pipeline_model_parallel_size", str(pp)),
        ("model.virtual_pipeline_model_parallel_size", str(vpp) if vpp else "null"),
        ("model.context_parallel_size", str(cp)),
        ("train.global_batch_size", str(gbs)),
        ("train.micro_batch_size", str(mbs)),
        ("model.seq_length", str(seq)),
    ]
    if ep:
        out.append(("model.expert_model_parallel_size", str(ep)))
    return tuple(out)


def _env(cdmc: int | None, margin: int, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """A recipe's environment; `cdmc` None where it belongs to the HybridEP dispatcher
    (`_hybridep_env`)."""
    connections = () if cdmc is None else (("CUDA_DEVICE_MAX_CONNECTIONS", str(cdmc)),)
    return (
        *connections,
        ("NVTE_FWD_LAYERNORM_SM_MARGIN", str(margin)),
        ("NVTE_BWD_LAYERNORM_SM_MARGIN", str(margin)),
        *_ENV_COMMON,
        *extra,
    )


def _hybridep_env(domain: int, chunk: int | None = None) -> tuple[tuple[str, str], ...]:
    """What a HybridEP recipe's environment sets for its dispatcher: 32 connections (the rule for
    DeepEP / HybridEP) and the NVLink-domain variables."""
    out = [
        ("CUDA_DEVICE_MAX_CONNECTIONS", "32"),
        ("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN", "8"),
        ("NVLINK_DOMAIN_SIZE", str(domain)),
        ("USE_MNNVL", "1" if domain > 8 else "0"),
    ]
    if chunk is not None:
        out.append(("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API", str(chunk)))
    return tuple(out)


_PARAM_GATHER_IN_STEP = (
    "comm_overlap.overlap_param_gather_with_optimizer_step=true",
    "_enable_overlap_param_gather_with_optimizer_step (PP > 1 and VPP > 1): here the parameter "
    "gather always launches its first bucket inside the optimizer step, so the switch would do "
    "nothing",
)
_HYBRIDEP = (
    "model.moe_token_dispatcher_type=flex model.moe_flex_dispatcher_backend=hybridep",
    "HybridEP kernels are not built here: the all-to-all dispatcher runs (the MoE guide's command "
    "passes --moe_flex_dispatcher_backend None for the same)",
)


def _graphs(scope: str) -> tuple[str, str]:
    return (
        f"model.cuda_graph_impl=transformer_engine model.cuda_graph_scope=[{scope}]",
        "CUDA graphs are not built here: none (the MoE guide's command passes "
        "--cuda_graph_impl none)",
    )


_QWEN30_EP_OVERLAP = (
    Setting(
        "comm_overlap.overlap_moe_expert_parallel_comm",
        "true",
        "since 7ded17dae (2026-07-25): EP overlap on",
        _ep_overlap_layout,
    ),
    Setting("comm_overlap.delay_wgrad_compute", "false", "since 7ded17dae"),
)


def _llama3_70b(gpu: str, tp: int, cdmc: int, graphs: tuple) -> PerfRecipe:
    """Llama3-70B's 64-GPU recipe on Hopper and B200: TP PP4 VPP5 CP2 with TP overlap and the GPU's
    userbuffers preset."""
    return PerfRecipe(
        f"llama3_70b_pretrain_64gpu_{gpu}_bf16_config",
        64,
        _layout(tp, 4, 5, 2, None, 256, 1, 8192),
        _COMMON
        + (
            ("comm_overlap.tp_comm_overlap", "true", "TP overlap on"),
            (
                "comm_overlap.tp_comm_overlap_cfg",
                f"userbuffers_bf16_{gpu}_h8192_tp{tp}_mbs1_seqlen8192",
                f"the {gpu.upper()} TP{tp} preset",
            ),
        ),
        _env(cdmc, 20, ("NCCL_P2P_NET_CHUNKSIZE", "2097152")),
        _COMMON_NOT_CARRIED + (_BIAS_ACTIVATION, _PARAM_GATHER_IN_STEP) + graphs,
    )


PERF_RECIPES: dict[tuple[str, str, str], tuple[PerfRecipe, ...]] = {
    ("qwen3_30b_a3b", "h100", "bf16"): (
        PerfRecipe(
            "qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config",
            16,
            _layout(1, 1, None, 1, 16, 1024, 1, 4096),
            _QWEN30_EP_OVERLAP + _COMMON + _MOE,
            _env(None, 10),
            _COMMON_NOT_CARRIED
            + _MOE_NOT_CARRIED
            + (_HYBRIDEP, _graphs("moe_router,moe_preprocess")),
            _hybridep_env(8, 64),
        ),
    ),
    **{
        ("qwen3_30b_a3b", gpu, "bf16"): (
            PerfRecipe(
                f"qwen3_30b_a3b_pretrain_8gpu_{gpu}_bf16_config",
                8,
                _layout(1, 1, None, 1, 8, 512, mbs, 4096),
                _COMMON + _MOE,
                _env(None, 20),
                _COMMON_NOT_CARRIED + _MOE_NOT_CARRIED + (_HYBRIDEP, _graphs(scope)),
                _hybridep_env(domain, 128),
            ),
        )
        for gpu, mbs, scope, domain in (
            ("b200", 4, "attn,moe_router,moe_preprocess", 8),
            ("gb200", 4, "attn,moe_router,moe_preprocess", 72),
            ("b300", 8, "moe_router,moe_preprocess", 8),
            ("gb300", 8, "moe_router,moe_preprocess", 72),
        )
    },
    ("qwen3_235b_a22b", "h100", "bf16"): (
        PerfRecipe(
            "qwen3_235b_a22b_pretrain_256gpu_h100_bf16_config",
            256,
            _layout(2, 8, 4, 1, 32, 8192, 1, 4096),
            (
                ("comm_overlap.tp_comm_overlap", "false", "TP overlap off at TP2"),
                Setting(
                    "comm_overlap.overlap_moe_expert_parallel_comm",
                    "true",
                    "EP overlap on",
                    _ep_overlap_layout,
                ),
                Setting(
                    "comm_overlap.delay_wgrad_compute",
                    "true",
                    "with delayed weight gradients",
                    _ep_overlap_layout,
                ),
            )
            + _COMMON
            + _MOE,
            _env(8, 16),
            _COMMON_NOT_CARRIED + _MOE_NOT_CARRIED + (_PARAM_GATHER_IN_STEP,),
        ),
    ),
    ("qwen3_235b_a22b", "b200", "bf16"): (
        PerfRecipe(
            "qwen3_235b_a22b_pretrain_256gpu_b200_bf16_config",
            256,
            _layout(1, 8, 4, 1, 8, 8192, 1, 4096),
            _COMMON + _MOE,
            _env(32, 16),
            _COMMON_NOT_CARRIED + _MOE_NOT_CARRIED + (_PARAM_GATHER_IN_STEP,),
        ),
    ),
    **{
        ("qwen3_235b_a22b", gpu, "bf16"): (
            PerfRecipe(
                f"qwen3_235b_a22b_pretrain_256gpu_{gpu}_bf16_config",
                256,
                _layout(1, pp, None, 1, ep, 8192, mbs, 4096),
                _COMMON + _MOE,
                _env(None, 20),
                _COMMON_NOT_CARRIED + _MOE_NOT_CARRIED + (_HYBRIDEP,) + graphs,
                _hybridep_env(domain),
            ),
        )
        for gpu, pp, ep, mbs, graphs, domain in (
            ("gb200", 8, 8, 1, (_graphs("attn,moe_router,moe_preprocess"),), 72),
            ("b300", 8, 8, 2, (), 8),
            ("gb300", 4, 32, 2, (_graphs("attn,moe_router,moe_preprocess"),), 72),
        )
    },
    ("llama3_8b", "h100", "bf16"): (
        PerfRecipe(
            "llama3_8b_pretrain_8gpu_h100_bf16_config",
            8,
            _layout(1, 1, None, 2, None, 128, 1, 8192),
            _COMMON,
            _env(1, 20),
            _COMMON_NOT_CARRIED + (_BIAS_ACTIVATION,),
        ),
    ),
    **{
        ("llama3_8b", gpu, "bf16"): (
            PerfRecipe(
                f"llama3_8b_pretrain_8gpu_{gpu}_bf16_config",
                8,
                _layout(1, 1, None, 1, None, 128, mbs, 8192),
                _COMMON,
                _env(32, 20),
                _COMMON_NOT_CARRIED
                + (_BIAS_ACTIVATION,)
                + (
                    (
                        "model.cuda_graph_impl=local model.cuda_graph_scope=[full_iteration]",
                        "CUDA graphs are not built here: none",
                    ),
                ),
            ),
        )
        for gpu, mbs in (("b200", 2), ("gb200", 2), ("b300", 4), ("gb300", 4))
    },
    ("llama3_70b", "h100", "bf16"): (_llama3_70b("h100", 4, 1, ()),),
    ("llama3_70b", "b200", "bf16"): (
        _llama3_70b(
            "b200",
            2,
            32,
            (
                (
                    "model.cuda_graph_impl=local model.cuda_graph_scope=[full_iteration]",
                    "CUDA graphs are not built here: none",
                ),
            ),
        ),
    ),
}
"""(model recipe, -g, -c) -> Bridge's perf recipes for it (one per published GPU count). Not listed,
so not applied: Llama3-70B on GB200 / B300 / GB300 (Megatron-FSDP at TP1 with activation offload,
not built here), Qwen3-8B (Bridge has no perf recipe for it), FP8 precisions (not built)."""


LAYOUT_KEYS = (
    "model.tensor_model_parallel_size",
    "model.sequence_parallel",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.context_parallel_size",
    "model.expert_model_parallel_size",
    "model.expert_tensor_parallel_size",
    "model.pipeline_model_parallel_layout",
    "model.account_for_embedding_in_pipeline_split",
    "model.account_for_loss_in_pipeline_split",
)
"""The keys that make a layout: a command line that sets any of them chooses its own, and the perf
recipe's layout is not applied (its batch sizes and sequence length still are)."""


def perf_recipe(model: str, gpu: str, precision: str | None, num_gpus: int) -> PerfRecipe | None:
    """The perf recipe for this model, GPU and precision: the one published for `num_gpus`, else the
    largest (Bridge's default); None when Bridge has none."""
    recipes = PERF_RECIPES.get((model, gpu, precision or ""), ())
    if not recipes:
        return None
    exact = [r for r in recipes if r.num_gpus == num_gpus]
    return exact[0] if exact else max(recipes, key=lambda r: r.num_gpus)
