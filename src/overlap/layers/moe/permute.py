"""Token permutation for MoE: group routed (token, expert) pairs by expert, and scatter expert outputs back.

Layout of the permuted rows (both paths, bit-identical): rows are grouped by expert in ascending order, and within
one expert they keep token order. A token routed to k experts appears k times. `token_idx[i]` is the token position
of permuted row i, which is all that un-permutation needs.

Two implementations, chosen by `config.moe_permute_fusion`:
- fused (True): one stable argsort of the flattened routing plus index_select / index_add; no Python loop over
  experts, so its cost does not grow with the expert count (the role TE's fused kernels play in Megatron).
- loop (False): one `torch.where` per expert; easy to read and check, and the reference the fused path is tested
  against.

After the EP all-to-all, a rank holds rows ordered by (source rank, local expert); its experts want them ordered by
(local expert, source rank). `sort_chunks_by_local_expert` and its inverse reorder those chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Permutation:
    """Rows grouped by expert, plus what is needed to undo the grouping."""

    tokens: torch.Tensor  # [N, h], N = T * k
    weights: torch.Tensor  # [N], the combine weight of each row
    token_idx: torch.Tensor  # [N], token position of each row
    tokens_per_expert: torch.Tensor  # [E] int64, rows per expert (stays a tensor: no host sync here)


def permute(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
            fused: bool) -> Permutation:
    """Group the rows of `hidden` [T, h] by the experts in `topk_idx` [T, k] (weights [T, k] travel along)."""
    if fused:
        return _permute_fused(hidden, topk_idx, topk_weights, num_experts)
    return _permute_loop(hidden, topk_idx, topk_weights, num_experts)


def _permute_fused(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int) -> Permutation:
    flat = topk_idx.reshape(-1)
    # Stable sort: flat position t * k + j grows with t, so equal experts keep token order.
    order = torch.argsort(flat, stable=True)
    token_idx = torch.div(order, topk_idx.shape[1], rounding_mode="floor")
    return Permutation(tokens=hidden.index_select(0, token_idx),
                       weights=topk_weights.reshape(-1).index_select(0, order),
                       token_idx=token_idx,
                       tokens_per_expert=torch.bincount(flat, minlength=num_experts))


def _permute_loop(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int) -> Permutation:
    token_parts, weight_parts = [], []
    for expert in range(num_experts):
        tokens, slots = torch.where(topk_idx == expert)  # row-major: token order
        token_parts.append(tokens)
        weight_parts.append(topk_weights[tokens, slots])
    token_idx = torch.cat(token_parts)
    counts = torch.tensor([len(t) for t in token_parts], dtype=torch.int64, device=topk_idx.device)
    return Permutation(tokens=hidden.index_select(0, token_idx), weights=torch.cat(weight_parts),
                       token_idx=token_idx, tokens_per_expert=counts)


def unpermute(rows: torch.Tensor, token_idx: torch.Tensor, tokens_per_expert: list[int], num_tokens: int,
              fused: bool) -> torch.Tensor:
    """Sum permuted `rows` [N, h] back into their tokens: returns [num_tokens, h].

    Rows are expected to be weighted already. Both paths add a token's rows in the same order (ascending expert), so
    their results are bit-identical on CPU.
    """
    out = rows.new_zeros((num_tokens, rows.shape[-1]))
    if fused:
        return out.index_add(0, token_idx, rows)
    for expert_rows, expert_tokens in zip(rows.split(tokens_per_expert), token_idx.split(tokens_per_expert)):
        out = out.index_add(0, expert_tokens, expert_rows)
    return out


def _reorder_chunks(rows: torch.Tensor, split_sizes: list[int], order: list[int]) -> torch.Tensor:
    chunks = rows.split(split_sizes)
    return torch.cat([chunks[i] for i in order])


def _chunk_orders(ep_size: int, num_local_experts: int) -> tuple[list[int], list[int]]:
    """Chunk index orders: (source, expert)-major -> (expert, source)-major, and back."""
    to_expert_major = [s * num_local_experts + e for e in range(num_local_experts) for s in range(ep_size)]
    to_source_major = [e * ep_size + s for s in range(ep_size) for e in range(num_local_experts)]
    return to_expert_major, to_source_major


def sort_chunks_by_local_expert(rows: torch.Tensor, counts: list[int], ep_size: int,
                                num_local_experts: int) -> torch.Tensor:
    """Reorder received rows from (source rank, local expert) to (local expert, source rank) order.

    `counts[s * num_local_experts + e]` is the number of rows source rank s sent for local expert e.
    """
    order, _ = _chunk_orders(ep_size, num_local_experts)
    return _reorder_chunks(rows, counts, order)


def unsort_chunks_by_local_expert(rows: torch.Tensor, counts: list[int], ep_size: int,
                                  num_local_experts: int) -> torch.Tensor:
    """Inverse of `sort_chunks_by_local_expert` (same `counts`, still indexed by (source rank, local expert))."""
    to_expert_major, to_source_major = _chunk_orders(ep_size, num_local_experts)
    return _reorder_chunks(rows, [counts[i] for i in to_expert_major], to_source_major)
