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

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from overlap.config.aliases import Request, request
from overlap.config.decisions import DEFAULT, MODEL_CONFIG, RULE, USER, DecisionLog
from overlap.config.tp_overlap import (
    LinearPlan,
    SlotPlan,
    TransformerLayerTPOverlapCfg,
    effective_tp_plan,
    get_tp_overlap_preset,
    kernel_knobs,
)
from overlap.errors import ConfigError

if TYPE_CHECKING:
    from overlap.config.mixed_precision import Precision
    from overlap.config.model import ModelConfig
    from overlap.config.training import DDPConfig, OptimizerConfig

Resolved = dict[str, Any]  # the resolved switches, by OverlapPlan field, while they are decided

# Megatron-Bridge's DP bucket when DP > 1 with the distributed optimizer: a count of parameters, not
# bytes.
BRIDGE_DP_BUCKET_SIZE = 128 * 1024 * 1024

TP_DISABLE_TP_SIZE = "Disabling tensor parallel communication overlap due to TP size < 2."
TP_DISABLE_NO_SP = "Disabling tensor parallel communication overlap due to sequence_parallel=False."
TP_NO_PRESET = (
    "Tensor parallel overlap: No overlap config provided. Initializing TP comm overlap with the "
    "default config."
)


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
    data_parallel_size: int | None = None  # the DP size, filled in by finalize (not a setting)
    # EP all-to-alls under another micro-batch's compute
    overlap_moe_expert_parallel_comm: bool | None = None
    # EP overlap: wgrad GEMMs deferred out of the backward
    delay_wgrad_compute: bool | None = None
    # ours: any request that cannot be honoured is an error instead of a logged decision
    strict: bool = False


Ask = Callable[[str], Request]  # a switch's request, by its comm_overlap name (`aliases.request`)


def _choose(
    log: DecisionLog,
    field: str,
    req: Request,
    auto: Any,
    auto_by: str,
    auto_reason: str,
    note: Callable[[Any], str | None] = lambda _value: None,
) -> Any:
    """Take the request (comm_overlap's spelling beats the direct one: `aliases.request`), else the
    automatic value, and record the decision; `note` (given the effective value) adds what that
    value means here to the reason."""
    if req.spelling is None:
        value, requested, by, why = auto, None, auto_by, auto_reason
    elif req.on_home:
        value, requested, by, why = req.value, req.value, USER, "set on comm_overlap"
    else:
        value, requested, by = req.value, req.value, MODEL_CONFIG
        why = f"set directly on {req.spelling.split('.')[0]}"
    extra = note(value)
    return log.record(field, requested, value, by, why if extra is None else f"{why}; {extra}")


def _by(req: Request) -> str | None:
    """Who set a request: the user on comm_overlap, a direct spelling, or nobody (None)."""
    return None if req.spelling is None else USER if req.on_home else MODEL_CONFIG


@dataclass(frozen=True, kw_only=True)
class OverlapPlan:
    """Every overlap switch of a finalized run as a plain value: the one home of the resolved
    values, which the runtime, the model build and the planner read (never the `None`-able request
    fields of the configs, which keep only what was asked). Defaults: all off."""

    # TP collectives overlapped with the GEMMs (the per-GEMM plan: tp_overlap.py)
    tp_comm_overlap: bool = False
    # what each TP GEMM slot runs, (slot, plan or None: no overlap) pairs; empty with TP overlap off
    tp_slots: tuple[tuple[str, SlotPlan | None], ...] = ()
    # TP overlap's bootstrap backend, kept for Bridge (None with TP overlap off)
    tp_comm_bootstrap_backend: str | None = None
    overlap_p2p_comm: bool = False  # pipeline receives posted early, sends not waited on
    batch_p2p_comm: bool = False  # pipeline sends and receives batched into one call
    # EP all-to-alls under another micro-batch's compute
    overlap_moe_expert_parallel_comm: bool = False
    # weight-gradient GEMMs deferred out of the EP-overlapped backward
    delay_wgrad_compute: bool = False
    # the output layer's weight gradient deferred to the pipeline flush
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = -1  # how many output wgrads may wait (-1: automatic)
    # the shared expert computes under the dispatch/combine all-to-all
    moe_shared_expert_overlap: bool = False
    overlap_grad_reduce: bool = False  # DP gradient reduce bucket by bucket in the backward
    overlap_param_gather: bool = False  # DP parameter all-gather bucket by bucket
    align_param_gather: bool = False  # all pipeline stages launch their gathers together
    bucket_size: int | None = None  # parameters per DP bucket (None: one bucket)
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


