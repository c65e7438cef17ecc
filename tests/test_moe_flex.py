"""Flex token dispatch (backend "torch") and shared-expert overlap.

Flex vs all-to-all: the same layer (same weights, same tokens, same routing) with either dispatcher.
The experts see the same rows in the same order, so their outputs are bitwise equal; what differs is
where a token's expert outputs are summed (partly on the expert rank, in fp32, then over destination
ranks at home, instead of all at home in expert order), so outputs and gradients agree to rounding:
fp32, atol = rtol = 1e-5 as in test_moe.py (O(1) values, rounding-level differences ~1e-7; a wrong
row, weight or split gives O(1) errors).

Shared-expert overlap on vs off runs the same operations with the same final add, so outputs and
gradients are compared bitwise (they are identical: each gradient is the same sum of the same
contributions, accumulated in the same order).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from overlap.config.model import ModelConfig
from overlap.errors import NotBuiltError
from overlap.layers.init import init_model_params
from overlap.layers.moe import MoELayer
from overlap.layers.moe.flex_dispatcher import FlexDispatcher
from overlap.layout import ParallelLayout
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from tests.configs import bare_kernels, bare_plan, moe_layer_model
from tests.ep_overlap_runs import compare_ep_overlap
from tests.moe_layer_runs import bare_moe_layer, rank_routing
from tests.world import run_world

SEQ, BATCH, HIDDEN = 8, 2, 32
TOL = dict(atol=1e-5, rtol=1e-5)
INIT_STD = 0.2
FLEX = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="torch")


def _config(tp: int = 1, ep: int = 1, **overrides) -> ModelConfig:
    fields = dict(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, sequence_parallel=tp > 1
    )
    return moe_layer_model(**{**fields, **overrides})


def _layer(
    cfg: ModelConfig, ps: ParallelState, skewed: bool, shared_overlap: bool = False
) -> MoELayer:
    """Same logical weights in every layout. `skewed` (with positive inputs): router rows 0..k-1
    positive, the others negative, so every token picks experts 0..k-1, all on the first EP rank(s);
    the last ranks receive nothing. `shared_overlap`: the plan's shared-expert overlap."""
    plan = bare_plan(moe_shared_expert_overlap=shared_overlap)
    layer = bare_moe_layer(cfg, ps, plan)
    init_model_params(layer, seed=1234, std=INIT_STD)
    if skewed:
        with torch.no_grad():
            layer.router.weight.abs_()
            layer.router.weight[cfg.moe_router_topk :].neg_()
    return layer


def _inputs(seed: int, positive: bool, tp: int, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's sequence shard of one micro-batch's input and output gradient."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.rand(SEQ, BATCH, HIDDEN, generator=g) + 0.1
        if positive
        else torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    )
    return x.chunk(tp)[tp_rank].clone(), torch.randn(SEQ, BATCH, HIDDEN, generator=g).chunk(tp)[
        tp_rank
    ]


