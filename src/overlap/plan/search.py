"""`overlap plan --search`: which layout to run at all - the fastest configuration the memory model
says fits, from the same models that price one configuration (`overlap.plan.predict`).

What it searches, for a model recipe on a cluster (GPU type, count, GPUs per node, the harness's
precision and batch): tensor parallelism within a node (dividing the attention heads and the query
groups), pipeline stages with or without interleaving (every virtual-pipeline size whose split
Megatron accepts, the recipe's uneven accounting of the embedding and loss included), expert
parallelism for MoE models, the micro-batch size, and activation recompute (none, selective of the
attention product, selective of the MLP's or experts' activation and the norms). Every candidate is
resolved as `overlap run` would resolve it, so the rules of Megatron and the runtime decide what is
valid (a candidate they refuse is counted, not shown); context parallelism and expert tensor
parallelism are not searched (CP sizes are not tried yet: `overlap plan -cp N` prices one; ETP
stays at its default).

The overlap switches are not multiplied into the layouts: each layout runs with its automatic
decisions (the decision table's rules), then each switch that applies is turned the other way on
the fastest layouts, and a flip that predicts faster is kept (`overlap.plan.cli.SWITCHES`; the
memory model re-checks each flip, as EP overlap and overlapped 1F1B keep more alive).

A candidate fits when its peak (`overlap.perf.memory_model.rank_memory`) plus the reserve (2 GiB
and 5% of the peak) is within the GPU's memory; the margin is printed. The ranking is by predicted
step time; the explanation of the winner against the runner-up is the difference of their step's
components (compute, bubble, the stretch of overlapped compute, exposed communication by kind).

Usable as a library call: `search(words, overrides)` with the harness words of an `overlap run`
command line (its layout flags are replaced), returning `SearchResult`.
"""

from __future__ import annotations

import itertools
import logging
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from overlap.errors import ConfigError
from overlap.perf.memory_model import GPU_MEMORY_BYTES, rank_memory, reserve_bytes
from overlap.plan.hardware import Cluster, builtin_cluster, precision_of
from overlap.plan.predict import Prediction, predict

# the harness flags a candidate sets (with their values), replacing any the caller gave
LAYOUT_FLAGS = ("-tp", "-pp", "-vp", "-cp", "-ep", "-et", "-mb")
# the override keys a candidate sets, replacing any the caller gave
LAYOUT_KEYS = (
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.expert_model_parallel_size",
    "model.sequence_parallel",
    "model.recompute_granularity",
    "model.recompute_modules",
    "train.micro_batch_size",
)
REFUSED, NOT_FITTING = "refused", "does not fit"
MAX_PP = 16
MICRO_BATCHES = (1, 2, 4)
# the fastest layouts whose overlap switches are each tried the other way
REFINE = 12


@dataclass(frozen=True)
class Layout:
    """One point of the search: the harness flags and the recompute choice."""

    tp: int
    pp: int
    vp: int | None
    ep: int
    mb: int
    recompute: tuple[str, ...] = ()  # selective recompute's modules (empty: none)

    def words(self) -> list[str]:
        return [
            "-tp",
            str(self.tp),
            "-pp",
            str(self.pp),
            "-vp",
            str(self.vp) if self.vp else "None",
            "-ep",
            str(self.ep),
            "-mb",
            str(self.mb),
        ]

    def overrides(self) -> list[str]:
        if not self.recompute:
            return []
        return [
            "model.recompute_granularity=selective",
            f"model.recompute_modules=[{','.join(self.recompute)}]",
        ]

    def describe(self) -> str:
        vp = f" VP{self.vp}" if self.vp else ""
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        rc = f", recompute {'+'.join(self.recompute)}" if self.recompute else ""
        return f"TP{self.tp} PP{self.pp}{vp}{ep} mb{self.mb}{rc}"


@dataclass(frozen=True)
class Candidate:
    """A layout that resolved and fits, with its best overlap switches and its prediction."""

    layout: Layout
    switches: tuple[str, ...]  # overrides that flipped an automatic overlap decision
    prediction: Prediction
    margin_bytes: int  # the GPU's memory left after the peak and the reserve

    def command(self, words: list[str], overrides: list[str]) -> str:
        """The `overlap run` command line that runs this candidate."""
        return shlex.join(
            [
                "overlap",
                "run",
                *_without_layout(words),
                *self.layout.words(),
                *_without_layout_keys(overrides),
                *self.layout.overrides(),
                *self.switches,
            ]
        )


