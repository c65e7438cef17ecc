"""CommOverlapConfig and the rules that decide which communication overlap is on.

Precedence, deliberately better than Megatron-Bridge's (where auto-defaults silently overwrite
values set on the model): a value set on `CommOverlapConfig` (the user) wins; then a value set
directly on the model / DDP / optimizer config (a recipe or an override); then the rule's automatic
default. Every field gets a logged decision record, a request that cannot be honoured is logged as
such (an error in strict mode), and unmet prerequisites of the MoE overlap are always errors, as in
the reference.

Each switch is declared once, here; Bridge's direct spelling (`model.tp_comm_overlap`,
`ddp.overlap_grad_reduce`, ...) is an alias of it (`overlap.config.aliases`), and the rank of the
two is decided there, once (`aliases.request`). Both are inputs only: the resolution reads them and
never writes them back, so after `finalize` they still say what the user (or a recipe) typed. The
resolved value of every switch has one home, the frozen `OverlapPlan` (`cfg.resolved.overlap`),
which everything built or planned from the run reads: the model and its layers, DDP, the optimizer,
the schedules and the planner.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from overlap.config.aliases import request
from overlap.config.switches import Rule, Switch, decide, noops_in
from overlap.config.tp_overlap import TransformerLayerTPOverlapCfg, get_tp_overlap_preset
from overlap.decisions import DEFAULT, MODEL_CONFIG, RULE, USER, DecisionLog
from overlap.errors import ConfigError, check_rules
from overlap.kernels import LinearPlan, SlotPlan
from overlap.kernels.moe_dispatch import record_moe_routing
from overlap.kernels.tp_overlap import TPOverlapInputs, record_tp_slots
from overlap.layout.prerequisites import (
    CP_COMM_TYPES,
    CP_RING_TYPES,
    cp_chunks_fit,
    ep_overlap_has_experts,
    ep_overlap_interleaves,
)

if TYPE_CHECKING:
    from overlap.config.mixed_precision import Precision
    from overlap.config.model import ModelConfig
    from overlap.config.training import DDPConfig, OptimizerConfig
    from overlap.layout import ParallelLayout

# Megatron-Bridge's DP bucket when DP > 1 with the distributed optimizer: a count of parameters, not
# bytes.
BRIDGE_DP_BUCKET_SIZE = 128 * 1024 * 1024


@dataclass(kw_only=True)
class CommOverlapConfig:
    """User-facing overlap switches (Megatron-Bridge names). `None` means "decide for me"; every
    decision is logged.

    `tp_comm_overlap` is required, as in the reference (`CommOverlapConfig()` raises TypeError);
    `None` is accepted for it and means "not requested" (used when a harness flag creates the object
    on the user's behalf).
    """

    # TP collectives overlapped with the GEMMs (needs TP >= 2 and sequence parallel)
    tp_comm_overlap: bool | None
    # per-GEMM TP overlap plan: a userbuffers_* preset name or its dataclass
    tp_comm_overlap_cfg: TransformerLayerTPOverlapCfg | str | None = None
    # TP overlap bootstrap backend (Bridge's; recorded, nccl by default)
    tp_comm_bootstrap_backend: str | None = "nccl"
    # pipeline p2p overlapped with compute
    overlap_p2p_comm: bool | None = None
    # pipeline sends/receives batched
    batch_p2p_comm: bool | None = None
    # ours: plain 1F1B's warm-up, x (PP - rank - 1) forwards (2: every transfer a step of slack)
    p2p_warmup_depth: int | None = None
    # DP gradient reduce overlapped with the backward
    overlap_grad_reduce: bool | None = None
    # DP parameter gather overlapped with the forward
    overlap_param_gather: bool | None = None
    # first param gather in the optimizer step
    overlap_param_gather_with_optimizer_step: bool | None = None
    # pipeline stages launch their param gathers together
    align_param_gather: bool | None = None
    # parameters per DP bucket (not bytes, as Megatron-Core counts); None: the DP rule
    bucket_size: int | None = None
    # output wgrad deferred to the pipeline flush
    defer_embedding_wgrad_compute: bool | None = None
    # deferred output wgrads that may wait, -1: automatic
    wgrad_deferral_limit: int | None = None
    # Bridge's container fills it in; here the layout decides DP (a typed value must agree)
    data_parallel_size: int | None = None
    # EP all-to-alls under another micro-batch's compute
    overlap_moe_expert_parallel_comm: bool | None = None
    # EP overlap: wgrad GEMMs deferred out of the backward
    delay_wgrad_compute: bool | None = None
    # ours: any request that cannot be honoured is an error instead of a logged decision
    strict: bool = False


@dataclass(frozen=True, kw_only=True)
class OverlapPlan:
    """Every overlap switch of a finalized run as a plain value: the one home of the resolved
    values, which the runtime, the model build and the planner read (never the `None`-able request
    fields of the configs, which keep only what was asked). Defaults: all off."""

    # TP collectives overlapped with the GEMMs (what each GEMM slot runs: kernels/tp_overlap.py)
    tp_comm_overlap: bool = False
    # what each TP GEMM slot runs, (slot, plan or None: no overlap) pairs; empty with TP overlap off
    tp_slots: tuple[tuple[str, SlotPlan | None], ...] = ()
    # TP overlap's bootstrap backend, kept for Bridge (None with TP overlap off)
    tp_comm_bootstrap_backend: str | None = None
    overlap_p2p_comm: bool = False  # pipeline receives posted early, sends not waited on
    batch_p2p_comm: bool = False  # pipeline sends and receives batched into one call
    # plain 1F1B's warm-up multiple under overlapped p2p (`pipeline.schedules`; 1: Megatron's)
    p2p_warmup_depth: int = 1
    # EP all-to-alls under another micro-batch's compute
    overlap_moe_expert_parallel_comm: bool = False
    # weight-gradient GEMMs deferred out of the EP-overlapped backward
    delay_wgrad_compute: bool = False
    # the output layer's weight gradient deferred to the pipeline flush
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = -1  # how many output wgrads may wait (-1: automatic)
    # the shared expert computes under the dispatch/combine all-to-all
    moe_shared_expert_overlap: bool = False
    # the distributed optimizer (sharded state, reduce-scatter / all-gather): either of Bridge's
    # two spellings true
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False  # DP gradient reduce bucket by bucket in the backward
    overlap_param_gather: bool = False  # DP parameter all-gather bucket by bucket
    align_param_gather: bool = False  # all pipeline stages launch their gathers together
    bucket_size: int | None = None  # parameters per DP bucket (None: one bucket)
    # Megatron-FSDP and what it shards over DP (`FSDP_SHARDING`; "no_shard" without it)
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    # the first parameter gather launched inside the optimizer step
    overlap_param_gather_with_optimizer_step: bool = False
    # context parallelism's attention exchange: p2p | all_gather | a2a | a2a+p2p (None: CP = 1)
    cp_comm_type: str | None = None
    # p2p: the next KV block in flight under this block's attention (dKV under the backward's)
    cp_comm_overlap: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "tp_slots":
                plain = "tuple of (slot, SlotPlan or None) pairs"
                ok = isinstance(value, tuple) and all(
                    isinstance(pair, tuple)
                    and len(pair) == 2
                    and isinstance(pair[0], str)
                    and isinstance(pair[1], (SlotPlan, type(None)))
                    for pair in value
                )
            else:
                kind = bool if f.type == "bool" else str if f.type.startswith("str") else int
                plain = kind.__name__
                ok = isinstance(value, kind) or (value is None and f.type.endswith("| None"))
            if not ok:
                raise TypeError(f"OverlapPlan.{f.name} resolved to {value!r}, not a plain {plain}")

    def linear(self, name: str) -> LinearPlan | None:
        """The slots of the TP linear `name` (qkv, proj, fc1, fc2), what its layer executes; None
        when none of them overlaps (TP overlap off included)."""
        plans = dict(self.tp_slots)
        plan = LinearPlan(
            plans.get(f"{name}_fprop"), plans.get(f"{name}_dgrad"), plans.get(f"{name}_wgrad")
        )
        return None if plan == LinearPlan(None, None, None) else plan


class _Run:
    """What the rules read: the configs as typed (by section name), the run's precision, layout
    sizes and sequence parallelism, and the switches decided so far (`resolved`, by OverlapPlan
    field)."""

    def __init__(
        self,
        sections: dict[str, Any],
        precision: Precision,
        layout: ParallelLayout,
        log: DecisionLog,
    ):
        self.sections, self.precision, self.log = sections, precision, log
        self.model = sections["model"]
        self.resolved: dict[str, Any] = {}
        self.tp, self.cp, self.pp, self.ep = layout.tp, layout.cp, layout.pp, layout.ep
        self.vpp, self.dp = layout.vpp, layout.dp
        self.sequence_parallel = layout.sequence_parallel
        self.interleaved = self.pp > 1 and self.vpp > 1  # PP > 1 with a virtual pipeline
        self.many = layout.dp > 1
        # gradients are reduced (and the distributed optimizer's state sharded) over DP x CP
        self.reduces = layout.dp * layout.cp > 1
        # the distributed optimizer, and with DP > 1 (Bridge's condition for the DP overlaps)
        self.dist_opt = self.sharded = False  # decided first among the DP switches
        self.fsdp_level = -1  # Megatron-FSDP's index in FSDP_SHARDING (-1: not used)

    def read(self, field: str) -> Any:
        """A field's value as typed, by its `section.name`."""
        section, _, name = field.partition(".")
        return getattr(self.sections[section], name)

    def decide(self, switches: tuple[Switch, ...]) -> None:
        for switch in switches:
            decide(self.log, switch, self)


def resolve_comm_overlap(
    user: CommOverlapConfig | None,
    model: ModelConfig,
    ddp: DDPConfig,
    optimizer: OptimizerConfig,
    precision: Precision,
    layout: ParallelLayout,
    log: DecisionLog,
) -> OverlapPlan:
    """Resolve every overlap switch from its two spellings (read, never written), recording each
    decision; returns the resolved switches as the frozen plan everything downstream reads (the
    distributed optimizer too: on when either of its spellings is, `aliases.ANY_TRUE`). The model /
    DDP / optimizer configs are left as typed. `precision`, `layout`: the run's, already decided
    (EP overlap needs 16-bit compute; the pipeline switches read the layout's virtual pipeline)."""
    u = user or CommOverlapConfig(tp_comm_overlap=None, tp_comm_bootstrap_backend=None)
    sections = {"comm_overlap": u, "model": model, "ddp": ddp, "optimizer": optimizer}
    run = _Run(sections, precision, layout, log)
    tp_cfg = _resolve_tp(run)
    run.decide(_PIPELINE + _CP + _MOE)
    if model.is_moe:
        decide(log, _SHARED_EXPERT, run)
        record_moe_routing(model, log)
    else:  # a dense model has no row for it; a value set is a no-op row (EP = 1)
        run.resolved["moe_shared_expert_overlap"] = bool(model.moe_shared_expert_overlap)
    # the GEMM slots after delay_wgrad_compute is known (it takes the wgrad slots)
    run.resolved["tp_slots"] = (
        record_tp_slots(TPOverlapInputs.of(model), tp_cfg, run.resolved["delay_wgrad_compute"], log)
        if run.resolved["tp_comm_overlap"]
        else ()
    )
    _agree_distributed_optimizer(run)
    run.decide(_DP)
    noops_in(log, _NOOPS, run)
    return OverlapPlan(**run.resolved)


# --- tensor parallelism ---------------------------------------------------------------------------
_TP = Switch(
    "model.tp_comm_overlap",
    lambda _: (False, "not requested"),
    off=(
        (
            lambda s: s.tp < 2,
            "Disabling tensor parallel communication overlap due to TP size < 2.",
            "use -tp 2 or more (it turns sequence parallel on), or do not request tp_comm_overlap.",
        ),
        (
            lambda s: not s.sequence_parallel,
            "Disabling tensor parallel communication overlap due to sequence_parallel=False.",
            "set model.sequence_parallel=true (or drop the override that turned it off), or do not "
            "request tp_comm_overlap.",
        ),
    ),
    # The reference also needs Transformer Engine here; our runtime's overlap
    # (layers/tp_overlap.py) runs on every backend.
    asked=("requested; TP>=2 and sequence parallel", "requested off"),
)


def _resolve_tp(run: _Run) -> dict[str, Any] | None:
    """TP overlap on or off, and its per-GEMM plan; returns the plan in Bridge's dict form (None:
    TP overlap off, or no plan given), which `record_tp_slots` turns into the slots."""
    log, r = run.log, run.resolved
    on = decide(log, _TP, run)
    plan_req = request(run.sections, "comm_overlap.tp_comm_overlap_cfg")
    plan = plan_req.value
    r["tp_comm_bootstrap_backend"] = (
        request(run.sections, "comm_overlap.tp_comm_bootstrap_backend").value or "nccl"
        if on
        else None
    )
    if not on:
        log.record("model.tp_comm_overlap_cfg", None, None, RULE, "TP overlap is off")
        return None
    if plan is None:
        log.record(
            "model.tp_comm_overlap_cfg",
            None,
            None,
            DEFAULT,
            "Tensor parallel overlap: No overlap config provided. Initializing TP comm overlap "
            "with the default config.",
        )
        return None
    preset = get_tp_overlap_preset(plan) if isinstance(plan, str) else plan
    if not isinstance(preset, TransformerLayerTPOverlapCfg):
        raise ConfigError(
            plan_req.spelling,
            plan,
            "it must be a TransformerLayerTPOverlapCfg or the name of a userbuffers_* preset.",
            "pass a preset name such as userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048.",
        )
    label = plan if isinstance(plan, str) else "TransformerLayerTPOverlapCfg"
    log.record(
        "model.tp_comm_overlap_cfg",
        label,
        label,
        USER if plan_req.on_home else MODEL_CONFIG,
        "per-GEMM plan, handed to the TP layers as a dict with top-level None entries dropped",
    )
    return preset.to_dict()


# --- pipeline parallelism -------------------------------------------------------------------------
# overlapped p2p in plain 1F1B: what it does beyond the reference, and what it costs
_P2P_WITHOUT_VPP = (
    "beyond the reference (Megatron-Core asserts overlap_p2p_comm needs a virtual pipeline, "
    "where plain 1F1B's steady cycle crosses the link twice however early receives are posted): "
    "each backward sends its input gradient before its weight gradients (the first stage runs "
    "them after its next forward), so transfers up to a backward's weight-gradient time hide at "
    "PP 2 (half of one between middle stages) and the drain shortens; cost: on the first stage, "
    "one backward's weight-gradient inputs kept one task longer (about one more micro-batch's "
    "activations, counted in the memory estimate); comm_overlap.p2p_warmup_depth=2 gives every "
    "transfer a whole step of slack for PP - rank - 1 more micro-batches' activations"
)


# a deeper warm-up: what it buys and what it costs
_DEEP_WARMUP = (
    "each stage runs {d} x (PP - rank - 1) warm-up forwards, {e} more micro-batches ahead of the "
    "next than 1F1B, so the two transfers of a steady cycle travel under a whole step of compute "
    "(transfers up to half a forward-backward hide; with the weight-gradient split alone, half a "
    "weight-gradient time between middle stages); cost: {e} x (PP - rank - 1) more micro-batches' "
    "activations alive on pipeline rank r, counted in the memory estimate"
)


def _deepens(s: _Run) -> bool:
    """Whether a warm-up multiple acts: overlapped p2p in plain 1F1B."""
    return s.pp > 1 and s.vpp == 1 and s.resolved["overlap_p2p_comm"]


def _depth_note(s: _Run, depth: int) -> str | None:
    return _DEEP_WARMUP.format(d=depth, e=depth - 1) if depth > 1 else None


def _p2p_rule(s: _Run) -> tuple[bool, str]:
    """overlap_p2p_comm by the pipeline layout (batch_p2p_comm: its opposite under PP), and why."""
    if s.interleaved:
        return True, "PP>1 with virtual pipeline: overlap p2p with compute, unbatched"
    if s.pp > 1:
        return False, "PP>1 without virtual pipeline: batched isend/irecv, no p2p overlap"
    return False, "PP=1: no pipeline communication"


_PIPELINE = (
    Switch(
        "model.overlap_p2p_comm",
        _p2p_rule,
        RULE,
        note=lambda s, on: _P2P_WITHOUT_VPP if on and s.pp > 1 and s.vpp == 1 else None,
    ),
    Switch(
        "model.batch_p2p_comm",
        lambda s: (s.pp > 1 and not _p2p_rule(s)[0], _p2p_rule(s)[1]),
        RULE,
        needs=(
            Rule(
                "comm_overlap.batch_p2p_comm",
                lambda s: s.resolved["overlap_p2p_comm"],
                "overlap_p2p_comm and batch_p2p_comm cannot both be on (overlapped p2p is "
                "unbatched).",
                "set one of them to false, or leave both unset for the PP rule.",
                True,
            ),
        ),
    ),
    Switch(
        "comm_overlap.p2p_warmup_depth",
        lambda _: (1, "1F1B's warm-up, PP - rank - 1 forwards (Megatron's)"),
        asked=("requested: a deeper warm-up for overlapped 1F1B", "requested"),
        fixed=lambda s: (
            None if _deepens(s) else (1, "only overlapped p2p in plain 1F1B has a warm-up multiple")
        ),
        checks=(
            Rule(
                "comm_overlap.p2p_warmup_depth",
                lambda s: (
                    not (
                        s.read("comm_overlap.p2p_warmup_depth") is None
                        or type(s.read("comm_overlap.p2p_warmup_depth")) is int
                        and s.read("comm_overlap.p2p_warmup_depth") >= 1
                    )
                ),
                "the warm-up multiple is a whole number of micro-batches per stage, at least 1.",
                "use 1 (1F1B's warm-up) or 2 (a step of slack for every transfer).",
            ),
        ),
        noops=(
            Rule(
                "comm_overlap.p2p_warmup_depth",
                lambda s: (
                    not _deepens(s) and s.read("comm_overlap.p2p_warmup_depth") not in (None, 1)
                ),
                "the warm-up multiple gives overlapped transfers slack in plain 1F1B only (the "
                "interleaved schedule's warm-up has it; batched p2p waits each transfer at once)",
                "use it with -pp 2 or more, no virtual pipeline and "
                "comm_overlap.overlap_p2p_comm=true, comm_overlap.batch_p2p_comm=false; or drop "
                "it.",
            ),
        ),
        note=_depth_note,
    ),
    Switch("model.defer_embedding_wgrad_compute"),
    Switch("model.wgrad_deferral_limit", lambda _: (-1, "Bridge auto default")),
)

# --- context parallelism --------------------------------------------------------------------------
# Context parallelism's exchange (`model.cp_comm_type`, a TransformerConfig field with no
# comm_overlap spelling) and whether p2p's ring overlaps its transfers, with Megatron's
# prerequisites: the sequence cut into 2 x CP load-balanced chunks, and for a2a the heads and query
# groups of a TP rank divisible by CP (each CP rank's share split again over TP under sequence
# parallelism is a split rule, `overlap.layout.resolve.split_rules`). A value set at CP = 1 is a
# no-op row (`_NOOPS`). The exchanges and the chunking predicate are the layout's
# (`overlap.layout.prerequisites`).


def _a2a_heads(s: _Run) -> tuple[int, int, int]:
    """(all-to-all size, a TP rank's attention heads, its query groups) under a2a or a2a+p2p."""
    sizes = s.model.hierarchical_context_parallel_sizes
    a2a = s.cp if s.resolved["cp_comm_type"] == "a2a" else sizes[0]
    return a2a, s.model.num_attention_heads // s.tp, s.model.query_groups // s.tp


def _cp_overlap_fixed(s: _Run) -> tuple[bool, str] | None:
    """cp_comm_overlap is off, whatever was asked, at CP = 1 and with a one-collective exchange."""
    if s.cp == 1:
        return False, "CP=1: nothing to overlap"
    kind = s.resolved["cp_comm_type"]
    if kind in CP_RING_TYPES:
        return None
    return False, f"cp_comm_type={kind}: one collective, nothing in flight under attention"


def _bad_hierarchy(s: _Run) -> bool:
    sizes = s.model.hierarchical_context_parallel_sizes
    return s.resolved["cp_comm_type"] == "a2a+p2p" and (
        not sizes or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != s.cp
    )


_CP = (
    Switch(
        "model.cp_comm_type",
        lambda _: (
            "p2p",
            "CP>1: the KV ring, the next block's transfer under this block's attention "
            "(Megatron's default)",
        ),
        RULE,
        fixed=lambda s: (None, "CP=1: no context-parallel communication") if s.cp == 1 else None,
        checks=(
            Rule(
                "model.cp_comm_type",
                lambda s: s.model.cp_comm_type not in (None, *CP_COMM_TYPES),
                f"context parallelism exchanges keys and values by one of "
                f"{', '.join(CP_COMM_TYPES)}.",
                "use model.cp_comm_type=p2p (the overlapped ring), all_gather or a2a.",
            ),
            Rule(
                "model.seq_length",
                lambda s: not cp_chunks_fit(s.model.seq_length, s.cp),
                lambda s: (
                    f"context parallelism cuts the sequence into 2 x CP = {2 * s.cp} "
                    "load-balanced chunks (rank i holds chunks i and 2CP-1-i), so it must be "
                    "divisible by them."
                ),
                lambda s: f"choose a sequence length divisible by {2 * s.cp}, or a smaller -cp.",
            ),
            Rule(
                "model.hierarchical_context_parallel_sizes",
                _bad_hierarchy,
                lambda s: (
                    f"a2a+p2p needs [a2a size, p2p size] whose product is "
                    f"context_parallel_size ({s.cp})."
                ),
                lambda s: (
                    f"e.g. model.hierarchical_context_parallel_sizes=[2,{s.cp // 2}] (a2a "
                    "inside pairs of CP ranks, the ring across them)."
                ),
            ),
            Rule(
                "model.cp_comm_type",
                lambda s: (
                    s.resolved["cp_comm_type"] in ("a2a", "a2a+p2p")
                    and any(n % _a2a_heads(s)[0] for n in _a2a_heads(s)[1:])
                ),
                lambda s: (
                    "the all-to-all trades sequence for heads: a TP rank's {1} attention "
                    "heads and {2} query groups must be divisible by its size ({0}).".format(
                        *_a2a_heads(s)
                    )
                ),
                "use model.cp_comm_type=p2p or all_gather, or a CP size dividing the heads.",
            ),
        ),
    ),
    Switch(
        "model.cp_comm_overlap",
        lambda s: (
            True,
            f"{s.resolved['cp_comm_type']}: block k+1's keys and values travel while block k's "
            "attention computes",
        ),
        RULE,
        fixed=_cp_overlap_fixed,
        noops=(
            Rule(
                "model.cp_comm_overlap",
                lambda s: (
                    s.cp > 1
                    and s.resolved["cp_comm_type"] not in CP_RING_TYPES
                    and s.model.cp_comm_overlap
                ),
                lambda s: (
                    f"cp_comm_type={s.resolved['cp_comm_type']} exchanges keys and values "
                    "in one collective before attention: there is no ring to overlap"
                ),
                "use model.cp_comm_type=p2p, or drop model.cp_comm_overlap.",
                True,
            ),
        ),
    ),
)


# --- expert parallelism ---------------------------------------------------------------------------
def _graph_scope(model: ModelConfig) -> set[str]:
    """The CUDA-graph scope as a set of module names; "full" / empty mean no per-module scope (as
    the delay_wgrad_compute checks of Megatron-Bridge's CommOverlapConfig read it)."""
    return set(model.graph_scope) - {"full", "full_iteration"}


def _graphed_wgrads(s: _Run) -> bool:
    """delay_wgrad_compute under CUDA graphs that capture weight-gradient GEMMs: attention's, or
    the router's when a shared expert runs outside the overlap (whatever cuda_graph_impl says, as
    the reference checks it)."""
    m, scope = s.model, _graph_scope(s.model)
    return "attn" in scope or (
        "moe_router" in scope
        and m.moe_shared_expert_intermediate_size is not None
        and not m.moe_shared_expert_overlap
    )


def _ep_size_fix(s: _Run) -> str:
    per_stage = s.tp * s.cp * s.dp
    if per_stage >= 2:
        return "use -ep 2 or more."
    # -ep 2 is impossible here: experts are carved out of the ranks of one pipeline stage.
    return (
        "expert parallelism needs at least 2 ranks per pipeline stage and this layout has "
        f"{per_stage}: use -ng 2 -ep 2 or more, or drop --moe_a2a_overlap / "
        "comm_overlap.overlap_moe_expert_parallel_comm."
    )


def _delay_spelling(s: _Run) -> str:
    """The spelling delay_wgrad_compute was requested under (its errors name what was typed)."""
    return request(s.sections, "comm_overlap.delay_wgrad_compute").spelling


def _torch_below_2_6(_: _Run) -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6)


