"""Mixture of experts: top-k router, token permutation, all-to-all dispatcher (expert parallel; in
fixed blocks for the sync-free dropless mode), grouped experts."""

from overlap.layers.moe.dispatcher import AllToAllDispatcher, DispatchPlan, PendingAllToAll
from overlap.layers.moe.experts import GroupedExperts
from overlap.layers.moe.moe_layer import MoELayer
from overlap.layers.moe.rank_capacity import RankCapacityDispatcher, StaticDispatchSteps
from overlap.layers.moe.router import TopKRouter

__all__ = [
    "AllToAllDispatcher",
    "DispatchPlan",
    "GroupedExperts",
    "MoELayer",
    "PendingAllToAll",
    "RankCapacityDispatcher",
    "StaticDispatchSteps",
    "TopKRouter",
]