def resolve_comm_overlap(
    user: CommOverlapConfig | None,
    model: ModelConfig,
    ddp: DDPConfig,
    optimizer: OptimizerConfig,
    precision: Precision,
    dp_size: int,
    log: DecisionLog,
) -> OverlapPlan:
    """Resolve every overlap switch from its two spellings (read, never written), recording each
    decision; returns the resolved switches as the frozen plan everything downstream reads. The
    model / DDP / optimizer configs are left as typed, except the distributed optimizer's home,
    `ddp.use_distributed_optimizer`, which the runtime reads: it is set when its alias
    `optimizer.use_distributed_optimizer` is true (`aliases.ANY_TRUE`). `precision`: the run's,
    already decided (EP overlap needs 16-bit compute)."""
    u = (
        user
        if user is not None
        else CommOverlapConfig(tp_comm_overlap=None, tp_comm_bootstrap_backend=None)
    )
    r: Resolved = {}
    sections = {"comm_overlap": u, "model": model, "ddp": ddp, "optimizer": optimizer}

    def ask(name: str) -> Request:
        return request(sections, f"comm_overlap.{name}")

    tp_cfg = _resolve_tp(ask, model, log, r)
    _resolve_pp(ask, model, log, r)
    _resolve_cp(model, log, r)
    _resolve_moe(ask, model, precision, log, dp_size, r)
    _resolve_tp_plan(model, tp_cfg, log, r)
    _resolve_dp(ask, model, ddp, optimizer, dp_size, log, r)
    _detect_noops(model, ddp, dp_size, log, r)
    return OverlapPlan(**r)


