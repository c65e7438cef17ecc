"""The MoE layer: router -> all-to-all dispatch -> routed experts -> all-to-all combine (+ optional
shared expert).

The dispatcher is the run's `moe_token_dispatcher_type` (as resolved, `Kernels`): "alltoall" (one
row per chosen expert) or "flex" with backend "torch" (one row per destination rank,
`flex_dispatcher.py`); with
`moe_expert_rank_capacity_factor` the all-to-all in fixed blocks per EP peer, no host read
(`rank_capacity.py`). All have the same steps.

`forward` runs the steps in plain order, waiting on each collective at once. The steps are also
public methods, named after Megatron-Core's `MoELayer`, because the EP-overlap schedule runs them as
separate nodes and interleaves two micro-batches (one's all-to-all in flight while the other
computes):

    topk_weights, pending_plan, aux = layer.route(x)        # router; launches the split sizes
    shared = layer.shared_experts_compute(x)                # None without a shared expert
    plan = pending_plan.resolve()                           # waits for the split sizes
    rows, weights = layer.permute(x, topk_weights, plan)
    pending = layer.dispatch(rows, weights, plan)           # launch, returns handles
    out_rows = layer.routed_experts_compute(pending, plan)  # wait, sort, weighted experts, unsort
    pending = layer.combine(out_rows, plan)                 # launch, returns handles
    y = layer.postprocess(pending, plan, shared)            # wait, un-permute, add shared expert

With a padded expert capacity (`moe_pad_expert_input_to_capacity`) the split sizes are fixed by
the configuration, none are exchanged and `resolve` waits for nothing.

The resolved plan's `moe_shared_expert_overlap` runs the shared expert inside `forward` in two
halves, each while an all-to-all is in flight (see `_forward_with_shared_expert_overlap`).

Input and output are [s_local, b, h] (s_local = s / tp under sequence parallel). Under sequence
parallel every TP rank routes and dispatches only its own tokens: the routed path is token-wise, so
nothing is gathered for it, and only the aux-loss statistics are summed over TP (in the router).
"""

from __future__ import annotations

import torch
from torch import nn

from overlap.config.comm_overlap import OverlapPlan
from overlap.config.mixed_precision import Precision
from overlap.config.model import ModelConfig
from overlap.config.recompute import selective_modules
from overlap.errors import NotBuiltError, Rule, check_rules
from overlap.kernels import Kernels
from overlap.layers.mlp import MLP
from overlap.layers.moe.dispatcher import (
    AllToAllDispatcher,
    DispatchPlan,
    PendingAllToAll,
    PendingPlan,
)
from overlap.layers.moe.experts import GroupedExperts
from overlap.layers.moe.flex_dispatcher import FlexDispatcher, FlexDispatchPlan
from overlap.layers.moe.rank_capacity import RankCapacityDispatcher, RankCapacityPlan
from overlap.layers.moe.router import TopKRouter
from overlap.layers.recompute import maybe_checkpoint
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder

Plan = DispatchPlan | FlexDispatchPlan | RankCapacityPlan


def unbuilt_dispatch(config: ModelConfig, kernels: Kernels) -> list[Rule]:
    """What the token dispatchers do not build, as NotBuiltError rows (`why`: what is not built)
    for the dispatcher the run decided on (`kernels`) and `config`'s capacity factors: the
    run-time refusal table lists them before any rank starts
    (`overlap.training.runtime_refusals`), and `dispatcher_class` raises the first for a layer
    built from a bare config."""
    if not config.is_moe:
        return []
    kind, backend = kernels.moe_token_dispatcher_type, kernels.moe_flex_dispatcher_backend
    flex = kind == "flex"
    factor, rank_factor = config.moe_expert_capacity_factor, config.moe_expert_rank_capacity_factor
    return [
        (
            "model.moe_token_dispatcher_type",
            "allgather",
            kind != "allgather",
            "The all-gather token dispatcher",
            "use model.moe_token_dispatcher_type=alltoall or flex.",
        ),
        (
            "model.moe_flex_dispatcher_backend",
            backend,
            not (flex and backend in ("deepep", "hybridep")),
            "Dispatch through DeepEP kernels",
            "use moe_flex_dispatcher_backend=torch.",
        ),
        (
            "model.moe_expert_capacity_factor",
            factor,
            not (flex and factor is not None),
            "Expert capacity with the flex dispatcher",
            "use model.moe_token_dispatcher_type=alltoall, or drop the capacity factor.",
        ),
        (
            "model.moe_expert_rank_capacity_factor",
            rank_factor,
            rank_factor is None or kind == "alltoall",
            f"Sync-free fixed-block dispatch with the '{kind}' token dispatcher",
            "use model.moe_token_dispatcher_type=alltoall, or drop the expert-rank capacity "
            "factor.",
        ),
        (
            "model.moe_paged_stash",
            True,
            not config.moe_paged_stash,
            "Paged stashing of the experts' activations (Megatron's moe_paged_stash: the rows "
            "routed, not the padded blocks, kept for the backward)",
            "drop model.moe_paged_stash (the sync-free dispatch keeps its padded blocks).",
        ),
        (
            # the loop cuts the rows by host counts, which the sync-free dispatch never reads
            "model.moe_expert_rank_capacity_factor",
            rank_factor,
            rank_factor is None or kernels.moe_grouped_gemm,
            "The sync-free dispatch where the experts' GEMMs take the per-expert loop (this run's "
            "GPU and precision: the decision table's experts' GEMM row says why)",
            "drop model.moe_expert_rank_capacity_factor (the all-to-all reads the split sizes), "
            "or run on Hopper in bf16 or on the CPU, where the grouped kernel runs.",
        ),
    ]


