"""The planner against published runs: two numbers per GPU type, fitted on stated rows, and every
row predicted by a fit that did not see it.

`python -m overlap.plan.validate` prints the table docs/planner.md carries, from the rows' linear
models stored in `overlap.plan.fitted`; `--write` first takes them again (under a minute) and
regenerates that module (the fits `overlap plan` uses, with their expected error).

Rows (`ROWS`): Megatron-Bridge's performance summary (step time = GBS x seq / (tokens/s/GPU x GPUs))
and the MoE comm-overlap skill's measured on/off pairs. Each row says what we assumed where the
source does not say it (dispatcher, EP overlap, CUDA graphs: the row's release's perf recipe) and
how it is expressed; a row the configuration cannot express is listed with the reason and not
predicted.

Fitted (`overlap.plan.compute`): the compute efficiency and the per-kernel overhead. Near a point a
row's predicted step is a + b / efficiency + c x overhead (`Linear`, by finite differences, taken
at its group's fit); a group's fit minimizes the sum of |log(predicted / published)| over its rows
(least absolute deviation: robust to a run from an older software release). Groups: `h100` (H100
rows) and `blackwell` (B200, GB200 and GB300 rows: one die family, their peaks and SMs already
differ). Blackwell takes the per-kernel overhead of the H100 fit on all H100 rows (`OVERHEAD_FROM`;
a host-side cost, fitted on no Blackwell row; six of its eleven rows run full-iteration CUDA
graphs, which launch without it) and fits its efficiency alone, the median of its rows' own.
Validation: leave-one-out within the group, both numbers re-fitted without the row (the runs of an
on/off pair are left out together, so a pair's ratio is predicted by rows that include none of
it), and the row predicted by the full model at that fit; the shipped fit uses all the group's
rows.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from pprint import pformat

from overlap.files import write_replace
from overlap.plan.hardware import Efficiency, builtin_cluster
from overlap.plan.predict import predict

WITHIN = 0.20  # a row is "within" when |predicted / published - 1| <= 20%
RATIO_WITHIN = 0.03  # an on/off pair's ratio within 0.03 of the published one (issue 53)
GROUPS = {"h100": "h100", "b200": "blackwell", "gb200": "blackwell", "gb300": "blackwell"}
# Where each group's per-kernel overhead is fitted: with its efficiency on its own rows, or (too
# few rows to fit two numbers apart) taken from another group's fit on all that group's rows.
OVERHEAD_FROM = {"h100": "h100", "blackwell": "h100"}
START = (0.6, 10e-6)  # (efficiency, per-kernel overhead) of the first linearization
TAU_STEP_S = 5e-6  # the finite difference in the overhead
MAX_ROUNDS = 8  # linearizations before `solve_linear` gives up on a fit that keeps moving
_QWEN30 = "-m qwen -mr qwen3_30b_a3b"
_QWEN235 = "-m qwen -mr qwen3_235b_a22b"
# GPT-OSS-120B (openai/gpt-oss-120b config.json) on the Qwen3-MoE recipe's structure: 36 layers,
# hidden 2880, 64 query / 8 KV heads of 64, 128 experts of 2880 top-4, vocabulary 201088, no QK
# norm. Its sliding-window layers and attention sinks are not expressed (Megatron's FLOPs count,
# which the published TFLOP/s use, ignores them too).
_GPT_OSS = (
    "model.num_layers=36 model.hidden_size=2880 model.num_attention_heads=64 "
    "model.num_query_groups=8 model.kv_channels=64 model.ffn_hidden_size=2880 "
    "model.moe_ffn_hidden_size=2880 model.moe_router_topk=4 model.vocab_size=201088 "
    "model.qk_layernorm=false"
)


@dataclass(frozen=True)
class Row:
    """One published run and how the plan expresses it."""

    name: str
    gpu: str
    precision: str  # the plan's: bf16 | fp8 | mxfp8
    published_s: float
    flags: str  # harness flags (the config is resolved at -c bf16; `precision` is the plan's)
    overrides: str = ""
    source: str = "Bridge performance summary"
    # what the source does not say and we chose, or how an inexpressible part is approximated
    assumed: str = ""
    pair: str = ""  # on/off pairs: the pair's name; "off" rows end in " off"
    not_expressible: str = ""  # why it is not predicted

    def args(self) -> list[str]:
        return f"{self.flags} -c bf16 {self.overrides}".split()


def _row(name, gpu, prec, n, gbs, mbs, seq, tp, pp, vp, ep, step, model, extra="", **kw) -> Row:
    # GB200 / GB300 NVL72 racks run 64 of their GPUs in these recipes
    gpn = (72 if n % 72 == 0 else 64 if n % 64 == 0 else 8) if gpu in ("gb200", "gb300") else 8
    flags = (
        f"{model} -g {gpu} -ng {n} -gn {gpn} -tp {tp} -pp {pp} -vp {vp or 'None'} -ep {ep} -gb "
        f"{gbs} -mb {mbs} -sl {seq}"
    )
    return Row(name, gpu, prec, step, flags, extra, **kw)


_EP_OFF = "comm_overlap.overlap_moe_expert_parallel_comm=false"
_EP_ON = "comm_overlap.overlap_moe_expert_parallel_comm=true"
_A2A = "model.moe_token_dispatcher_type=alltoall"
_HYBRID = "--moe_flex_dispatcher_backend hybridep"
_GUIDE = "Bridge MoE comm-overlap skill (alltoall pair)"
_SKILL = "Bridge MoE comm-overlap skill (HybridEP pair)"
# What Bridge's perf harness sets per GPU and precision (Megatron-Bridge
# scripts/performance/configs/qwen/qwen3_workload_base_configs.py): dispatcher, EP overlap
# (moe_a2a_overlap) and TE's scoped CUDA graphs.
_WORKLOAD = "Bridge's workload config for it"
_GRAPHS = "model.cuda_graph_impl=transformer_engine model.cuda_graph_scope="
_GRAPH_ROUTER = f"{_GRAPHS}[moe_router,moe_preprocess]"
_GRAPH_ATTN = f"{_GRAPHS}[attn,moe_router,moe_preprocess]"
_H100_30B_FP8 = (
    f"{_WORKLOAD} (FP8 H100, 16 GPUs): HybridEP, EP overlap off, no CUDA graphs; "
    "the same assumed for the older releases' PP2 layouts"
)
# Megatron-Bridge 55443cbfb (2026-06-10; the 26.06 release on) turned on for the GB200 / GB300
# MXFP8 Qwen3 recipes what `_enable_hybridep_full_iteration_mxfp8` sets at its HEAD
# (src/megatron/bridge/perf_recipes/qwen/common.py): full-iteration CUDA graphs, EP overlap with
# delay_wgrad (`moe_a2a_overlap`), the sync-free MoE buffers (`moe_expert_rank_capacity_factor`
# 1.5, paged stash, re-run on overflow), the CuTeDSL fused grouped-expert MLP and FP8 attention;
# HybridEP on 32 SMs throughout. The 26.04.01 rows ran before it, with TE's scoped graphs and EP
# overlap off (`qwen3_workload_base_configs.py` at 55443cbfb^).
_STACK = (
    f"{_HYBRID} {_EP_ON} comm_overlap.delay_wgrad_compute=true model.cuda_graph_impl=local "
    "model.cuda_graph_scope=[full_iteration] model.moe_expert_rank_capacity_factor=1.5 "
    "model.moe_paged_stash=true model.moe_paged_stash_buffer_size_factor_cuda=1.2"
)
_STACK_ASSUMED = (
    "Bridge 55443cbfb's recipe: HybridEP (32 SMs), EP overlap + delay_wgrad, full-iteration CUDA "
    "graphs, sync-free MoE buffers at capacity factor 1.5 with the paged stash (a pool of 1.2x "
    "the routed rows; `overlap run` refuses both on SM100 today); its fused grouped MLP and FP8 "
    "attention not expressed"
)
# GPT-OSS-120B's GB200 / GB300 MXFP8 recipes (`_apply_gpt_oss_120b_full_iter_fp8mx_configs`,
# src/megatron/bridge/perf_recipes/gpt_oss/common.py): the same stack, and an FP8 output projection
_GPT_OSS_STACK = (
    "Bridge's recipe (perf_recipes/gpt_oss): HybridEP (32 SMs), EP overlap + delay_wgrad, "
    "full-iteration CUDA graphs, sync-free MoE buffers at capacity factor 1.5 with the paged "
    "stash (a pool of 1.2x the routed rows; `overlap run` refuses both on SM100 today), no "
    "recompute; its fused grouped MLP, FP8 attention and FP8 output projection not expressed"
)
_PRE_STACK = "release 26.04.01, before Bridge 55443cbfb: HybridEP (32 SMs), EP overlap off"
# the selective recompute Bridge's H100 workload configs set for Qwen3-235B-A22B and GPT-OSS-120B
# (`recompute_modules=["layernorm", "moe_act"]`, GPT-OSS's since its first config, v0.2.0 / 25.11)
_SELECTIVE = "model.recompute_granularity=selective model.recompute_modules=[layernorm,moe_act]"
# The performance summary's archive (Megatron-Bridge docs/performance-summary-archive.md,
# docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html): the H100 MoE runs
# at micro-batch > 1 (issue 53: the only published ones of the reference on Hopper).
_ARCHIVE = (
    "Bridge performance summary archive "
    "(docs.nvidia.com/nemo/megatron-bridge/latest/performance-summary-archive.html)"
)
# 25.09's H100 Qwen3-30B-A3B FP8 recipe (scripts/performance/configs/qwen3/
# qwen3_30b_a3b_llm_pretrain.py of that release): FP8 current scaling, the alltoall dispatcher
# (which its token drop requires), token drop on (`apply_moe_token_drop`: capacity factor 1.0,
# padded to capacity; the summary's "tokendrop"), EP overlap off (`moe_a2a` False), no CUDA
# graphs on H100
_TOKEN_DROP = "model.moe_expert_capacity_factor=1.0 model.moe_pad_expert_input_to_capacity=true"
_UNEVEN_235 = "the recipe's uneven layout (embedding and loss accounted as layers)"

ROWS: tuple[Row, ...] = (
    _row(
        "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap off",
        "h100",
        "bf16",
        16,
        1024,
        1,
        4096,
        1,
        1,
        None,
        16,
        41.25,
        _QWEN30,
        f"{_A2A} {_EP_OFF}",
        source=_GUIDE,
        pair="guide",
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap on",
        "h100",
        "bf16",
        16,
        1024,
        1,
        4096,
        1,
        1,
        None,
        16,
        31.31,
        _QWEN30,
        f"{_A2A} {_EP_ON}",
        source=_GUIDE,
        pair="guide",
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap + delay_wgrad",
        "h100",
        "bf16",
        16,
        1024,
        1,
        4096,
        1,
        1,
        None,
        16,
        31.20,
        _QWEN30,
        f"{_A2A} {_EP_ON} comm_overlap.delay_wgrad_compute=true",
        source=_GUIDE,
        pair="guide",
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap off",
        "h100",
        "bf16",
        16,
        1024,
        1,
        4096,
        1,
        1,
        None,
        16,
        24.714,
        _QWEN30,
        f"{_HYBRID} {_EP_OFF} {_GRAPH_ROUTER}",
        source=_SKILL,
        pair="hybridep",
        assumed=f"{_WORKLOAD} (BF16 H100): router and preprocess CUDA graphs",
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on",
        "h100",
        "bf16",
        16,
        1024,
        1,
        4096,
        1,
        1,
        None,
        16,
        20.992,
        _QWEN30,
        f"{_HYBRID} {_EP_ON} {_GRAPH_ROUTER}",
        source=_SKILL,
        pair="hybridep",
        assumed=f"{_WORKLOAD} (BF16 H100): router and preprocess CUDA graphs",
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 FP8 EP16",
        "h100",
        "fp8",
        16,
        1024,
        1,
        4096,
        1,
        1,
        None,
        16,
        29.26,
        _QWEN30,
        f"{_HYBRID} {_EP_OFF}",
        assumed=_H100_30B_FP8,
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 FP8 PP2 VP12 EP8",
        "h100",
        "fp8",
        16,
        1024,
        1,
        4096,
        1,
        2,
        12,
        8,
        28.94,
        _QWEN30,
        f"{_HYBRID} {_EP_OFF}",
        assumed=_H100_30B_FP8,
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 FP8-CS MBS2 PP2 VP24 EP8",
        "h100",
        "fp8",
        16,
        512,
        2,
        4096,
        1,
        2,
        24,
        8,
        24.85,
        _QWEN30,
        f"{_HYBRID} {_EP_OFF}",
        assumed=_H100_30B_FP8,
    ),
    _row(
        "Qwen3-30B-A3B 16xH100 FP8 MBS2 PP2 VP24 EP8 token drop (25.09)",
        "h100",
        "fp8",
        16,
        512,
        2,
        4096,
        1,
        2,
        24,
        8,
        12.489,  # 10494 tokens/s/GPU
        _QWEN30,
        f"{_A2A} {_EP_OFF} {_TOKEN_DROP}",
        source=_ARCHIVE,
        assumed="release 25.09 (the archive; its FP8 granularity footnote): its recipe's FP8 "
        "current scaling, alltoall, token drop at capacity factor 1.0 padded, EP overlap off, no "
        "CUDA graphs",
    ),
    _row(
        "Qwen3-235B-A22B 256xH100 FP8 TP2 PP8 VP4 EP32",
        "h100",
        "fp8",
        256,
        8192,
        1,
        4096,
        2,
        8,
        4,
        32,
        76.56,
        _QWEN235,
        f"{_A2A} {_EP_ON} {_SELECTIVE}",
        assumed=f"{_WORKLOAD} (FP8 H100): alltoall, EP overlap on, no CUDA graphs; selective "
        f"recompute of layernorm and moe_act; {_UNEVEN_235}",
    ),
    _row(
        "GPT-OSS-120B 64xH100 BF16 PP4 EP8",
        "h100",
        "bf16",
        64,
        1280,
        1,
        4096,
        1,
        4,
        None,
        8,
        14.07,
        _QWEN30,
        f"{_A2A} {_EP_OFF} {_GPT_OSS} {_SELECTIVE}",
        assumed="alltoall, EP overlap off; selective recompute of layernorm and moe_act (Bridge's "
        "H100 workload config); sliding windows not expressed",
    ),
    _row(
        "GPT-OSS-120B 64xH100 BF16 MBS4 PP4 EP8 (25.11)",
        "h100",
        "bf16",
        64,
        512,
        4,
        4096,
        1,
        4,
        None,
        8,
        5.820,  # 5630 tokens/s/GPU
        _QWEN30,
        f"{_A2A} {_EP_OFF} {_GPT_OSS} {_SELECTIVE}",
        source=_ARCHIVE,
        assumed="release 25.11 (the archive); alltoall, EP overlap off and selective recompute of "
        "layernorm and moe_act, as the 26.04.01 row; sliding windows not expressed",
    ),
    _row(
        "Llama3-8B 8xH100 FP8-CS FSDP",
        "h100",
        "fp8",
        8,
        128,
        1,
        8192,
        1,
        1,
        None,
        1,
        9.07,
        "-m llama -mr llama3_8b",
        "ddp.use_megatron_fsdp=true ddp.data_parallel_sharding_strategy=optim_grads_params",
        assumed="Megatron-FSDP as Bridge's --use_megatron_fsdp sets it (optim_grads_params)",
    ),
    _row(
        "Llama3-70B 64xH100 FP8 TP4 PP8 VP5",
        "h100",
        "fp8",
        64,
        256,
        1,
        8192,
        4,
        8,
        5,
        1,
        19.69,
        "-m llama -mr llama3_70b",
        "comm_overlap.tp_comm_overlap=true",
        assumed="TP overlap on (Bridge's Llama3-70B perf recipe)",
    ),
    _row(
        "Llama3.1-405B 1024xH100 FP8 TP8 PP8 CP2 VP8",
        "h100",
        "fp8",
        1024,
        1536,
        1,
        8192,
        8,
        8,
        8,
        1,
        37.46,
        "-m llama -mr llama3_70b",
        "-cp 2 model.num_layers=126 model.hidden_size=16384 model.ffn_hidden_size=53248 "
        "model.num_attention_heads=128 model.account_for_embedding_in_pipeline_split=true "
        "model.account_for_loss_in_pipeline_split=true comm_overlap.tp_comm_overlap=true",
        assumed="Llama-3.1-405B's shape on the Llama-3 70B recipe (126 layers, hidden 16384, FFN "
        "53248, 128 query / 8 KV heads; its RoPE scaling changes no FLOP or byte); the embedding "
        "and loss counted as layers in the pipeline split (128 / 64 virtual stages); CP2 as the "
        "p2p ring; TP overlap on (Bridge's perf recipe)",
    ),
    _row(
        "DeepSeek-V3 1024xH100 FP8 TP2 PP8 VP4 EP64",
        "h100",
        "fp8",
        1024,
        8192,
        1,
        4096,
        2,
        8,
        4,
        64,
        25.26,
        _QWEN30,
        not_expressible="multi-latent attention and MTP are not in the model config",
    ),
    _row(
        "Qwen3-30B-A3B 8xB200 MXFP8 MBS4 EP8",
        "b200",
        "mxfp8",
        8,
        512,
        4,
        4096,
        1,
        1,
        None,
        8,
        9.66,
        _QWEN30,
        f"{_HYBRID} {_EP_OFF} {_GRAPH_ATTN}",
        assumed=f"{_WORKLOAD}: HybridEP, EP overlap off, attention, router and preprocess CUDA "
        "graphs",
    ),
    *(
        _row(
            f"Qwen3-30B-A3B 8x{gpu.upper()} MXFP8 MBS{mbs} EP8 ({release})",
            gpu,
            "mxfp8",
            8,
            512,
            mbs,
            4096,
            1,
            1,
            None,
            8,
            step,
            _QWEN30,
            flags,
            assumed=assumed,
        )
        for gpu, mbs, release, step, flags, assumed in (
            (
                "gb200",
                4,
                "26.04.01",
                10.039,  # 26112 tokens/s/GPU
                f"{_HYBRID} {_EP_OFF} {_GRAPH_ROUTER}",
                f"{_PRE_STACK}, router and preprocess CUDA graphs",
            ),
            (
                "gb300",
                8,
                "26.04.01",
                8.258,  # 31744
                f"{_HYBRID} {_EP_OFF} {_GRAPH_ROUTER}",
                f"{_PRE_STACK}, router and preprocess CUDA graphs",
            ),
            ("gb200", 4, "26.08", 6.564, _STACK, _STACK_ASSUMED),  # 39936
            ("gb300", 8, "26.08", 5.885, _STACK, _STACK_ASSUMED),  # 44544
        )
    ),
    *(
        _row(
            f"Qwen3-235B-A22B 256x{gpu.upper()} MXFP8 MBS{mbs} PP{pp} VP{vp} EP32 ({release})",
            gpu,
            "mxfp8",
            256,
            8192,
            mbs,
            4096,
            1,
            pp,
            vp,
            32,
            step,
            _QWEN235,
            flags,
            assumed=f"{assumed}; {_UNEVEN_235}; 64 GPUs per NVLink domain",
        )
        for gpu, mbs, pp, vp, release, step, flags, assumed in (
            (
                "gb200",
                1,
                8,
                3,
                "26.04.01",
                23.077,  # 5680 tokens/s/GPU
                f"{_HYBRID} {_EP_OFF} {_GRAPH_ATTN}",
                f"{_PRE_STACK}, attention, router and preprocess CUDA graphs",
            ),
            (
                "gb300",
                2,
                4,
                12,
                "26.04.01",
                18.876,  # 6944
                f"{_HYBRID} {_EP_OFF} {_GRAPH_ATTN}",
                f"{_PRE_STACK}, attention, router and preprocess CUDA graphs",
            ),
            ("gb200", 1, 8, 3, "26.08", 18.004, _STACK, _STACK_ASSUMED),  # 7280
            ("gb300", 2, 4, 12, "26.08", 14.868, _STACK, _STACK_ASSUMED),  # 8816
        )
    ),
    _row(
        "DeepSeek-V3 256xGB200 MXFP8 PP4 VP4 EP64",
        "gb200",
        "mxfp8",
        256,
        4096,
        1,
        4096,
        1,
        4,
        4,
        64,
        13.34,
        _QWEN30,
        not_expressible="multi-latent attention and MTP are not in the model config",
    ),
    _row(
        "DeepSeek-V3 256xGB300 MXFP8 PP2 VP8 EP32",
        "gb300",
        "mxfp8",
        256,
        4096,
        1,
        4096,
        1,
        2,
        8,
        32,
        10.42,  # 6288 tokens/s/GPU (26.08)
        _QWEN30,
        not_expressible="multi-latent attention and MTP are not in the model config",
    ),
    *(
        _row(
            f"GPT-OSS-120B 64x{gpu.upper()} MXFP8 MBS4 EP{ep} (26.08)",
            gpu,
            "mxfp8",
            64,
            1280,
            4,
            4096,
            1,
            1,
            None,
            ep,
            step,
            _QWEN30,
            f"{_STACK} {_GPT_OSS}",
            assumed=f"{_GPT_OSS_STACK}; sliding windows not expressed",
        )
        for gpu, ep, step in (("gb200", 64, 2.857), ("gb300", 16, 2.481))  # 28672, 33024
    ),
)


def _config(row: Row):
    from overlap.harness import resolve_run

    job = resolve_run(row.args(), [])
    return job.cfg, job.resolution.layout


def _cluster(row: Row, efficiency: float, kernel_overhead_s: float):
    return builtin_cluster(
        row.gpu, row.precision, None, Efficiency(efficiency, "validation", kernel_overhead_s)
    )


def predicted_s(row: Row, efficiency: float, kernel_overhead_s: float, config=None) -> float:
    cfg, layout = config or _config(row)
    cluster = _cluster(row, efficiency, kernel_overhead_s)
    return predict(row.name, [], cfg, layout, cluster).step_ms / 1e3


@dataclass(frozen=True)
class Linear:
    """A row's predicted step near one point of the two fitted numbers: a + b x + c tau, x = 1 /
    efficiency, tau the per-kernel overhead in seconds (exact while no overlap window changes
    which side is longer and no kernel crosses the overhead's floor: the finite differences take
    the secant across the kernels that do; the fit re-linearizes at its own result)."""

    a: float
    b: float
    c: float

    def step_s(self, efficiency: float, kernel_overhead_s: float) -> float:
        return self.a + self.b / efficiency + self.c * kernel_overhead_s


def linearize(row: Row, efficiency: float, kernel_overhead_s: float, config=None) -> Linear:
    """The row's `Linear` at (efficiency, per-kernel overhead), by finite differences."""
    config = config or _config(row)
    x0, tau0 = 1 / efficiency, kernel_overhead_s
    s0 = predicted_s(row, efficiency, tau0, config)
    b = (predicted_s(row, 1 / (1.25 * x0), tau0, config) - s0) / (0.25 * x0)
    c = (predicted_s(row, efficiency, tau0 + TAU_STEP_S, config) - s0) / TAU_STEP_S
    return Linear(s0 - b * x0 - c * tau0, b, c)