def _detect_noops(
    model: ModelConfig, ddp: DDPConfig, dp_size: int, log: DecisionLog, r: Resolved
) -> None:
    """Switches left on by the resolution that cannot do anything in this layout (the
    model-dependent ones, such as a DP overlap with a single bucket, are found by
    `overlap.training.dp_overlap_noops`)."""
    pp, vp = model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size or 1
    if model.context_parallel_size == 1:
        for name in ("cp_comm_type", "cp_comm_overlap", "hierarchical_context_parallel_sizes"):
            if getattr(model, name) not in (None, False):
                log.noop(
                    f"model.{name}",
                    getattr(model, name),
                    "CP=1: the sequence is not split, there is no context-parallel exchange",
                    "use -cp 2 or more, or drop it.",
                )
    if r["moe_shared_expert_overlap"] and model.expert_model_parallel_size == 1:
        log.noop(
            "model.moe_shared_expert_overlap",
            True,
            "EP=1: every token stays on its rank, so there is no dispatch/combine all-to-all for "
            "the shared expert to compute under",
            "use -ep 2 or more, or drop moe_shared_expert_overlap.",
        )
    pipeline = {
        "overlap_p2p_comm": r["overlap_p2p_comm"],
        "batch_p2p_comm": r["batch_p2p_comm"],
        "deallocate_pipeline_outputs": model.deallocate_pipeline_outputs,
    }
    for name, on in pipeline.items():
        if on and pp == 1:
            log.noop(
                f"model.{name}",
                True,
                "PP=1: there is no pipeline send/receive",
                "use -pp 2 or more, or drop it.",
            )
    if r["align_param_gather"] and not (
        dp_size > 1 and ddp.use_distributed_optimizer and pp > 1 and vp > 1
    ):
        log.noop(
            "ddp.align_param_gather",
            True,
            "it aligns the parameter gathers of pipeline stages, which needs DP>1, the distributed "
            "optimizer, PP>1 and VPP",
            "drop ddp.align_param_gather.",
        )
    elif r["align_param_gather"] and not r["overlap_param_gather"]:
        log.noop(
            "ddp.align_param_gather",
            True,
            "without ddp.overlap_param_gather every parameter gather runs at the optimizer step "
            "anyway",
            "set ddp.overlap_param_gather=true, or drop ddp.align_param_gather.",
        )


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _resolve_cp(model: ModelConfig, log: DecisionLog, r: Resolved) -> None:
    """Context parallelism's exchange (`model.cp_comm_type`, a TransformerConfig field with no
    comm_overlap spelling) and whether p2p's ring overlaps its transfers, with Megatron's
    prerequisites: the sequence cut into 2 x CP load-balanced chunks (each CP rank's share split
    again over TP under sequence parallelism), and for a2a the heads and query groups of a TP rank
    divisible by CP. A user value at CP = 1 is a no-op row."""
    cp, tp = model.context_parallel_size, model.tensor_model_parallel_size
    if model.cp_comm_type is not None and model.cp_comm_type not in CP_COMM_TYPES:
        raise ConfigError(
            "model.cp_comm_type",
            model.cp_comm_type,
            f"context parallelism exchanges keys and values by one of {', '.join(CP_COMM_TYPES)}.",
            "use model.cp_comm_type=p2p (the overlapped ring), all_gather or a2a.",
        )
    if cp == 1:
        # a value set at CP = 1 is reported once, as a no-op row (`_detect_noops`)
        r["cp_comm_type"] = log.record(
            "model.cp_comm_type",
            None,
            None,
            RULE,
            "CP=1: no context-parallel communication",
        )
        r["cp_comm_overlap"] = log.record(
            "model.cp_comm_overlap", None, False, RULE, "CP=1: nothing to overlap"
        )
        return
    if model.seq_length % (2 * cp):
        raise ConfigError(
            "model.seq_length",
            model.seq_length,
            f"context parallelism cuts the sequence into 2 x CP = {2 * cp} load-balanced chunks "
            "(rank i holds chunks i and 2CP-1-i), so it must be divisible by them.",
            f"choose a sequence length divisible by {2 * cp}, or a smaller -cp.",
        )
    if model.sequence_parallel and (model.seq_length // cp) % tp:
        raise ConfigError(
            "model.seq_length",
            model.seq_length,
            f"each CP rank's {model.seq_length // cp} tokens are split again over "
            f"tensor_model_parallel_size ({tp}) by sequence parallelism.",
            f"choose a sequence length divisible by CP x TP = {cp * tp}.",
        )
    kind = _choose(
        log,
        "model.cp_comm_type",
        request({"model": model}, "model.cp_comm_type"),
        "p2p",
        RULE,
        "CP>1: the KV ring, the next block's transfer under this block's attention "
        "(Megatron's default)",
    )
    sizes = model.hierarchical_context_parallel_sizes
    if kind == "a2a+p2p" and (
        not sizes or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp
    ):
        raise ConfigError(
            "model.hierarchical_context_parallel_sizes",
            sizes,
            f"a2a+p2p needs [a2a size, p2p size] whose product is context_parallel_size ({cp}).",
            f"e.g. model.hierarchical_context_parallel_sizes=[2,{cp // 2}] (a2a inside pairs of "
            "CP ranks, the ring across them).",
        )
    if kind in ("a2a", "a2a+p2p"):
        a2a = cp if kind == "a2a" else sizes[0]
        heads, groups = model.num_attention_heads // tp, model.query_groups // tp
        if heads % a2a or groups % a2a:
            raise ConfigError(
                "model.cp_comm_type",
                kind,
                f"the all-to-all trades sequence for heads: a TP rank's {heads} attention heads "
                f"and {groups} query groups must be divisible by its size ({a2a}).",
                "use model.cp_comm_type=p2p or all_gather, or a CP size dividing the heads.",
            )
    r["cp_comm_type"] = kind
    if kind in ("p2p", "a2a+p2p"):
        r["cp_comm_overlap"] = _choose(
            log,
            "model.cp_comm_overlap",
            request({"model": model}, "model.cp_comm_overlap"),
            True,
            RULE,
            f"{kind}: block k+1's keys and values travel while block k's attention computes",
        )
        return
    if model.cp_comm_overlap:
        log.noop(
            "model.cp_comm_overlap",
            True,
            f"cp_comm_type={kind} exchanges keys and values in one collective before attention: "
            "there is no ring to overlap",
            "use model.cp_comm_type=p2p, or drop model.cp_comm_overlap.",
        )
    r["cp_comm_overlap"] = log.record(
        "model.cp_comm_overlap",
        None,
        False,
        RULE,
        f"cp_comm_type={kind}: one collective, nothing in flight under attention",
    )


def _resolve_tp(
    ask: Ask, model: ModelConfig, log: DecisionLog, r: Resolved
) -> dict[str, Any] | None:
    """TP overlap on or off, and its per-GEMM plan; returns the plan in Bridge's dict form (None:
    TP overlap off, or no plan given), which `_resolve_tp_plan` turns into the slots."""
    req = ask("tp_comm_overlap")
    requested, src = req.value, _by(req)
    if requested:
        fix = None
        if model.tensor_model_parallel_size < 2:
            effective, by, reason = False, RULE, TP_DISABLE_TP_SIZE
            fix = (
                "use -tp 2 or more (it turns sequence parallel on), or do not request "
                "tp_comm_overlap."
            )
        elif not model.sequence_parallel:
            effective, by, reason = False, RULE, TP_DISABLE_NO_SP
            fix = (
                "set model.sequence_parallel=true (or drop the override that turned it off), or do "
                "not request tp_comm_overlap."
            )
        else:
            # The reference also needs Transformer Engine here; our runtime's overlap
            # (layers/tp_overlap.py) runs on every backend.
            effective, by, reason = True, src, "requested; TP>=2 and sequence parallel"
    else:
        effective, fix = False, None
        by, reason = (src, "requested off") if src else (DEFAULT, "not requested")
    r["tp_comm_overlap"] = log.record(
        "model.tp_comm_overlap", requested, effective, by, reason, fix=fix
    )

    plan_req = ask("tp_comm_overlap_cfg")
    plan = plan_req.value
    if not effective:
        log.record("model.tp_comm_overlap_cfg", None, None, RULE, "TP overlap is off")
        r["tp_comm_bootstrap_backend"] = None
        return None
    r["tp_comm_bootstrap_backend"] = ask("tp_comm_bootstrap_backend").value or "nccl"
    if plan is None:
        log.record("model.tp_comm_overlap_cfg", None, None, DEFAULT, TP_NO_PRESET)
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
        _by(plan_req),
        "per-GEMM plan, handed to the TP layers as a dict with top-level None entries dropped",
    )
    return preset.to_dict()