_EP_ON = "when enabling overlap_moe_expert_parallel_comm"
# The prerequisites of the MoE expert-parallel overlap: the asserts of Megatron-Bridge's
# CommOverlapConfig, which mirror Megatron-Core's TransformerConfig.__post_init__ (always errors).
_EP_OVERLAP_NEEDS = (
    Rule(
        "model.expert_model_parallel_size",
        lambda s: not ep_overlap_has_experts(s.ep),
        "EP overlap is only supported when expert_model_parallel_size > 1.",
        _ep_size_fix,
    ),
    Rule(
        "model.num_moe_experts",
        lambda s: (s.model.num_moe_experts or 0) <= 1,
        "EP overlap is only supported when num_moe_experts > 1.",
        "use a MoE recipe (e.g. -mr qwen3_moe_tiny).",
    ),
    Rule(
        "model.moe_token_dispatcher_type",
        lambda s: s.model.moe_token_dispatcher_type not in ("alltoall", "flex"),
        "EP overlap is only supported when moe_token_dispatcher_type == 'alltoall' or 'flex'.",
        "set model.moe_token_dispatcher_type=alltoall.",
    ),
    Rule(
        "model.bf16",
        lambda s: not (s.precision.bf16 or s.precision.fp16),
        "EP overlap is only supported when using bf16 or fp16 models.",
        "use -c bf16 (mixed_precision=bf16_mixed).",
        lambda s: s.precision.bf16,
    ),
    Rule(
        "torch",
        _torch_below_2_6,
        "A2A overlap encounters hang issue with torch version < 2.6.0.",
        "install torch >= 2.6.",
        lambda _: torch.__version__,
    ),
    Rule(
        "model.virtual_pipeline_model_parallel_size",
        lambda s: (
            not ep_overlap_interleaves(s.pp, s.vpp, s.model.virtual_pipeline_model_parallel_size)
        ),
        "virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size "
        "> 1 (PP without VPP cannot interleave the overlap schedule).",
        "set -vp 2 (or more), or -pp 1.",
    ),
    Rule(
        "model.recompute_granularity",
        lambda s: s.model.recompute_granularity == "full",
        f"disable full recomputation {_EP_ON}.",
        "use recompute_granularity=selective (without 'moe') or no recompute.",
    ),
    Rule(
        "model.recompute_method",
        lambda s: s.model.recompute_method is not None,
        f"disable recomputation method {_EP_ON}.",
        "set model.recompute_method=null.",
    ),
    Rule(
        "model.recompute_num_layers",
        lambda s: s.model.recompute_num_layers is not None,
        f"recompute_num_layers must be None {_EP_ON}.",
        "set model.recompute_num_layers=null.",
    ),
    Rule(
        "model.recompute_modules",
        lambda s: "moe" in (s.model.recompute_modules or []),
        f"disable moe in recompute_modules {_EP_ON}.",
        "remove 'moe' from recompute_modules.",
    ),
    Rule(
        "model.moe_shared_expert_overlap",
        lambda s: s.model.moe_shared_expert_overlap,
        f"disable moe_shared_expert_overlap {_EP_ON} (they conflict).",
        "set model.moe_shared_expert_overlap=false.",
    ),
    Rule(
        "model.mtp_num_layers",
        lambda s: s.model.mtp_num_layers not in (None, 0, 1),
        f"MTP supports at most one layer {_EP_ON}.",
        "set model.mtp_num_layers to 0 or 1.",
    ),
    Rule(
        "model.cuda_graph_scope",
        lambda s: (
            s.model.cuda_graph_impl == "transformer_engine"
            and _graph_scope(s.model) & {"moe", "mlp"}
        ),
        "CUDA-graph scope must not cover 'moe' or 'mlp' with EP overlap (the schedule splits "
        "those parts).",
        "drop moe/mlp from cuda_graph_scope.",
    ),
)
_DELAY_WGRAD_NEEDS = (
    Rule(
        _delay_spelling,
        lambda s: not s.resolved["overlap_moe_expert_parallel_comm"],
        "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute.",
        lambda s: (
            f"also set {_delay_spelling(s).split('.')[0]}.overlap_moe_expert_parallel_comm="
            "true, or drop delay_wgrad."
        ),
        True,
    ),
    Rule(
        "model.gradient_accumulation_fusion",
        lambda s: _graphed_wgrads(s) and not s.model.gradient_accumulation_fusion,
        "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion (the captured "
        "weight-gradient GEMMs need static memory addresses).",
        "set model.gradient_accumulation_fusion=true or remove attn/moe_router from "
        "cuda_graph_scope.",
        False,
    ),
    Rule(
        lambda s: "model.add_bias_linear" if s.model.add_bias_linear else "model.add_qkv_bias",
        lambda s: (
            "attn" in _graph_scope(s.model) and (s.model.add_bias_linear or s.model.add_qkv_bias)
        ),
        "CUDA graph with delay_wgrad_compute does not support attention bias for now.",
        "set model.add_bias_linear=false and model.add_qkv_bias=false.",
        True,
    ),
)
_MOE = (
    Switch("model.overlap_moe_expert_parallel_comm", needs=_EP_OVERLAP_NEEDS),
    Switch("model.delay_wgrad_compute", needs=_DELAY_WGRAD_NEEDS),
)
_SHARED_EXPERT = Switch(
    "model.moe_shared_expert_overlap",
    off=(
        (
            lambda s: not s.model.moe_shared_expert_intermediate_size,
            "the model has no shared expert (moe_shared_expert_intermediate_size is not set): "
            "nothing to overlap",
            "set model.moe_shared_expert_intermediate_size, or drop moe_shared_expert_overlap.",
        ),
        (
            lambda s: s.model.moe_token_dispatcher_type == "flex",
            "the flex dispatcher does not support shared-expert overlap",
            "use moe_token_dispatcher_type=alltoall, or drop moe_shared_expert_overlap.",
        ),
    ),
    asked=("shared expert computes under the dispatch/combine all-to-all", "requested off"),
)


