"""`overlap plan --search`: which layout to run at all - the fastest configuration the memory model
says fits, from the same models that price one configuration (`overlap.plan.predict`).

What it searches, for a model recipe on a cluster (GPU type, count, GPUs per node, the harness's
precision and batch):

- tensor parallelism within a node (dividing the attention heads and the query groups);
- pipeline stages, with or without interleaving (every virtual-pipeline size whose split Megatron
  accepts), each split two ways where both divide: even over the transformer layers, and uneven
  with the embedding and the loss accounted as one layer each (Megatron's
  `account_for_embedding_in_pipeline_split` / `..._loss_...`: the `pipeline_model_parallel_layout`
  `Et*k|...|t*kL` the reference's Qwen3-235B runs use);
- context parallelism (powers of two dividing the heads and half the sequence), each size with the
  resolved exchange and then, on the fastest layouts, every other `cp_comm_type` the plan prices
  (`p2p`, `a2a`, `all_gather`);
- expert parallelism for MoE models, and on the fastest layouts every token dispatcher the plan
  prices (`alltoall`, and `flex` with each backend: `torch`, `deepep`, `hybridep`);
- the micro-batch size (1, 2, 4, 8: the GB300 Qwen3 runs use 8);
- activation recompute: none, selective of the attention product, selective of the MLP's
  (experts') activation and the norms, or full (uniform, one layer a checkpoint). Recompute never
  makes a step faster by itself, so a layout that fits without it runs without; one that does not
  takes the fastest rung that fits (which rung costs least depends on the model: for a MoE layer
  re-running the attention product can cost more than the experts' activation and the norms);
- Megatron-FSDP (`FSDP`: the gradients and parameters sharded over DP x CP, gathered layer by layer
  every micro-batch) as a memory rung where DP x CP > 1, alone and on top of each recompute rung
  that does not fit (`heavier_rungs`): more traffic, so never faster by itself, but it can let a
  layout run without recompute or at a larger micro-batch;
- each overlap switch (`overlap.plan.cli.SWITCHES`) turned the other way from the decision table's
  automatic choice on the fastest layouts; a flip that predicts faster is kept.

Expert tensor parallelism is not searched: `overlap run` refuses ETP > 1 today and the compute model
prices the experts at ETP 1 (`overlap.plan.compute`), so a candidate with it would be neither
runnable nor priced.

Every candidate is resolved as `overlap run` would resolve it, so the rules of Megatron and the
runtime decide what is valid (a candidate they refuse is counted by reason, not shown). A candidate
the configuration accepts but whose runtime is not built yet (a DeepEP / HybridEP dispatcher, CUDA
graphs from the command line, Megatron-FSDP) is ranked and labelled with what `overlap run` would
refuse.

Fast: the expensive part of pricing is the pipeline program's simulation. A candidate's step is
bounded below without it (`_Space.bound`: the step priced unpipelined, plus the pipeline's least
extra, less what EP overlap's warm-up may take back), so the candidates are priced in the order of
that bound, and the search stops once the next bound is slower than the `keep`-th fastest step
found and than the fastest plus the GPU group's median error: every layout left is provably slower
than all of those (counted as `bounded`), and every layout the model cannot tell from the fastest
(`SearchResult.near_best`) is priced and counted, so the printout says how many there are. Memory is
checked before pricing; a layout that does not fit without a memory rung goes back into the queue
once per rung (recompute, Megatron-FSDP), each at its own bound, and a rung whose bound is slower
than a rung of the same layout already priced is not priced; each group of layouts sharing TP, CP,
PP, split and EP is probed once at its least memory-hungry point and dropped unresolved where even
that does not fit.
Below the search, what repeats across thousands of candidates is worked out once: each distinct
chunk's activations and memory walk (`overlap.launch.resources.peak_memory`), each pipeline
program's tasks (`overlap.plan.pipeline_sim`), the run's argument parser (docs/planner.md,
"Speed").

A candidate fits when its peak (`overlap.perf.memory_model.rank_memory`) plus the reserve (2 GiB
and 5% of the peak) is within the GPU's memory; the margin is printed. The explanation of the
winner against the runner-up is the difference of their step's components (compute, bubble, the
stretch of overlapped compute, exposed communication by kind).

Usable as a library call: `search(words, overrides)` with the harness words of an `overlap run`
command line (its layout flags are replaced), returning `SearchResult`.
"""

from __future__ import annotations

import heapq
import itertools
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from overlap.errors import ConfigError
from overlap.layout.prerequisites import cp_chunks_fit
from overlap.perf.memory_model import GPU_MEMORY_BYTES, rank_memory, reserve_bytes
from overlap.plan.comm_model import comm_plan, microbatches
from overlap.plan.compute import microbatch_compute
from overlap.plan.hardware import Cluster, builtin_cluster, precision_of
from overlap.plan.predict import Prediction, check_priced, predict, switches_of
from overlap.plan.step_times import StepTimes, step_times, unmerged_forwards

