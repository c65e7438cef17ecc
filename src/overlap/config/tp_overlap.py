"""Tensor-parallel communication-overlap plans ("userbuffers presets").

A plan says, for every tensor-parallel GEMM of one transformer layer, how its collective is hidden
behind compute:

* ``method="ring_exchange"``: the GEMM is split along the ring and each chunk is exchanged
  point-to-point;
* ``method="pipeline"``: the GEMM is cut into ``num_splits`` chunks whose reduce-scatter overlaps
  the next chunk;
* ``method="bulk"``: the whole collective runs concurrently with an independent GEMM;

plus how many SMs (``num_sm``) and which CGA size the communication kernels may use, and whether the
layernorm kernels keep an SM margin for them (``set_sm_margin``).

The class names, field names and order, ``method`` strings and the 19 preset names follow
Megatron-Bridge's ``comm_overlap.py`` so that configurations written for it keep working; the
presets are data (``presets/tp_overlap.yaml``), each a module attribute under its name.
:meth:`TransformerLayerTPOverlapCfg.to_dict` gives the nested dict Bridge hands to the model
(``model.tp_comm_overlap_cfg``). :func:`effective_tp_plan` turns that dict (or the defaults), the
Megatron switches (``tp_comm_overlap_ag`` ...) and the size rule into the plan our runtime
(``overlap.layers.tp_overlap``) executes: one method per GEMM slot, or none. The resolution logs
every slot's outcome and keeps the slots in the frozen overlap plan (``OverlapPlan.tp_slots``),
which the layers read (``OverlapPlan.linear``), so what the decision table says is what runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from overlap.errors import ConfigError

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig

# the 19 userbuffers_* presets join these once loaded from the presets file
__all__ = [
    "TPOverlapCfg",
    "PipelineOverlapCfg",
    "RingExchangeOverlapCfg",
    "BulkOverlapCfg",
    "TransformerLayerTPOverlapCfg",
    "TP_OVERLAP_PRESETS",
    "get_tp_overlap_preset",
    "SlotPlan",
    "LinearPlan",
    "SlotDecision",
    "effective_tp_plan",
    "kernel_knobs",
    "MIN_CHUNK_ROWS",
]

RING, PIPELINE, BULK = "ring_exchange", "pipeline", "bulk"


# --------------------------------------------------------------------------------------------------
# Per-GEMM plans
# --------------------------------------------------------------------------------------------------


@dataclass
class TPOverlapCfg:
    """Marker base class of every per-GEMM overlap plan."""


@dataclass
class PipelineOverlapCfg(TPOverlapCfg):
    """Chunked ("pipeline") overlap: the GEMM is cut into ``num_splits`` pieces whose collective
    overlaps the next one.

    Deliberate difference from Megatron-Bridge: there the ``fp8_buf`` default is the 1-tuple
    ``(False,)`` (a trailing-comma bug). A tuple is truthy, so in FP8 runs every pipeline-method
    GEMM that does not set ``fp8_buf`` explicitly would claim an FP8 communication buffer. Ours is
    the plain ``False``.
    """

    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = False  # NOT the reference's truthy `(False,)`; see the class docstring.
    atomic_gemm: bool = False
    method: str = PIPELINE


@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    """Ring-exchange overlap: chunks travel point-to-point around the TP ring while the local chunk
    is multiplied."""

    aggregate: bool = False
    method: str = RING
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class BulkOverlapCfg(TPOverlapCfg):
    """Bulk overlap: the whole collective runs concurrently with an independent GEMM."""

    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = BULK


# --------------------------------------------------------------------------------------------------
# Per-layer plan
# --------------------------------------------------------------------------------------------------


@dataclass
class TransformerLayerTPOverlapCfg:
    """The overlap plan of every TP GEMM of one transformer layer. ``None`` leaves the GEMM out of
    the plan: Bridge drops it from the dict and Transformer Engine (and our runtime) then use the
    slot's default method; switch a slot off with Megatron's switches (``tp_comm_overlap_ag``
    ...)."""

    qkv_dgrad: TPOverlapCfg | None
    qkv_wgrad: TPOverlapCfg | None
    fc1_dgrad: TPOverlapCfg | None
    fc1_wgrad: TPOverlapCfg | None
    qkv_fprop: TPOverlapCfg | None
    proj_dgrad: TPOverlapCfg | None
    fc1_fprop: TPOverlapCfg | None
    fc2_dgrad: TPOverlapCfg | None
    proj_fprop: TPOverlapCfg | None
    fc2_fprop: TPOverlapCfg | None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested-dict form (``dataclasses.asdict``) with the top-level ``None`` entries dropped.

        Example: ``{"qkv_dgrad": {"num_sm": 4, "cga_size": 2, "set_sm_margin": False, "method":
        "bulk"}, ...}``. Only whole-GEMM ``None`` entries are removed; values inside the nested
        dicts are kept as they are.
        """
        return {
            name: value for name, value in dataclasses.asdict(self).items() if value is not None
        }


