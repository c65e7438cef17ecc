"""What Megatron-Bridge's performance harness builds for a model, GPU and precision: the settings of
its perf recipes, declared as data in `perf.yaml` (with where each was read), which
`overlap.harness` applies the same way.

Bridge's `scripts/performance/run_script.py` picks a flat recipe by name -
`{model}_pretrain_{N}gpu_{gpu}_{precision}_config` in `src/megatron/bridge/perf_recipes/` - built on
the library recipe, then `_benchmark_common` (50 iterations, bf16 gradient reduction, RoPE fusion,
...), then the command line's flags and overrides. Here the model recipe (`overlap.recipes.models`)
is the library recipe and these recipes are the perf layer: each entry's settings are applied after
the harness flags (a setting a flag wrote is left to the flag) and before the overrides, each a row
in the decision table naming the Bridge recipe it came from. The parallel layout and the batch sizes
are the published run's, applied when `-ng` is its GPU count; at another count the model recipe's
layout rule stays (Bridge would take its largest recipe and scale the batch).

What the runtime cannot carry is listed per entry (`not_carried`) and shown, not applied: HybridEP
and DeepEP dispatch, CUDA graphs, Megatron-FSDP, Transformer Engine's own fusions (ours have no
switch: the cross-entropy is always the chunked one, `overlap.layers.cross_entropy`). Where we
differ on purpose the README says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple

import yaml

from overlap.layout.prerequisites import (
    ep_overlap_has_experts,
    ep_overlap_interleaves,
    keeps_sent_outputs,
)


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
    under PP (`layout.prerequisites.keeps_sent_outputs`, which the run-time refusal asks)."""
    if _pp(cfg) == 1:
        return "PP = 1: there is no pipeline send to release"
    co = cfg.comm_overlap
    if keeps_sent_outputs(_pp(cfg), co is not None and bool(co.overlap_moe_expert_parallel_comm)):
        return "releasing sent outputs under EP overlap with PP > 1 is not built here"
    return None


def _ep_overlap_layout(cfg: Any) -> str | None:
    """EP overlap's layout prerequisites (the switch's own rules, `comm_overlap`), asked of the
    layout the command line chose, which may meet neither. The virtual pipeline is read as typed
    (`-vp`; a layout string's is not resolved before finalize)."""
    m = cfg.model
    if not ep_overlap_has_experts(m.expert_model_parallel_size):
        return "this layout has EP 1: there is no all-to-all to overlap"
    vpp = m.virtual_pipeline_model_parallel_size
    if not ep_overlap_interleaves(_pp(cfg), vpp or 1, vpp):
        return "this layout has PP > 1 without VPP, where EP overlap cannot interleave"
    return None


def _pp(cfg: Any) -> int:
    return cfg.model.pipeline_model_parallel_size


# The rules a setting may name (its fourth item in perf.yaml) to skip it on this layout
SKIPS = {"released_outputs": _released_outputs, "ep_overlap_layout": _ep_overlap_layout}


@dataclass(frozen=True)
class PerfRecipe:
    """One Bridge perf recipe: its name, the GPU count it was published for, the layout and batch
    (applied at that count), the other settings, the environment it sets, the environment its
    HybridEP dispatcher needs (applied only where that dispatcher is what runs: the user chose it,
    and the run then refuses it), and what the runtime cannot carry (setting, why)."""

    name: str
    num_gpus: int
    layout: tuple[tuple[str, str], ...]
    settings: tuple[Setting, ...]
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


def _expanded(items: list, groups: dict[str, list]) -> list[tuple]:
    """A list of entries and group names -> the entries, each group's in its place."""
    out: list[tuple] = []
    for item in items:
        out += _expanded(groups[item], groups) if isinstance(item, str) else [tuple(item)]
    return out


def _load(text: str) -> tuple[str, dict[tuple[str, str, str], tuple[PerfRecipe, ...]]]:
    """The source and the recipes of perf.yaml, keyed by (model recipe, -g, -c)."""
    data = yaml.safe_load(text)
    groups = data["groups"]
    out = {}
    for key, entries in data["recipes"].items():
        model, gpu, precision = key.split("/")
        out[model, gpu, precision] = tuple(
            PerfRecipe(
                e["name"],
                e["num_gpus"],
                _layout(**e["layout"]),
                tuple(
                    Setting(k, v, why, SKIPS[skip[0]] if skip else None)
                    for k, v, why, *skip in _expanded(e["settings"], groups["settings"])
                ),
                tuple(_expanded(e["env"], groups["env"])),
                tuple(_expanded(e["not_carried"], groups["not_carried"])),
                _hybridep_env(**e["hybridep"]) if "hybridep" in e else (),
            )
            for e in entries
        )
    return data["source"], out


SOURCE, PERF_RECIPES = _load(resources.files("overlap.recipes").joinpath("perf.yaml").read_text())
"""(model recipe, -g, -c) -> Bridge's perf recipes for it (one per published GPU count), and the
Bridge revision they were read from."""


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
