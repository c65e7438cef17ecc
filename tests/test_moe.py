"""MoE tests: permutation paths, the all-to-all dispatcher, and the MoE layer in EP and TP x EP
layouts against a single-process reference.

Reference: `run_world(1, ...)` builds the same layer with every expert local and runs, one after
another, the batches that the ranks of the parallel run process at the same time; its gradients
therefore accumulate over all batches, and are compared with the parallel run's gradients summed
over ranks (router, shared expert shards) or gathered over EP (expert slices, after summing the
expert-data-parallel replicas).

Tolerance (fp32): atol = rtol = 1e-5. Routing decisions are identical in every layout (same logits
from the same weights and tokens), and every per-token value is computed by the same operations;
what differs is that an expert's GEMM sees a different number of rows (tokens from several ranks),
and BLAS may block its K-reduction differently with M, plus gradient sums over ranks in a different
order. Those are rounding-level (~1e-7 relative) differences; 1e-5 is ample for that and tight
enough to catch any wrong row, weight or split (errors of O(1)).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap.config.mixed_precision import Precision
from overlap.layers.moe import AllToAllDispatcher, TopKRouter
from overlap.layers.moe.permute import (
    permute,
    sort_chunks_by_local_expert,
    unpermute,
    unsort_chunks_by_local_expert,
)
from overlap.layout import ParallelLayout
from overlap.parallel import comm
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from tests.configs import bare_kernels, tiny_config
from tests.moe_layer_runs import (
    BATCH,
    HIDDEN,
    INIT_STD,
    SEQ,
    bare_moe_layer,
    check_against_reference,
    moe_config,
    none_mode_step,
    rank_routing,
)
from tests.world import run_world

# --------------------------------------------------------------------------------------------------
# Permutation (single process)
# --------------------------------------------------------------------------------------------------


@st.composite
def routings(draw):
    """A random routing of T tokens to k distinct experts each, restricted to a random subset of the
    experts so that empty experts are common; T = 0 included."""
    num_experts = draw(st.integers(1, 8))
    topk = draw(st.integers(1, min(3, num_experts)))
    num_active = draw(st.integers(topk, num_experts))
    num_tokens = draw(st.integers(0, 12))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    active = torch.randperm(num_experts, generator=g)[:num_active]
    topk_idx = active[torch.rand(num_tokens, num_active, generator=g).argsort(dim=1)[:, :topk]]
    return (
        torch.randn(num_tokens, 5, generator=g),
        topk_idx,
        torch.rand(num_tokens, topk, generator=g),
        num_experts,
    )


@settings(max_examples=150, deadline=None)
@given(routings())
def test_permutation_paths_agree_and_group_by_expert(routing):
    hidden, topk_idx, topk_weights, num_experts = routing
    fused = permute(hidden, topk_idx, topk_weights, num_experts, fused=True)
    loop = permute(hidden, topk_idx, topk_weights, num_experts, fused=False)
    for name in ("tokens", "weights", "token_idx", "tokens_per_expert"):
        assert torch.equal(getattr(fused, name), getattr(loop, name)), name

    # Grouped by expert ascending, token order inside an expert.
    pairs = sorted((e, t, j) for t, row in enumerate(topk_idx.tolist()) for j, e in enumerate(row))
    assert fused.token_idx.tolist() == [t for _, t, _ in pairs]
    assert torch.equal(
        fused.weights, torch.tensor([topk_weights[t, j].item() for _, t, j in pairs])
    )
    assert fused.tokens_per_expert.tolist() == [
        sum(1 for e, _, _ in pairs if e == x) for x in range(num_experts)
    ]

    rows = fused.tokens * fused.weights.unsqueeze(-1)
    counts = fused.tokens_per_expert.tolist()
    back_fused = unpermute(rows, fused.token_idx, counts, hidden.shape[0], fused=True)
    back_loop = unpermute(rows, loop.token_idx, counts, hidden.shape[0], fused=False)
    assert torch.equal(back_fused, back_loop)
    torch.testing.assert_close(
        back_fused, (hidden.unsqueeze(1) * topk_weights.unsqueeze(-1)).sum(dim=1)
    )


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.data())
def test_sort_chunks_by_local_expert_and_back(ep_size, num_local_experts, data):
    counts = data.draw(
        st.lists(
            st.integers(0, 3),
            min_size=ep_size * num_local_experts,
            max_size=ep_size * num_local_experts,
        )
    )
    rows = torch.arange(sum(counts), dtype=torch.float32).unsqueeze(-1)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    # Chunk (source s, expert e) holds rows starts[i] .. starts[i] + counts[i], i = s *
    # num_local_experts + e.
    expected = [
        starts[i] + r
        for e in range(num_local_experts)
        for s in range(ep_size)
        for i in [s * num_local_experts + e]
        for r in range(counts[i])
    ]
    by_expert = sort_chunks_by_local_expert(rows, counts, ep_size, num_local_experts)
    assert by_expert.squeeze(-1).tolist() == expected
    assert torch.equal(
        unsort_chunks_by_local_expert(by_expert, counts, ep_size, num_local_experts), rows
    )


def test_aux_loss_is_switch_formula_and_none_disables_it():
    ps = SimpleNamespace(layout=ParallelLayout(world_size=1), ep_rank=0, device=torch.device("cpu"))
    cfg = moe_config(num_experts=4)
    router = TopKRouter(cfg, ps, Precision.of(cfg))
    torch.nn.init.normal_(router.weight, std=INIT_STD, generator=torch.Generator().manual_seed(0))
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    topk_idx, topk_weights, aux = router(x)

    logits = x.reshape(-1, HIDDEN) @ router.weight.T
    top, idx = logits.topk(2, dim=-1)
    assert torch.equal(topk_idx, idx)
    torch.testing.assert_close(topk_weights, torch.softmax(top, dim=-1))
    share = torch.stack([(idx == e).sum() for e in range(4)]) / idx.numel()
    torch.testing.assert_close(aux, 1e-2 * 4 * (share * torch.softmax(logits, -1).mean(0)).sum())

    cfg = moe_config(num_experts=4, moe_router_load_balancing_type="none")
    no_aux = TopKRouter(cfg, ps, Precision.of(cfg))
    no_aux.weight.data.copy_(router.weight.data)
    assert no_aux(x)[2].item() == 0.0


def test_forced_load_balancing_routes_by_its_own_random_logits_with_a_straight_through_gradient():
    ps = SimpleNamespace(
        layout=ParallelLayout(world_size=1),
        cp_rank=0,
        ep_rank=0,
        dp_rank=0,
        tp_rank=0,
        device=torch.device("cpu"),
    )
    cfg = moe_config(num_experts=8, moe_router_force_load_balancing=True)
    router, twin = (TopKRouter(cfg, ps, Precision.of(cfg), layer_number=3) for _ in range(2))
    torch.nn.init.normal_(router.weight, std=INIT_STD, generator=torch.Generator().manual_seed(0))
    twin.weight.data.copy_(router.weight.data)
    x = torch.randn(256, 4, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    idx, weights, _ = router(x)
    torch.manual_seed(123)  # the global RNG has no say
    twin_idx, _, _ = twin(x)
    # the same layer and token share: the same draws, call by call
    assert torch.equal(idx, twin_idx)
    expected = torch.randn(1024, 8, generator=torch.Generator().manual_seed((3 * 1_000_003) * 1009))
    assert torch.equal(idx, expected.topk(2, dim=-1).indices)
    real = (x.reshape(-1, HIDDEN) @ router.weight.T).topk(2, dim=-1).indices
    assert not torch.equal(idx, real)
    loads = torch.bincount(idx.reshape(-1), minlength=8).float()
    # 2048 assignments over 8 experts: balanced up to sampling noise
    assert loads.max() / loads.min() < 1.25
    # The gradient passes straight through the random logits: the router's weight gets the gradient
    # w.r.t. the logits (computed on the same draws, as a leaf) times the tokens, as if the draws
    # had been the logits.
    coeff = torch.randn(weights.shape, generator=torch.Generator().manual_seed(2))
    (weights * coeff).sum().backward()
    drawn = expected.clone().requires_grad_()
    top, _ = drawn.topk(2, dim=-1)
    (grad_logits,) = torch.autograd.grad((torch.softmax(top, dim=-1) * coeff).sum(), drawn)
    assert grad_logits.abs().sum() > 0
    torch.testing.assert_close(router.weight.grad, grad_logits.T @ x.detach().reshape(-1, HIDDEN))
    torch.testing.assert_close(x.grad.reshape(-1, HIDDEN), grad_logits @ router.weight.detach())
    assert not torch.equal(router(x)[0], idx)  # the next call draws anew
    other = TopKRouter(
        cfg,
        SimpleNamespace(
            layout=ParallelLayout(world_size=1),
            cp_rank=0,
            ep_rank=0,
            dp_rank=1,
            tp_rank=0,
            device=torch.device("cpu"),
        ),
        Precision.of(cfg),
        layer_number=3,
    )
    other.weight.data.copy_(router.weight.data)
    twin2 = TopKRouter(cfg, ps, Precision.of(cfg), layer_number=3)
    twin2.weight.data.copy_(router.weight.data)
    # another data-parallel rank's tokens: other draws
    assert not torch.equal(other(x)[0], twin2(x)[0])


def test_experts_must_split_evenly_over_ep():
    with pytest.raises(ValueError, match="num_moe_experts"):
        cfg = moe_config(num_experts=6)
        bare_moe_layer(cfg, SimpleNamespace(layout=ParallelLayout(world_size=4, ep=4)))


# --------------------------------------------------------------------------------------------------
# Dispatcher round trip (multi-process)
# --------------------------------------------------------------------------------------------------


def _dispatch_round_trip(num_experts: int, fused: bool):
    ep, rank = dist.get_world_size(), dist.get_rank()
    ps = ParallelState(ParallelLayout(world_size=ep, ep=ep))
    el = num_experts // ep
    cfg = moe_config(num_experts, ep=ep, moe_permute_fusion=fused)
    dispatcher = AllToAllDispatcher(cfg, ps, bare_kernels(cfg))
    hidden, topk_idx, topk_weights = rank_routing(rank, num_experts, el)
    hidden.requires_grad_()
    topk_weights.requires_grad_()

    plan = dispatcher.route(topk_idx, topk_weights, hidden.shape).resolve()
    rows, weights = dispatcher.dispatch_preprocess(hidden, topk_weights, plan)
    expert_rows, expert_weights = dispatcher.dispatch_postprocess(
        *dispatcher.token_dispatch(rows, weights, plan).wait(), plan
    )

    # Every rank can rebuild every rank's routing: the rows of local expert e must be, source rank
    # by source rank, that rank's tokens routed to e, in token order.
    expected_rows, expected_counts = [], []
    for e in range(ps.ep_rank * el, (ps.ep_rank + 1) * el):
        count = 0
        for src in range(ep):
            src_hidden, src_idx, _ = rank_routing(src, num_experts, el)
            tokens = (src_idx == e).any(dim=1).nonzero().flatten()
            expected_rows.append(src_hidden[tokens])
            count += len(tokens)
        expected_counts.append(count)
    assert plan.tokens_per_local_expert == expected_counts
    assert torch.equal(expert_rows, torch.cat(expected_rows))

    # Identity experts (which apply the combine weights, as `GroupedExperts` does): what comes back
    # is each token scaled by the sum of its combine weights.
    out_rows = dispatcher.combine_preprocess(expert_rows * expert_weights.unsqueeze(-1), plan)
    (returned,) = dispatcher.token_combine(out_rows, plan).wait()
    y = dispatcher.combine_postprocess(returned, plan)
    torch.testing.assert_close(y, hidden * topk_weights.sum(dim=1, keepdim=True))
    # And the backward all-to-alls (swapped splits) bring the gradients home.
    y.sum().backward()
    torch.testing.assert_close(
        hidden.grad, topk_weights.detach().sum(dim=1, keepdim=True).expand_as(hidden)
    )
    torch.testing.assert_close(
        topk_weights.grad, hidden.detach().sum(dim=1, keepdim=True).expand(-1, 2)
    )
    return sum(plan.output_splits)


@pytest.mark.parametrize("world, num_experts, fused", [(2, 4, True), (4, 8, False)])
def test_dispatcher_round_trip_with_identity_experts(world, num_experts, fused):
    received = run_world(world, _dispatch_round_trip, num_experts, fused)
    # the last rank's experts got nothing, the others did
    assert received[-1] == 0 and sum(received) > 0


# --------------------------------------------------------------------------------------------------
# MoE layer: parallel layouts vs the single-process reference
# --------------------------------------------------------------------------------------------------


def _many_round_trip() -> list[bool]:
    """Rank side: bf16 rows, fp32 weights [N] and int64 ids [N, 3] in one all-to-all with uneven
    splits (rank r sends r + j rows to rank j, rank 0 sends none to itself), then back; everything
    must arrive bit-exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    send = [rank + j for j in range(world)]
    recv = [j + rank for j in range(world)]
    n = sum(send)
    gen = torch.Generator().manual_seed(rank)
    rows = torch.randn(n, 5, generator=gen).to(torch.bfloat16)
    weights = torch.rand(n, generator=gen)
    ids = torch.randint(-(2**40), 2**40, (n, 3), generator=gen)
    handle = comm.all_to_all_many((rows, weights, ids), group, "ep_dispatch", recv, send)
    got_rows, got_weights, got_ids = handle.wait()
    ok = [
        got_rows.dtype == torch.bfloat16 and got_rows.shape == (sum(recv), 5),
        got_weights.shape == (sum(recv),) and got_ids.shape == (sum(recv), 3),
    ]
    back = comm.all_to_all_many(
        (got_rows, got_weights, got_ids), group, "ep_combine", send, recv
    ).wait()
    ok += [torch.equal(a, b) for a, b in zip(back, (rows, weights, ids))]
    # One row from rank 0 to rank 1, nothing else: ranks receive 1 or 0 rows, and most send none.
    send = [int(rank == 0 and j == 1) for j in range(world)]
    recv = [int(j == 0 and rank == 1) for j in range(world)]
    one = comm.all_to_all_many(
        (rows[: sum(send)], weights[: sum(send)], ids[: sum(send)]),
        group,
        "ep_dispatch",
        recv,
        send,
    ).wait()
    ok.append([t.shape[0] for t in one] == [sum(recv)] * 3)
    if rank == 1:
        ok.append(all(torch.equal(a, b) for a, b in zip(one, _rank0_tensors())))
    return ok