# the harness flags a candidate sets (with their values), replacing any the caller gave
LAYOUT_FLAGS = ("-tp", "-pp", "-vp", "-cp", "-ep", "-et", "-mb", "--use_megatron_fsdp")
# the dispatcher's harness flag, replaced where a candidate sets its own dispatcher
DISPATCHER_FLAG = "--moe_flex_dispatcher_backend"
# the override keys a candidate sets, replacing any the caller gave
LAYOUT_KEYS = (
    "model.tensor_model_parallel_size",
    "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size",
    "model.context_parallel_size",
    "model.expert_model_parallel_size",
    "model.expert_tensor_parallel_size",
    "model.sequence_parallel",
    "model.pipeline_model_parallel_layout",
    "model.account_for_embedding_in_pipeline_split",
    "model.account_for_loss_in_pipeline_split",
    "model.recompute_granularity",
    "model.recompute_modules",
    "model.recompute_method",
    "model.recompute_num_layers",
    "train.micro_batch_size",
    "ddp.use_megatron_fsdp",
    "ddp.data_parallel_sharding_strategy",
)
REFUSED, NOT_FITTING = "refused", "does not fit"
MAX_PP = 16
MAX_CP = 8
# the fewest tokens a CP rank keeps: shorter shards leave the attention GEMMs too small to pay for
# the ring (the reference's CP runs keep 4096 and more a rank)
MIN_CP_TOKENS = 4096
MICRO_BATCHES = (1, 2, 4, 8)
FULL = ("full",)  # the recompute rung that re-runs whole layers
# Megatron-FSDP's overrides (what Bridge's --use_megatron_fsdp sets): the memory rung that shards
# the gradients and parameters over DP
FSDP = ("ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")
# memory rungs as (recompute, Megatron-FSDP): none; Megatron-FSDP alone (where a group of layouts
# fits only with it, they start there)
NO_RUNG, FSDP_ONLY = ((), False), ((), True)
# the fastest layouts whose dispatcher, CP exchange and overlap switches are each tried
REFINE = 8
# how many of the fastest candidates are priced exactly (the rest are bounded out)
KEEP = 12
# the share of the ideal pipeline ramp the bound counts (a margin for the simulated stage times)
RAMP = 0.9
DISPATCHERS = ("alltoall", "flex:torch", "flex:deepep", "flex:hybridep")
CP_KINDS = ("p2p", "a2a", "all_gather")


@dataclass(frozen=True)
class Layout:
    """One point of the search: the harness flags, the pipeline split, the recompute choice, and
    the dispatcher and CP exchange where they differ from the command line's."""

    tp: int
    pp: int
    vp: int | None
    ep: int
    mb: int
    recompute: tuple[str, ...] = ()  # selective recompute's modules, FULL, or empty: none
    cp: int = 1
    # the embedding and the loss accounted as layers (None: no pipeline, nothing to split)
    accounted: bool | None = None
    dispatcher: str = ""  # "alltoall" | "flex:<backend>" ("": the command line's)
    cp_kind: str = ""  # model.cp_comm_type ("": the resolved one)
    fsdp: bool = False  # Megatron-FSDP (`FSDP`), a memory rung as recompute is

    def plain(self) -> Layout:
        """The layout without its memory rung (recompute, Megatron-FSDP)."""
        return replace(self, recompute=(), fsdp=False)

    @property
    def rung(self) -> tuple[tuple[str, ...], bool]:
        return self.recompute, self.fsdp

    def words(self) -> list[str]:
        return [
            "-tp",
            str(self.tp),
            "-pp",
            str(self.pp),
            "-vp",
            str(self.vp) if self.vp else "None",
            "-cp",
            str(self.cp),
            "-ep",
            str(self.ep),
            "-mb",
            str(self.mb),
        ]

    def overrides(self) -> list[str]:
        out = []
        if self.accounted is not None:
            flag = str(self.accounted).lower()
            out += [
                f"model.account_for_embedding_in_pipeline_split={flag}",
                f"model.account_for_loss_in_pipeline_split={flag}",
            ]
        if self.recompute == FULL:
            out += [
                "model.recompute_granularity=full",
                "model.recompute_method=uniform",
                "model.recompute_num_layers=1",
            ]
        elif self.recompute:
            out += [
                "model.recompute_granularity=selective",
                f"model.recompute_modules=[{','.join(self.recompute)}]",
            ]
        if self.dispatcher:
            kind, _, backend = self.dispatcher.partition(":")
            out.append(f"model.moe_token_dispatcher_type={kind}")
            if backend:
                out.append(f"model.moe_flex_dispatcher_backend={backend}")
        if self.cp_kind:
            out.append(f"model.cp_comm_type={self.cp_kind}")
        return out + list(FSDP if self.fsdp else ())

    def key(self) -> tuple:
        """The parallel layout a published run names (what the validation matches)."""
        return (self.tp, self.pp, self.vp, self.cp, self.ep, self.mb)

    def describe(self) -> str:
        vp = f" VP{self.vp}" if self.vp else ""
        split = " E+L split" if self.accounted else ""
        cp = f" CP{self.cp}" if self.cp > 1 else ""
        cp += f" {self.cp_kind}" if self.cp_kind else ""
        ep = f" EP{self.ep}" if self.ep > 1 else ""
        ep += f" {self.dispatcher}" if self.dispatcher else ""
        rc = f", recompute {'+'.join(self.recompute)}" if self.recompute else ""
        rc += ", Megatron-FSDP" if self.fsdp else ""
        return f"TP{self.tp} PP{self.pp}{vp}{split}{cp}{ep} mb{self.mb}{rc}"


