"""Expert capacity (`moe_expert_capacity_factor`, `moe_pad_expert_input_to_capacity`,
`moe_token_drop_policy`).

What is checked:
- the permutation keeps exactly the assignments the drop policy names (a brute-force reference
  written from the policy's definition: "probs" keeps each expert's highest combine weights, ties to
  the earlier token; "position" keeps its earliest tokens), in the dropless layout, and the fused
  and loop paths agree bit for bit;
- the MoE layer's output is the sum over KEPT assignments only (a dense single-process reference);
- EP=2 with drops matches the single-process layer (the capacity is per rank and micro-batch, so the
  reference, which runs each rank's micro-batch on its own, drops the same assignments);
- a capacity no expert reaches gives the dropless run: bit for bit without padding (same rows),
  within fp32 tolerance with padding (zero rows change the GEMMs' row count, so BLAS may block
  differently);
- with padding no split sizes are exchanged at all (static shapes);
- the EP-overlap schedule with padded capacity matches the plain loop within test_ep_overlap's
  tolerance;
- the configuration errors name the field.

Tolerance: fp32, atol = rtol = 1e-5 as in test_moe.py (rounding-level differences; a wrong row or
weight is O(1)).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap.config.model import ModelConfig
from overlap.errors import ConfigError, NotBuiltError
from overlap.layers.init import init_model_params
from overlap.layers.moe.permute import ExpertCapacity, expert_capacity, expert_counts, permute
from overlap.layout import ParallelLayout
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.training.runtime_refusals import runtime_refusals
from tests.configs import container, moe_layer_model, moe_model
from tests.ep_overlap_runs import compare_ep_overlap
from tests.moe_layer_runs import bare_moe_layer, check_against_reference
from tests.world import run_world

SEQ, BATCH, HIDDEN = 8, 2, 32
TOL = dict(atol=1e-5, rtol=1e-5)


def _kept_by_policy(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, capacity: int, policy: str
) -> dict[int, list[tuple[int, int]]]:
    """Per expert, the (token, slot) assignments it keeps, in token order: the policy's definition,
    by brute force."""
    kept = {}
    for e in range(num_experts):
        pairs = [
            (t, j)
            for t in range(topk_idx.shape[0])
            for j in range(topk_idx.shape[1])
            if topk_idx[t, j] == e
        ]
        if policy == "probs":
            pairs.sort(key=lambda p: (-float(topk_weights[p]), p[0]))
        kept[e] = sorted(pairs[:capacity])
    return kept


@st.composite
def capped_routings(draw):
    """A random routing (often uneven, weights with ties) and a capacity that usually drops
    something."""
    num_experts = draw(st.integers(1, 6))
    topk = draw(st.integers(1, min(3, num_experts)))
    num_tokens = draw(st.integers(0, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # skewed preference: some experts get far more tokens
    hot = torch.rand(num_experts, generator=g) ** 3
    topk_idx = (torch.rand(num_tokens, num_experts, generator=g) * hot).argsort(
        dim=1, descending=True
    )[:, :topk]
    # ties are common
    topk_weights = torch.randint(1, 4, (num_tokens, topk), generator=g).float() / 4
    capacity = ExpertCapacity(
        draw(st.integers(0, 6)), draw(st.booleans()), draw(st.sampled_from(["probs", "position"]))
    )
    return torch.randn(num_tokens, 3, generator=g), topk_idx, topk_weights, num_experts, capacity


@settings(max_examples=200, deadline=None)
@given(capped_routings())
def test_permutation_keeps_what_the_drop_policy_says(routing):
    hidden, topk_idx, topk_weights, num_experts, capacity = routing
    fused = permute(hidden, topk_idx, topk_weights, num_experts, fused=True, capacity=capacity)
    loop = permute(hidden, topk_idx, topk_weights, num_experts, fused=False, capacity=capacity)
    for name in ("tokens", "weights", "token_idx", "tokens_per_expert"):
        assert torch.equal(getattr(fused, name), getattr(loop, name)), name

    kept = _kept_by_policy(topk_idx, topk_weights, num_experts, capacity.capacity, capacity.policy)
    num_tokens, c = topk_idx.shape[0], capacity.capacity
    expected_tokens, expected_weights = [], []
    for e in range(num_experts):
        expected_tokens += [t for t, _ in kept[e]]
        expected_weights += [float(topk_weights[t, j]) for t, j in kept[e]]
        if capacity.pad:  # padding rows: the scratch token, weight 0
            expected_tokens += [num_tokens] * (c - len(kept[e]))
            expected_weights += [0.0] * (c - len(kept[e]))
    rows = len(expected_tokens)
    assert fused.token_idx[:rows].tolist() == expected_tokens
    assert fused.weights[:rows].tolist() == expected_weights
    assert fused.tokens_per_expert.tolist() == [
        c if capacity.pad else len(kept[e]) for e in range(num_experts)
    ]
    assert torch.equal(expert_counts(topk_idx, num_experts, capacity), fused.tokens_per_expert)
    padded_hidden = torch.cat([hidden, hidden.new_zeros(1, 3)])
    assert torch.equal(fused.tokens[:rows], padded_hidden[expected_tokens])
    if capacity.pad:
        assert fused.token_idx.numel() == num_experts * c
    # the dropped assignments follow, to be cut off by the dispatcher once it knows the kept total
    else:
        assert fused.token_idx.numel() == topk_idx.numel()


def test_capacity_is_ceil_of_tokens_times_topk_over_experts_times_factor():
    assert expert_capacity(16, 2, 8, 1.0) == 4
    assert expert_capacity(16, 2, 8, 0.3) == 2  # ceil(1.2)
    assert expert_capacity(0, 2, 8, 1.0) == 0


# --------------------------------------------------------------------------------------------------
# The MoE layer
# --------------------------------------------------------------------------------------------------


def _config(ep: int = 1, **overrides) -> ModelConfig:
    fields = dict(expert_model_parallel_size=ep, moe_permute_fusion=True)
    return moe_layer_model(**{**fields, **overrides})


def _capacity(factor: float, pad: bool, policy: str = "probs") -> dict:
    return dict(
        moe_expert_capacity_factor=factor,
        moe_pad_expert_input_to_capacity=pad,
        moe_token_drop_policy=policy,
    )


def _output_vs_dense_reference(overrides: dict) -> tuple[int, int]:
    """Single process: the layer's output against sum over kept assignments of weight x
    expert(token). Returns (kept assignments, all assignments)."""
    ps = ParallelState(ParallelLayout(world_size=1))
    cfg = _config(**overrides)
    layer = bare_moe_layer(cfg, ps)
    init_model_params(layer, seed=1234, std=0.2)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y, _ = layer(x)
        tokens = x.reshape(-1, HIDDEN)
        topk_idx, topk_weights, _ = layer.router(x)
        c = expert_capacity(
            tokens.shape[0],
            cfg.moe_router_topk,
            cfg.num_moe_experts,
            cfg.moe_expert_capacity_factor,
        )
        kept = _kept_by_policy(
            topk_idx, topk_weights, cfg.num_moe_experts, c, cfg.moe_token_drop_policy
        )
        ex = layer.experts
        ref = torch.zeros_like(tokens)
        for e, pairs in kept.items():
            for t, j in pairs:
                gate, up = (ex.fc1_weight[e] @ tokens[t]).chunk(2)
                h = F.silu(gate) * up
                ref[t] += topk_weights[t, j] * (ex.down_weight[e] @ h)
    torch.testing.assert_close(y.reshape(-1, HIDDEN), ref, **TOL)
    return sum(len(p) for p in kept.values()), topk_idx.numel()


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "drop+pad"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_layer_output_sums_only_the_kept_assignments(pad, policy):
    kept, total = run_world(1, _output_vs_dense_reference, _capacity(0.5, pad, policy))[0]
    assert 0 < kept < total  # the capacity really dropped assignments


@pytest.mark.parametrize("pad", [False, True], ids=["drop", "drop+pad"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_ep2_with_drops_matches_single_process_reference(pad, policy):
    check_against_reference(
        2, tp=1, ep=2, cfg_overrides=dict(num_experts=8, **_capacity(0.5, pad, policy))
    )


def _capacity_vs_dropless(pad: bool) -> tuple[dict, dict, list[str]]:
    """EP=2: the same layer and tokens dropless and with a capacity no expert can reach (factor E:
    capacity T * k)."""
    ps = ParallelState(ParallelLayout(world_size=dist.get_world_size(), ep=dist.get_world_size()))
    g = torch.Generator().manual_seed(40 + dist.get_rank())
    x, dy = (
        torch.randn(SEQ, BATCH, HIDDEN, generator=g),
        torch.randn(SEQ, BATCH, HIDDEN, generator=g),
    )
    results, kinds = {}, []
    for name, overrides in (("dropless", {}), ("capacity", _capacity(8.0, pad))):
        cfg = _config(ep=ps.layout.ep, **overrides)
        layer = bare_moe_layer(cfg, ps)
        init_model_params(layer, seed=1234, std=0.2)
        xi = x.clone().requires_grad_()
        recorder().drain()
        y, aux = layer(xi)
        ((y * dy).sum() + aux).backward()
        kinds = sorted({e.kind for e in recorder().drain()[0]})
        results[name] = {
            "y": y.detach(),
            "dx": xi.grad,
            **{n: p.grad for n, p in layer.named_parameters()},
        }
    return results["dropless"], results["capacity"], kinds


def test_unreached_capacity_without_padding_is_the_dropless_run_bit_for_bit():
    for dropless, capped, kinds in run_world(2, _capacity_vs_dropless, False):
        for key, ref in dropless.items():
            assert torch.equal(capped[key], ref), key
        assert "ep_counts" in kinds  # without padding the (clamped) counts still travel


def test_unreached_padded_capacity_matches_dropless_and_exchanges_no_split_sizes():
    for dropless, capped, kinds in run_world(2, _capacity_vs_dropless, True):
        for key, ref in dropless.items():
            torch.testing.assert_close(
                capped[key], ref, **TOL, msg=lambda m, key=key: f"{key}: {m}"
            )
        # static shapes: nothing to exchange
        assert "ep_counts" not in kinds and "ep_dispatch" in kinds


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_ep_overlap_with_padded_capacity_matches_plain_loop(policy):
    compare_ep_overlap({"ep": 2}, 2, _capacity(0.75, True, policy), True)


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(moe_expert_capacity_factor=0.0), "model.moe_expert_capacity_factor"),
        (dict(moe_expert_capacity_factor=-1.0), "model.moe_expert_capacity_factor"),
        (dict(moe_pad_expert_input_to_capacity=True), "model.moe_pad_expert_input_to_capacity"),
        (
            dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="random"),
            "model.moe_token_drop_policy",
        ),
    ],
)
def test_invalid_capacity_settings_name_the_field(fields, field):
    with pytest.raises(ConfigError) as exc:
        container(moe_model(**fields)).finalize(2)
    assert exc.value.field == field


def test_valid_capacity_settings_resolve():
    container(moe_model(**_capacity(1.25, True, "position"))).finalize(2)


def test_capacity_with_flex_dispatcher_is_refused_by_name():
    cfg = _config(
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="torch",
        moe_expert_capacity_factor=1.0,
    )
    with pytest.raises(NotBuiltError, match="moe_expert_capacity_factor"):
        bare_moe_layer(cfg, SimpleNamespace(layout=ParallelLayout(world_size=1)))


@pytest.mark.parametrize(
    "factors, field",
    [
        (dict(moe_expert_capacity_factor=1.0), "model.moe_expert_capacity_factor"),
        (dict(moe_expert_rank_capacity_factor=1.5), "model.moe_expert_rank_capacity_factor"),
    ],
)
def test_capacity_with_flex_is_refused_before_any_rank_starts(factors, field):
    """The dispatchers' unbuilt combinations are rows of the run-time refusal table (the one place
    the rule is stated; the layer raises the same row for a bare config), so `overlap run` refuses
    them before launch and explain lists them."""
    flex = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="torch")
    cfg = container(moe_model(**flex, **factors))
    cfg.finalize(2)
    assert field in {e.field for e in runtime_refusals(cfg) if isinstance(e, NotBuiltError)}