def _resolve_tp_plan(
    model: ModelConfig, tp_cfg: dict[str, Any] | None, log: DecisionLog, r: Resolved
) -> None:
    """With TP overlap on, one decision per GEMM slot (what runs there, and why: the plan, a
    default, a Megatron switch or a runtime rule), after delay_wgrad_compute is known (it takes the
    wgrad slots); the slots go to the plan, which the layers execute. The plan's GPU-kernel knobs
    are listed, recorded without effect."""
    if not r["tp_comm_overlap"]:
        r["tp_slots"] = ()
        return
    plans, slots = effective_tp_plan(model, tp_cfg, r["delay_wgrad_compute"])
    r["tp_slots"] = tuple(plans.items())
    for d in slots:
        log.record(
            f"model.tp_comm_overlap_cfg.{d.slot}",
            d.requested,
            d.effective,
            d.decided_by,
            d.reason,
            fix="drop --strict to accept the rule, or change the plan/shape it names (e.g. a "
            "longer sequence for the size rule, num_splits that divide the shard).",
        )
    knobs = kernel_knobs(tp_cfg)
    if knobs:
        names = sorted({k for kv in knobs.values() for k in kv})
        shown = f"{', '.join(names)} (set in {len(knobs)} slot{'s' if len(knobs) > 1 else ''})"
        # A decision, not a no-op: every preset carries them, and nothing the user could change
        # would make them act.
        log.record(
            "model.tp_comm_overlap_cfg.gpu_kernel_knobs",
            None,
            shown,
            RULE,
            "recorded without effect: num_sm, cga_size, set_sm_margin, use_ce, atomic_gemm, "
            "fp8_buf and the priorities tune Transformer Engine's userbuffers kernels; this "
            "runtime overlaps with async collectives and point-to-point transfers (method, "
            "num_splits and aggregate are honoured)",
        )


# overlapped p2p in plain 1F1B: what it does beyond the reference, and what it costs
_P2P_WITHOUT_VPP = (
    "beyond the reference (Megatron-Core asserts overlap_p2p_comm needs a virtual pipeline, "
    "where plain 1F1B's steady cycle crosses the link twice however early receives are posted): "
    "each backward sends its input gradient before its weight gradients (the first stage runs "
    "them after its next forward), so transfers up to a backward's weight-gradient time hide at "
    "PP 2 (half of one between middle stages) and the drain shortens; cost: on the first stage, "
    "one backward's weight-gradient inputs kept one task longer (about one more micro-batch's "
    "activations, counted in the memory estimate)"
)