@dataclass(frozen=True)
class Candidate:
    """A layout that resolved and fits, with its best overlap switches and its prediction."""

    layout: Layout
    switches: tuple[str, ...]  # overrides that flipped an automatic overlap decision
    prediction: Prediction
    margin_bytes: int  # the GPU's memory left after the peak and the reserve
    # what `overlap run` would refuse today (the configuration accepts it): "" when runnable
    not_runnable: str = ""
    # the resolved configuration (its dispatcher, CP exchange and switches are what was priced)
    cfg: object = field(default=None, repr=False, compare=False)

    def overrides(self, overrides: list[str]) -> list[str]:
        """The overrides that run this candidate after the caller's `overrides`."""
        return [*_without_layout_keys(overrides), *self.layout.overrides(), *self.switches]

    def command(self, words: list[str], overrides: list[str]) -> str:
        """The `overlap run` command line that runs this candidate."""
        return shlex.join(
            [
                "overlap",
                "run",
                *_without_layout(words, bool(self.layout.dispatcher)),
                *self.layout.words(),
                *self.overrides(overrides),
            ]
        )


@dataclass(frozen=True)
class Given:
    """The command line's own layout priced as typed (its switches as the decision table resolves
    them, none flipped): where the run the user has stands against the search's."""

    layout: Layout
    prediction: Prediction
    margin_bytes: int  # negative: it does not fit

    def rank(self, result: SearchResult) -> tuple[int, bool]:
        """(its place among the priced: 1 + the layouts predicted faster, whether that is its place
        among all: a layout left unpriced is slower than the kept ones and the band, so only past
        those may one come before it)."""
        step, ranked = self.prediction.times.total_s, result.ranked
        place = 1 + sum(c.prediction.times.total_s < step for c in ranked)
        if not ranked:
            return place, result.bounded == 0
        kept = ranked[min(result.keep, len(ranked)) - 1].prediction.times.total_s
        limit = max(kept, ranked[0].prediction.times.total_s * (1 + result.band))
        return place, result.bounded == 0 or step <= limit

    def to_json(self, result: SearchResult) -> dict:
        from overlap.plan.report import config_json

        ranked = result.ranked
        first = ranked[0].prediction.step_ms if ranked else self.prediction.step_ms
        place, exact = self.rank(result)
        return {
            **config_json(self.prediction),
            "layout": self.layout.describe(),
            "vs_first": self.prediction.step_ms / first,
            "rank": place,
            "rank_is_exact": exact,
            "fits": self.margin_bytes >= 0,
            "margin_gb": self.margin_bytes / 1e9,
        }