def _loss(points: list[tuple[Linear, float]], x: float, tau: float) -> float:
    """Sum of |log(predicted / published)| (least absolute deviation: one run from another
    software release cannot drag the fit, as it would a mean of squares)."""
    total = 0.0
    for lin, published in points:
        step = lin.a + lin.b * x + lin.c * tau
        if step <= 0:
            return math.inf
        total += abs(math.log(step / published))
    return total


def center(values: list[float]) -> float:
    """The median in log (of an even count, the middle of the two middle ones)."""
    logs = sorted(math.log(v) for v in values)
    mid = len(logs) // 2
    return math.exp(logs[mid] if len(logs) % 2 else (logs[mid - 1] + logs[mid]) / 2)


def fit_group(
    points: list[tuple[Linear, float]], kernel_overhead_s: float | None = None
) -> tuple[float, float]:
    """(efficiency, per-kernel overhead) minimizing `_loss` over the rows' linear models.

    Both free: the minimum of a sum of absolute deviations lies where two rows are met exactly
    (or one, the overhead held at 0), so every such point is tried. The overhead given: the
    efficiency alone, the median of the rows' own ones (each row met exactly at it), which is
    that minimum in one dimension, at most 1 (a share of the peak)."""

    def x_at(lin: Linear, published: float, tau: float) -> float:
        return (published - lin.a - lin.c * tau) / lin.b

    if kernel_overhead_s is not None:
        xs = [x_at(lin, p, kernel_overhead_s) for lin, p in points]
        if min(xs) <= 0:
            raise ValueError("a row's published step is shorter than what no efficiency shrinks")
        return min(1.0, center([1 / x for x in xs])), kernel_overhead_s
    candidates = [(x_at(lin, p, 0.0), 0.0) for lin, p in points]
    for i, (li, pi) in enumerate(points):
        for lj, pj in points[i + 1 :]:
            det = li.b * lj.c - lj.b * li.c
            if abs(det) < 1e-12 * max(abs(li.b * lj.c), abs(lj.b * li.c), 1e-30):
                continue
            x = ((pi - li.a) * lj.c - (pj - lj.a) * li.c) / det
            tau = (li.b * (pj - lj.a) - lj.b * (pi - li.a)) / det
            candidates.append((x, tau))
    usable = [(x, tau) for x, tau in candidates if x >= 1.0 and tau >= 0.0]
    if not usable:
        raise ValueError("no efficiency <= 1 and overhead >= 0 fits these rows")
    x, tau = min(usable, key=lambda xt: (_loss(points, *xt), xt))
    return 1 / x, tau