def _resolve_pp(ask: Ask, model: ModelConfig, log: DecisionLog, r: Resolved) -> None:
    pp = model.pipeline_model_parallel_size
    vp = model.virtual_pipeline_model_parallel_size or 1
    if pp > 1 and vp > 1:
        auto, why = (True, False), "PP>1 with virtual pipeline: overlap p2p with compute, unbatched"
    elif pp > 1:
        auto, why = (
            (False, True),
            "PP>1 without virtual pipeline: batched isend/irecv, no p2p overlap",
        )
    else:
        auto, why = (False, False), "PP=1: no pipeline communication"
    r["overlap_p2p_comm"] = _choose(
        log,
        "model.overlap_p2p_comm",
        ask("overlap_p2p_comm"),
        auto[0],
        RULE,
        why,
        lambda on: _P2P_WITHOUT_VPP if on and pp > 1 and vp == 1 else None,
    )
    r["batch_p2p_comm"] = _choose(
        log, "model.batch_p2p_comm", ask("batch_p2p_comm"), auto[1], RULE, why
    )
    if r["overlap_p2p_comm"] and r["batch_p2p_comm"]:
        raise ConfigError(
            "comm_overlap.batch_p2p_comm",
            True,
            "overlap_p2p_comm and batch_p2p_comm cannot both be on (overlapped p2p is unbatched).",
            "set one of them to false, or leave both unset for the PP rule.",
        )
    r["defer_embedding_wgrad_compute"] = _choose(
        log,
        "model.defer_embedding_wgrad_compute",
        ask("defer_embedding_wgrad_compute"),
        False,
        DEFAULT,
        "off unless requested",
    )
    r["wgrad_deferral_limit"] = _choose(
        log,
        "model.wgrad_deferral_limit",
        ask("wgrad_deferral_limit"),
        -1,
        DEFAULT,
        "Bridge auto default",
    )


def _ep_overlap_prerequisites(
    model: ModelConfig, precision: Precision
) -> list[tuple[str, Any, bool, str, str]]:
    """(field, value, ok, why, fix) for every prerequisite of the MoE expert-parallel overlap (the
    asserts of Megatron-Bridge's CommOverlapConfig, which mirror Megatron-Core's
    TransformerConfig.__post_init__)."""
    modules = model.recompute_modules or []
    torch_ok = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)
    scope = _graph_scope(model) if model.cuda_graph_impl == "transformer_engine" else set()
    return [
        (
            "model.expert_model_parallel_size",
            model.expert_model_parallel_size,
            model.expert_model_parallel_size > 1,
            "EP overlap is only supported when expert_model_parallel_size > 1.",
            "use -ep 2 or more.",
        ),
        (
            "model.num_moe_experts",
            model.num_moe_experts,
            (model.num_moe_experts or 0) > 1,
            "EP overlap is only supported when num_moe_experts > 1.",
            "use a MoE recipe (e.g. -mr qwen3_moe_tiny).",
        ),
        (
            "model.moe_token_dispatcher_type",
            model.moe_token_dispatcher_type,
            model.moe_token_dispatcher_type in ("alltoall", "flex"),
            "EP overlap is only supported when moe_token_dispatcher_type == 'alltoall' or 'flex'.",
            "set model.moe_token_dispatcher_type=alltoall.",
        ),
        (
            "model.bf16",
            precision.bf16,
            precision.bf16 or precision.fp16,
            "EP overlap is only supported when using bf16 or fp16 models.",
            "use -c bf16 (mixed_precision=bf16_mixed).",
        ),
        (
            "torch",
            torch.__version__,
            torch_ok,
            "A2A overlap encounters hang issue with torch version < 2.6.0.",
            "install torch >= 2.6.",
        ),
        (
            "model.virtual_pipeline_model_parallel_size",
            model.virtual_pipeline_model_parallel_size,
            model.pipeline_model_parallel_size == 1
            or model.virtual_pipeline_model_parallel_size is not None,
            "virtual_pipeline_model_parallel_size must be specified when "
            "pipeline_model_parallel_size > 1 (PP without VPP cannot interleave the overlap "
            "schedule).",
            "set -vp 2 (or more), or -pp 1.",
        ),
        (
            "model.recompute_granularity",
            model.recompute_granularity,
            model.recompute_granularity != "full",
            "disable full recomputation when enabling overlap_moe_expert_parallel_comm.",
            "use recompute_granularity=selective (without 'moe') or no recompute.",
        ),
        (
            "model.recompute_method",
            model.recompute_method,
            model.recompute_method is None,
            "disable recomputation method when enabling overlap_moe_expert_parallel_comm.",
            "set model.recompute_method=null.",
        ),
        (
            "model.recompute_num_layers",
            model.recompute_num_layers,
            model.recompute_num_layers is None,
            "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm.",
            "set model.recompute_num_layers=null.",
        ),
        (
            "model.recompute_modules",
            model.recompute_modules,
            "moe" not in modules,
            "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm.",
            "remove 'moe' from recompute_modules.",
        ),
        (
            "model.moe_shared_expert_overlap",
            model.moe_shared_expert_overlap,
            not model.moe_shared_expert_overlap,
            "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm "
            "(they conflict).",
            "set model.moe_shared_expert_overlap=false.",
        ),
        (
            "model.mtp_num_layers",
            model.mtp_num_layers,
            model.mtp_num_layers in (None, 0, 1),
            "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm.",
            "set model.mtp_num_layers to 0 or 1.",
        ),
        (
            "model.cuda_graph_scope",
            model.cuda_graph_scope,
            not (scope & {"moe", "mlp"}),
            "CUDA-graph scope must not cover 'moe' or 'mlp' with EP overlap (the schedule splits "
            "those parts).",
            "drop moe/mlp from cuda_graph_scope.",
        ),
    ]