def dispatcher_class(config: ModelConfig, kernels: Kernels) -> type[AllToAllDispatcher]:
    """The token dispatcher the run decided on (`kernels`, with `config`'s capacity factors); one
    this runtime does not build is an error (`unbuilt_dispatch`), never a silent fallback to
    all-to-all."""
    check_rules(unbuilt_dispatch(config, kernels), NotBuiltError)
    if config.moe_expert_rank_capacity_factor is not None:
        return RankCapacityDispatcher
    if kernels.moe_token_dispatcher_type == "alltoall":
        return AllToAllDispatcher
    # flex: config resolution turns flex without a backend into alltoall and validates the
    # backend's name, so only a layer built from a bare config reaches this guard
    if kernels.moe_flex_dispatcher_backend != "torch":
        raise ValueError(
            f"flex dispatch needs moe_flex_dispatcher_backend=torch, not "
            f"{kernels.moe_flex_dispatcher_backend!r}"
        )
    return FlexDispatcher


class MoELayer(nn.Module):
    """`forward(x) -> (y, aux_loss)`; aux_loss is a scalar the caller adds to the training loss.
    `overlap`: the run's resolved overlap plan (whether the shared expert overlaps the
    all-to-alls); `kernels`: the run's kernel and dispatcher choices; `wgrad_store`: the model's
    store the experts' and the shared expert's weight gradients go through (None: computed in
    backward)."""

    def __init__(
        self,
        config: ModelConfig,
        ps: ParallelState,
        layer_number: int,
        overlap: OverlapPlan,
        precision: Precision,
        kernels: Kernels,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        # experts divisible by EP: the config's cross-section rule; only a layer built from a bare
        # config reaches this guard
        if config.num_moe_experts % ps.layout.ep:
            raise ValueError(
                f"num_moe_experts ({config.num_moe_experts}) does not split over EP {ps.layout.ep}"
            )
        dispatcher = dispatcher_class(config, kernels)
        self.layer_number = layer_number
        self.router = TopKRouter(config, ps, precision, layer_number)
        self.dispatcher = dispatcher(config, ps, kernels)
        self.experts = GroupedExperts(config, ps, precision, kernels, wgrad_store)
        self.shared_experts = (
            MLP(
                config,
                ps,
                None,
                precision,
                kernels,
                ffn_hidden_size=config.moe_shared_expert_intermediate_size,
                wgrad_store=wgrad_store,
            )
            if config.moe_shared_expert_intermediate_size
            else None
        )
        self.shared_expert_overlap = (
            overlap.moe_shared_expert_overlap and self.shared_experts is not None
        )
        # selective "shared_experts" (the config refuses it with moe_shared_expert_overlap)
        modules = selective_modules(config)
        self.recompute_shared = "shared_experts" in modules and "moe" not in modules

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, PendingPlan[Plan], torch.Tensor]:
        """Route `x`; returns (combine weights [T, k], the plan with its split-size exchange in
        flight, aux_loss). Resolving the plan is the layer's one host sync (see
        `AllToAllDispatcher.route`)."""
        topk_idx, topk_weights, aux_loss = self.router(x)
        return topk_weights, self.dispatcher.route(topk_idx, topk_weights, x.shape), aux_loss

    def permute(
        self, x: torch.Tensor, topk_weights: torch.Tensor, plan: Plan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `x` to dispatch and their combine weights, in the plan's order."""
        return self.dispatcher.dispatch_preprocess(x, topk_weights, plan)

    def shared_experts_compute(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output for `x`, or None without one. Not wrapped in a compute span:
        under TP it waits on its own SP collectives, which a span would wrongly count as compute
        covering communication."""
        if self.shared_experts is None:
            return None
        return maybe_checkpoint(self.recompute_shared, self.shared_experts, x)[0]

    def dispatch(self, rows: torch.Tensor, weights: torch.Tensor, plan: Plan) -> PendingAllToAll:
        """Launch the dispatch all-to-all (rows and weights); returns at once."""
        return self.dispatcher.token_dispatch(rows, weights, plan)

    def routed_experts_compute(self, pending: PendingAllToAll, plan: Plan) -> torch.Tensor:
        """Wait for the dispatch, run the local experts, and return their weighted outputs ready for
        combine."""
        return self.experts_compute(*pending.wait(), plan)

    def experts_compute(
        self, rows: torch.Tensor, weights: torch.Tensor, plan: Plan
    ) -> torch.Tensor:
        """Received rows and weights (source-rank order) -> weighted expert outputs in the same
        order."""
        rows, weights = self.dispatcher.dispatch_postprocess(rows, weights, plan)
        with recorder().span("moe.experts"):
            out = self.experts(
                rows, weights, plan.tokens_per_local_expert, plan.local_expert_counts
            )
        return self.dispatcher.combine_preprocess(out, plan)

    def combine(self, rows: torch.Tensor, plan: Plan) -> PendingAllToAll:
        """Launch the combine all-to-all; returns at once."""
        return self.dispatcher.token_combine(rows, plan)

    def postprocess(
        self, pending: PendingAllToAll, plan: Plan, shared_output: torch.Tensor | None
    ) -> torch.Tensor:
        """Wait for the combine, un-permute to [s_local, b, h] and add the shared expert's
        output."""
        (rows,) = pending.wait()
        return self.combine_postprocess(rows, plan, shared_output)

    def combine_postprocess(
        self, rows: torch.Tensor, plan: Plan, shared_output: torch.Tensor | None
    ) -> torch.Tensor:
        """Returned rows -> [s_local, b, h], plus the shared expert's output."""
        y = self.dispatcher.combine_postprocess(rows, plan)
        return y if shared_output is None else y + shared_output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        topk_weights, pending_plan, aux_loss = self.route(x)
        # Without the overlap the shared expert runs while the split sizes travel.
        shared_output = None if self.shared_expert_overlap else self.shared_experts_compute(x)
        plan = pending_plan.resolve()
        rows, weights = self.permute(x, topk_weights, plan)
        if self.shared_expert_overlap:
            return self._forward_with_shared_expert_overlap(x, rows, weights, plan), aux_loss
        expert_rows = self.routed_experts_compute(self.dispatch(rows, weights, plan), plan)
        return self.postprocess(self.combine(expert_rows, plan), plan, shared_output), aux_loss

    def _forward_with_shared_expert_overlap(
        self, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, plan: Plan
    ) -> torch.Tensor:
        """`moe_shared_expert_overlap`: the shared expert's two halves run while the all-to-alls
        fly.

            launch dispatch -> shared fc1 + activation -> wait, routed experts -> launch combine ->
            shared fc2 -> wait combine, un-permute, add

        The shared expert's computation (including its own SP all-gather / reduce-scatter on the TP
        group) does not depend on the routed tokens, so it is the work that fills the dispatch and
        the combine. This overlaps the FORWARD only: the backward runs in autograd's order, whose
        all-to-alls wait inside their autograd nodes. The math is the plain path's (same ops, same
        final `routed + shared` add), so outputs are bit-identical. The halves get compute spans
        although fc1 / fc2 may wait on TP collectives: the exposure report subtracts wait intervals
        from spans, so those waits are not counted as compute covering communication.
        """
        mlp = self.shared_experts
        pending = self.dispatch(rows, weights, plan)
        with recorder().span("moe.shared_fc1"):
            hidden = mlp.fc1_and_activation(x)
        pending = self.combine(self.routed_experts_compute(pending, plan), plan)
        with recorder().span("moe.shared_fc2"):
            shared_output = mlp.linear_fc2(hidden)
        return self.postprocess(pending, plan, shared_output)