@dataclass
class Result:
    row: Row
    loo_efficiency: float  # fitted on the group's other rows (pair partners left out too)
    loo_overhead_s: float  # the per-kernel overhead of that fit
    predicted_s: float  # at that fit
    fit_rows: tuple[str, ...]
    own_efficiency: float  # the efficiency at which this row alone is met, at the fit's overhead

    @property
    def error(self) -> float:
        return self.predicted_s / self.row.published_s - 1


def _group(row: Row) -> str:
    return GROUPS[row.gpu]


def solve_linear(rows: tuple[Row, ...] = ROWS) -> tuple[dict[str, Linear], dict[str, tuple]]:
    """Every expressible row's `Linear`, taken at its group's fit on all its rows; and the points
    they were taken at, by group. From a common start, linearize and fit until the fit is the
    point its rows were linearized at (the overhead's floor makes the step piecewise linear, so a
    linearization holds only near its point: four linearizations from START today)."""
    usable = [r for r in rows if not r.not_expressible]
    configs = {r.name: _config(r) for r in usable}
    at = {g: START for g in set(GROUPS.values())}
    for _ in range(MAX_ROUNDS):
        lins = {r.name: linearize(r, *at[_group(r)], configs[r.name]) for r in usable}
        fits = _group_fits(usable, lins)
        if all(math.isclose(f, a, rel_tol=1e-6) for g in fits for f, a in zip(fits[g], at[g])):
            return lins, at
        at = fits
    raise ValueError(f"the fit did not settle in {MAX_ROUNDS} linearizations (last: {at})")