# --- data parallelism -----------------------------------------------------------------------------
# Megatron-FSDP's sharding strategies, in order: each shards what the one before it does and more
FSDP_SHARDING = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _megatron_fsdp(run: _Run) -> bool:
    """Megatron-FSDP's rules (megatron/training/arguments.py; Bridge's perf harness): the sharding
    strategy is its own (set without it, it would shard nothing: refused, not ignored); it cannot
    average inside the collective or defer the output layer's weight gradient (Bridge turns both
    off for it). Records its row; returns whether it is on."""
    ddp = run.sections["ddp"]
    fsdp, strategy = bool(ddp.use_megatron_fsdp), ddp.data_parallel_sharding_strategy
    check_rules(
        [
            (
                "ddp.data_parallel_sharding_strategy",
                strategy,
                strategy in FSDP_SHARDING,
                "unknown sharding strategy.",
                f"use one of {', '.join(FSDP_SHARDING)}.",
            ),
            (
                "ddp.data_parallel_sharding_strategy",
                strategy,
                fsdp or strategy == "no_shard",
                "the sharding strategy is Megatron-FSDP's: without it nothing is sharded so.",
                "set ddp.use_megatron_fsdp=true, or ddp.use_distributed_optimizer=true to shard "
                "the optimizer state only.",
            ),
            (
                "ddp.average_in_collective",
                True,
                not (fsdp and ddp.average_in_collective),
                "Megatron-FSDP does not average inside the collective (Bridge turns it off).",
                "set ddp.average_in_collective=false.",
            ),
            (
                "comm_overlap.defer_embedding_wgrad_compute",
                True,
                not (fsdp and run.resolved["defer_embedding_wgrad_compute"]),
                "deferring the output layer's weight gradient cannot work with Megatron-FSDP "
                "(Bridge turns it off).",
                "set comm_overlap.defer_embedding_wgrad_compute=false.",
            ),
        ]
    )
    run.resolved["use_megatron_fsdp"] = fsdp
    run.resolved["data_parallel_sharding_strategy"] = strategy
    run.fsdp_level = FSDP_SHARDING.index(strategy) if fsdp else -1
    if fsdp:
        shards = (
            "nothing (its buffers are whole; gradients are all-reduced)",
            "the optimizer state",
            "the optimizer state and the gradients (reduce-scattered layer by layer every "
            "micro-batch)",
            "the optimizer state, the gradients and the parameters (gathered layer by layer for "
            "every forward and backward)",
        )[run.fsdp_level]
        run.log.record(
            "ddp.use_megatron_fsdp",
            True,
            True,
            USER,
            f"DP ranks shard {shards}"
            + ("" if run.reduces else "; DP x CP = 1: nothing to shard over"),
        )
    return fsdp