def _graph_scope(model: ModelConfig) -> set[str]:
    """The CUDA-graph scope as a set of module names; "full" / empty mean no per-module scope (as
    the delay_wgrad_compute checks of Megatron-Bridge's CommOverlapConfig read it)."""
    scope = model.cuda_graph_scope or []
    if isinstance(scope, str):
        scope = scope.split(",")
    return {s.strip() for s in scope if s.strip() and s.strip() not in ("full", "full_iteration")}


def _resolve_moe(
    ask: Ask, model: ModelConfig, precision: Precision, log: DecisionLog, dp_size: int, r: Resolved
) -> None:
    ep_on = _choose(
        log,
        "model.overlap_moe_expert_parallel_comm",
        ask("overlap_moe_expert_parallel_comm"),
        False,
        DEFAULT,
        "off unless requested",
    )
    if ep_on:
        per_stage = model.tensor_model_parallel_size * model.context_parallel_size * dp_size
        for field, value, ok, why, fix in _ep_overlap_prerequisites(model, precision):
            if not ok:
                if field == "model.expert_model_parallel_size" and per_stage < 2:
                    # -ep 2 is impossible here: experts are carved out of the ranks of one pipeline
                    # stage.
                    fix = (
                        "expert parallelism needs at least 2 ranks per pipeline stage and this "
                        "layout has "
                        f"{per_stage}: use -ng 2 -ep 2 or more, or drop --moe_a2a_overlap / "
                        "comm_overlap.overlap_moe_expert_parallel_comm."
                    )
                raise ConfigError(field, value, why, fix)
    r["overlap_moe_expert_parallel_comm"] = ep_on

    delay = ask("delay_wgrad_compute")
    if delay.value:
        if not ep_on:
            section = delay.spelling.split(".")[0]
            raise ConfigError(
                delay.spelling,
                True,
                "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute.",
                f"also set {section}.overlap_moe_expert_parallel_comm=true, or drop delay_wgrad.",
            )
        scope = _graph_scope(model)  # checked whatever cuda_graph_impl says, as the reference
        attn = "attn" in scope
        router = (
            "moe_router" in scope
            and model.moe_shared_expert_intermediate_size is not None
            and not model.moe_shared_expert_overlap
        )
        if (attn or router) and not model.gradient_accumulation_fusion:
            raise ConfigError(
                "model.gradient_accumulation_fusion",
                False,
                "CUDA graph with delay_wgrad_compute requires gradient_accumulation_fusion (the "
                "captured weight-gradient GEMMs need static memory addresses).",
                "set model.gradient_accumulation_fusion=true or remove attn/moe_router from "
                "cuda_graph_scope.",
            )
        if attn and (model.add_bias_linear or model.add_qkv_bias):
            raise ConfigError(
                "model.add_bias_linear" if model.add_bias_linear else "model.add_qkv_bias",
                True,
                "CUDA graph with delay_wgrad_compute does not support attention bias for now.",
                "set model.add_bias_linear=false and model.add_qkv_bias=false.",
            )
    r["delay_wgrad_compute"] = _choose(
        log,
        "model.delay_wgrad_compute",
        ask("delay_wgrad_compute"),
        False,
        DEFAULT,
        "off unless requested",
    )
    shared = model.moe_shared_expert_overlap
    if model.is_moe:
        if shared and not model.moe_shared_expert_intermediate_size:
            shared = log.record(
                "model.moe_shared_expert_overlap",
                True,
                False,
                RULE,
                "the model has no shared expert (moe_shared_expert_intermediate_size is not set): "
                "nothing to overlap",
                fix="set model.moe_shared_expert_intermediate_size, or drop "
                "moe_shared_expert_overlap.",
            )
        elif shared and model.moe_token_dispatcher_type == "flex":
            shared = log.record(
                "model.moe_shared_expert_overlap",
                True,
                False,
                RULE,
                "the flex dispatcher does not support shared-expert overlap",
                fix="use moe_token_dispatcher_type=alltoall, or drop moe_shared_expert_overlap.",
            )
        elif shared is None:
            shared = log.record(
                "model.moe_shared_expert_overlap", None, False, DEFAULT, "off unless requested"
            )
        else:
            log.record(
                "model.moe_shared_expert_overlap",
                shared,
                shared,
                MODEL_CONFIG,
                "shared expert computes under the dispatch/combine all-to-all"
                if shared
                else "requested off",
            )
    r["moe_shared_expert_overlap"] = bool(shared)
    if model.is_moe:
        _record_expert_capacity(model, log)
        if model.moe_router_force_load_balancing:
            log.record(
                "model.moe_router_force_load_balancing",
                True,
                True,
                MODEL_CONFIG,
                "benchmark mode: the router routes by random logits (their gradient passes "
                "straight through to the real ones), so every expert gets about the same rows; the "
                "model does not learn to route - for measuring, not for training",
            )