@dataclass
class SearchResult:
    """The fitting candidates, fastest first, and what the search left out."""

    ranked: list[Candidate]
    words: list[str]
    overrides: list[str]
    cluster: Cluster
    considered: int = 0
    # why candidates were refused by the configuration rules, with how many each
    refused: dict[str, int] = field(default_factory=dict)
    not_fitting: int = 0

    def to_json(self, top: int) -> dict:
        """The search as JSON: the `top` candidates (the plan's per-configuration fields, with the
        layout, margin and command) and what was left out."""
        from overlap.plan.report import config_json

        return {
            "considered": self.considered,
            "not_fitting": self.not_fitting,
            "refused": dict(sorted(self.refused.items(), key=lambda kv: -kv[1])),
            "why_best": self.why_best(),
            "candidates": [
                {
                    **config_json(c.prediction),
                    "switches": list(c.switches),
                    "margin_gb": c.margin_bytes / 1e9,
                    "command": c.command(self.words, self.overrides),
                }
                for c in self.ranked[:top]
            ],
        }

    def why_best(self) -> str:
        """Why the first candidate beats the second: the step components that differ most."""
        if len(self.ranked) < 2:
            return "only one layout fits"
        a, b = self.ranked[0].prediction.times, self.ranked[1].prediction.times
        parts = {
            "compute": b.compute_s - a.compute_s,
            "pipeline bubble": b.bubble_s - a.bubble_s,
            "overlapped compute's stretch": b.slowdown_s - a.slowdown_s,
        }
        for kind in sorted(set(a.exposed_s) | set(b.exposed_s)):
            parts[f"exposed {kind}"] = b.exposed_s.get(kind, 0.0) - a.exposed_s.get(kind, 0.0)
        shown = sorted(parts.items(), key=lambda kv: -abs(kv[1]))[:4]
        gap = (b.total_s - a.total_s) * 1e3
        detail = ", ".join(
            f"{name} {abs(delta) * 1e3:.0f} ms {'shorter' if delta >= 0 else 'longer'}"
            for name, delta in shown
            if abs(delta) * 1e3 >= 0.5
        )
        return (
            f"{self.ranked[0].layout.describe()} beats {self.ranked[1].layout.describe()} by "
            f"{gap:.0f} ms per step; against the runner-up its {detail}"
        )


def _without_layout(words: list[str]) -> list[str]:
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word in LAYOUT_FLAGS:
            skip = True
            continue
        out.append(word)
    return out


def _without_layout_keys(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.split("=", 1)[0].strip() not in LAYOUT_KEYS]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def recompute_options(cfg) -> list[tuple[str, ...]]:
    """Selective recompute's module sets, cheapest first: none, the attention product, then the
    MLP's (experts') activation and the norms. Recompute never makes a step faster by itself, so a
    layout takes the first that fits."""
    m = cfg.model
    return [
        (),
        ("core_attn",),
        ("layernorm", "moe_act") if m.num_moe_experts else ("core_attn", "mlp"),
    ]


