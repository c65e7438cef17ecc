"""Token permutation for MoE: group routed (token, expert) pairs by expert, and scatter expert
outputs back.

Layout of the permuted rows (both paths, bit-identical): rows are grouped by expert in ascending
order, and within one expert they keep token order. A token routed to k experts appears k times.
`token_idx[i]` is the token position of permuted row i, which is all that un-permutation needs;
`slot_idx[i]` is its position in the flattened [T * k] routing, which picks its combine weight.

Routing (`route`: indices and counts, no rows) is apart from gathering the rows (`gather`), so a
dispatcher can send the per-expert counts off as soon as routing is known and gather the rows while
they travel.

Expert capacity (`ExpertCapacity`, Megatron's `moe_expert_capacity_factor`): each expert keeps at
most `capacity` of this rank's rows, chosen by the drop policy ("probs": the highest combine
weights, ties to the earlier token; "position": the earliest tokens); kept rows keep the layout
above, so a capacity no expert reaches gives exactly the dropless rows. Dropped rows follow all kept
rows (expert, then token order): a dispatcher cuts them off once it knows the kept total, which
needs no data-dependent shape (no host sync) here. With `pad` (Megatron's
`moe_pad_expert_input_to_capacity`) every expert gets exactly `capacity` rows, its kept rows then
padding rows; a padding row has `slot_idx = T * k` and `token_idx = T`, one past the real ones,
which `gather` maps to a zero row with weight 0 and `unpermute` to a scratch row that is dropped.
Every shape is then fixed by the configuration alone.

Two implementations, chosen by the run's `Kernels.moe_permute_fusion` (`model.moe_permute_fusion`
decided for the run's device; unset: the loop on CPU, the fused one on CUDA, where the loop's
data-dependent shapes make the host wait for the GPU; `overlap.kernels.moe_permute`):
- fused (True): stable argsorts of the flattened routing plus index_select / scatter / index_add; no
  Python loop over experts, so its cost does not grow with the expert count (the role TE's fused
  kernels play in Megatron).
- loop (False): one `torch.where` per expert; easy to read and check, and the reference the fused
  path is tested against.

After the EP all-to-all, a rank holds rows ordered by (source rank, local expert); its experts want
them ordered by (local expert, source rank). `sort_chunks_by_local_expert` and its inverse reorder
those chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from overlap.layers.moe import split_sizes

DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class ExpertCapacity:
    """At most `capacity` rows per expert from one rank; `pad`: exactly that many, padding
    included."""

    capacity: int
    pad: bool
    policy: str  # one of DROP_POLICIES


def expert_capacity(num_tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Rows one expert may take from one rank: ceil(T * k / E * factor), as Megatron's
    `get_capacity`."""
    return math.ceil(num_tokens * topk / num_experts * factor)


@dataclass
class Routing:
    """Where each permuted row comes from (no rows yet)."""

    token_idx: torch.Tensor  # [R] token position of each row (T for a padding row)
    # [R] position of each row in the flattened [T * k] routing (T * k for padding)
    slot_idx: torch.Tensor
    # [E] int64 rows per expert, kept rows only (stays a tensor: no host sync)
    tokens_per_expert: torch.Tensor


@dataclass
class Permutation:
    """Rows grouped by expert, plus what is needed to undo the grouping (`route` followed by
    `gather`)."""

    tokens: torch.Tensor  # [R, h]
    weights: torch.Tensor  # [R], the combine weight of each row
    token_idx: torch.Tensor  # [R], token position of each row
    tokens_per_expert: torch.Tensor  # [E] int64, rows per expert


