"""All-to-all token dispatcher for expert parallelism (Megatron's `MoEAlltoAllTokenDispatcher`, ETP
= 1).

The trip of one micro-batch's tokens is cut into separate steps so that a scheduler can run other
work between a launch and its wait (the EP-overlap schedule interleaves two micro-batches this way).
After the plan, the six steps are Megatron-Core's
(`megatron/core/transformer/moe/token_dispatcher.py`), named in mirror pairs; the two token steps
launch and return a `PendingAllToAll`, whose `wait()` gives what the postprocess step takes:

    route                 routing -> permuted layout; LAUNCH the counts exchange -> PendingPlan
    PendingPlan.resolve   wait for the counts (one host sync of the split sizes)  -> DispatchPlan
    dispatch_preprocess   gather the rows and their combine weights in that layout (autograd)
    token_dispatch        launch the all-to-all of rows and combine weights -> PendingAllToAll
    dispatch_postprocess  sort the received rows by local expert            -> rows for the experts
    (experts)             the expert outputs, weighted by their combine weights
    combine_preprocess    undo the local-expert sort
    token_combine         launch the all-to-all back                        -> PendingAllToAll
    combine_postprocess   un-permute (sum each token's rows)                -> shaped like the input

The counts leave as soon as routing is known and are waited for only when the dispatch needs them:
the exchange is a collective, so its wait is where a rank that is ahead waits for its peers, and a
scheduler wants that wait as late as possible and filled with other work (`resolve(wait)` takes the
scheduler's wait). With a static expert capacity (`moe_expert_capacity_factor` with
`moe_pad_expert_input_to_capacity`) every rank sends exactly `capacity` rows per expert, so every
split size is fixed by the configuration and no counts are exchanged at all; without padding the
capacity only drops rows, and the (smaller) counts still travel. The sync-free dropless mode
(`moe_expert_rank_capacity_factor`) is this dispatcher with fixed blocks per EP peer whose counts
only the device reads (`rank_capacity.RankCapacityDispatcher`).

Combine weights are applied on the expert side, inside the experts' activation (`GroupedExperts`):
the rows sent back are already weighted, so the source rank only has to sum a token's rows, and the
weights never travel back. They do travel out, in fp32, as extra bytes of each row in the same
all-to-all (`comm.all_to_all_many`: one collective, not two), and their gradient comes back the same
way with the rows' gradient.

Tensors flow through the step arguments and results; `DispatchPlan` holds only the routing metadata
(no autograd), so a scheduler that cuts autograd at step boundaries knows exactly which tensors to
detach.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch.distributed import ProcessGroup

from overlap.config.model import ModelConfig
from overlap.kernels import Kernels
from overlap.layers.moe.permute import (
    ExpertCapacity,
    Routing,
    expert_capacity,
    expert_counts,
    gather,
    route,
    sort_chunks_by_local_expert,
    unpermute,
    unsort_chunks_by_local_expert,
)
from overlap.layers.moe.split_sizes import BalancedRouting, read_split_sizes
from overlap.parallel import comm
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder


class _AwaitAllToAll(torch.autograd.Function):
    """Autograd node of an all-to-all launched earlier: forward waits for its outputs, backward
    sends their gradients the opposite way (one all-to-all for all of them, input and output split
    sizes swapped).

    The launch happens outside autograd (in `token_dispatch` / `token_combine`) so that it can
    return at once with a handle; this node links the received tensors to the sent ones when the
    scheduler decides to wait.
    """

    @staticmethod
    def forward(ctx, pending: PendingAllToAll, *sent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Keep only metadata: holding `pending` would keep the sent rows alive until backward.
        ctx.group, ctx.kind = pending.group, pending.kind
        ctx.output_splits, ctx.input_splits = pending.output_splits, pending.input_splits
        return pending.handle.wait()

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # One node for all the tensors, so every output gets a gradient (zeros where a sent tensor
        # needed none): a few extra bytes in the one all-to-all back, instead of a second
        # collective.
        back = comm.all_to_all_many(
            grads,
            ctx.group,
            ctx.kind + "_bwd",
            output_split_sizes=ctx.input_splits,
            input_split_sizes=ctx.output_splits,
        )
        return (None, *back.wait())


@dataclass
class PendingAllToAll:
    """Tensors with the same splits in flight in one all-to-all. `wait()` (call it once) returns the
    received tensors, autograd-linked to the sent ones; until then the caller is free to run
    unrelated work."""

    sent: tuple[torch.Tensor, ...]
    handle: comm.ManyHandle
    group: ProcessGroup
    kind: str
    output_splits: list[int]
    input_splits: list[int]

    @classmethod
    def launch(
        cls,
        tensors: tuple[torch.Tensor, ...],
        group: ProcessGroup,
        kind: str,
        output_splits: list[int],
        input_splits: list[int],
    ) -> PendingAllToAll:
        handle = comm.all_to_all_many(tensors, group, kind, output_splits, input_splits)
        return cls(tensors, handle, group, kind, output_splits, input_splits)

    def wait(self) -> tuple[torch.Tensor, ...]:
        return _AwaitAllToAll.apply(self, *self.sent)


WaitFn = Callable[[comm.CommHandle], torch.Tensor]
PlanT = TypeVar("PlanT")


def wait_now(handle: comm.CommHandle) -> torch.Tensor:
    """The plain wait: block until the data is there."""
    return handle.wait()


class PendingPlan(Generic[PlanT]):
    """A dispatch plan whose metadata exchange may still be in flight. `resolve(wait)` finishes it
    once (later calls return the same plan); `wait` is how each metadata handle is waited for, so a
    scheduler can fill the wait."""

    def __init__(self, finish: Callable[[WaitFn], PlanT]) -> None:
        self._finish: Callable[[WaitFn], PlanT] | None = finish
        self._plan: PlanT | None = None

    def resolve(self, wait: WaitFn = wait_now) -> PlanT:
        if self._finish is not None:
            self._plan, self._finish = self._finish(wait), None
        return self._plan


@dataclass
class DispatchPlan:
    """Routing metadata of one micro-batch, fixed by `PendingPlan.resolve` (all split sizes are host
    ints)."""

    hidden_shape: torch.Size  # shape of the layer input, restored by combine_postprocess
    token_idx: torch.Tensor  # [R] token position of each sent row (T: padding)
    # [R] position of each sent row in the flattened [T * k] routing (T * k: padding)
    slot_idx: torch.Tensor
    padded: bool  # rows are padded to the expert capacity
    tokens_per_expert: list[int]  # [E] rows this rank sends to each (global) expert
    input_splits: list[int]  # [ep] rows sent to each EP rank
    output_splits: list[int]  # [ep] rows received from each EP rank
    recv_counts: list[int]  # [ep * E_local] rows received, indexed (source rank, local expert)
    tokens_per_local_expert: list[int]  # [E_local] rows each local expert processes
    # the same [E_local] as int64 on the device (the grouped GEMM's offsets)
    local_expert_counts: torch.Tensor


class AllToAllDispatcher:
    """Moves routed tokens to the EP rank that owns their expert and brings the expert outputs
    back."""

    def __init__(self, config: ModelConfig, ps: ParallelState, kernels: Kernels) -> None:
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.ep = ps.layout.ep
        self.num_local_experts = config.num_moe_experts // ps.layout.ep
        self.group = ps.ep_group
        self.meta_group = ps.ep_meta_group  # split sizes travel apart from the bulk all-to-alls
        # the fused permutation or the per-expert loop, as the run decided (`overlap.kernels`)
        self.permute_fusion = kernels.moe_permute_fusion
        self.capacity_factor = config.moe_expert_capacity_factor
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        self.drop_policy = config.moe_token_drop_policy

    def capacity(self, num_tokens: int) -> ExpertCapacity | None:
        """The expert capacity for `num_tokens` local tokens, or None (dropless)."""
        if self.capacity_factor is None:
            return None
        return ExpertCapacity(
            expert_capacity(num_tokens, self.topk, self.num_experts, self.capacity_factor),
            self.pad_to_capacity,
            self.drop_policy,
        )

    def route(
        self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, hidden_shape: torch.Size
    ) -> PendingPlan[DispatchPlan]:
        """Launch the counts exchange (none with padded capacity) and lay out the permutation of the
        routing `topk_idx` [T, k] while the counts travel; returns without waiting."""
        capacity = self.capacity(topk_idx.shape[0])
        if capacity is not None and capacity.pad:
            with recorder().span("moe.permute"):
                routing = route(
                    topk_idx, topk_weights, self.num_experts, self.permute_fusion, capacity
                )
            static = [capacity.capacity] * self.num_experts
            on_device = torch.full(
                (self.num_local_experts,),
                capacity.capacity * self.ep,
                dtype=torch.int64,
                device=topk_idx.device,
            )
            plan = self._plan(hidden_shape, routing, True, static, static, on_device)
            return PendingPlan(lambda wait: plan)
        # Counts per (destination rank, local expert) go out first; what comes back is, per source
        # rank, how many rows it will send for each of our local experts.
        el = self.num_local_experts
        counts = expert_counts(topk_idx, self.num_experts, capacity)
        handle = comm.all_to_all(
            counts, self.meta_group, "ep_counts", [el] * self.ep, [el] * self.ep
        )
        with recorder().span("moe.permute"):
            routing = route(topk_idx, topk_weights, self.num_experts, self.permute_fusion, capacity)

        def finish(wait: WaitFn) -> DispatchPlan:
            # THE host sync of the layer, done once and as late as the dispatch allows: all_to_all
            # needs its split sizes on the host, and so do the chunk sort and the expert loop. One
            # read of every count means no later step blocks the CPU (on CUDA a pinned copy that
            # waits for the exchange only: `split_sizes`).
            host, recv = read_split_sizes(
                counts,
                handle,
                wait,
                lambda: self._balanced(topk_idx.shape[0], capacity).alltoall_counts(
                    comm.group_rank(self.group)
                ),
            )
            return self._plan(
                hidden_shape,
                routing,
                False,
                host[: self.num_experts],
                host[self.num_experts :],
                recv.view(self.ep, el).sum(0),
            )

        return PendingPlan(finish)

    def _balanced(self, num_tokens: int, capacity: ExpertCapacity | None) -> BalancedRouting:
        """The routing a dry run assumes for `num_tokens` local tokens
        (`overlap.layers.moe.split_sizes`)."""
        return BalancedRouting(
            num_tokens,
            self.topk,
            self.num_experts,
            self.ep,
            None if capacity is None else capacity.capacity,
        )

    def _plan(
        self,
        hidden_shape: torch.Size,
        routing: Routing,
        padded: bool,
        local: list[int],
        recv_counts: list[int],
        local_expert_counts: torch.Tensor,
    ) -> DispatchPlan:
        """The plan from host counts: `local` [E] rows sent per expert, `recv_counts` [ep * E_local]
        received per (source rank, local expert), and `local_expert_counts` [E_local], the rows of
        each local expert summed over the source ranks, on the device. Rows past the sent total
        (capacity drops) are cut off here."""
        el, sent = self.num_local_experts, sum(local)
        return DispatchPlan(
            hidden_shape=hidden_shape,
            token_idx=routing.token_idx[:sent],
            slot_idx=routing.slot_idx[:sent],
            padded=padded,
            tokens_per_expert=local,
            input_splits=[sum(local[r * el : (r + 1) * el]) for r in range(self.ep)],
            output_splits=[sum(recv_counts[r * el : (r + 1) * el]) for r in range(self.ep)],
            recv_counts=recv_counts,
            tokens_per_local_expert=[
                sum(recv_counts[r * el + e] for r in range(self.ep)) for e in range(el)
            ],
            local_expert_counts=local_expert_counts,
        )

    def dispatch_preprocess(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, plan: DispatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [R, h] of `hidden` [..., h] and their combine weights [R] in the plan's order
        (differentiable)."""
        with recorder().span("moe.permute"):
            return gather(
                hidden.reshape(-1, hidden.shape[-1]),
                topk_weights,
                plan.token_idx,
                plan.slot_idx,
                plan.padded,
            )

    def token_dispatch(
        self, rows: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan
    ) -> PendingAllToAll:
        """Launch the all-to-all of the permuted rows and their combine weights; does not wait."""
        return PendingAllToAll.launch(
            (rows, weights), self.group, "ep_dispatch", plan.output_splits, plan.input_splits
        )

    def dispatch_postprocess(
        self, rows: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Received rows/weights, (source rank, local expert) order -> grouped by local expert
        (`plan.tokens_per_local_expert`)."""
        el = self.num_local_experts
        with recorder().span("moe.sort_chunks"):
            return (
                sort_chunks_by_local_expert(rows, plan.recv_counts, self.ep, el),
                sort_chunks_by_local_expert(weights, plan.recv_counts, self.ep, el),
            )

    def combine_preprocess(self, expert_output: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Put the (weighted) expert output rows back in (source rank, local expert) order."""
        with recorder().span("moe.sort_chunks"):
            return unsort_chunks_by_local_expert(
                expert_output, plan.recv_counts, self.ep, self.num_local_experts
            )

    def token_combine(self, rows: torch.Tensor, plan: DispatchPlan) -> PendingAllToAll:
        """Launch the all-to-all that returns weighted rows to their source ranks; does not wait."""
        return PendingAllToAll.launch(
            (rows,), self.group, "ep_combine", plan.input_splits, plan.output_splits
        )

    def combine_postprocess(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Sum each token's returned (already weighted) rows back into a tensor shaped like the
        layer input."""
        with recorder().span("moe.unpermute"):
            out = unpermute(
                rows,
                plan.token_idx,
                plan.tokens_per_expert,
                plan.hidden_shape[:-1].numel(),
                self.permute_fusion,
            )
            return out.reshape(plan.hidden_shape)