def _agree_distributed_optimizer(run: _Run) -> None:
    """The distributed optimizer is on when either spelling is (Bridge's rule): the plan's
    `use_distributed_optimizer`, which the runtime reads; both spellings stay as typed, and the one
    left false is a decision row. Under Megatron-FSDP its sharding strategy decides instead (a
    row where that differs from the spellings): Megatron runs it on the distributed optimizer,
    whose state it shards from `optim` on, and `no_shard` shards nothing."""
    ddp, optimizer = run.sections["ddp"], run.sections["optimizer"]
    run.dist_opt = bool(request(run.sections, "ddp.use_distributed_optimizer").value)
    if _megatron_fsdp(run):
        sharded = run.fsdp_level >= 1
        if sharded != run.dist_opt:
            run.dist_opt = sharded
            run.log.record(
                "ddp.use_distributed_optimizer",
                None,
                sharded,
                RULE,
                "Megatron-FSDP shards the optimizer state by its strategy (on the distributed "
                "optimizer, which Megatron turns on)"
                if sharded
                else "Megatron-FSDP's no_shard keeps the optimizer state whole",
            )
    elif run.dist_opt and not (
        ddp.use_distributed_optimizer and optimizer.use_distributed_optimizer
    ):
        run.log.record(
            f"{'ddp' if not ddp.use_distributed_optimizer else 'optimizer'}"
            ".use_distributed_optimizer",
            None,
            True,
            RULE,
            "the distributed optimizer is on in one of ddp/optimizer; both must agree",
        )
    run.sharded = run.many and run.dist_opt
    run.resolved["use_distributed_optimizer"] = run.dist_opt


