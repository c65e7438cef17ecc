"""Which overlap method each tensor-parallel GEMM slot runs: the slot rules of TP communication
overlap (`comm_overlap.tp_comm_overlap`), applied once by the resolution.

Every TP linear of a layer has three GEMM slots ("ub_name" in Megatron: ``qkv_fprop`` ...
``fc2_dgrad``), each with a collective to hide behind compute by one of three methods:

* ``ring_exchange``: the GEMM is split along the ring and each chunk is exchanged point-to-point;
* ``pipeline``: the GEMM is cut into ``num_splits`` chunks whose reduce-scatter overlaps the next
  chunk;
* ``bulk``: the whole collective runs concurrently with an independent GEMM.

:func:`effective_tp_plan` turns the requested per-GEMM plan (Bridge's dict form of a
``TransformerLayerTPOverlapCfg``, declared with its presets in `overlap.config.tp_overlap`; or
Transformer Engine's defaults), Megatron's switches (``tp_comm_overlap_ag`` ...) and the size rule
into what runs: one `overlap.kernels.SlotPlan` per slot, or none, and a :class:`SlotDecision` saying
why; :func:`record_tp_slots` records every slot's outcome in the decision table for the resolution
(`overlap.config.comm_overlap`), which keeps the slots in the frozen overlap plan
(``OverlapPlan.tp_slots``), which the layers execute (``OverlapPlan.linear`` ->
`overlap.kernels.LinearPlan`, `overlap.layers.tp_overlap`), so what the decision table says is what
runs. The planner prices the same slots
(`overlap.plan.tp_slots`: one layer's TP collectives, exposed or hidden, per slot's method).
:func:`kernel_knobs` lists what a plan sets for Transformer Engine's userbuffers kernels, which
this runtime records without effect.

This module sits below `config/`: it reads plain values (:class:`TPOverlapInputs`, taken from a
model section by its field names), never the configuration classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from overlap.decisions import RULE, DecisionLog
from overlap.errors import ConfigError
from overlap.kernels import BULK, PIPELINE, RING, SlotPlan

# The ten GEMM slots of one layer, per TP linear ("ub_name" in Megatron): what each slot's
# collective is, and which methods can hide it. An all-gather feeding a GEMM can only be split along
# the ring (Transformer Engine: "pipeline is not allowed for AG"); a GEMM feeding a reduce-scatter
# can be chunked (pipeline) or ring-reduced; the column-parallel backward's two collectives can each
# run whole beside the other GEMM (bulk), or the dgrad's reduce-scatter can be chunked with the
# dgrad GEMM (Megatron's tp_comm_overlap_rs_dgrad), which leaves the wgrad GEMM nothing to hide.
SLOT_METHODS: dict[str, tuple[str, ...]] = {
    "qkv_fprop": (RING,),
    "fc1_fprop": (RING,),
    "proj_dgrad": (RING,),
    "fc2_dgrad": (RING,),
    "proj_fprop": (PIPELINE, RING),
    "fc2_fprop": (PIPELINE, RING),
    "qkv_dgrad": (BULK, PIPELINE, RING),
    "fc1_dgrad": (BULK, PIPELINE, RING),
    "qkv_wgrad": (BULK,),
    "fc1_wgrad": (BULK,),
}
# A slot's first method is Transformer Engine's default for it (initialize_ub), used where no plan
# names the slot.
DEFAULT_SPLITS = 4  # Transformer Engine's pipeline default
AG_SLOTS = ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad")  # an all-gather feeds the GEMM
# Megatron's switches and the slots each turns off when false (tp_comm_bulk_dgrad: a bulk plan only)
_SWITCHES = {
    "tp_comm_overlap_ag": AG_SLOTS,
    "tp_comm_overlap_rs": ("proj_fprop", "fc2_fprop"),
    "tp_comm_bulk_dgrad": ("qkv_dgrad", "fc1_dgrad"),
    "tp_comm_bulk_wgrad": ("qkv_wgrad", "fc1_wgrad"),
}

# The size rule: a GEMM chunk of fewer sequence rows than this is not made (a micro-batch of b
# sequences has b tokens per row; the rule counts rows so that every layer can apply it from the
# model configuration alone). Each extra chunk costs one more collective launch (tens of
# microseconds on NCCL, 0.1-0.8 ms on gloo; bench/results/gloo_costs.txt) while a GEMM of so few
# rows takes about as long, so splitting further exposes more than it hides; torch's micro-pipeline
# TP skips shards below 1024 features for the same reason. Pipeline splits are lowered until each
# chunk has at least this many rows (and off below two chunks); ring exchange, whose chunk is a
# whole shard, is off below it.
MIN_CHUNK_ROWS = 32

# Userbuffers knobs that tune Transformer Engine's GPU kernels: recorded, shown, without effect in
# this runtime.
_KERNEL_KNOBS = (
    "num_sm",
    "cga_size",
    "set_sm_margin",
    "use_ce",
    "atomic_gemm",
    "fp8_buf",
    "comm_priority",
    "gemm_priority",
)


@dataclass(frozen=True, kw_only=True)
class TPOverlapInputs:
    """What the slot rules read of the run, as plain values (the resolution takes them from the
    model configuration, under its field names): the TP size and sequence length (the size rule),
    whether any layer runs a dense MLP (the fc1/fc2 slots exist), and Megatron-Core's per-direction
    TP-overlap switches, which narrow the plan (``_SWITCHES``; ``tp_comm_overlap_rs_dgrad`` chunks
    the dgrad reduce-scatter instead of the bulk pair; ``tp_comm_overlap_disable_qkv`` /
    ``_fc1`` turn a linear's slots off). A value object rather than `ModelFields` (the device rules'
    view of the model): one of its values, `dense_mlp`, is derived over the layers, and a frozen
    record makes what the plan depended on printable."""

    tensor_model_parallel_size: int
    seq_length: int
    dense_mlp: bool
    tp_comm_overlap_ag: bool
    tp_comm_overlap_rs: bool
    tp_comm_bulk_dgrad: bool
    tp_comm_bulk_wgrad: bool
    tp_comm_overlap_rs_dgrad: bool
    tp_comm_overlap_disable_qkv: bool
    tp_comm_overlap_disable_fc1: bool

    @classmethod
    def of(cls, model: Any) -> TPOverlapInputs:
        """The inputs of a model section (read by its field names; `dense_mlp` over its
        layers)."""
        dense_mlp = not model.is_moe or any(
            not model.is_moe_layer(i) for i in range(model.num_layers)
        )
        names = (f.name for f in fields(cls) if f.name != "dense_mlp")
        return cls(dense_mlp=dense_mlp, **{name: getattr(model, name) for name in names})


@dataclass(frozen=True)
class SlotDecision:
    """One slot's outcome for the decision table: asked (None when only the defaults asked), in
    effect, by, why."""

    slot: str
    requested: str | None
    effective: str
    decided_by: str
    reason: str


def _slot_from_entry(slot: str, entry: Mapping[str, Any]) -> SlotPlan:
    """A plan entry checked against what the slot can run: its method, an integer num_splits >= 2
    for pipeline, and aggregate (a bool) only where a ring all-gathers."""
    field = f"comm_overlap.tp_comm_overlap_cfg.{slot}"
    method = entry.get("method")
    if method not in SLOT_METHODS[slot]:
        raise ConfigError(
            f"{field}.method",
            method,
            f"{slot} supports {' or '.join(SLOT_METHODS[slot])}.",
            f"use method={SLOT_METHODS[slot][0]} for {slot}, or leave the slot out for its "
            "default.",
        )
    splits = entry.get("num_splits", DEFAULT_SPLITS) if method == PIPELINE else 1
    if method == PIPELINE and (
        isinstance(splits, bool) or not isinstance(splits, int) or splits < 2
    ):
        raise ConfigError(
            f"{field}.num_splits",
            splits,
            "a pipeline needs an integer number of chunks >= 2.",
            "use num_splits=2 or more (one chunk would overlap nothing).",
        )
    aggregate = entry.get("aggregate", False)
    if not isinstance(aggregate, bool):
        raise ConfigError(
            f"{field}.aggregate", aggregate, "it must be true or false.", "use aggregate=false."
        )
    if aggregate and (method != RING or slot not in AG_SLOTS):
        raise ConfigError(
            f"{field}.aggregate",
            aggregate,
            "aggregate pairs the chunks of a ring all-gather; this slot does not all-gather.",
            f"set aggregate=false for {slot} (it is honoured on {', '.join(AG_SLOTS)}).",
        )
    return SlotPlan(method, splits, aggregate)


def _largest_split(rows: int, wanted: int) -> int:
    """The largest split <= wanted that divides the shard's sequence rows into chunks of >=
    MIN_CHUNK_ROWS rows."""
    for n in range(wanted, 0, -1):
        if rows % n == 0 and rows // n >= MIN_CHUNK_ROWS:
            return n
    return 0


def effective_tp_plan(
    run: TPOverlapInputs,
    tp_comm_overlap_cfg: Mapping[str, Mapping[str, Any]] | None,
    delay_wgrad_compute: bool,
) -> tuple[dict[str, SlotPlan | None], list[SlotDecision]]:
    """Every slot's plan in a run with TP overlap on, and why: the resolution's step (the layers
    read its outcome from the overlap plan). `tp_comm_overlap_cfg` is the resolved per-GEMM plan
    (Bridge's dict form, ``TransformerLayerTPOverlapCfg.to_dict()``; None: Transformer Engine's
    defaults) and `delay_wgrad_compute` the resolved switch; the layout, the shape and Megatron's
    switches come from `run`.

    Order of the rules: the plan's method (the preset's, or Transformer Engine's default), the
    Megatron switches (a user's choice: honoured as asked), then the runtime's rules (the request is
    changed, and said so): delay_wgrad_compute takes the wgrad slots (the weight-gradient GEMM runs
    later, so the reduce-scatter cannot hide under it; the reference refuses the pair), a chunked
    dgrad reduce-scatter takes its wgrad bulk slot, aggregate needs an even TP of 4 or more, and the
    size rule (MIN_CHUNK_ROWS)."""
    tp = run.tensor_model_parallel_size
    rows = run.seq_length // tp  # sequence rows of one rank's shard
    entries = tp_comm_overlap_cfg or {}
    plans: dict[str, SlotPlan | None] = {}
    decisions: list[SlotDecision] = []
    for slot in SLOT_METHODS:
        linear = slot.split("_")[0]
        entry = entries.get(slot)
        if entry is not None:
            plan = _slot_from_entry(slot, entry)
            requested, by, reason = str(plan), "plan", "from the overlap plan"
        else:  # not in the plan (Bridge drops a preset's None entries): TE's default
            method = SLOT_METHODS[slot][0]
            plan = SlotPlan(method, DEFAULT_SPLITS if method == PIPELINE else 1)
            requested, by = None, "default"
            reason = "Transformer Engine's default method for this slot"
        if linear in ("fc1", "fc2") and not run.dense_mlp:
            # these GEMMs do not exist here: nothing asked for is lost
            plan, requested, by = None, None, "rule"
            reason = "every layer is MoE: no dense MLP runs these GEMMs (experts go through EP)"
        # The user's switches: what they ask for is what they get (the request follows them).
        if (
            slot in ("qkv_dgrad", "fc1_dgrad")
            and run.tp_comm_overlap_rs_dgrad
            and plan is not None
            and plan.method == BULK
        ):
            plan, by = SlotPlan(PIPELINE, DEFAULT_SPLITS), "model.tp_comm_overlap_rs_dgrad=true"
            requested, reason = str(plan), "the dgrad reduce-scatter is chunked with the dgrad GEMM"
        for switch, slots in _SWITCHES.items():
            if (
                slot in slots
                and not getattr(run, switch)
                and plan is not None
                and (switch != "tp_comm_bulk_dgrad" or plan.method == BULK)
            ):
                plan, requested, by, reason = None, "off", f"model.{switch}=false", "switched off"
        if (
            linear in ("qkv", "fc1")
            and getattr(run, f"tp_comm_overlap_disable_{linear}")
            and plan is not None
        ):
            plan, requested, by = None, "off", f"model.tp_comm_overlap_disable_{linear}=true"
            reason = "switched off"
        # The runtime's rules: a request changed here is said (and refused under strict).
        if slot.endswith("_wgrad") and plan is not None:
            dgrad = plans.get(f"{linear}_dgrad")
            if delay_wgrad_compute:
                plan, by = None, "rule"
                reason = (
                    "delay_wgrad_compute runs the weight-gradient GEMM later, so the dgrad "
                    "reduce-scatter has nothing to hide under (the reference refuses bulk wgrad "
                    "overlap with it)"
                )
            elif dgrad is not None and dgrad.method != BULK:
                plan, by = None, "rule"
                reason = (
                    f"{linear}_dgrad already chunks the dgrad reduce-scatter ({dgrad}); "
                    "nothing is left to hide"
                )
        if plan is not None and plan.aggregate and (tp < 4 or tp % 2):
            plan, by = SlotPlan(RING), "rule"
            reason = (
                f"aggregate pairs the ring's chunks, which needs an even TP of 4 or more (TP={tp})"
            )
        if plan is not None and plan.method == PIPELINE:
            splits = _largest_split(rows, plan.num_splits)
            if splits != plan.num_splits:
                by = "rule"
                reason = (
                    f"size rule: the split must divide the shard's {rows} sequence rows "
                    f"(seq_length {run.seq_length} / TP {tp}) into chunks of >= "
                    f"{MIN_CHUNK_ROWS} rows"
                )
                plan = SlotPlan(PIPELINE, splits) if splits >= 2 else None
        elif plan is not None and plan.method == RING and rows < MIN_CHUNK_ROWS:
            plan, by = None, "rule"
            reason = (
                f"size rule: a ring step's chunk (one shard: {rows} sequence rows) has fewer than "
                f"{MIN_CHUNK_ROWS}"
            )
        plans[slot] = plan
        decisions.append(
            SlotDecision(slot, requested, "off" if plan is None else str(plan), by, reason)
        )
    return plans, decisions


def kernel_knobs(
    tp_comm_overlap_cfg: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """Per slot, the plan's GPU-kernel knobs that are set to something other than off (num_sm,
    cga_size, ...): Transformer Engine's userbuffers kernels read them; this runtime's async
    collectives have nothing to tune."""
    entries = tp_comm_overlap_cfg or {}
    out: dict[str, dict[str, Any]] = {}
    for slot in SLOT_METHODS:
        entry = entries.get(slot) or {}
        knobs = {k: entry[k] for k in _KERNEL_KNOBS if entry.get(k) not in (None, False)}
        if knobs:
            out[slot] = knobs
    return out


def record_tp_slots(
    inputs: TPOverlapInputs,
    tp_comm_overlap_cfg: Mapping[str, Mapping[str, Any]] | None,
    delay_wgrad_compute: bool,
    log: DecisionLog,
) -> tuple[tuple[str, SlotPlan | None], ...]:
    """With TP overlap on: one decision row per GEMM slot (what runs there, and why: the plan, a
    default, a Megatron switch or a runtime rule), and the slots, which the resolution keeps in the
    overlap plan for the layers to execute. The plan's GPU-kernel knobs are listed, recorded
    without effect."""
    plans, slots = effective_tp_plan(inputs, tp_comm_overlap_cfg, delay_wgrad_compute)
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
    knobs = kernel_knobs(tp_comm_overlap_cfg)
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
    return tuple(plans.items())
