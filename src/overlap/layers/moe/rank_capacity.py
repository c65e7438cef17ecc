"""Sync-free dropless dispatch (`model.moe_expert_rank_capacity_factor`, Megatron's name): the
all-to-all dispatcher with every shape fixed by the configuration, and exact dropless results.

The all-to-all dispatcher reads the split sizes on the host once per MoE layer and micro-batch
(`read_split_sizes`): each read waits for the device. The padded capacity path
(`moe_expert_capacity_factor` + `moe_pad_expert_input_to_capacity`) reads nothing but drops the rows
past each expert's capacity, so it trains another model. This dispatcher reads nothing and drops
nothing that survives the step:

- every EP rank sends each EP peer one block of exactly C = ceil(T x k / EP x factor) rows
  (`expert_rank_capacity`): the peer's rows in the dropless layout (local expert, then token order)
  and then padding rows (zero row, weight 0, `permute.gather`). All split sizes are [C] x EP, host
  ints known from the configuration;
- no counts are exchanged: each row carries its local expert beside its combine weight, in the same
  all-to-all, and the receiver sorts the EP x C rows it gets by local expert with a stable device
  sort (padding last), which is the order the dropless path gives its experts (local expert, source
  rank, token). So no split-size exchange precedes the dispatch (the latency-bound rendezvous
  `ep_counts` of the other paths is gone too), and nothing waits for metadata;
- the experts' grouped GEMM runs on all EP x C rows, its groups' ends computed on the device from
  the received experts (the padding rows join the last expert's group: zero rows whose output and
  weight-gradient contributions are zero). The per-expert loop (`GroupedLinear` without offsets)
  needs host counts and is refused (`GroupedExperts`);
- combine undoes the sort on the device and sends blocks of C rows back; the source sums each
  token's rows in ascending expert order as the dropless un-permutation does (padding lands in a
  scratch row). Backward is autograd's through the same index ops and the same fixed splits.

Overflow: a block needs more than C rows when a rank routes more than C of its (token, expert)
pairs to one peer's experts. The rows past C are then not sent, and the dispatcher adds the count
of such blocks into its device counter `overflow`, which nothing reads on the host here. The trainer
(`overlap.training.trainer`) folds the counters' sum into the step's existing loss and grad-norm
reductions (`StaticDispatchSteps`), so every rank learns in the grad-norm read it makes anyway
whether ANY rank overflowed, and if so re-runs the whole forward-backward with these dispatchers
switched to the dropless path (`AllToAllDispatcher`'s, host split sizes), before the optimizer
applies anything: the step that counts is then the dropless step, and what it leaves (weights,
optimizer state, loss scaler, RNG, data position) is what a dropless run's step leaves. With no
overflow the result equals the dropless step's up to the GEMMs' rounding (the last expert's group
has padding rows: BLAS may block it otherwise).

The factor trades memory and bandwidth for re-runs: each rank holds and sends EP x C = factor x T x
k rows per MoE layer and micro-batch where dropless holds T x k on average (factor >= EP never
overflows: a block then has room for every pair of the rank); a re-run costs one more
forward-backward of the step. `overlap explain`'s decision table says both; at the end of a run the
trainer says how many steps re-ran and the largest factor a block needed (`needed`).

Against the reference (Megatron-LM's paged-stash feature): there the budget sizes HybridEP's
dispatch buffers and Transformer Engine's fused grouped experts, and its runner re-runs a step once
without padding when any rank went over budget, as here. Here the blocks are plain NCCL/gloo
all-to-alls, one fixed block per (source, destination) pair of EP ranks. Not built: paged stashing
of the experts' activations (`model.moe_paged_stash`: only the rows routed kept for the backward;
`overlap run` refuses it, the planner prices its pool), this mode with the flex dispatcher (both
refused by `moe_layer.unbuilt_dispatch`), and the CUDA graphs a static-shape step would allow.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from overlap.config.model import ModelConfig, expert_rank_capacity
from overlap.kernels import Kernels
from overlap.layers.moe.dispatcher import AllToAllDispatcher, DispatchPlan, PendingPlan
from overlap.layers.moe.permute import count_per_expert, route, sum_rows
from overlap.layers.moe.router import TopKRouter
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder


@dataclass
class RankCapacityPlan:
    """Routing metadata of one micro-batch in fixed blocks: every split size is the block size, and
    everything that depends on the routing stays on the device. The receiving side's three tensors
    come from the rows' local experts, which travel with the rows: `dispatch_postprocess` sets them
    (None before)."""

    hidden_shape: torch.Size  # shape of the layer input, restored by combine_postprocess
    # [EP x C] token position of each sent row, block by block (T: padding)
    token_idx: torch.Tensor
    # [EP x C] position of each sent row in the flattened [T x k] routing (T x k: padding)
    slot_idx: torch.Tensor
    # [EP x C] float32 local expert (on its destination rank) of each sent row (E_local: padding)
    local_expert: torch.Tensor
    input_splits: list[int]  # [EP] C rows sent to each EP rank
    output_splits: list[int]  # [EP] C rows received from each EP rank
    # [EP x C] received row at each expert input row: (local expert, source rank, token), padding
    # last
    expert_order: torch.Tensor | None = None
    expert_unorder: torch.Tensor | None = None  # [EP x C] its inverse permutation
    # [E_local] int64 rows of each grouped-GEMM group on the device: the valid rows of each local
    # expert, the padding rows added to the last one
    local_expert_counts: torch.Tensor | None = None
    # the grouped GEMM needs no host counts here (GroupedExperts refuses the per-expert loop)
    tokens_per_local_expert: None = None
    padded: bool = True  # `permute.gather`: padding rows get a zero row and weight 0


class RankCapacityDispatcher(AllToAllDispatcher):
    """The all-to-all dispatcher in fixed blocks of `expert_rank_capacity` rows per EP peer (module
    docstring). `dropless = True` switches it to `AllToAllDispatcher`'s path (the re-run of a step
    that overflowed); `overflow` counts, on the device, the blocks that had no room for all their
    rows since it was last zeroed; `needed` is the largest factor a block of this rank has needed
    so far (its rows over T x k / EP), on the device too, for the run's closing report.

    The combine weights travel as [R, 2] float32: each row's weight, then its local expert (exact
    as a float: fewer than 2^24 experts), so the receiver learns the rows' experts from the rows
    themselves and no counts are exchanged. The second column's gradient is zero (4 bytes a row in
    the dispatch's backward)."""

    def __init__(self, config: ModelConfig, ps: ParallelState, kernels: Kernels) -> None:
        super().__init__(config, ps, kernels)
        self.rank_capacity_factor = config.moe_expert_rank_capacity_factor
        self.dropless = False
        self.overflow = torch.zeros((), dtype=torch.int64, device=ps.device)
        self.needed = torch.zeros((), dtype=torch.float32, device=ps.device)

    def block_rows(self, num_tokens: int) -> int:
        """C: the rows of one block for `num_tokens` local tokens."""
        return expert_rank_capacity(num_tokens, self.topk, self.ep, self.rank_capacity_factor)

    def route(
        self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, hidden_shape: torch.Size
    ) -> PendingPlan[DispatchPlan | RankCapacityPlan]:
        """Lay out the blocks: nothing is exchanged, nothing waited for (the dropless path's own
        `route`, with its counts exchange, while `dropless`)."""
        if self.dropless:
            return super().route(topk_idx, topk_weights, hidden_shape)
        ep, el = self.ep, self.num_local_experts
        num_tokens, pairs = topk_idx.shape[0], topk_idx.numel()
        c = self.block_rows(num_tokens)
        with recorder().span("moe.permute"):
            # the dropless layout (expert, then token order): each peer's rows are one run of it
            routing = route(topk_idx, topk_weights, self.num_experts, self.permute_fusion)
            per_peer = routing.tokens_per_expert.view(ep, el).sum(1)
            self.overflow += (per_peer > c).sum()
            if pairs:
                fullest = per_peer.max().float() * (ep / pairs)
                torch.maximum(self.needed, fullest, out=self.needed)
            position = torch.arange(c, device=topk_idx.device)
            first = per_peer.cumsum(0) - per_peer
            # [EP, C]: the routing row at each block position, `pairs` (padding) past the peer's
            # rows; a block over capacity keeps its first C rows
            source = torch.where(position < per_peer[:, None], first[:, None] + position, pairs)
            slot_idx = torch.cat([routing.slot_idx, routing.slot_idx.new_full((1,), pairs)])
            slot_idx = slot_idx.index_select(0, source.reshape(-1))
            # each row's expert, local to its destination (padding: E_local)
            expert = torch.cat([topk_idx.reshape(-1), topk_idx.new_full((1,), -1)])
            expert = expert.index_select(0, slot_idx)
            local_expert = torch.where(expert < 0, el, expert % el).float()
        plan = RankCapacityPlan(
            hidden_shape=hidden_shape,
            token_idx=torch.div(slot_idx, self.topk, rounding_mode="floor"),
            slot_idx=slot_idx,
            local_expert=local_expert,
            input_splits=[c] * ep,
            output_splits=[c] * ep,
        )
        return PendingPlan(lambda wait: plan)

    def dispatch_preprocess(
        self,
        hidden: torch.Tensor,
        topk_weights: torch.Tensor,
        plan: DispatchPlan | RankCapacityPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks' rows [EP x C, h] and, per row, [combine weight, local expert] (class
        docstring; differentiable in the rows and weights)."""
        rows, weights = super().dispatch_preprocess(hidden, topk_weights, plan)
        if isinstance(plan, DispatchPlan):
            return rows, weights
        return rows, torch.stack([weights, plan.local_expert], dim=1)

    def dispatch_postprocess(
        self, rows: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan | RankCapacityPlan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Received blocks -> rows and weights grouped by local expert, padding last (a device sort
        by the local experts that came with the rows); fills the plan's receiving side."""
        if isinstance(plan, DispatchPlan):
            return super().dispatch_postprocess(rows, weights, plan)
        el = self.num_local_experts
        with recorder().span("moe.sort_chunks"):
            expert = weights[:, 1].detach().long()
            order = torch.argsort(expert, stable=True)
            plan.expert_order = order
            plan.expert_unorder = torch.empty_like(order).scatter_(
                0, order, torch.arange(order.numel(), device=order.device)
            )
            valid = count_per_expert(expert, el + 1)[:el]
            # the grouped GEMM's groups cover every row: padding joins the last group
            plan.local_expert_counts = torch.cat(
                [valid[:-1], (order.numel() - valid[:-1].sum()).view(1)]
            )
            return rows.index_select(0, order), weights[:, 0].index_select(0, order)

    def combine_preprocess(
        self, expert_output: torch.Tensor, plan: DispatchPlan | RankCapacityPlan
    ) -> torch.Tensor:
        """Expert output rows back into the received blocks' order."""
        if isinstance(plan, DispatchPlan):
            return super().combine_preprocess(expert_output, plan)
        with recorder().span("moe.sort_chunks"):
            return expert_output.index_select(0, plan.expert_unorder)

    def combine_postprocess(
        self, rows: torch.Tensor, plan: DispatchPlan | RankCapacityPlan
    ) -> torch.Tensor:
        """Sum each token's returned rows (ascending expert, as the dropless path adds them; padding
        into a scratch row) into a tensor shaped like the layer input."""
        if isinstance(plan, DispatchPlan):
            return super().combine_postprocess(rows, plan)
        num_tokens = plan.hidden_shape[:-1].numel()
        with recorder().span("moe.unpermute"):
            out = sum_rows(rows, plan.token_idx, num_tokens + 1)[:num_tokens]
            return out.reshape(plan.hidden_shape)