def _fsdp_overlaps(level: int, what: str):
    """Megatron-FSDP turns the DP overlap `what` on from sharding `level` on (megatron_fsdp.py:
    "Default to overlapped ..."), whatever the request: the switch's fixed value (None below)."""
    return lambda s: (
        (True, f"Megatron-FSDP {what} layer by layer and turns this on")
        if s.fsdp_level >= level and s.reduces
        else None
    )


_SHARDED = "DP>1 with the distributed optimizer"


def _reduce_rule(s: _Run) -> tuple[bool, str]:
    if s.sharded:
        return True, _SHARDED
    if not s.reduces:
        return False, "DP x CP = 1: no gradient reduction"
    if not s.many:
        return (
            False,
            "DP=1: Bridge's DP defaults need DP>1 (the reduction over CP is honoured on request)",
        )
    return False, "DP defaults apply only with the distributed optimizer (as Bridge)"


def _gather_rule(s: _Run) -> tuple[bool, str]:
    if s.sharded:
        return True, _SHARDED
    if s.dist_opt and s.reduces:
        return (
            False,
            "DP=1: Bridge's DP defaults need DP>1 (the gather over CP is honoured on request)",
        )
    return False, "no distributed parameter gather"


def _bucket_rule(s: _Run) -> tuple[int | None, str]:
    if s.sharded:
        return BRIDGE_DP_BUCKET_SIZE, f"{_SHARDED}: 128M parameters (Bridge)"
    if s.resolved["overlap_grad_reduce"]:
        bucket = max(40_000_000, 1_000_000 * s.dp)
        return bucket, "overlapped reduce: Megatron DDP default bucket"
    return None, "no overlapped reduce: one bucket"


