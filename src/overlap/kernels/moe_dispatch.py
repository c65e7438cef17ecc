"""Which token dispatch the MoE layers run, said in the decision table with what it costs: dropless
(every routed row reaches its expert; the EP ranks exchange split sizes per MoE layer and
micro-batch, each read on the host), an expert capacity (rows past it dropped; padded to it, static
shapes with no split-size exchange), or the sync-free static blocks of
`moe_expert_rank_capacity_factor` (each rank sends every EP peer one padded block; a step that
overflows is re-run dropless), and the benchmark router. The dispatcher
(`overlap.layers.moe.dispatcher`, `rank_capacity`) runs what the model fields say."""

from __future__ import annotations

from typing import Any

from overlap.decisions import DEFAULT, MODEL_CONFIG, DecisionLog


def record_moe_routing(model: Any, log: DecisionLog) -> None:
    """Dropless routing or an expert capacity, said in the table with what it does to the dispatch
    (only variable shapes need the split-size exchange, the per-layer rendezvous of the EP ranks),
    and the benchmark router."""
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
            "any rank overflowed is re-run dropless before the optimizer applies anything (exact: "
            "the dropless step's result; each re-run costs one more forward-backward, logged per "
            f"iteration). Memory: {rank_factor} x tokens x top-k dispatched rows per MoE layer and "
            f"micro-batch ({rank_factor}x the dropless average); a factor >= EP never overflows",
        )
        if model.moe_paged_stash:
            stash = model.moe_paged_stash_buffer_size_factor_cuda
            pool = f"{abs(stash)}x the {'average' if stash > 0 else 'largest'} routed rows"
            log.record(
                "model.moe_paged_stash",
                True,
                True,
                MODEL_CONFIG,
                "Megatron's paged stash: the experts' activations kept for the backward go into "
                f"pages of the rows routed, in a GPU pool of {pool} "
                "(moe_paged_stash_buffer_size_factor_cuda), not the padded blocks; the padded "
                "buffers hold one layer at a time. Not built here (`overlap run` refuses it); "
                "the memory model prices the pool, as the reference runs it",
            )
    elif factor is None:
        log.record(
            "model.moe_expert_capacity_factor",
            None,
            None,
            DEFAULT,
            "dropless: every routed row reaches its expert; the EP ranks exchange split sizes per "
            "MoE layer and micro-batch (ep_counts), each read on the host (a sync on a GPU; "
            "model.moe_expert_rank_capacity_factor keeps dropless results without the read)",
        )
    else:
        probs = model.moe_token_drop_policy == "probs"
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
            f"each expert takes at most ceil(tokens x top-k / experts x {factor}) rows from each "
            f"rank; rows past it are dropped, "
            f"{'the lowest router weights' if probs else 'the latest tokens'} first "
            f"(moe_token_drop_policy={model.moe_token_drop_policy}); {shapes}",
        )
    if model.moe_router_force_load_balancing:
        log.record(
            "model.moe_router_force_load_balancing",
            True,
            True,
            MODEL_CONFIG,
            "benchmark mode: the router routes by random logits (their gradient passes straight "
            "through to the real ones), so every expert gets about the same rows; the model does "
            "not learn to route - for measuring, not for training",
        )
