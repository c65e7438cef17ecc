"""The MoE layer: router -> all-to-all dispatch -> routed experts -> all-to-all combine (+ optional shared expert).

`forward` runs the steps in plain order, waiting on each collective at once. The steps are also public methods,
named after Megatron-Core's `MoELayer`, because the EP-overlap schedule runs them as separate nodes and interleaves
two micro-batches (one's all-to-all in flight while the other computes):

    rows, weights, plan, aux = layer.router_and_preprocess(x)
    shared = layer.shared_experts_compute(x)             # None without a shared expert
    pending = layer.dispatch(rows, weights, plan)        # launch, returns handles
    out_rows = layer.routed_experts_compute(pending, plan)   # wait, sort, experts, weight, unsort
    pending = layer.combine(out_rows, plan)              # launch, returns handles
    y = layer.postprocess(pending, plan, shared)         # wait, un-permute, add shared expert output

Input and output are [s_local, b, h] (s_local = s / tp under sequence parallel). Under sequence parallel every TP
rank routes and dispatches only its own tokens: the routed path is token-wise, so nothing is gathered for it, and
only the aux-loss statistics are summed over TP (in the router).
"""

from __future__ import annotations

import torch
from torch import nn

from overlap.config.model import ModelConfig
from overlap.errors import ConfigError
from overlap.layers.mlp import MLP
from overlap.layers.moe.dispatcher import AllToAllDispatcher, DispatchPlan, PendingAllToAll
from overlap.layers.moe.experts import GroupedExperts
from overlap.layers.moe.router import TopKRouter
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import RECORDER


class MoELayer(nn.Module):
    """`forward(x) -> (y, aux_loss)`; aux_loss is a scalar the caller adds to the training loss."""

    def __init__(self, config: ModelConfig, ps: ParallelState, layer_number: int) -> None:
        super().__init__()
        if config.num_moe_experts % ps.ep_size:
            raise ConfigError("model.num_moe_experts", config.num_moe_experts,
                              f"the experts must split evenly over expert parallel size {ps.ep_size}.",
                              "choose an expert parallel size (-ep) that divides num_moe_experts.")
        self.layer_number = layer_number
        self.router = TopKRouter(config, ps)
        self.dispatcher = AllToAllDispatcher(config, ps)
        self.experts = GroupedExperts(config, ps)
        self.shared_experts = (MLP(config, ps, ffn_hidden_size=config.moe_shared_expert_intermediate_size)
                               if config.moe_shared_expert_intermediate_size else None)

    def router_and_preprocess(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan, torch.Tensor]:
        """Route `x` and permute it by expert; returns (rows, row weights, plan, aux_loss). Holds the layer's one
        host sync (split sizes), see `AllToAllDispatcher.preprocess`."""
        topk_idx, topk_weights, aux_loss = self.router(x)
        rows, weights, plan = self.dispatcher.preprocess(x, topk_idx, topk_weights)
        return rows, weights, plan, aux_loss

    def shared_experts_compute(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's output for `x`, or None without one. Not wrapped in a compute span: under TP it waits
        on its own SP collectives, which a span would wrongly count as compute covering communication."""
        return None if self.shared_experts is None else self.shared_experts(x)[0]

    def dispatch(self, rows: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan) -> PendingAllToAll:
        """Launch the dispatch all-to-all (rows and weights); returns at once."""
        return self.dispatcher.dispatch(rows, weights, plan)

    def routed_experts_compute(self, pending: PendingAllToAll, plan: DispatchPlan) -> torch.Tensor:
        """Wait for the dispatch, run the local experts, and return their weighted outputs ready for combine."""
        return self.experts_compute(*pending.wait(), plan)

    def experts_compute(self, rows: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Received rows and weights (source-rank order) -> weighted expert outputs in the same order."""
        rows, weights = self.dispatcher.sort_received(rows, weights, plan)
        with RECORDER.span("moe.experts"):
            out = self.experts(rows, plan.tokens_per_local_expert)
        return self.dispatcher.combine_preprocess(out, weights, plan)

    def combine(self, rows: torch.Tensor, plan: DispatchPlan) -> PendingAllToAll:
        """Launch the combine all-to-all; returns at once."""
        return self.dispatcher.combine(rows, plan)

    def postprocess(self, pending: PendingAllToAll, plan: DispatchPlan,
                    shared_output: torch.Tensor | None) -> torch.Tensor:
        """Wait for the combine, un-permute to [s_local, b, h] and add the shared expert's output."""
        (rows,) = pending.wait()
        return self.combine_postprocess(rows, plan, shared_output)

    def combine_postprocess(self, rows: torch.Tensor, plan: DispatchPlan,
                            shared_output: torch.Tensor | None) -> torch.Tensor:
        """Returned rows -> [s_local, b, h], plus the shared expert's output."""
        y = self.dispatcher.unpermute_returned(rows, plan)
        return y if shared_output is None else y + shared_output

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, weights, plan, aux_loss = self.router_and_preprocess(x)
        shared_output = self.shared_experts_compute(x)
        expert_rows = self.routed_experts_compute(self.dispatch(rows, weights, plan), plan)
        return self.postprocess(self.combine(expert_rows, plan), plan, shared_output), aux_loss