# --------------------------------------------------------------------------------------------------
# The presets (presets/tp_overlap.yaml)
# --------------------------------------------------------------------------------------------------

# the per-GEMM plan class of each method
_CLASSES: dict[str, type[TPOverlapCfg]] = {
    BULK: BulkOverlapCfg,
    PIPELINE: PipelineOverlapCfg,
    RING: RingExchangeOverlapCfg,
}


def _load(text: str) -> dict[str, TransformerLayerTPOverlapCfg]:
    """The presets of a TP-overlap presets file by name, in the file's order: each slot's entry
    built as the class its ``method`` names (a new object per GEMM: the file's shared entries are
    YAML aliases of one dict)."""
    return {
        name: TransformerLayerTPOverlapCfg(
            **{
                slot: None if entry is None else _CLASSES[entry["method"]](**entry)
                for slot, entry in slots.items()
            }
        )
        for name, slots in yaml.safe_load(text)["presets"].items()
    }


TP_OVERLAP_PRESETS = _load(
    resources.files("overlap.config").joinpath("presets/tp_overlap.yaml").read_text()
)
"""The 19 userbuffers presets by name; each is also a module attribute (and in ``__all__``), so
``from overlap.config.tp_overlap import userbuffers_...`` works as in Bridge."""
globals().update(TP_OVERLAP_PRESETS)
__all__ += list(TP_OVERLAP_PRESETS)


def get_tp_overlap_preset(name: str) -> TransformerLayerTPOverlapCfg:
    """The preset called ``name``; a :class:`~overlap.errors.ConfigError` naming the valid choices
    otherwise.

    The returned object is the shared module-level preset: copy it (``copy.deepcopy``) before
    mutating it.
    """
    try:
        return TP_OVERLAP_PRESETS[name]
    except KeyError:
        raise ConfigError(
            field="comm_overlap.tp_comm_overlap_cfg",
            value=name,
            why="unknown preset name for the tensor-parallel overlap plan.",
            fix="use one of: " + ", ".join(sorted(TP_OVERLAP_PRESETS)),
        ) from None


# --------------------------------------------------------------------------------------------------
# The plan the runtime executes
# --------------------------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class SlotPlan:
    """How one GEMM slot hides its collective: ``method`` (ring_exchange | pipeline | bulk),
    ``num_splits`` chunks for pipeline, ``aggregate`` (ring exchange moves two chunks per step)."""

    method: str
    num_splits: int = 1
    aggregate: bool = False

    def __str__(self) -> str:
        if self.method == PIPELINE:
            return f"pipeline x{self.num_splits}"
        return f"{self.method} (aggregate)" if self.aggregate else self.method


@dataclass(frozen=True)
class LinearPlan:
    """The slots of one TP linear: forward GEMM, input-gradient GEMM, weight-gradient GEMM (None: no
    overlap)."""

    fprop: SlotPlan | None
    dgrad: SlotPlan | None
    wgrad: SlotPlan | None


