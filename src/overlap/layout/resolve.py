"""The layout a model's fields describe: its parallel sizes (`ParallelLayout`), the layers each
pipeline stage holds (`PipelineLayout`), and the divisibility the tensor-parallel splits need of the
model's sizes. `ConfigContainer.finalize` builds the layout with `resolve_layout` and checks
`split_rules` with its other rules, on the model section that runs (read by its field names, never
written: what is decided here is said in the decision log)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from overlap.decisions import DEFAULT, MODEL_CONFIG, RULE, DecisionLog
from overlap.errors import Rule, check_rules
from overlap.layout.dims import SP_WITHOUT_TP_FIX, SP_WITHOUT_TP_WHY, ParallelLayout
from overlap.layout.pipeline import (
    LAYOUT_FIELD,
    PipelineLayout,
    parse_layout,
    resolve_pipeline_layout,
)


def resolve_layout(
    m: Any, world_size: int, log: DecisionLog
) -> tuple[ParallelLayout, PipelineLayout]:
    """The layout of model section `m` on `world_size` ranks (checked by `ParallelLayout` itself)
    and its pipeline stages."""
    return _stages(m, _sizes(m, world_size, log), log)


def _sizes(m: Any, world_size: int, log: DecisionLog) -> ParallelLayout:
    """The sizes, with the sequence parallelism that runs: as typed, but off without a
    tensor-parallel group (said in the log; the model section keeps what was typed)."""
    tp = m.tensor_model_parallel_size
    layout = ParallelLayout(
        world_size=world_size,
        tp=tp,
        pp=m.pipeline_model_parallel_size,
        cp=m.context_parallel_size,
        ep=m.expert_model_parallel_size,
        etp=m.expert_tensor_parallel_size,
        cp_a2a=(m.hierarchical_context_parallel_sizes or [1])[0]
        if m.cp_comm_type == "a2a+p2p" and m.context_parallel_size > 1
        else 1,
        sequence_parallel=bool(m.sequence_parallel) and tp > 1,
    )
    if m.sequence_parallel and tp == 1:
        log.record(
            "model.sequence_parallel",
            True,
            False,
            RULE,
            SP_WITHOUT_TP_WHY,
            fix=SP_WITHOUT_TP_FIX,
        )
    return layout


def _stages(
    m: Any, layout: ParallelLayout, log: DecisionLog
) -> tuple[ParallelLayout, PipelineLayout]:
    """The layers every pipeline stage holds (whichever field decided it, logged for
    `explain`), and `layout` with its virtual pipeline: -vp, or a
    pipeline_model_parallel_layout's stages / PP as Megatron-Core derives it (said in the log;
    the model section keeps what was typed)."""
    spec, vpp = m.pipeline_model_parallel_layout, m.virtual_pipeline_model_parallel_size
    found = 1 if spec is None else len(parse_layout(spec, layout.pp)) // layout.pp
    check_rules(
        [
            (
                LAYOUT_FIELD,
                spec,
                found == 1 or layout.pp > 1,
                f"{found} stages need pipeline parallelism (a virtual pipeline of {found} "
                "chunks needs PP >= 2).",
                "use -pp with stages = PP x VPP, or one stage for -pp 1.",
            ),
            (
                "model.virtual_pipeline_model_parallel_size",
                vpp,
                vpp is None or (vpp >= 1 and layout.pp > 1),
                "a virtual pipeline needs pipeline_model_parallel_size > 1 and a size >= 1.",
                "use -vp None, or -pp 2 or more.",
            ),
        ]
    )
    if vpp is None and found > 1:
        log.record_in(
            "pipeline",
            "model.virtual_pipeline_model_parallel_size",
            None,
            found,
            RULE,
            f"the layout's stages / PP = {found * layout.pp} / {layout.pp}",
        )
    resolved = resolve_pipeline_layout(m, layout.pp)
    if layout.pp > 1 or spec is not None:
        by = {"even split": DEFAULT, "pipeline_model_parallel_layout": MODEL_CONFIG}.get(
            resolved.source, RULE
        )
        log.record_in("pipeline", LAYOUT_FIELD, spec, resolved.as_string(), by, resolved.describe())
    return replace(layout, vpp=resolved.vpp), resolved


def split_rules(m: Any, layout: ParallelLayout) -> Iterator[Rule]:
    """The sizes of model section `m` that tensor parallelism splits must be divisible by it (heads
    by their groups too), as rows of `errors.check_rules`."""
    tp, tp_name = layout.tp, "tensor_model_parallel_size"
    heads, groups = m.num_attention_heads, m.query_groups
    for key, value, by, by_name, fix in (
        (
            "model.hidden_size",
            m.hidden_size,
            heads if m.kv_channels is None else 1,
            "num_attention_heads",
            "pick hidden_size as a multiple of the head count, or set kv_channels.",
        ),
        (
            "model.num_attention_heads",
            heads,
            tp,
            tp_name,
            "use a -tp that divides the head count.",
        ),
        (
            "model.num_attention_heads",
            heads,
            groups,
            "num_query_groups",
            "use num_query_groups that divides num_attention_heads.",
        ),
        (
            "model.num_query_groups",
            groups,
            tp,
            tp_name,
            "use a -tp that divides num_query_groups.",
        ),
        ("model.ffn_hidden_size", m.ffn_size, tp, tp_name, "use a -tp that divides it."),
        (
            "model.vocab_size",
            m.vocab_size,
            tp,
            tp_name,
            "use a vocabulary size divisible by -tp (e.g. --vocab_size rounded up).",
        ),
    ):
        yield key, value, value % by == 0, f"it must be divisible by {by_name} ({by}).", fix
    # sequence parallelism splits each CP rank's share (the whole sequence at CP 1) over TP
    cp, share = layout.cp, m.seq_length // layout.cp
    yield (
        "model.seq_length",
        m.seq_length,
        not layout.sequence_parallel or share % tp == 0,
        f"each CP rank's {share} tokens are split again over {tp_name} ({tp}) by sequence "
        "parallelism."
        if cp > 1
        else f"it must be divisible by {tp_name} (sequence parallel) ({tp}).",
        f"choose a sequence length divisible by CP x TP = {cp * tp}."
        if cp > 1
        else "use -sl divisible by -tp.",
    )
    shared = m.moe_shared_expert_intermediate_size if m.is_moe else None
    yield (
        "model.moe_shared_expert_intermediate_size",
        shared,
        not shared or shared % tp == 0,
        "the shared expert is split over tensor parallelism, so its width must be "
        f"divisible by tensor_model_parallel_size ({tp}).",
        "use a multiple of -tp.",
    )