def _record_expert_capacity(model: ModelConfig, log: DecisionLog) -> None:
    """Dropless routing or an expert capacity, said in the table with what it does to the dispatch:
    only variable shapes need the split-size exchange, the per-layer rendezvous of the EP ranks."""
    factor = model.moe_expert_capacity_factor
    rank_factor = model.moe_expert_rank_capacity_factor
    if rank_factor is not None:
        log.record(
            "model.moe_expert_rank_capacity_factor",
            rank_factor,
            rank_factor,
            MODEL_CONFIG,
            "sync-free dropless dispatch: each rank sends every EP peer one block of "
            f"ceil(tokens x top-k / EP x {rank_factor}) rows, padded, each row with its local "
            "expert (static shapes: no split-size exchange, no host read of split sizes); the "
            "grouped GEMM runs on the padded rows. A block that overflows is counted on the "
            "device, the count rides the step's loss and grad-norm reductions, and a step where "
            "any rank overflowed is re-run "
            "dropless before the optimizer applies anything (exact: the dropless step's result; "
            "each re-run costs one more forward-backward, logged per iteration). Memory: "
            f"{rank_factor} x tokens x top-k dispatched rows per MoE layer and micro-batch "
            f"({rank_factor}x the dropless average); a factor >= EP never overflows",
        )
        return
    if factor is None:
        log.record(
            "model.moe_expert_capacity_factor",
            None,
            None,
            DEFAULT,
            "dropless: every routed row reaches its expert; the EP ranks exchange split sizes per "
            "MoE layer and micro-batch (ep_counts), each read on the host (a sync on a GPU; "
            "model.moe_expert_rank_capacity_factor keeps dropless results without the read)",
        )
        return
    dropped = (
        "the lowest router weights"
        if model.moe_token_drop_policy == "probs"
        else "the latest tokens"
    )
    shapes = (
        "padded to capacity (moe_pad_expert_input_to_capacity): static shapes, no split-size "
        "exchange"
        if model.moe_pad_expert_input_to_capacity
        else "not padded: shapes still vary, so the split sizes are still exchanged (add "
        "model.moe_pad_expert_input_to_capacity=true for static shapes)"
    )
    log.record(
        "model.moe_expert_capacity_factor",
        factor,
        factor,
        MODEL_CONFIG,
        f"each expert takes at most ceil(tokens x top-k / experts x {factor}) rows from each rank; "
        "rows past "
        f"it are dropped, {dropped} first (moe_token_drop_policy={model.moe_token_drop_policy}); "
        f"{shapes}",
    )