def _rank0_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0's first row of each tensor in `_many_round_trip` (same generator, same draws)."""
    gen = torch.Generator().manual_seed(0)
    # rank 0 sends 0 + 1 + 2 = 3 rows on 3 ranks
    rows = torch.randn(3, 5, generator=gen).to(torch.bfloat16)
    weights = torch.rand(3, generator=gen)
    ids = torch.randint(-(2**40), 2**40, (3, 3), generator=gen)
    return rows[:1], weights[:1], ids[:1]


def test_all_to_all_many_is_bit_exact_for_mixed_dtypes_and_uneven_splits():
    for ok in run_world(3, _many_round_trip):
        assert all(ok), ok


def _one_rank_exchange() -> tuple:
    rows, weights = torch.randn(5, 3, requires_grad=True), torch.rand(5, requires_grad=True)
    recorder().discard()
    sent = (rows * 2, weights + 1)
    back = comm.all_to_all_many(sent, dist.group.WORLD, "ep_dispatch", [5], [5]).wait()
    shares = [
        b.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for b, t in zip(back, sent)
    ]
    return (
        [b.requires_grad for b in back],
        shares,
        [torch.equal(b, t) for b, t in zip(back, sent)],
        [(e.kind, e.nbytes) for e in recorder().drain()[0]],
    )