_DP = (
    # Bridge turns the overlapped reduce on only for DP>1 with the distributed optimizer; we honour
    # an explicit request without it too (bucketed all-reduce instead of reduce-scatter).
    Switch(
        "ddp.overlap_grad_reduce",
        _reduce_rule,
        RULE,
        fixed=_fsdp_overlaps(2, "reduce-scatters the gradients"),
        off=(
            (
                lambda s: not s.reduces,
                "DP x CP = 1: there is no gradient reduction to overlap",
                "use more data-parallel or context-parallel ranks, or do not request it.",
            ),
        ),
    ),
    Switch(
        "ddp.overlap_param_gather",
        _gather_rule,
        RULE,
        fixed=_fsdp_overlaps(3, "gathers the parameters"),
        off=(
            (
                lambda s: not s.reduces,
                "DP x CP = 1: no parameter gather",
                "set ddp.use_distributed_optimizer=true with DP x CP > 1.",
            ),
            (
                lambda s: not s.dist_opt,
                "parameters are only gathered with the distributed optimizer",
                "set ddp.use_distributed_optimizer=true with DP>1.",
            ),
        ),
    ),
    Switch(
        "ddp.align_param_gather",
        lambda s: (
            (True, "all PP stages launch the param gather together with VPP")
            if s.sharded and s.interleaved
            else (False, "only with DP>1, distributed optimizer, PP>1 and VPP")
        ),
        RULE,
    ),
    Switch(
        "ddp.bucket_size",
        _bucket_rule,
        RULE,
        checks=(
            Rule(
                "ddp.bucket_size",
                lambda s: s.resolved["bucket_size"] is not None and s.resolved["bucket_size"] < 1,
                "a bucket holds at least one parameter.",
                "use a positive count of parameters (not bytes), or null for one bucket.",
                lambda s: s.resolved["bucket_size"],
            ),
        ),
    ),
    Switch(
        "optimizer.overlap_param_gather_with_optimizer_step",
        lambda _: (False, "never turned on automatically"),
        off=(
            (
                lambda s: not (s.dist_opt and s.interleaved),
                "needs the distributed optimizer with PP>1 and VPP",
                "use it only with -pp >1 -vp >1 and the distributed optimizer.",
            ),
        ),
        # Megatron launches the first bucket's gather inside the optimizer step only with this
        # switch; our overlapped gather always does (data_parallel/param_gather.py), and without
        # it gathers right after the step.
        noops=(
            Rule(
                "optimizer.overlap_param_gather_with_optimizer_step",
                lambda s: s.resolved["overlap_param_gather_with_optimizer_step"],
                lambda s: (
                    "ddp.overlap_param_gather already launches the first bucket's "
                    "all-gather inside the optimizer step"
                    if s.resolved["overlap_param_gather"]
                    else "without ddp.overlap_param_gather every bucket is gathered right "
                    "after the step"
                ),
                "drop it: ddp.overlap_param_gather=true gives the overlap it asks for.",
                True,
            ),
        ),
    ),
)

