"""Which tokens of a sequence each context-parallel rank holds: Megatron's load-balanced causal
split (`get_batch_on_this_cp_rank`).

The sequence is cut into 2 x CP equal chunks and CP rank i holds chunks i and 2CP-1-i, in that
order. Under a causal mask a token's work grows with its position, so pairing an early chunk with
its mirror gives every rank the same attention work (a plain cut would leave rank 0 one block and
the last rank CP of them). The data loader cuts each sample this way, RoPE rotates each token by
its global position, and the attention's causal mask between a rank's queries and another rank's
keys follows from the two ranks' chunk numbers.
"""

from __future__ import annotations

import torch

from overlap.layout.prerequisites import cp_chunks_fit


def rank_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk numbers (of 2 x cp_size) CP rank `cp_rank` holds, early one first."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_positions(
    seq_length: int, cp_rank: int, cp_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The global positions of the seq_length / cp_size tokens CP rank `cp_rank` holds, in the
    order it holds them (an int64 index: a sample's [..., positions] is this rank's share)."""
    # the CP rule (`cp_chunks_fit`) refuses such a configuration at finalize: only a bare call,
    # never a user's run, reaches this guard
    if not cp_chunks_fit(seq_length, cp_size):
        raise ValueError(f"sequence {seq_length} is not divisible into 2 x CP = {2 * cp_size}")
    chunk = seq_length // (2 * cp_size)
    return torch.cat(
        [
            torch.arange(c * chunk, (c + 1) * chunk, device=device)
            for c in rank_chunks(cp_rank, cp_size)
        ]
    )


def gathered_positions(
    seq_length: int, cp_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The global positions of the whole sequence gathered from the CP ranks in rank order (an
    all-gather's or all-to-all's output): rank 0's two chunks, then rank 1's, ..."""
    return torch.cat([cp_positions(seq_length, r, cp_size, device) for r in range(cp_size)])