def _resolve_dp(
    ask: Ask,
    model: ModelConfig,
    ddp: DDPConfig,
    optimizer: OptimizerConfig,
    dp_size: int,
    log: DecisionLog,
    r: Resolved,
) -> None:
    dist = request({"ddp": ddp, "optimizer": optimizer}, "ddp.use_distributed_optimizer")
    if dist.value and not (ddp.use_distributed_optimizer and optimizer.use_distributed_optimizer):
        which = "ddp" if not ddp.use_distributed_optimizer else "optimizer"
        log.record(
            f"{which}.use_distributed_optimizer",
            None,
            True,
            RULE,
            "the distributed optimizer is on in one of ddp/optimizer; both must agree",
        )
        # the home holds what runs (the runtime reads ddp's); the alias stays as typed
        ddp.use_distributed_optimizer = True
    dist_opt = bool(dist.value)
    pp, vp = model.pipeline_model_parallel_size, model.virtual_pipeline_model_parallel_size or 1
    many = dp_size > 1

    # overlap_grad_reduce: Bridge turns it on only for DP>1 with the distributed optimizer; we
    # honour an explicit request without the distributed optimizer too (bucketed all-reduce instead
    # of reduce-scatter).
    want = ask("overlap_grad_reduce").value
    if want and not many:
        r["overlap_grad_reduce"] = log.record(
            "ddp.overlap_grad_reduce",
            want,
            False,
            RULE,
            "DP=1: there is no gradient reduction to overlap",
            fix="use more data-parallel ranks, or do not request it.",
        )
    else:
        r["overlap_grad_reduce"] = _choose(
            log,
            "ddp.overlap_grad_reduce",
            ask("overlap_grad_reduce"),
            many and dist_opt,
            RULE,
            "DP>1 with the distributed optimizer"
            if many and dist_opt
            else "DP=1"
            if not many
            else "DP defaults apply only with the distributed optimizer (as Bridge)",
        )

    want = ask("overlap_param_gather").value
    if want and not (many and dist_opt):
        why = (
            "DP=1: no parameter gather"
            if not many
            else "parameters are only gathered with the distributed optimizer"
        )
        r["overlap_param_gather"] = log.record(
            "ddp.overlap_param_gather",
            want,
            False,
            RULE,
            why,
            fix="set ddp.use_distributed_optimizer=true with DP>1.",
        )
    else:
        r["overlap_param_gather"] = _choose(
            log,
            "ddp.overlap_param_gather",
            ask("overlap_param_gather"),
            many and dist_opt,
            RULE,
            "DP>1 with the distributed optimizer"
            if many and dist_opt
            else "no distributed parameter gather",
        )

    r["align_param_gather"] = _choose(
        log,
        "ddp.align_param_gather",
        ask("align_param_gather"),
        many and dist_opt and pp > 1 and vp > 1,
        RULE,
        "all PP stages launch the param gather together with VPP"
        if many and dist_opt and pp > 1 and vp > 1
        else "only with DP>1, distributed optimizer, PP>1 and VPP",
    )

    if many and dist_opt:
        auto, why = (
            BRIDGE_DP_BUCKET_SIZE,
            "DP>1 with the distributed optimizer: 128M parameters (Bridge)",
        )
    elif r["overlap_grad_reduce"]:
        auto, why = (
            max(40_000_000, 1_000_000 * dp_size),
            "overlapped reduce: Megatron DDP default bucket",
        )
    else:
        auto, why = None, "no overlapped reduce: one bucket"
    bucket = _choose(log, "ddp.bucket_size", ask("bucket_size"), auto, RULE, why)
    if bucket is not None and bucket < 1:
        raise ConfigError(
            "ddp.bucket_size",
            bucket,
            "a bucket holds at least one parameter.",
            "use a positive count of parameters (not bytes), or null for one bucket.",
        )
    r["bucket_size"] = bucket

    want = ask("overlap_param_gather_with_optimizer_step").value
    if want and not (dist_opt and pp > 1 and vp > 1):
        r["overlap_param_gather_with_optimizer_step"] = log.record(
            "optimizer.overlap_param_gather_with_optimizer_step",
            want,
            False,
            RULE,
            "needs the distributed optimizer with PP>1 and VPP",
            fix="use it only with -pp >1 -vp >1 and the distributed optimizer.",
        )
    else:
        r["overlap_param_gather_with_optimizer_step"] = _choose(
            log,
            "optimizer.overlap_param_gather_with_optimizer_step",
            ask("overlap_param_gather_with_optimizer_step"),
            False,
            DEFAULT,
            "never turned on automatically",
        )
    if r["overlap_param_gather_with_optimizer_step"]:
        # Megatron launches the first bucket's gather inside the optimizer step only with this
        # switch; our overlapped gather always does (data_parallel/param_gather.py), and without it
        # gathers right after the step.
        already = (
            "ddp.overlap_param_gather already launches the first bucket's all-gather inside the "
            "optimizer step"
            if r["overlap_param_gather"]
            else "without ddp.overlap_param_gather every bucket is gathered right after the step"
        )
        log.noop(
            "optimizer.overlap_param_gather_with_optimizer_step",
            True,
            already,
            "drop it: ddp.overlap_param_gather=true gives the overlap it asks for.",
        )