@dataclass(frozen=True)
class SlotDecision:
    """One slot's outcome for the decision table: asked (None when only the defaults asked), in
    effect, by, why."""

    slot: str
    requested: str | None
    effective: str
    decided_by: str
    reason: str


def _entries(cfg: Any) -> dict[str, Any]:
    """The resolved plan as Bridge's to_dict form (slot -> entry); empty without one."""
    if isinstance(cfg, TransformerLayerTPOverlapCfg):
        return cfg.to_dict()
    return cfg if isinstance(cfg, dict) else {}


def _slot_from_entry(slot: str, entry: dict[str, Any]) -> SlotPlan:
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
    model: ModelConfig, tp_comm_overlap_cfg: Any, delay_wgrad_compute: bool
) -> tuple[dict[str, SlotPlan | None], list[SlotDecision]]:
    """Every slot's plan in a run with TP overlap on, and why: the resolution's step (the layers
    read its outcome from the overlap plan). `tp_comm_overlap_cfg` is the resolved per-GEMM plan
    (Bridge's dict form; None: Transformer Engine's defaults) and `delay_wgrad_compute` the
    resolved switch; the layout, the shape and Megatron's switches come from the model.

    Order of the rules: the plan's method (the preset's, or Transformer Engine's default), the
    Megatron switches (a user's choice: honoured as asked), then the runtime's rules (the request is
    changed, and said so): delay_wgrad_compute takes the wgrad slots (the weight-gradient GEMM runs
    later, so the reduce-scatter cannot hide under it; the reference refuses the pair), a chunked
    dgrad reduce-scatter takes its wgrad bulk slot, aggregate needs an even TP of 4 or more, and the
    size rule (MIN_CHUNK_ROWS)."""
    tp = model.tensor_model_parallel_size
    rows = model.seq_length // tp  # sequence rows of one rank's shard
    entries = _entries(tp_comm_overlap_cfg)
    dense_mlp = not model.is_moe or any(not model.is_moe_layer(i) for i in range(model.num_layers))
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
        if linear in ("fc1", "fc2") and not dense_mlp:
            # these GEMMs do not exist here: nothing asked for is lost
            plan, requested, by = None, None, "rule"
            reason = "every layer is MoE: no dense MLP runs these GEMMs (experts go through EP)"
        # The user's switches: what they ask for is what they get (the request follows them).
        if (
            slot in ("qkv_dgrad", "fc1_dgrad")
            and model.tp_comm_overlap_rs_dgrad
            and plan is not None
            and plan.method == BULK
        ):
            plan, by = SlotPlan(PIPELINE, DEFAULT_SPLITS), "model.tp_comm_overlap_rs_dgrad=true"
            requested, reason = str(plan), "the dgrad reduce-scatter is chunked with the dgrad GEMM"
        for switch, slots in _SWITCHES.items():
            if (
                slot in slots
                and not getattr(model, switch)
                and plan is not None
                and (switch != "tp_comm_bulk_dgrad" or plan.method == BULK)
            ):
                plan, requested, by, reason = None, "off", f"model.{switch}=false", "switched off"
        if (
            linear in ("qkv", "fc1")
            and getattr(model, f"tp_comm_overlap_disable_{linear}")
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
                    f"(seq_length {model.seq_length} / TP {tp}) into chunks of >= "
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


def kernel_knobs(cfg: Any) -> dict[str, dict[str, Any]]:
    """Per slot, the plan's GPU-kernel knobs that are set to something other than off (num_sm,
    cga_size, ...): Transformer Engine's userbuffers kernels read them; this runtime's async
    collectives have nothing to tune."""
    entries = _entries(cfg)
    out: dict[str, dict[str, Any]] = {}
    for slot in SLOT_METHODS:
        entry = entries.get(slot) or {}
        knobs = {k: entry[k] for k in _KERNEL_KNOBS if entry.get(k) not in (None, False)}
        if knobs:
            out[slot] = knobs
    return out