def count_per_expert(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many entries of `topk_idx` name each expert. Not `torch.bincount`: its output
    size depends on the values (the largest + 1), so on a GPU it reads them on the host (a sync in
    every MoE layer) and it cannot run on fake tensors (`overlap run --dry-run`). Adding ones into E
    fixed slots gives the same integers, shape known."""
    flat = topk_idx.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).index_add_(
        0, flat, torch.ones_like(flat)
    )


def expert_counts(
    topk_idx: torch.Tensor, num_experts: int, capacity: ExpertCapacity | None = None
) -> torch.Tensor:
    """[E] int64 rows each expert gets from this routing (`route`'s `tokens_per_expert`, without the
    layout): all a counts exchange needs, so it can leave before the permutation is laid out."""
    counts = count_per_expert(topk_idx, num_experts)
    if capacity is None:
        return counts
    return (
        torch.full_like(counts, capacity.capacity)
        if capacity.pad
        else counts.clamp(max=capacity.capacity)
    )


def route(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    fused: bool,
    capacity: ExpertCapacity | None = None,
) -> Routing:
    """The permuted layout of the routing `topk_idx` [T, k]; `topk_weights` [T, k] only rank rows
    for the "probs" drop policy."""
    impl = _route_fused if fused else _route_loop
    return impl(topk_idx, topk_weights.detach(), num_experts, capacity)


def gather(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    token_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    padded: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [R, h] of `hidden` [T, h] and their combine weights [R] from `topk_weights` [T, k].
    `padded`: the routing has padding rows (`ExpertCapacity.pad`), which get a zero row and weight 0
    that carry no gradient."""
    weights = topk_weights.reshape(-1)
    if padded:
        hidden = torch.cat([hidden, hidden.new_zeros((1, hidden.shape[-1]))])
        weights = torch.cat([weights, weights.new_zeros(1)])
    return hidden.index_select(0, token_idx), weights.index_select(0, slot_idx)


def permute(
    hidden: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    fused: bool,
    capacity: ExpertCapacity | None = None,
) -> Permutation:
    """Group the rows of `hidden` [T, h] by the experts in `topk_idx` [T, k] (weights [T, k] travel
    along)."""
    r = route(topk_idx, topk_weights, num_experts, fused, capacity)
    tokens, weights = gather(
        hidden, topk_weights, r.token_idx, r.slot_idx, capacity is not None and capacity.pad
    )
    return Permutation(
        tokens=tokens, weights=weights, token_idx=r.token_idx, tokens_per_expert=r.tokens_per_expert
    )


def _route_fused(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    capacity: ExpertCapacity | None,
) -> Routing:
    k = topk_idx.shape[1]
    flat = topk_idx.reshape(-1)
    # Stable sort: flat position t * k + j grows with t, so equal experts keep token order.
    order = torch.argsort(flat, stable=True)
    counts = count_per_expert(flat, num_experts)
    if capacity is None:
        return Routing(torch.div(order, k, rounding_mode="floor"), order, counts)
    keep = _keep_fused(flat, order, topk_weights.reshape(-1), counts, capacity)
    kept = counts.clamp(max=capacity.capacity)
    if capacity.pad:
        slots = _pad_slots_fused(flat, order, keep, kept, capacity.capacity)
        return Routing(
            torch.div(slots, k, rounding_mode="floor"),
            slots,
            torch.full_like(counts, capacity.capacity),
        )
    # Kept rows first (expert, then token order), the dropped ones after them in the same order.
    kept_first = order[torch.argsort((~keep[order]).to(torch.uint8), stable=True)]
    return Routing(torch.div(kept_first, k, rounding_mode="floor"), kept_first, kept)


def _keep_fused(
    flat: torch.Tensor,
    order: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    capacity: ExpertCapacity,
) -> torch.Tensor:
    """[N] bool: the assignments each expert keeps, the first `capacity` in drop-policy order
    (`order`: by expert, then token, which is the "position" order)."""
    priority = order
    # by weight, descending; the stable sorts break ties by flat position (token)
    if capacity.policy == "probs":
        by_weight = torch.argsort(weights, descending=True, stable=True)
        priority = by_weight[torch.argsort(flat[by_weight], stable=True)]
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[priority]]
    keep = torch.empty_like(flat, dtype=torch.bool)
    keep[priority] = rank_in_expert < capacity.capacity
    return keep


def _pad_slots_fused(
    flat: torch.Tensor, order: torch.Tensor, keep: torch.Tensor, kept: torch.Tensor, capacity: int
) -> torch.Tensor:
    """[E * capacity] flat position of the row in each expert slot (N = padding): kept rows in token
    order first."""
    n, num_experts = flat.numel(), kept.numel()
    kept_in_order = keep[order]
    before = torch.cumsum(kept_in_order.long(), 0) - 1 - (torch.cumsum(kept, 0) - kept)[flat[order]]
    # last: discarded
    dest = torch.where(kept_in_order, flat[order] * capacity + before, num_experts * capacity)
    slots = torch.full((num_experts * capacity + 1,), n, dtype=order.dtype, device=order.device)
    return slots.scatter_(0, dest, order)[:-1]


def _route_loop(
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    capacity: ExpertCapacity | None,
) -> Routing:
    k, n = topk_idx.shape[1], topk_idx.numel()
    # a dry run's fakes have no values to select by: balanced routing's counts (`split_sizes`)
    answered = split_sizes.loop_permutation_counts(topk_idx.shape[0], k, num_experts)
    kept, dropped = [], []
    for expert in range(num_experts):
        if answered is not None:
            # stand-in positions; the capacity keeps the first ones, as the policy's order would
            flat = torch.arange(answered[expert], device=topk_idx.device)
            cut = answered[expert] if capacity is None else min(answered[expert], capacity.capacity)
            kept.append(flat[:cut])
            dropped.append(flat[cut:])
            continue
        tokens, slots = torch.where(topk_idx == expert)  # row-major: token order
        flat = tokens * k + slots
        keep = _keep_loop(flat, topk_weights.reshape(-1), capacity)
        kept.append(flat[keep])
        dropped.append(flat[~keep])
    if capacity is not None and capacity.pad:
        parts = [
            torch.cat([rows, rows.new_full((capacity.capacity - len(rows),), n)]) for rows in kept
        ]
    else:
        parts = kept + dropped
    slot_idx = torch.cat(parts)
    return Routing(
        torch.div(slot_idx, k, rounding_mode="floor"),
        slot_idx,
        torch.tensor(
            [len(p) for p in parts[:num_experts]], dtype=torch.int64, device=topk_idx.device
        ),
    )