class StaticDispatchSteps:
    """The trainer's handle on a rank's `RankCapacityDispatcher`s for one step: `begin()` before
    the first forward, `overflowed()` the counters' sum on the device after the backward, `rerun()`
    before a step's dropless re-run.

    The handle exists on every rank of a run in this mode, with the dispatchers of the MoE layers
    the rank holds - none on a pipeline stage of dense layers only, whose count is then 0: every
    rank must carry the count through the same reductions (the collectives match by position).

    The random state kept for the re-run: the global CPU generator, the device's default generator,
    and the routers' own generators (forced load balancing draws its logits from them)."""

    def __init__(
        self,
        dispatchers: list[RankCapacityDispatcher],
        routers: list[TopKRouter],
        device: torch.device,
    ) -> None:
        self.dispatchers, self.routers, self.device = dispatchers, routers, device
        self._random: tuple | None = None

    @classmethod
    def of(
        cls, config: ModelConfig, modules: Iterable[nn.Module], device: torch.device
    ) -> StaticDispatchSteps | None:
        """The handle for a run of `config` whose rank holds `modules` (its model chunks) on
        `device`, or None where the run is not in this mode."""
        if config.moe_expert_rank_capacity_factor is None or not config.is_moe:
            return None
        layers = [
            m
            for chunk in modules
            for m in chunk.modules()
            if isinstance(getattr(m, "dispatcher", None), RankCapacityDispatcher)
        ]
        return cls([m.dispatcher for m in layers], [m.router for m in layers], device)

    def begin(self) -> None:
        """Start a step: counters zeroed, the blocks on, the random state kept."""
        for d in self.dispatchers:
            d.overflow.zero_()
            d.dropless = False
        self._random = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            [
                None if r.random_logits is None else r.random_logits.get_state()
                for r in self.routers
            ],
        )

    def needed_factor(self) -> torch.Tensor:
        """[1] float32 on the device: the largest factor any block of this rank has needed in the
        run so far (the rows the fullest block had over T x k / EP; 0 without MoE layers)."""
        return self._stacked([d.needed for d in self.dispatchers]).max().view(1)

    def overflowed(self) -> torch.Tensor:
        """[1] float32: blocks over capacity on this rank since `begin()` (0: none), on the
        device."""
        return self._stacked([d.overflow.float() for d in self.dispatchers]).sum().view(1)

    def rerun(self) -> None:
        """Before the step's dropless re-run: the random state as `begin()` found it, so the re-run
        draws what the dropless step would have, and the dropless path on."""
        cpu, device_state, routers = self._random
        torch.set_rng_state(cpu)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, self.device)
        for router, state in zip(self.routers, routers):
            if state is None:
                router.random_logits = None  # made (seeded) again at its first use
            else:
                router.random_logits.set_state(state)
        for d in self.dispatchers:
            d.dropless = True

    def _stacked(self, values: list[torch.Tensor]) -> torch.Tensor:
        """`values` (scalars) as one float32 vector; a single 0 where the rank has none."""
        if not values:
            return torch.zeros(1, dtype=torch.float32, device=self.device)
        return torch.stack(values)