@dataclass
class SearchResult:
    """The priced candidates (the `keep` fastest that fit, every one predicted within `band` of
    the fastest, and any priced on the way), fastest first, and what the search left out."""

    ranked: list[Candidate]
    words: list[str]
    overrides: list[str]
    cluster: Cluster
    considered: int = 0
    # why layouts were refused by the configuration rules, with how many each
    refused: dict[str, int] = field(default_factory=dict)
    # why recompute rungs of layouts that need one were refused (the layout takes another rung)
    rungs_refused: dict[str, int] = field(default_factory=dict)
    not_fitting: int = 0
    # layouts left unpriced: their compute alone is slower than the keep-th fastest step and than
    # the fastest plus `band`
    bounded: int = 0
    # the command line's own layout priced as typed, or why it could not be (the rule it breaks,
    # or what the model does not price)
    given: Given | str | None = None
    keep: int = KEEP  # how many of the fastest the search priced at least

    @property
    def band(self) -> float:
        """The GPU group's median step-time error (leave-one-out over published runs; 0 where
        the cluster's efficiency is not validated): predictions closer than this are not ordered
        by the model with any confidence."""
        return self.cluster.expected_error[0] if self.cluster.expected_error else 0.0

    def near_best(self) -> int:
        """How many layouts, the first included, are predicted within `band` of the first. Every
        layout within it at the automatic switches and dispatcher is priced (the search bounds out
        only slower ones); the first `REFINE` are also refined (each switch, dispatcher and CP
        exchange the other way), the rest are counted as priced, and refining them could only
        bring more inside: a lower bound once more than `REFINE` are inside
        (`near_best_is_exact`)."""
        if not self.ranked:
            return 0
        first = self.ranked[0].prediction.times.total_s
        limit = first * (1 + self.band)  # the search bounds out from the limit on
        return sum(
            c.prediction.times.total_s < limit or c.prediction.times.total_s == first
            for c in self.ranked
        )

    def near_best_is_exact(self) -> bool:
        """Whether every layout inside the band was refined (so `near_best` is the count)."""
        return self.near_best() <= REFINE

    def to_json(self, top: int) -> dict:
        """The search as JSON: the `top` candidates (the plan's per-configuration fields, with the
        layout, margin and command) and what was left out."""
        from overlap.plan.report import config_json

        return {
            "considered": self.considered,
            "not_fitting": self.not_fitting,
            "bounded": self.bounded,
            "refused": dict(sorted(self.refused.items(), key=lambda kv: -kv[1])),
            "why_best": self.why_best(),
            "rungs_refused": dict(sorted(self.rungs_refused.items(), key=lambda kv: -kv[1])),
            "expected_median_error": self.band if self.cluster.expected_error else None,
            "near_best": self.near_best(),
            "near_best_is_exact": self.near_best_is_exact(),
            "given": self.given.to_json(self)
            if isinstance(self.given, Given)
            else {"refused": self.given}
            if self.given
            else None,
            "candidates": [
                {
                    **config_json(c.prediction),
                    "switches": list(c.switches),
                    "margin_gb": c.margin_bytes / 1e9,
                    "not_runnable": c.not_runnable,
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
        gap, detail = b.total_s - a.total_s, differences(a, b)
        inside = (
            f", inside the model's ±{100 * self.band:.1f}% median error"
            if self.band > 0 and gap < self.band * a.total_s
            else ""
        )
        return (
            f"{self.ranked[0].layout.describe()} beats {self.ranked[1].layout.describe()} by "
            f"{gap * 1e3:.0f} ms per step ({100 * gap / a.total_s:.1f}%{inside}); against the "
            f"runner-up its {detail}"
        )


def differences(a: StepTimes, b: StepTimes) -> str:
    """The (at most four) step components in which `a` differs most from `b`, each as `a`'s
    shorter or longer."""
    parts = {
        "compute": b.compute_s - a.compute_s,
        "pipeline bubble": b.bubble_s - a.bubble_s,
        "overlapped compute's stretch": b.slowdown_s - a.slowdown_s,
    }
    for kind in sorted(set(a.exposed_s) | set(b.exposed_s)):
        parts[f"exposed {kind}"] = b.exposed_s.get(kind, 0.0) - a.exposed_s.get(kind, 0.0)
    shown = sorted(parts.items(), key=lambda kv: -abs(kv[1]))[:4]
    return ", ".join(
        f"{name} {abs(delta) * 1e3:.0f} ms {'shorter' if delta >= 0 else 'longer'}"
        for name, delta in shown
        if abs(delta) * 1e3 >= 0.5
    )


def _without_layout(words: list[str], dispatcher: bool = False) -> list[str]:
    """`words` without the layout flags (and the dispatcher's, where `dispatcher`)."""
    drop = LAYOUT_FLAGS + ((DISPATCHER_FLAG,) if dispatcher else ())
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word in drop:
            skip = True
            continue
        out.append(word)
    return out


def _without_layout_keys(overrides: list[str]) -> list[str]:
    return [o for o in overrides if o.split("=", 1)[0].strip() not in LAYOUT_KEYS]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def recompute_options(cfg) -> list[tuple[str, ...]]:
    """Recompute's rungs: none, the attention product, the MLP's (experts') activation and the
    norms (a dense model: the attention product and the MLP), full recompute. A layout runs
    without recompute where that fits, else takes the fastest rung that fits (their order is not
    their cost's)."""
    m = cfg.resolved.model
    return [
        (),
        ("core_attn",),
        ("layernorm", "moe_act") if m.num_moe_experts else ("core_attn", "mlp"),
        FULL,
    ]


def dp_of(layout: Layout, gpus: int) -> int:
    """The ranks the layout's Megatron-FSDP would shard over on `gpus` GPUs: DP x CP (Megatron's
    data-parallel group with CP)."""
    return gpus // (layout.tp * layout.pp)


def heavier_rungs(
    rung: tuple[tuple[str, ...], bool],
    recompute: list[tuple[str, ...]],
    dp: int,
    start: tuple[tuple[str, ...], bool],
) -> list[tuple[tuple[str, ...], bool]]:
    """The memory rungs to try where a layout at `rung` (recompute, Megatron-FSDP) does not fit:
    from none, each recompute rung and Megatron-FSDP alone (where it has ranks to shard over);
    from a recompute rung, the same with Megatron-FSDP. Megatron-FSDP shards the gradients and
    parameters and moves more bytes for it (every micro-batch), so it is tried on top of a rung
    only where that rung did not fit. A layout that `start`s at Megatron-FSDP alone (its group
    fits nowhere without it, `_probe`) goes on to each recompute rung with it."""
    modules, fsdp = rung
    if start == FSDP_ONLY:
        return [(r, True) for r in recompute[1:]] if rung == start else []
    if fsdp or dp <= 1:
        return [(r, False) for r in recompute[1:]] if rung == NO_RUNG else []
    if modules:
        return [(modules, True)]
    return [(r, False) for r in recompute[1:]] + [FSDP_ONLY]


def candidate_layouts(cfg, gpus: int, gpus_per_node: int) -> Iterator[Layout]:
    """Every layout (without recompute) to try for the resolved base configuration `cfg` on `gpus`
    GPUs: the arithmetic filters (divisibility, an even virtual-pipeline split of the layers, with
    or without the embedding and loss accounted as layers), leaving the rest to the configuration's
    own rules."""
    m = cfg.resolved.model
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    experts = m.num_moe_experts or 0
    for tp in _powers_of_two(min(gpus_per_node, gpus)):
        if heads % tp or groups % tp:
            continue
        for cp in _powers_of_two(min(MAX_CP, gpus // tp)):
            if cp > 1 and (
                not cp_chunks_fit(m.seq_length, cp) or m.seq_length // cp < MIN_CP_TOKENS
            ):
                continue
            for pp in range(1, min(MAX_PP, gpus // (tp * cp), m.num_layers) + 1):
                if (gpus // (tp * cp)) % pp:
                    continue
                dp = gpus // (tp * cp * pp)
                for accounted, vp in _splits(m.num_layers, pp):
                    eps = [e for e in _powers_of_two(experts) if experts % e == 0] or [1]
                    for ep, mb in itertools.product(eps, MICRO_BATCHES):
                        if ep > 1 and (tp * cp * dp) % ep:
                            continue
                        if cfg.train.global_batch_size % (mb * dp):
                            continue
                        yield Layout(tp, pp, vp, ep, mb, (), cp, accounted)


def _splits(layers: int, pp: int) -> Iterator[tuple[bool | None, int | None]]:
    """(accounted, VP) pairs whose split divides: even, and with the embedding and loss as layers;
    spelt out under PP (the recipe's own choice, or a perf recipe's, would otherwise decide), None
    without PP."""
    if pp == 1:
        yield None, None
        return
    for accounted in (False, True):
        total = layers + 2 * accounted
        if total % pp:
            continue
        yield accounted, None
        # down to one layer per virtual stage (Bridge runs Qwen3-30B-A3B at PP2 x VP24)
        for v in range(2, total // pp + 1):
            if total % (pp * v) == 0:
                yield accounted, v


def _resolve(words: list[str]):
    """`overlap run`'s resolution of `words`, without its start-up warnings (a no-op switch is
    the decision table's business; hundreds of candidates would repeat them)."""
    from overlap.harness import resolve_run, start_up_quiet

    with start_up_quiet():
        return resolve_run(words, [], model_noops=False)


@dataclass
class _Space:
    """What every candidate shares: the command line without its layout, and the cluster."""

    words: list[str]
    overrides: list[str]
    cluster: Cluster
    result: SearchResult

    def job(self, layout: Layout, switches: tuple[str, ...] = ()):
        """The resolved job of `layout` (a ConfigError where the rules refuse it)."""
        words = _without_layout(self.words, bool(layout.dispatcher))
        return _resolve(
            words + layout.words() + self.overrides + layout.overrides() + list(switches)
        )

    def resolve(
        self,
        layout: Layout,
        switches: tuple[str, ...] = (),
        count: bool = True,
        rung: bool = False,
    ):
        """The resolved job of `layout` (None where the rules refuse it, counted by reason: as a
        layout, or where `rung` as one of its recompute rungs)."""
        try:
            return self.job(layout, switches)
        except ConfigError as exc:
            if count:
                key = f"{exc.field}: {exc.why.rstrip('.')}"
                tally = self.result.rungs_refused if rung else self.result.refused
                tally[key] = tally.get(key, 0) + 1
            return None

    def bound(self, job) -> float:
        """A lower bound on the step of `job` without simulating its pipeline program:

        - the step priced as if unpipelined (`step_times` at PP 1: compute, the stretch of
          overlapped compute, every exposed transfer; the pipeline's own part is added after these
          and only adds);
        - plus what the pipeline adds at the least: the busiest rank's extra compute and `RAMP` of
          the ideal ramp (rank r's first forward waits for the stages before it, its last backward
          is followed by theirs), on the compute-only task times the simulated ones exceed;
        - minus, under EP overlap, what the unpipelined price may have counted too much: under PP
          more micro-batches' MoE layers run unmerged (the warm-up), each at most one merged
          pair's cost cheaper (`_merged_unit_bound`)."""
        cfg, parallel = job.cfg, job.resolution.layout
        c = microbatch_compute(cfg, parallel, self.cluster)
        comm = comm_plan(cfg, parallel, self.cluster)
        sw = switches_of(cfg, parallel)
        m = microbatches(cfg, parallel)
        slowdown = self.cluster.overlap_slowdown
        flat = step_times(c, comm, replace(sw, pp=1, vpp=1, vp_group=None), m, slowdown)
        pp, weights = max(1, parallel.pp), c.stage_weights
        if pp == 1 or len(weights) != pp * sw.vpp:
            return flat.total_s
        vpp, compute = sw.vpp, m * c.fwd_bwd_s
        ramp = max(
            compute * sum(weights[r::pp]) / vpp + RAMP * c.fwd_bwd_s * sum(weights[:r]) / vpp
            for r in range(pp)
        )
        corrected = 0.0
        if sw.overlap_moe_expert_parallel_comm and comm.ep_a2a_s and m > 1:
            alone = [unmerged_forwards(pp, vpp, m, sw.vp_group), unmerged_forwards(1, 1, m, None)]
            units = c.moe_layers * max(0.0, alone[0] / vpp - alone[1])
            corrected = units * _merged_unit_bound(c, comm, slowdown)
        return flat.total_s + ramp - compute - corrected

    def margin(self, job) -> tuple[int, object]:
        """(the GPU memory left after the peak and the reserve, the peak)."""
        peak = rank_memory(
            job.cfg,
            job.resolution.layout,
            cpu=self.cluster.gpu == "cpu",
            gemm_precision=self.cluster.precision,
        )
        device = GPU_MEMORY_BYTES.get(self.cluster.gpu)
        return (0 if device is None else device - peak.total - reserve_bytes(peak.total)), peak

    def price(self, layout: Layout, switches: tuple[str, ...], job) -> Candidate | str:
        """The candidate (NOT_FITTING where it does not fit)."""
        margin, peak = self.margin(job)
        if margin < 0:
            return NOT_FITTING
        cfg, parallel = job.cfg, job.resolution.layout
        name = layout.describe()
        prediction = predict(name, list(switches), cfg, parallel, self.cluster, False, peak)
        return Candidate(layout, switches, prediction, margin, _refusal(cfg, self.cluster), cfg)

    def variant(self, layout: Layout, switches: tuple[str, ...]) -> Candidate | None:
        job = self.resolve(layout, switches, count=False)
        if job is None:
            return None
        priced = self.price(layout, switches, job)
        return priced if isinstance(priced, Candidate) else None


def _merged_unit_bound(c, comm, slowdown: dict[str, float]) -> float:
    """At most what one merged MoE layer pair (EP overlap) costs beyond its compute: each transfer
    exposed whole and as much again in SM stretch, plus the largest stretch of the layer pair's
    compute (`step_times._merged_moe_layer` charges less)."""
    transfers = sum(comm.ep_a2a_s.values()) + comm.ep_counts_s
    layer = (c.attention_fwd_s + c.moe_fwd_s) * (1 + c.bwd_factor)
    layer += c.attention_recompute_s + c.moe_recompute_s
    return 2 * transfers + 2 * max(slowdown.values(), default=0.0) * layer


def _refusal(cfg, cluster: Cluster) -> str:
    """What `overlap run` would refuse in `cfg` today ("" when nothing)."""
    from overlap.training.runtime_refusals import runtime_refusals

    refusals = runtime_refusals(cfg, gpu=cluster.gpu != "cpu")
    # a setting two rules refuse is named once
    return "; ".join(dict.fromkeys(f"{e.field}={e.value}" for e in refusals))


def search(
    words: list[str],
    overrides: list[str] | None = None,
    cluster: Cluster | None = None,
    plan_precision: str | None = None,
    keep: int = KEEP,
) -> SearchResult:
    """Search the layouts of the `overlap run` command line `words` (harness flags; its layout flags
    are replaced) plus `overrides`, on `cluster` (None: the built-in one for its -g and -gn);
    `plan_precision` prices FP8 as `overlap plan -c fp8_*` does. Returns the `keep` (at least)
    fastest fitting candidates, fastest first (the module notes say what is searched and how the
    rest are bounded out)."""
    if keep < 1:
        raise ValueError(f"keep={keep}: a search keeps at least one layout")
    # KEY=VALUE words are overrides wherever they were written (they follow every flag)
    overrides = [w for w in words if _is_override(w)] + list(overrides or [])
    words = [w for w in words if not _is_override(w)]
    fixed_overrides = _without_layout_keys(overrides)
    # the command line as given (its layout may be one the recipe's batch needs), else without its
    # layout (the recipe's)
    base = _first_resolving(words + overrides, _without_layout(words) + fixed_overrides)
    gpus = base.resolution.layout.world_size
    gpn = int(_flag(words, "-gn", "--gpus_per_node") or 8)
    if cluster is None:
        gpu = _flag(words, "-g", "--gpu")
        precision = plan_precision or precision_of(base.cfg.resolved.precision)
        cluster = builtin_cluster(str(gpu), precision, gpn)
    # what the model cannot price, refused before hundreds of candidates rather than at the first;
    # read without the command line's layout, which the candidates replace (-et, recompute)
    unlaid = _first_resolving(_without_layout(words) + fixed_overrides, words + overrides)
    check_priced(unlaid.cfg, unlaid.resolution.layout, gpu=cluster.gpu != "cpu")
    result = SearchResult([], words, overrides, cluster, keep=keep)
    space = _Space(words, fixed_overrides, cluster, result)
    rungs = recompute_options(base.cfg)

    # every layout's bound at its first recompute rung, then priced cheapest bound first
    queue: list[tuple[float, int, Layout, object]] = []
    order = itertools.count()
    starts: dict[Layout, tuple] = {}  # layout -> the rung it starts from (`_probe`)
    waiting: dict[Layout, int] = {}  # layout -> its memory rungs still in the queue
    for group in _groups(candidate_layouts(base.cfg, gpus, gpn)):
        result.considered += len(group)
        start = _probe(space, group, gpus)
        if isinstance(start, str):
            result.refused[start] = result.refused.get(start, 0) + len(group)
            continue
        if start is None:
            result.not_fitting += len(group)
            continue
        for layout in group:
            first = replace(layout, recompute=start[0], fsdp=start[1])
            job = space.resolve(first)
            if job is not None:
                starts[layout] = start
                waiting[layout] = int(start != NO_RUNG)
                queue.append((space.bound(job), next(order), first, job))
    heapq.heapify(queue)
    # the fastest fitting rung of each layout (keyed without its recompute), fastest first
    best: dict[Layout, Candidate] = {}
    priced: list[Candidate] = []
    too_big: dict[tuple, int] = {}  # layout without mb -> the smallest mb that fits nowhere
    lighter: dict[Layout, object] = {}  # Megatron-FSDP rungs resolved ahead of their turn
    short_at: dict[tuple, int] = {}  # (layout without mb, rung) -> the smallest mb that did not fit
    while queue:
        bound, _n, layout, job = heapq.heappop(queue)
        # kept: the `keep` fastest, and every layout within the expected error of the fastest
        if len(priced) >= keep and bound >= max(
            priced[keep - 1].prediction.times.total_s,
            priced[0].prediction.times.total_s * (1 + result.band),
        ):
            left = {entry[2].plain() for entry in queue} | {layout.plain()}
            result.bounded += len(left - set(best))
            break
        plain = layout.plain()
        if layout.rung != plain.rung:
            waiting[plain] -= 1
        found = best.get(plain)
        if found is not None and bound >= found.prediction.times.total_s:
            continue  # a rung of this layout already priced faster than this one can be
        shape = replace(plain, mb=1)
        if layout.mb >= too_big.get(shape, 1 << 30):  # a smaller micro-batch fits nowhere
            if not waiting.get(plain) and plain not in best:
                result.not_fitting += 1
            continue
        rung_key = (shape, layout.rung)
        # a larger micro-batch than one that did not fit at this rung only needs more memory
        fails = layout.mb >= short_at.get(rung_key, 1 << 30)
        outcome = NOT_FITTING if fails else space.price(layout, (), job)
        if isinstance(outcome, Candidate):
            if found is not None:
                if outcome.prediction.times.total_s >= found.prediction.times.total_s:
                    continue  # the rung already priced stays
                priced.remove(found)
            best[plain] = outcome
            priced.append(outcome)
            priced.sort(key=lambda c: c.prediction.times.total_s)
            continue
        short_at[rung_key] = min(layout.mb, short_at.get(rung_key, 1 << 30))
        # It does not fit at this rung: the heavier rungs go into the queue, each at its own
        # bound. Which rung costs least is the bound's to say, not the rungs' order (re-running
        # the attention product can cost more than the experts' activation and the norms).
        dp = dp_of(layout, gpus)
        for recompute, fsdp in heavier_rungs(layout.rung, rungs, dp, starts[plain]):
            heavier = replace(layout, recompute=recompute, fsdp=fsdp)
            # resolved once: a Megatron-FSDP rung checked ahead of its turn (None: refused)
            job = lighter.pop(heavier) if heavier in lighter else space.resolve(heavier, rung=True)
            if job is None:
                continue
            if recompute and not fsdp and dp > 1:
                # Megatron-FSDP at the same recompute needs less memory: where even that does
                # not fit, this rung cannot (its job is kept for the rung after this one)
                sharded = replace(heavier, fsdp=True)
                lighter[sharded] = space.resolve(sharded, rung=True)
                if lighter[sharded] is not None and space.margin(lighter[sharded])[0] < 0:
                    continue
            waiting[plain] = waiting.get(plain, 0) + 1
            heapq.heappush(queue, (space.bound(job), next(order), heavier, job))
        if not waiting.get(plain) and plain not in best:
            result.not_fitting += 1
            too_big[shape] = min(layout.mb, too_big.get(shape, 1 << 30))
    result.ranked = _refined(space, priced)
    result.given = _given(space, words + overrides)
    return result


def _given(space: _Space, words: list[str]) -> Given | str:
    """The command line's own layout, priced as typed (its micro-batch and recompute included),
    or the configuration rule or pricing refusal that stops it, as the error says it."""
    try:
        job = _resolve(words)
        margin, peak = space.margin(job)
        layout = _layout_of(job)
        prediction = predict(
            layout.describe(), [], job.cfg, job.resolution.layout, space.cluster, False, peak
        )
    except ConfigError as exc:
        return f"{exc.field}: {exc.why.rstrip('.')}"
    return Given(layout, prediction, margin)


def _layout_of(job) -> Layout:
    """The search's description of a resolved job's layout."""
    m, parallel = job.cfg.resolved.model, job.resolution.layout
    if m.recompute_granularity == "full":
        recompute = FULL
    elif m.recompute_granularity == "selective":
        recompute = tuple(m.recompute_modules or ("core_attn",))  # Megatron's default module
    else:
        recompute = ()
    accounted = None
    if parallel.pp > 1:
        accounted = bool(
            m.account_for_embedding_in_pipeline_split and m.account_for_loss_in_pipeline_split
        )
    return Layout(
        tp=parallel.tp,
        pp=parallel.pp,
        vp=parallel.vpp if parallel.vpp > 1 else None,
        ep=parallel.ep,
        mb=job.cfg.train.micro_batch_size,
        recompute=recompute,
        cp=parallel.cp,
        accounted=accounted,
        fsdp=job.cfg.resolved.overlap.use_megatron_fsdp,
    )


def _groups(layouts: Iterator[Layout]) -> list[list[Layout]]:
    """The layouts by (TP, CP, PP, split, EP), each group's least memory-hungry first (the
    smallest micro-batch, no or the shallowest interleave)."""
    groups: dict[tuple, list[Layout]] = {}
    for layout in layouts:
        key = (layout.tp, layout.cp, layout.pp, layout.accounted, layout.ep)
        groups.setdefault(key, []).append(layout)
    return [sorted(g, key=lambda x: (x.mb, x.vp or 1)) for g in groups.values()]


# fields whose refusal holds for a whole group (what the group shares decides it)
GROUP_FIELDS = (
    "model.tensor_model_parallel_size",
    "model.context_parallel_size",
    "model.expert_model_parallel_size",
)


def _probe(space: _Space, group: list[Layout], gpus: int) -> str | tuple | None:
    """Where a group's layouts start, from its least memory-hungry layout the rules accept under
    full recompute (a larger micro-batch, a deeper interleave or less recompute only keeps more
    alive): `NO_RUNG` where that fits; where it fits only under Megatron-FSDP too (DP x CP > 1),
    `FSDP_ONLY`, as no layout of the group fits without it; None where neither fits (a few
    resolutions and one or two memory walks rule out a group that fits nowhere). A probe refused
    on what the group shares (its TP, CP or EP size) rules the group out with that reason
    (returned); one refused on its own interleave tries the next."""
    for layout in group:
        if layout.mb != group[0].mb:
            break
        lightest = replace(layout, recompute=FULL)
        try:
            job = space.job(lightest)
        except ConfigError as exc:
            if exc.field in GROUP_FIELDS:
                return f"{exc.field}: {exc.why.rstrip('.')}"
            continue
        if space.margin(job)[0] >= 0:
            return NO_RUNG
        if dp_of(layout, gpus) <= 1:
            return None
        try:
            job = space.job(replace(lightest, fsdp=True))
        except ConfigError:
            return None  # refused by the command line's own settings (averaging in the collective)
        return FSDP_ONLY if space.margin(job)[0] >= 0 else None
    return NO_RUNG


def _refined(space: _Space, priced: list[Candidate]) -> list[Candidate]:
    """The fastest `REFINE` candidates with their dispatcher, CP exchange and each overlap switch
    tried the other way, one at a time, each kept where it predicts faster; then re-ranked."""
    out = []
    for rank, best in enumerate(priced):
        if rank < REFINE:
            best = _refine(space, best)
        out.append(best)
    return sorted(out, key=lambda c: c.prediction.times.total_s)


def _refine(space: _Space, best: Candidate) -> Candidate:
    layout, m, kernels = best.layout, best.cfg.resolved.model, best.cfg.resolved.kernels
    tries: list[Layout] = []
    if m.is_moe and layout.ep > 1:
        current = kernels.moe_token_dispatcher_type
        if current == "flex":
            current = f"flex:{kernels.moe_flex_dispatcher_backend}"
        tries += [replace(layout, dispatcher=d) for d in DISPATCHERS if d != current]
    if layout.cp > 1:
        current = best.cfg.resolved.overlap.cp_comm_type
        tries += [replace(layout, cp_kind=k) for k in CP_KINDS if k != current]
    for tried_layout in tries:
        tried = space.variant(tried_layout, ())
        if tried is not None and _faster(tried, best):
            best = tried
    for flip in _flips(best):
        tried = space.variant(best.layout, flip)
        if tried is not None and _faster(tried, best):
            best = tried
    return best


def _faster(a: Candidate, b: Candidate) -> bool:
    return a.prediction.times.total_s < b.prediction.times.total_s * (1 - 1e-3)


def _first_resolving(*commands: list[str]):
    """The first of `commands` that resolves (the last one's error where none does)."""
    for i, words in enumerate(commands):
        try:
            return _resolve(words)
        except ConfigError:
            if i == len(commands) - 1:
                raise
    raise ValueError("no command to resolve")


def _is_override(word: str) -> bool:
    return "=" in word and not word.startswith("-")


def _flag(words: list[str], *names: str) -> str | None:
    for i, word in enumerate(words[:-1]):
        if word in names:
            return words[i + 1]
    return None


def _flips(candidate: Candidate) -> list[tuple[str, ...]]:
    """Each applicable overlap switch the other way from where the decisions put it."""
    from overlap.plan.cli import SWITCHES, not_applicable

    prediction, cfg = candidate.prediction, candidate.cfg
    sw = prediction.switches
    state = {
        "EP overlap": sw.overlap_moe_expert_parallel_comm,
        "delay_wgrad": sw.delay_wgrad_compute,
        "DP overlap": sw.overlap_grad_reduce,
        "PP overlap": sw.overlap_p2p_comm,
        "PP deeper warm-up": sw.p2p_warmup_depth > 1,
        "CP overlap": sw.cp_comm_overlap,
    }
    flips = []
    for case in SWITCHES:
        if not_applicable(case.label, prediction.layout, cfg) is not None:
            continue
        on = state.get(case.label)
        # TP overlap's state is per GEMM slot: try it both ways
        flips += [case.off, case.on] if on is None else [case.off if on else case.on]
    return flips