def _group_fits(
    usable: list[Row], lins: dict[str, Linear], leave_out: Row | None = None
) -> dict[str, tuple[float, float]]:
    """Each group's (efficiency, overhead) on its rows (less `leave_out` and its pair partners).
    The overhead is fitted where OVERHEAD_FROM says; a group fitted elsewhere takes that group's
    overhead on all its rows (none of which is this group's)."""

    def points(group: str, skip: Row | None) -> list[tuple[Linear, float]]:
        return [
            (lins[r.name], r.published_s)
            for r in usable
            if _group(r) == group
            and not (skip and (r is skip or (skip.pair and r.pair == skip.pair)))
        ]

    out = {}
    for group in sorted(set(GROUPS.values()), key=lambda g: OVERHEAD_FROM[g] != g):
        source = OVERHEAD_FROM[group]
        skip = leave_out if leave_out is not None and _group(leave_out) == group else None
        if source == group:
            out[group] = fit_group(points(group, skip))
        else:
            tau = fit_group(points(source, None))[1]
            out[group] = fit_group(points(group, skip), tau)
    return out


def fit(
    lins: dict[str, Linear], rows: tuple[Row, ...] = ROWS
) -> tuple[list[Result], dict[str, dict]]:
    """Leave-one-out results for every expressible row and each group's fit on all its rows, from
    the rows' linear models (`solve_linear`); each row's prediction is the full model's at the fit
    that did not see it."""
    usable = [r for r in rows if not r.not_expressible]
    results = []
    for r in usable:
        eff, tau = _group_fits(usable, lins, leave_out=r)[_group(r)]
        others = tuple(
            o.name
            for o in usable
            if _group(o) == _group(r) and o is not r and not (r.pair and o.pair == r.pair)
        )
        lin = lins[r.name]
        own = lin.b / (r.published_s - lin.a - lin.c * tau)
        results.append(Result(r, eff, tau, predicted_s(r, eff, tau), others, own))
    fits = _group_fits(usable, lins)
    groups = {}
    for group in sorted(set(GROUPS.values())):
        members = [r for r in results if _group(r.row) == group]
        errors = sorted(abs(r.error) for r in members)
        within = sum(e <= WITHIN for e in errors)
        source = OVERHEAD_FROM[group]
        groups[group] = {
            "efficiency": round(fits[group][0], 4),
            "kernel_overhead_us": round(fits[group][1] * 1e6, 3),
            "kernel_overhead_from": source,
            "median_error": round(errors[len(errors) // 2], 3),
            "worst_error": round(errors[-1], 3),
            "group": group,
            "fit_rows": [r.row.name for r in members],
            "expected_error": (
                f"median {100 * errors[len(errors) // 2]:.0f}%, worst {100 * errors[-1]:.0f}%, "
                f"{within} of {len(errors)} runs within {100 * WITHIN:.0f}% (leave-one-out over "
                "published runs, docs/planner.md)"
            ),
        }
    return results, groups


def median_error(results: list[Result]) -> float:
    """The median |predicted / published - 1| over the rows (of an even count, the middle two's
    mean)."""
    errors = sorted(abs(r.error) for r in results)
    mid = len(errors) // 2
    return errors[mid] if len(errors) % 2 else (errors[mid - 1] + errors[mid]) / 2


def pairs(results: list[Result]) -> list[tuple[Result, Result, float, float]]:
    """(off, on, published ratio, predicted ratio) of every on/off pair."""
    out = []
    for name in sorted({r.row.pair for r in results if r.row.pair}):
        members = [r for r in results if r.row.pair == name]
        off = next(r for r in members if r.row.name.endswith(" off"))
        for on in (r for r in members if r is not off):
            published = on.row.published_s / off.row.published_s
            out.append((off, on, published, on.predicted_s / off.predicted_s))
    return out


def markdown(results: list[Result], groups: dict[str, dict], rows: tuple[Row, ...] = ROWS) -> str:
    """The table docs/planner.md carries (generated: `python -m overlap.plan.validate`)."""
    lines = [
        "| run | GPU | precision | published s | predicted s | error | own eff. | fit eff. | fit "
        "overhead us | assumed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.row.name} | {r.row.gpu} | {r.row.precision} | {r.row.published_s:.2f} | "
            f"{r.predicted_s:.2f} | {100 * r.error:+.0f}% | {r.own_efficiency:.3f} | "
            f"{r.loo_efficiency:.3f} | {r.loo_overhead_s * 1e6:.1f} | {r.row.assumed or '-'} |"
        )
    for row in rows:
        if row.not_expressible:
            lines.append(
                f"| {row.name} | {row.gpu} | {row.precision} | {row.published_s:.2f} | - | not "
                f"expressed | - | - | - | {row.not_expressible} |"
            )
    within = sum(abs(r.error) <= WITHIN for r in results)
    lines += [
        "",
        f"{within} of {len(results)} expressible runs within {100 * WITHIN:.0f}%, median error "
        f"{100 * median_error(results):.1f}% (leave-one-out; {len(rows) - len(results)} not "
        "expressible).",
        "",
        "| pair | published on/off | predicted on/off | on step error |",
        "|---|---|---|---|",
    ]
    for _off, on, pub, pred in pairs(results):
        lines.append(f"| {on.row.name} | {pub:.3f} | {pred:.3f} | {100 * on.error:+.0f}% |")
    lines += [
        "",
        "| group | efficiency (all its rows) | per-kernel overhead us (fitted on) | expected error "
        "|",
        "|---|---|---|---|",
    ]
    for name, g in groups.items():
        lines.append(
            f"| {name} | {g['efficiency']:.4f} | {g['kernel_overhead_us']:.1f} "
            f"({g['kernel_overhead_from']} rows) | {g['expected_error']} |"
        )
    return "\n".join(lines)


def write_fitted(
    groups: dict[str, dict], lins: dict[str, Linear], at: dict[str, tuple[float, float]], path: Path
) -> None:
    """`overlap.plan.fitted`: each GPU type's group fit, the rows' linear models and the points
    they were taken at (so a test re-derives the fits from them and re-linearizes a few rows)."""
    by_gpu = {gpu: groups[group] for gpu, group in GROUPS.items()}
    header = (
        '"""Generated by `python -m overlap.plan.validate --write` (do not edit): '
        "the compute\nefficiency and per-kernel overhead of each GPU type, fitted on the published "
        "runs\nnamed here (`overlap.plan.validate`), its leave-one-out step-time error, and "
        "each\nrun's linear model (a, b, c: step = a + b / efficiency + c x "
        'overhead), taken at LINEARIZED_AT."""'
    )
    linear = {n: tuple(float(f"{v:.9g}") for v in (x.a, x.b, x.c)) for n, x in lins.items()}
    lines = [
        header,
        "",
        f"FITTED = {pformat(by_gpu, width=100, sort_dicts=False)}",
        "",
        f"LINEAR = {pformat(linear, width=100, sort_dicts=False)}",
        "",
        f"LINEARIZED_AT = {pformat(at, width=100, sort_dicts=True)}",
        "",
    ]
    write_replace(path, "\n".join(lines))


def stored_linear() -> dict[str, Linear]:
    from overlap.plan.fitted import LINEAR

    return {name: Linear(*abc) for name, abc in LINEAR.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m overlap.plan.validate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="re-linearize every row and regenerate src/overlap/plan/fitted.py",
    )
    args = parser.parse_args(argv)
    # the rows' resolution notes (e.g. a single DP bucket) are not the point here
    logging.getLogger("overlap").setLevel(logging.ERROR)
    logging.getLogger("overlap.config").setLevel(logging.ERROR)
    lins, at = solve_linear() if args.write else (stored_linear(), None)
    results, groups = fit(lins)
    if args.write:
        write_fitted(groups, lins, at, Path(__file__).with_name("fitted.py"))
    print(markdown(results, groups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