def candidate_layouts(cfg, gpus: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every layout (without recompute) to try for the resolved base configuration `cfg` on `gpus`
    GPUs: the arithmetic filters (divisibility, an even virtual-pipeline split of the layers and of
    the embedding and loss the recipe accounts as layers), leaving the rest to the configuration's
    own rules."""
    m = cfg.model
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    experts = m.num_moe_experts or 0
    layers = (
        m.num_layers
        + bool(m.account_for_embedding_in_pipeline_split)
        + bool(m.account_for_loss_in_pipeline_split)
    )
    for tp in _powers_of_two(min(gpus_per_node, gpus)):
        if heads % tp or groups % tp:
            continue
        for pp in range(1, min(MAX_PP, gpus // tp, m.num_layers) + 1):
            if (gpus // tp) % pp or layers % pp:
                continue
            dp = gpus // (tp * pp)
            vps: list[int | None] = [None]
            if pp > 1:
                # down to one layer per virtual stage (Bridge runs Qwen3-30B-A3B at PP2 x VP24)
                vps += [v for v in range(2, layers // pp + 1) if layers % (pp * v) == 0]
            eps = [e for e in _powers_of_two(experts) if experts % e == 0] if experts else [1]
            # micro-batches ascending: the search skips the larger ones of a layout that did not fit
            for vp, ep, mb in itertools.product(vps, eps, MICRO_BATCHES):
                if ep > 1 and (tp * dp) % ep:
                    continue
                if cfg.train.global_batch_size % (mb * dp):
                    continue
                yield Layout(tp, pp, vp, ep, mb)


def _resolve(words: list[str]):
    """`overlap run`'s resolution of `words`, without its start-up warnings (a no-op switch is
    the decision table's business; hundreds of candidates would repeat them)."""
    from overlap.harness import resolve_run

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return resolve_run(words, [], model_noops=False)
    finally:
        logging.disable(previous)


def search(
    words: list[str],
    overrides: list[str] | None = None,
    cluster: Cluster | None = None,
    plan_precision: str | None = None,
) -> SearchResult:
    """Search the layouts of the `overlap run` command line `words` (harness flags; its layout flags
    are replaced) plus `overrides`, on `cluster` (None: the built-in one for its -g and -gn);
    `plan_precision` prices FP8 as `overlap plan -c fp8_*` does. Returns every fitting candidate,
    fastest first (the module notes say what is searched)."""
    # KEY=VALUE words are overrides wherever they were written (they follow every flag)
    overrides = [w for w in words if _is_override(w)] + list(overrides or [])
    words = [w for w in words if not _is_override(w)]
    fixed_words, fixed_overrides = _without_layout(words), _without_layout_keys(overrides)
    base = _resolve(fixed_words + fixed_overrides)
    gpus = base.resolution.layout.world_size
    gpn = _flag(words, "-gn", "--gpus_per_node") or 8
    if cluster is None:
        gpu = _flag(words, "-g", "--gpu")
        precision = plan_precision or precision_of(base.cfg.model)
        cluster = builtin_cluster(str(gpu), precision, int(gpn))
    result = SearchResult([], words, overrides, cluster)
    scored: list[tuple[float, Layout, Prediction, int]] = []
    too_big: set[tuple] = set()  # layouts that did not fit at a smaller micro-batch
    for plain in candidate_layouts(base.cfg, gpus, int(gpn)):
        result.considered += 1
        shape = (plain.tp, plain.pp, plain.vp, plain.ep)
        if shape in too_big:  # a larger micro-batch only needs more memory
            result.not_fitting += 1
            continue
        for modules in recompute_options(base.cfg):
            layout = replace(plain, recompute=modules)
            outcome = _score(result, fixed_words, fixed_overrides, layout, (), cluster)
            if outcome != NOT_FITTING:
                break
        if isinstance(outcome, tuple):
            scored.append(outcome)
        elif outcome == NOT_FITTING:
            result.not_fitting += 1
            too_big.add(shape)
    scored.sort(key=lambda s: s[0])
    candidates = []
    for rank, (step_s, layout, prediction, margin) in enumerate(scored):
        switches: tuple[str, ...] = ()
        if rank < REFINE:
            best = (step_s, prediction, margin)
            for flip in _flips(prediction, base.cfg):
                tried = _score(result, fixed_words, fixed_overrides, layout, flip, cluster, False)
                if isinstance(tried, tuple) and tried[0] < best[0] * (1 - 1e-3):
                    best, switches = (tried[0], tried[2], tried[3]), flip
            step_s, prediction, margin = best
        candidates.append((step_s, Candidate(layout, switches, prediction, margin)))
    candidates.sort(key=lambda c: c[0])
    result.ranked = [c for _s, c in candidates]
    return result


def _is_override(word: str) -> bool:
    return "=" in word and not word.startswith("-")


def _flag(words: list[str], *names: str) -> str | None:
    for i, word in enumerate(words[:-1]):
        if word in names:
            return words[i + 1]
    return None


def _flips(prediction: Prediction, cfg) -> list[tuple[str, ...]]:
    """Each applicable overlap switch the other way from where the decisions put it."""
    from overlap.plan.cli import SWITCHES, not_applicable

    sw = prediction.switches
    state = {
        "EP overlap": sw.ep_overlap,
        "delay_wgrad": sw.delay_wgrad,
        "DP overlap": sw.overlap_grad_reduce,
        "PP overlap": sw.overlap_p2p,
    }
    flips = []
    for case in SWITCHES:
        if not_applicable(case.label, prediction.layout, cfg) is not None:
            continue
        on = state.get(case.label)
        # TP overlap's state is per GEMM slot: try it both ways
        flips += [case.off, case.on] if on is None else [case.off if on else case.on]
    return flips


def _score(
    result: SearchResult,
    words: list[str],
    overrides: list[str],
    layout: Layout,
    switches: tuple[str, ...],
    cluster: Cluster,
    count: bool = True,
) -> tuple[float, Layout, Prediction, int] | str:
    """(step seconds, layout, prediction, margin) of one candidate; `REFUSED` where the rules refuse
    it (counted by reason), `NOT_FITTING` where it does not fit."""
    try:
        job = _resolve(words + layout.words() + overrides + layout.overrides() + list(switches))
        cfg, parallel = job.cfg, job.resolution.layout
        # memory first: a layout that does not fit is not priced (nor advised on)
        peak = rank_memory(cfg, parallel, cpu=cluster.gpu == "cpu")
        device = GPU_MEMORY_BYTES.get(cluster.gpu)
        margin = 0 if device is None else device - peak.total - reserve_bytes(peak.total)
        if margin < 0:
            return NOT_FITTING
        prediction = predict(layout.describe(), list(switches), cfg, parallel, cluster, exact=False)
    except ConfigError as exc:
        if count:
            key = f"{exc.field}: {exc.why.rstrip('.')}"
            result.refused[key] = result.refused.get(key, 0) + 1
        return REFUSED
    return prediction.times.total_s, layout, prediction, margin