def _keep_loop(
    flat: torch.Tensor, weights: torch.Tensor, capacity: ExpertCapacity | None
) -> torch.Tensor:
    """Which of one expert's assignments `flat` (token order) it keeps."""
    keep = torch.ones_like(flat, dtype=torch.bool)
    if capacity is None or flat.numel() <= capacity.capacity:
        return keep
    if capacity.policy == "probs":
        dropped = torch.argsort(weights[flat], descending=True, stable=True)[capacity.capacity :]
    else:
        dropped = torch.arange(capacity.capacity, flat.numel(), device=flat.device)
    keep[dropped] = False
    return keep


class _SumRows(torch.autograd.Function):
    """`out[index[i]] += rows[i]` into `num_rows` zero rows, keeping only `index` for backward: the
    gradient of a row is the gradient of the row it was added into. (torch's `index_add` keeps its
    source for backward, which would keep a hidden-wide copy of every routed row alive until
    then.) `accumulate`: the dtype of the sums (None: the rows'); the result is in the rows' dtype.
    `loop_splits`: add the rows in these consecutive groups, one `index_add_` each (the loop
    permutation's reference order) instead of all at once."""

    @staticmethod
    def forward(
        ctx,
        rows: torch.Tensor,
        index: torch.Tensor,
        num_rows: int,
        accumulate: torch.dtype | None,
        loop_splits: list[int] | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        out = rows.new_zeros((num_rows, rows.shape[-1]), dtype=accumulate or rows.dtype)
        if loop_splits is None:
            out.index_add_(0, index, rows.to(out.dtype))
        else:
            for part, part_index in zip(rows.split(loop_splits), index.split(loop_splits)):
                out.index_add_(0, part_index, part.to(out.dtype))
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None, None, None


def sum_rows(
    rows: torch.Tensor,
    index: torch.Tensor,
    num_rows: int,
    accumulate: torch.dtype | None = None,
    loop_splits: list[int] | None = None,
) -> torch.Tensor:
    """[num_rows, h]: row r is the sum of the `rows` whose `index` is r (differentiable; backward
    keeps only the index, `_SumRows`)."""
    return _SumRows.apply(rows, index, num_rows, accumulate, loop_splits)


def unpermute(
    rows: torch.Tensor,
    token_idx: torch.Tensor,
    tokens_per_expert: list[int],
    num_tokens: int,
    fused: bool,
) -> torch.Tensor:
    """Sum permuted `rows` [R, h] back into their tokens: returns [num_tokens, h] (padding rows,
    token_idx = num_tokens, land in a scratch row that is dropped).

    Rows are expected to be weighted already. Both paths add a token's rows in the same order
    (ascending expert), so their results are bit-identical on CPU.
    """
    out = sum_rows(
        rows, token_idx, num_tokens + 1, loop_splits=None if fused else tokens_per_expert
    )
    return out[:num_tokens]


def _reorder_chunks(rows: torch.Tensor, split_sizes: list[int], order: list[int]) -> torch.Tensor:
    # one source rank or one local expert: already in order, nothing to copy
    if order == sorted(order):
        return rows
    chunks = rows.split(split_sizes)
    return torch.cat([chunks[i] for i in order])


def _chunk_orders(ep_size: int, num_local_experts: int) -> tuple[list[int], list[int]]:
    """Chunk index orders: (source, expert)-major -> (expert, source)-major, and back."""
    to_expert_major = [
        s * num_local_experts + e for e in range(num_local_experts) for s in range(ep_size)
    ]
    to_source_major = [e * ep_size + s for s in range(ep_size) for e in range(num_local_experts)]
    return to_expert_major, to_source_major


def sort_chunks_by_local_expert(
    rows: torch.Tensor, counts: list[int], ep_size: int, num_local_experts: int
) -> torch.Tensor:
    """Reorder received rows from (source rank, local expert) to (local expert, source rank) order.

    `counts[s * num_local_experts + e]` is the number of rows source rank s sent for local expert e.
    """
    order, _ = _chunk_orders(ep_size, num_local_experts)
    return _reorder_chunks(rows, counts, order)


def unsort_chunks_by_local_expert(
    rows: torch.Tensor, counts: list[int], ep_size: int, num_local_experts: int
) -> torch.Tensor:
    """Inverse of `sort_chunks_by_local_expert` (same `counts`, still indexed by (source rank, local
    expert))."""
    to_expert_major, to_source_major = _chunk_orders(ep_size, num_local_experts)
    return _reorder_chunks(rows, [counts[i] for i in to_expert_major], to_source_major)