def _step(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward; returns outputs, input grad and parameter grads by name."""
    x = x.clone().requires_grad_()
    y, aux = layer(x)
    ((y * dy).sum() + aux).backward()
    result = {"y": y.detach(), "aux": aux.detach(), "dx": x.grad}
    result.update({f"grad.{n}": p.grad for n, p in layer.named_parameters()})
    return result


def _traffic(events) -> tuple[int, int]:
    """(bytes of the forward dispatch + combine all-to-alls, rows this rank returned in the
    combine)."""
    moved = sum(e.nbytes for e in events if e.kind in ("ep_dispatch", "ep_combine"))
    returned = sum(e.nbytes for e in events if e.kind == "ep_combine") // (HIDDEN * 4)
    return moved, returned


# --------------------------------------------------------------------------------------------------
# Flex vs all-to-all
# --------------------------------------------------------------------------------------------------


def _flex_vs_alltoall(topk: int, skewed: bool) -> dict[str, tuple[int, int]]:
    ep, rank = dist.get_world_size(), dist.get_rank()
    ps = ParallelState(ParallelLayout(world_size=ep, ep=ep))
    x, dy = _inputs(100 + rank, skewed, 1, 0)
    results, traffic = {}, {}
    for name, overrides in (("alltoall", {}), ("flex", FLEX)):
        layer = _layer(_config(ep=ep, moe_router_topk=topk, **overrides), ps, skewed)
        recorder().drain()
        results[name] = _step(layer, x, dy)
        traffic[name] = _traffic(recorder().drain()[0])
    assert isinstance(layer.dispatcher, FlexDispatcher)
    for key, ref in results["alltoall"].items():
        torch.testing.assert_close(
            results["flex"][key], ref, **TOL, msg=lambda m, key=key: f"{key}: {m}"
        )
    return traffic


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("topk", [2, 4])
@pytest.mark.parametrize("skewed", [False, True], ids=["random", "uneven"])
def test_flex_matches_alltoall_and_sends_fewer_rows(world, topk, skewed):
    traffic = run_world(world, _flex_vs_alltoall, topk, skewed)
    bytes_a2a, rows_a2a = (sum(t["alltoall"][i] for t in traffic) for i in (0, 1))
    bytes_flex, rows_flex = (sum(t["flex"][i] for t in traffic) for i in (0, 1))
    assert rows_a2a == world * SEQ * BATCH * topk  # one row per (token, expert)
    assert rows_flex < rows_a2a
    assert bytes_flex < bytes_a2a
    if skewed:  # every token's k experts sit on ceil(k / experts per rank) ranks
        assert rows_flex == world * SEQ * BATCH * -(-topk // (8 // world))


def _flex_round_trip_with_identity_experts() -> None:
    """Dispatcher steps alone, rank 1 without tokens and the last rank's experts unused (zero-size
    splits)."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    ps = ParallelState(ParallelLayout(world_size=ep, ep=ep))
    cfg = _config(ep=ep, num_moe_experts=4, **FLEX)
    dispatcher = FlexDispatcher(cfg, ps, bare_kernels(cfg))
    hidden, topk_idx, topk_weights = rank_routing(rank, 4, 4 // ep)
    hidden.requires_grad_()
    topk_weights.requires_grad_()
    plan = dispatcher.route(topk_idx, topk_weights, hidden.shape).resolve()
    rows, weights = dispatcher.dispatch_preprocess(hidden, topk_weights, plan)
    expert_rows, pair_weights = dispatcher.dispatch_postprocess(
        *dispatcher.token_dispatch(rows, weights, plan).wait(), plan
    )
    assert expert_rows.shape[0] == sum(plan.tokens_per_local_expert)
    # identity experts that apply the combine weights, as `GroupedExperts` does
    out_rows = dispatcher.combine_preprocess(expert_rows * pair_weights.unsqueeze(-1), plan)
    (returned,) = dispatcher.token_combine(out_rows, plan).wait()
    y = dispatcher.combine_postprocess(returned, plan)
    torch.testing.assert_close(y, hidden * topk_weights.sum(dim=1, keepdim=True))
    y.sum().backward()
    torch.testing.assert_close(
        hidden.grad, topk_weights.detach().sum(dim=1, keepdim=True).expand_as(hidden)
    )
    torch.testing.assert_close(
        topk_weights.grad, hidden.detach().sum(dim=1, keepdim=True).expand(-1, 2)
    )


def test_flex_round_trip_with_empty_rank_and_idle_experts():
    run_world(2, _flex_round_trip_with_identity_experts)


def test_flex_under_ep_overlap_schedule_matches_plain_loop():
    compare_ep_overlap({"ep": 2}, 2, FLEX, True)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_gpu_flex_backends_are_refused_by_name(backend):
    cfg = _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend)
    with pytest.raises(NotBuiltError, match="moe_flex_dispatcher_backend"):
        bare_moe_layer(cfg, SimpleNamespace(layout=ParallelLayout(world_size=1)))


def test_flex_without_backend_is_refused():
    # finalize turns flex without a backend into alltoall; a bare config meets the layer's guard
    with pytest.raises(ValueError, match="moe_flex_dispatcher_backend"):
        cfg = _config(moe_token_dispatcher_type="flex")
        bare_moe_layer(cfg, SimpleNamespace(layout=ParallelLayout(world_size=1)))


# --------------------------------------------------------------------------------------------------
# Shared-expert overlap
# --------------------------------------------------------------------------------------------------


def _shared_overlap_on_vs_off(tp: int, ep: int) -> tuple[list, list]:
    world = dist.get_world_size()
    # sequence parallel wherever there is TP, as `_config` types it
    ps = ParallelState(ParallelLayout(world_size=world, tp=tp, ep=ep, sequence_parallel=tp > 1))
    x, dy = _inputs(200 + ps.dp_rank, False, tp, ps.tp_rank)
    results = {}
    for overlap in (False, True):
        cfg = _config(tp=tp, ep=ep, num_moe_experts=4, moe_shared_expert_intermediate_size=48)
        layer = _layer(cfg, ps, skewed=False, shared_overlap=overlap)
        recorder().drain()
        results[overlap] = _step(layer, x, dy)
        events, spans = recorder().drain()
    for key, ref in results[False].items():
        assert torch.equal(results[True][key], ref), key
    return (
        [e for e in events if e.kind == "ep_dispatch"],
        [s for s in spans if s.name in ("moe.shared_fc1", "moe.shared_fc2")],
    )


@pytest.mark.parametrize("world, tp, ep", [(2, 1, 2), (4, 2, 2)])
def test_shared_expert_overlap_matches_plain_order_and_runs_fc1_under_the_dispatch(world, tp, ep):
    for dispatches, spans in run_world(world, _shared_overlap_on_vs_off, tp, ep):
        (fc1,) = [s for s in spans if s.name == "moe.shared_fc1"]
        assert [s.name for s in spans] == ["moe.shared_fc1", "moe.shared_fc2"]
        assert len(dispatches) == 1  # rows and weights travel in one all-to-all
        for e in dispatches:  # launched before fc1 starts, waited for only after it ends
            assert e.t_launch <= fc1.t_start and fc1.t_end <= e.t_wait_start