# --- switches left on that cannot do anything in this layout --------------------------------------
# (the model-dependent ones, such as a DP overlap with a single bucket, are found by
# `overlap.training.dp_overlap_noops`)
_NOOPS = (
    *(
        Rule(
            f"model.{name}",
            lambda s, name=name: s.cp == 1 and getattr(s.model, name) not in (None, False),
            "CP=1: the sequence is not split, there is no context-parallel exchange",
            "use -cp 2 or more, or drop it.",
        )
        for name in ("cp_comm_type", "cp_comm_overlap", "hierarchical_context_parallel_sizes")
    ),
    Rule(
        "model.moe_shared_expert_overlap",
        lambda s: s.resolved["moe_shared_expert_overlap"] and s.ep == 1,
        "EP=1: every token stays on its rank, so there is no dispatch/combine all-to-all for the "
        "shared expert to compute under",
        "use -ep 2 or more, or drop moe_shared_expert_overlap.",
        True,
    ),
    *(
        Rule(
            f"model.{name}",
            lambda s, name=name: s.pp == 1 and s.resolved.get(name, getattr(s.model, name)),
            "PP=1: there is no pipeline send/receive",
            "use -pp 2 or more, or drop it.",
            True,
        )
        for name in ("overlap_p2p_comm", "batch_p2p_comm", "deallocate_pipeline_outputs")
    ),
    Rule(
        "ddp.align_param_gather",
        lambda s: s.resolved["align_param_gather"] and not (s.sharded and s.interleaved),
        "it aligns the parameter gathers of pipeline stages, which needs DP>1, the distributed "
        "optimizer, PP>1 and VPP",
        "drop ddp.align_param_gather.",
        True,
    ),
    Rule(
        "ddp.align_param_gather",
        lambda s: (
            s.resolved["align_param_gather"]
            and s.sharded
            and s.interleaved
            and not s.resolved["overlap_param_gather"]
        ),
        "without ddp.overlap_param_gather every parameter gather runs at the optimizer step anyway",
        "set ddp.overlap_param_gather=true, or drop ddp.align_param_gather.",
        True,
    ),
)
