"""Flex token dispatcher, backend "torch": each token crosses the network once per destination EP
rank.

The all-to-all dispatcher sends a token once per chosen expert, so a token whose top-k experts
include two on the same rank travels there twice and comes back twice. Here the source rank sends
one row per (token, destination rank) with that token's k combine weights (0 where the expert lives
elsewhere); the destination fans the row out to its local experts, and sums that token's weighted
local expert outputs into one returned row. The saving is the rows a token would have sent twice,
which grows with top-k and with the number of experts per rank. This is the data movement of
Megatron's flex dispatcher (DeepEP), built from plain all-to-alls so it runs on gloo and NCCL alike.

Steps and their API are those of `AllToAllDispatcher` (the EP-overlap schedule runs either
unchanged); this dispatcher overrides the plan and the four pre/postprocess steps, and takes
`token_dispatch` and `token_combine` as they are:

    route                 rows per destination rank and expert counts; LAUNCH their exchange
                                                                            -> PendingPlan
    PendingPlan.resolve   wait for the counts (ONE host sync), select the rows, exchange each row's
                          local expert ids, fan-out indices                 -> FlexDispatchPlan
    dispatch_preprocess   gather one row and k weights per (token, destination rank)
    token_dispatch        launch the all-to-all of rows [N, h] and weights [N, k] -> PendingAllToAll
    dispatch_postprocess  fan each received row out to its local experts, grouped by local expert
    (experts)             the expert outputs, weighted by their combine weights
    combine_preprocess    sum the weighted expert outputs per received row
    token_combine         launch the all-to-all back                        -> PendingAllToAll
    combine_postprocess   sum each token's returned rows (one per destination rank)

The metadata (how many rows go to each rank, how many (row, expert) pairs each local expert gets,
and each row's local expert ids) moves before the dispatch, through `resolve`'s wait, so
`token_dispatch` carries only the tensors that need gradients and a scheduler can launch it without
any host sync. Every index is built on the device from counts the host already knows, so there is no
data-dependent shape (and no hidden sync) after the one split-size read. Expert capacity is not
built for this dispatcher (`dispatcher_class` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap.layers.moe.dispatcher import AllToAllDispatcher, PendingPlan, WaitFn
from overlap.layers.moe.permute import count_per_expert, sum_rows
from overlap.layers.moe.split_sizes import read_split_sizes
from overlap.parallel import comm
from overlap.parallel.trace import recorder


@dataclass
class FlexDispatchPlan:
    """Routing metadata of one micro-batch, fixed by `PendingPlan.resolve` (split sizes are host
    ints)."""

    hidden_shape: torch.Size  # shape of the layer input, restored by combine_postprocess
    # [N] token position of each sent row (rows ordered by destination rank, then token)
    row_token: torch.Tensor
    input_splits: list[int]  # [ep] rows sent to each EP rank
    output_splits: list[int]  # [ep] rows received from each EP rank
    tokens_per_local_expert: list[int]  # [E_local] (row, expert) pairs each local expert processes
    # the same [E_local] as int64 on the device (the grouped GEMM's offsets)
    local_expert_counts: torch.Tensor
    # [P] received row feeding each expert input row (grouped by local expert)
    pair_row: torch.Tensor
    pair_slot: torch.Tensor  # [P] position of that pair in the received weights, flattened [M * k]
    on_row_rank: torch.Tensor  # [N, k] bool: the row's j-th expert lives on its destination rank


class FlexDispatcher(AllToAllDispatcher):
    """Moves each routed token once to every EP rank that owns one of its experts, and its summed
    output back.

    `token_dispatch` and `token_combine` are the all-to-all dispatcher's: only what is sent (one row
    per destination rank, k weights per row) and how rows are fanned out and summed differ.
    """

    def route(
        self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, hidden_shape: torch.Size
    ) -> PendingPlan[FlexDispatchPlan]:
        """Count rows per destination rank and pairs per expert, and launch their exchange; returns
        at once."""
        ep, el = self.ep, self.num_local_experts
        num_tokens = topk_idx.shape[0]
        with recorder().span("moe.permute"):
            # [T, k] EP rank of each chosen expert
            dest = torch.div(topk_idx, el, rounding_mode="floor")
            on_rank = torch.zeros(ep, num_tokens, dtype=torch.bool, device=topk_idx.device)
            # [ep, T]: token t has at least one expert on rank r
            on_rank.scatter_(0, dest.t(), True)
            pairs = count_per_expert(topk_idx, self.num_experts).view(ep, el)
            # [ep * (1 + el)]
            send = torch.cat([on_rank.sum(dim=1, keepdim=True), pairs], dim=1).reshape(-1)
        handle = comm.all_to_all(send, self.meta_group, "ep_counts", [1 + el] * ep, [1 + el] * ep)
        return PendingPlan(
            lambda wait: self._finish(wait, handle, send, topk_idx, dest, on_rank, hidden_shape)
        )

    def _finish(
        self,
        wait: WaitFn,
        handle: comm.CommHandle,
        send: torch.Tensor,
        topk_idx: torch.Tensor,
        dest: torch.Tensor,
        on_rank: torch.Tensor,
        hidden_shape: torch.Size,
    ) -> FlexDispatchPlan:
        """Wait for the counts `handle` exchanges, select the rows, exchange their local expert ids
        and build the fan-out indices."""
        ep, el, k = self.ep, self.num_local_experts, self.topk
        num_tokens = topk_idx.shape[0]
        # THE host sync of the layer (see AllToAllDispatcher.route for why here and only once).
        flat, recv = read_split_sizes(
            send,
            handle,
            wait,
            lambda: [
                n
                for side in self._balanced(num_tokens, None).flex_counts(
                    comm.group_rank(self.group)
                )
                for entry in side
                for n in entry
            ],
        )
        counts = [
            [flat[(s * ep + r) * (1 + el) : (s * ep + r + 1) * (1 + el)] for r in range(ep)]
            for s in (0, 1)
        ]
        input_splits = [c[0] for c in counts[0]]
        output_splits = [c[0] for c in counts[1]]
        tokens_per_local_expert = [sum(c[1 + e] for c in counts[1]) for e in range(el)]

        with recorder().span("moe.permute"):
            # (rank, token) pairs in rank-major order, first the selected ones: a stable sort of
            # "not selected" on the flattened [ep, T] mask, cut at the host-known count, instead of
            # a syncing nonzero().
            flat = torch.argsort((~on_rank).reshape(-1).to(torch.uint8), stable=True)[
                : sum(input_splits)
            ]
            row_rank = torch.div(flat, num_tokens, rounding_mode="floor")
            row_token = flat - row_rank * num_tokens
            on_row_rank = dest.index_select(0, row_token) == row_rank.unsqueeze(1)  # [N, k]
            local_ids = torch.where(
                on_row_rank, topk_idx.index_select(0, row_token) - row_rank.unsqueeze(1) * el, -1
            ).to(torch.int32)
        recv_ids = wait(
            comm.all_to_all(local_ids, self.meta_group, "ep_counts", output_splits, input_splits)
        )

        with recorder().span("moe.permute"):
            # Received (row, slot) pairs grouped by local expert; within an expert they keep (source
            # rank, token) order, the order the all-to-all dispatcher gives its experts. Padding
            # (-1) sorts last and is cut off.
            ids = recv_ids.reshape(-1).long()
            pair_slot = torch.argsort(torch.where(ids < 0, el, ids), stable=True)[
                : sum(tokens_per_local_expert)
            ]
            pair_row = torch.div(pair_slot, k, rounding_mode="floor")
        return FlexDispatchPlan(
            hidden_shape=hidden_shape,
            row_token=row_token,
            input_splits=input_splits,
            output_splits=output_splits,
            tokens_per_local_expert=tokens_per_local_expert,
            local_expert_counts=recv.view(ep, 1 + el)[:, 1:].sum(0),
            pair_row=pair_row,
            pair_slot=pair_slot,
            on_row_rank=on_row_rank,
        )

    def dispatch_preprocess(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, plan: FlexDispatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One row per (token, destination rank) and its k combine weights, 0 where the expert lives
        elsewhere, so the receiver's weighted sum covers exactly its own experts
        (differentiable)."""
        with recorder().span("moe.permute"):
            rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, plan.row_token)
            weights = torch.where(
                plan.on_row_rank, topk_weights.index_select(0, plan.row_token), 0.0
            )
        return rows, weights

    def dispatch_postprocess(
        self, rows: torch.Tensor, weights: torch.Tensor, plan: FlexDispatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Received rows [M, h] and weights [M, k] -> one row and one weight per (row, local expert)
        pair, grouped by local expert (`plan.tokens_per_local_expert`)."""
        with recorder().span("moe.sort_chunks"):
            return rows.index_select(0, plan.pair_row), weights.reshape(-1).index_select(
                0, plan.pair_slot
            )

    def combine_preprocess(
        self, expert_output: torch.Tensor, plan: FlexDispatchPlan
    ) -> torch.Tensor:
        """Sum the (weighted) expert output rows of one received row: returns [M, h], one row per
        token and source rank. The sum runs in fp32 (one rounding per returned row instead of one
        per expert)."""
        with recorder().span("moe.sort_chunks"):
            return sum_rows(
                expert_output, plan.pair_row, sum(plan.output_splits), accumulate=torch.float32
            )

    def combine_postprocess(self, rows: torch.Tensor, plan: FlexDispatchPlan) -> torch.Tensor:
        """Sum each token's returned rows (one per destination rank) back into a tensor shaped like
        the input."""
        with recorder().span("moe.unpermute"):
            out = sum_rows(rows, plan.row_token, plan.hidden_shape[:-1].numel())
            return out.reshape(plan.hidden_shape)