def test_all_to_all_many_in_a_group_of_one_returns_tensors_uncopied_and_still_records_the_op():
    ((needs_grad, shares, equal, recorded),) = run_world(1, _one_rank_exchange)
    assert needs_grad == [False, False] and shares == [True, True] and equal == [True, True]
    assert recorded == [("ep_dispatch", 5 * 3 * 4 + 5 * 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delayed", [False, True])
def test_grouped_gemm_kernel_and_expert_loop_are_bit_identical(dtype, delayed):
    """The grouped kernel (`F.grouped_mm`) and the per-expert loop give the same output, input
    gradient and weight gradient bit for bit, with empty experts (their weight gradient zeros) and
    with the weight gradient delayed."""
    from overlap.layers.linear_functions import GroupedLinear, grouped_offsets
    from overlap.layers.wgrad_store import WeightGradStore

    g = torch.Generator().manual_seed(7)
    counts = [5, 0, 9, 3, 0, 7]
    w = torch.nn.Parameter(torch.randn(6, 24, 16, generator=g).to(dtype))
    rows = torch.randn(sum(counts), 16, generator=g).to(dtype)
    dy = torch.randn(sum(counts), 24, generator=g).to(dtype)
    offs = grouped_offsets(torch.tensor(counts), rows, (w,), True)
    assert offs is not None and offs.tolist() == [5, 5, 14, 17, 17, 24]
    results = []
    store = WeightGradStore()
    for kernel_offs in (offs, None):
        x = rows.clone().requires_grad_()
        w.grad = None
        with store.delaying(delayed):
            y = GroupedLinear.apply(x, w, counts, kernel_offs, store)
            y.backward(dy)
        assert (w.grad is None) == delayed
        store.flush()
        results.append((y.detach(), x.grad, w.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert not results[0][2][[1, 4]].any()


def test_grouped_gemm_kernel_is_chosen_only_where_its_layout_rule_holds():
    """16-byte row strides: hidden 8 holds in fp32 (32 bytes), not in bf16 at width 4 (8 bytes)."""
    from overlap.layers.linear_functions import grouped_offsets

    assert (
        grouped_offsets(torch.tensor([1, 2]), torch.zeros(3, 8), (torch.zeros(2, 4, 8),), True)
        is not None
    )
    assert (
        grouped_offsets(
            torch.tensor([1, 2]),
            torch.zeros(3, 4, dtype=torch.bfloat16),
            (torch.zeros(2, 8, 4, dtype=torch.bfloat16),),
            True,
        )
        is None
    )


@pytest.mark.parametrize("world, fused", [(2, True), (4, False)])
def test_expert_parallel_matches_reference(world, fused):
    check_against_reference(
        world, tp=1, ep=world, cfg_overrides=dict(num_experts=8, moe_permute_fusion=fused)
    )


def test_uneven_routing_to_two_experts_matches_reference():
    # 4 experts on EP=2: experts 0 and 1 live on rank 0, so rank 1 receives no rows and its experts
    # stay idle.
    check_against_reference(2, tp=1, ep=2, cfg_overrides=dict(num_experts=4), uneven=True)


def test_sequence_parallel_tp2_ep2_matches_full_sequence_reference():
    check_against_reference(4, tp=2, ep=2, cfg_overrides=dict(num_experts=4))


def test_no_communication_mode_keeps_shapes():
    assert run_world(2, none_mode_step) == [(SEQ, BATCH, HIDDEN)] * 2


# Last: the shared expert uses the dense MLP (its own module), under plain EP and under TP x EP
# sequence parallel.
@pytest.mark.parametrize("world, tp, ep", [(2, 1, 2), (4, 2, 2)])
def test_shared_expert_matches_reference(world, tp, ep):
    check_against_reference(
        world,
        tp=tp,
        ep=ep,
        cfg_overrides=dict(num_experts=4, moe_shared_expert_intermediate_size=48),
    )


class _CudaRows:
    """The surface `grouped_offsets` reads of the experts' rows, as a CUDA bf16 tensor (a CPU
    build has none)."""

    device = torch.device("cuda", 0)
    dtype = torch.bfloat16
    is_cuda = True
    shape = (3, 64)

    def element_size(self) -> int:
        return 2


@pytest.mark.parametrize(
    "major, grouped",
    [(8, False), (9, True), (10, False), (12, False), (None, True)],
    ids=lambda v: str(v),
)
def test_the_experts_gemm_kernel_is_chosen_per_architecture(major, grouped):
    """Issue 47 item 10: torch's grouped GEMM only on Hopper in bf16. SM8x: it falls back to a loop
    after `offs.cpu()` (a host sync per GEMM); SM100+: experts without rows get non-zero weight
    gradients. Elsewhere the loop, which the table says with the reason; a GPU not known to the
    resolution (a dry run's) as Hopper. The run decides once for
    its GPU (`Kernels.moe_grouped_gemm`), and the experts' GEMMs take that decision."""
    from overlap.decisions import DecisionLog
    from overlap.kernels.choices import resolve_grouped_gemm
    from overlap.kernels.device import DeviceInfo
    from overlap.kernels.grouped_gemm import GROUPED, LOOP, grouped_gemm_kernel
    from overlap.layers.linear_functions import grouped_offsets

    decided = resolve_grouped_gemm(
        moe_config(4),
        "bfloat16",
        DecisionLog(strict=False),
        True,
        lambda: DeviceInfo("NVIDIA GPU", major),
    )
    weight = torch.zeros(2, 8, 64, dtype=torch.bfloat16)
    offs = grouped_offsets(torch.tensor([1, 2]), _CudaRows(), (weight,), decided)
    assert decided == grouped and (offs is not None) == grouped
    kernel, why = grouped_gemm_kernel("cuda", major, "bfloat16")
    assert kernel == (GROUPED if grouped else LOOP) and why
    assert grouped_gemm_kernel("cpu", None, "float32")[0] == GROUPED
    assert grouped_gemm_kernel("cuda", 9, "float32")[0] == LOOP
    assert grouped_gemm_kernel("meta", None, "bfloat16")[0] == LOOP


@pytest.mark.parametrize("gpu, kernel", [("h100", "grouped"), ("b200", "loop"), ("cpu", "grouped")])
def test_explain_shows_the_experts_gemm_kernel_for_the_target_gpu(gpu, kernel):
    from overlap.harness import resolve_run
    from overlap.kernels.choices import ROW

    job = resolve_run(["-m", "qwen", "-mr", "qwen3_moe_tiny", "-g", gpu, "-ng", "1"], [])
    (row,) = [d for d in job.resolution.decisions.sections["model"] if d.field == ROW]
    assert row.effective == kernel and row.reason


def _train_moe_steps(loop: bool) -> list[float]:
    """Three steps' losses of the tiny MoE (hidden 64, expert width 32: the grouped kernel's layout
    rule holds in fp32) on one rank, the experts' GEMMs on torch's grouped kernel or, `loop`, the
    per-expert loop forced (the rule answering as it does off Hopper, so the run decides it)."""
    from overlap.kernels import choices
    from overlap.kernels.grouped_gemm import LOOP
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    rule = choices.grouped_gemm_kernel
    if loop:
        choices.grouped_gemm_kernel = lambda *facts: (LOOP, "forced by the test")
    try:
        cfg = tiny_config(True, None, 2, [], 3)
        res = cfg.finalize(1)
        assert res.kernels.moe_grouped_gemm is not loop
        trainer = Trainer(cfg, ParallelState(res.layout))
        return [r.lm_loss for r in trainer.train().records]
    finally:
        choices.grouped_gemm_kernel = rule


def test_the_loop_fallback_trains_like_the_grouped_kernel():
    """The fallback the rule picks off Hopper, forced on the CPU, against the grouped kernel the CPU
    takes: the same losses bit for bit."""
    (grouped,) = run_world(1, _train_moe_steps, False)
    (loop,) = run_world(1, _train_moe_steps, True)
    assert grouped == loop and len(loop) == 3
