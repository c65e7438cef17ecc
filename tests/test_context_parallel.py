"""Context parallelism: each cp_comm_type's attention (p2p, all_gather, a2a, a2a+p2p) against plain
causal attention on the gathered sequence (forward and backward), and training at CP 2 and 4, alone
and with TP-SP, DP (distributed optimizer), PP-VPP, EP (with EP overlap), recompute and bf16,
against the single-process reference (DP 1 with the DP overlaps over CP too); the ring's overlap on
vs off, and what the tracer sees of it.

Tolerances (fp32): the ring merges blocks by log-sum-exp and the all-gather / all-to-all paths sum
the softmax in another order than the one-rank kernel, so values agree to a few ulps of the
accumulated sums; losses to 1e-5 relative (as tests/test_model_tp.py), attention outputs and
gradients to 1e-5 absolute on O(1) values; bf16 losses to 1e-3 dense (as tests/test_model_tp.py)
and 2e-2 for the MoE case with EP overlap (which needs a 16-bit model), the MoE layouts' usual
tolerance. p2p with the overlap on and off sends the same messages and computes the same blocks in
the same order: bit-identical.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap.layers.attention import unfused_attention
from overlap.layers.cp_attention import cp_attention
from overlap.layout import ParallelLayout
from overlap.parallel.cp_chunks import cp_positions
from overlap.parallel.state import ParallelState
from tests.configs import tiny_config
from tests.world import run_world

ATOL = 1e-5
STEPS = 3
KINDS = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _attention_case(kind: str, overlap: bool) -> tuple[torch.Tensor, ...]:
    """This CP rank's share of the attention output and of q, k, v's gradients, and the reference's
    (plain causal attention on the whole sequence, the same rows picked out). a2a+p2p: all-to-alls
    inside pairs of CP ranks, the ring across them (at CP 2 a ring of one)."""
    cp = dist.get_world_size()
    ps = ParallelState(ParallelLayout(cp, cp=cp, cp_a2a=2 if kind == "a2a+p2p" else 1))
    gen = torch.Generator().manual_seed(7)
    # a2a splits the heads and the query groups over CP
    b, heads, groups, seq, d = 2, 2 * cp, cp, 8 * cp, 8
    q, k, v = (torch.randn(b, n, seq, d, generator=gen) for n in (heads, groups, groups))
    dout = torch.randn(b, heads, seq, d, generator=gen)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = unfused_attention(*whole)
    ref.backward(dout)
    mine = cp_positions(seq, ps.cp_rank, cp)
    local = [t.index_select(2, mine).requires_grad_() for t in (q, k, v)]
    out = cp_attention(*local, ps, kind, overlap, unfused_attention)
    out.backward(dout.index_select(2, mine))
    pairs = [(out, ref.index_select(2, mine))]
    pairs += [(t.grad, w.grad.index_select(2, mine)) for t, w in zip(local, whole)]
    return tuple(float((a.detach() - r).abs().max()) for a, r in pairs) + (out.detach(),)


def _attention_cases() -> dict:
    return {
        (kind, overlap): _attention_case(kind, overlap)
        for kind in KINDS
        for overlap in ((True, False) if kind in ("p2p", "a2a+p2p") else (False,))
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def attention(request):
    return run_world(request.param, _attention_cases)


@pytest.mark.parametrize("kind", KINDS)
def test_cp_attention_matches_plain_attention(attention, kind):
    for rank in attention:
        errors = rank[(kind, kind in ("p2p", "a2a+p2p"))][:4]
        assert max(errors) < ATOL, (kind, errors)


def test_p2p_overlap_on_and_off_are_bit_identical(attention):
    for rank in attention:
        assert torch.equal(rank[("p2p", True)][4], rank[("p2p", False)][4])


def _train(
    layers: int, overrides: list[str], moe: bool = False, precision: str | None = None
) -> list[float]:
    from overlap.training.runtime_refusals import check_runtime_support
    from overlap.training.trainer import Trainer

    # a large aux-loss weight, so that a wrong aux-loss gradient under CP shows in the losses
    aux = ["model.moe_aux_loss_coeff=1.0"] if moe else []
    cfg = tiny_config(moe, precision, layers, aux + overrides, STEPS)
    res = cfg.finalize(dist.get_world_size())
    check_runtime_support(cfg)
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


CP2 = ["model.context_parallel_size=2"]
CP4 = ["model.context_parallel_size=4"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
DISTOPT = [
    "ddp.use_distributed_optimizer=true",
    "optimizer.use_distributed_optimizer=true",
    "ddp.overlap_grad_reduce=true",
    "ddp.overlap_param_gather=true",
]
PP2_VPP2 = [
    "model.pipeline_model_parallel_size=2",
    "model.virtual_pipeline_model_parallel_size=2",
]
# a2a inside pairs of CP ranks, the ring across the two pairs
HIERARCHICAL = ["model.cp_comm_type=a2a+p2p", "model.hierarchical_context_parallel_sizes=[2,2]"]
EP2 = ["model.expert_model_parallel_size=2"]
EP_OVERLAP = [
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=true",
]
TRAIN_CASES = [
    # (id, world, layers, overrides); MoE cases: id starts with "moe", "bf16" in it: bf16_mixed
    ("cp2_p2p", 2, 2, CP2),
    ("cp2_p2p_serialised", 2, 2, CP2 + ["model.cp_comm_overlap=false"]),
    ("cp2_all_gather", 2, 2, CP2 + ["model.cp_comm_type=all_gather"]),
    ("cp2_a2a", 2, 2, CP2 + ["model.cp_comm_type=a2a"]),
    ("cp4_p2p", 4, 2, CP4),
    ("cp4_all_gather", 4, 2, CP4 + ["model.cp_comm_type=all_gather"]),
    ("cp4_a2a_p2p", 4, 2, CP4 + HIERARCHICAL),
    ("cp4_a2a_p2p_serialised", 4, 2, CP4 + HIERARCHICAL + ["model.cp_comm_overlap=false"]),
    ("cp2_tp2_sp", 4, 2, CP2 + TP2),
    ("cp2_dp2_distopt", 4, 2, CP2 + DISTOPT),
    # DP 1: the gradients still reduced (the optimizer sharded) over CP, overlapped on request
    ("cp2_dp1_distopt_overlapped", 2, 2, CP2 + DISTOPT),
    ("cp2_pp2_vpp2", 4, 4, CP2 + PP2_VPP2),
    # recompute re-runs the ring (forward) inside the backward: the same messages, in order
    (
        "cp2_selective_recompute",
        2,
        2,
        CP2 + ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"],
    ),
    (
        "cp2_full_recompute",
        2,
        2,
        CP2
        + [
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=1",
        ],
    ),
    ("dense_bf16_cp2_a2a", 2, 2, CP2 + ["model.cp_comm_type=a2a"]),
    ("dense_bf16_cp2_p2p", 2, 2, CP2),
    # the experts over DP x CP (world 2: EP2 carved from CP2), the router's statistics over CP
    ("moe_cp2_ep2", 2, 2, CP2 + EP2),
    ("moe_bf16_cp2_ep2_ep_overlap", 2, 2, CP2 + EP2 + EP_OVERLAP),
    ("moe_cp2_tp2_sp_ep2", 4, 2, CP2 + TP2 + EP2),
]


def test_dp_overlaps_are_honoured_over_cp_alone():
    """At DP 1 the gradients are reduced, and the distributed optimizer's state sharded, over the
    CP ranks: a request for the DP overlaps stands (Bridge's automatic defaults still need DP > 1),
    and only DP x CP = 1 turns one off."""
    plan = tiny_config(False, None, 2, CP2 + DISTOPT, STEPS).finalize(2).overlap
    assert plan.overlap_grad_reduce and plan.overlap_param_gather
    auto = tiny_config(False, None, 2, CP2 + DISTOPT[:2], STEPS).finalize(2)
    assert not auto.overlap.overlap_grad_reduce
    assert "honoured on request" in auto.decisions.get("ddp.overlap_grad_reduce").reason
    alone = tiny_config(False, None, 2, ["ddp.overlap_grad_reduce=true"], STEPS).finalize(1)
    assert not alone.overlap.overlap_grad_reduce
    assert "DP x CP = 1" in alone.decisions.get("ddp.overlap_grad_reduce").reason


@pytest.fixture(scope="module")
def reference():
    return {
        (layers, moe, precision): run_world(1, _train, layers, [], moe, precision)[0]
        for layers, moe, precision in (
            (2, False, None),
            (2, False, "bf16_mixed"),
            (4, False, None),
            (2, True, None),
            (2, True, "bf16_mixed"),
        )
    }


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_cp_layouts_train_like_one_rank(case, reference):
    name, world, layers, overrides = case
    moe, precision = name.startswith("moe"), "bf16_mixed" if "bf16" in name else None
    ref = reference[(layers, moe, precision)]
    for losses in run_world(world, _train, layers, overrides, moe, precision):
        # bf16: dense as tests/test_model_tp.py, MoE as tests/test_nccl_rules.py
        rel = (2e-2 if moe else 1e-3) if precision else 1e-5
        assert losses == pytest.approx(ref, rel=rel)


def _in_flight_under_attention(
    overlap: bool, seq: int = 16, latency_s: float = 2e-3
) -> tuple[dict[str, int], dict[str, float], str]:
    """One CP2 training step at sequence `seq` over a modelled link of `latency_s`: the ring
    transfers (cp_kv forward, cp_dkv backward) in flight over a whole block's attention; the
    milliseconds of each CP kind's link time exposed where compute could have covered it; the
    exposed-communication table as a run's report prints it."""
    from overlap.parallel import comm, link_model
    from overlap.parallel.trace import recorder
    from overlap.profiling.exposed import (
        busy_intervals,
        exposure,
        format_table,
        length,
        subtract,
        union,
    )
    from overlap.training.trainer import Trainer

    overrides = CP2 + [f"model.seq_length={seq}", f"model.cp_comm_overlap={overlap}".lower()]
    cfg = tiny_config(False, None, 2, overrides, 1)
    res = cfg.finalize(2)
    link = link_model.LinkModel(latency_s=latency_s, bandwidth_Bps=1e9, families=("cp",))
    events, spans = [], []
    try:
        with comm.using(comm.CommSession(link=link)):
            trainer = Trainer(cfg, ParallelState(res.layout))
            recorder().drain()
            recorder().on_drain = lambda c, s: (events.extend(c), spans.extend(s))
            trainer.train()
    finally:
        recorder().on_drain = None
    counts = {}
    # at CP 2 the backward starts from the block the forward kept: its only transfer is the dKV
    for kind, span in (("cp_kv", "cp.attention"), ("cp_dkv", "cp.attention_bwd")):
        blocks = [s for s in spans if s.name == span]
        counts[f"{kind} under {span}"] = sum(
            1
            for e in events
            if e.kind == kind
            and e.t_done is not None
            and any(e.t_launch <= s.t_start and s.t_end <= e.t_done for s in blocks)
        )
    # the link's share that compute could cover: each receive from the moment both sides had
    # posted (`t_ready`) to its data, minus the compute, where the peer posted before this rank ran
    # out of compute and began to wait. A ring lets a rank run up to a block ahead (two ranks
    # sharing two busy cores are rarely even); the rank ahead then waits for its peer to post and
    # for the link after it, which no overlap can hide and the serialised run pays as well. The
    # table's peer-wait column cannot take that out: a send (whose receiver's posting time never
    # travels back) counts as on the link from its launch.
    busy = busy_intervals(spans, events)
    exposed = {
        kind: 1e3
        * length(
            subtract(
                union(
                    (e.t_ready, e.t_done)
                    for e in events
                    if e.kind == kind
                    and e.t_ready is not None
                    and e.t_done is not None
                    and e.t_wait_start is not None
                    and e.t_ready <= e.t_wait_start
                ),
                busy,
            )
        )
        for kind in ("cp_kv", "cp_dkv")
    }
    return counts, exposed, format_table(exposure(events, spans), "exposed communication")


@pytest.mark.gloo_only(reason="a modelled link, which NCCL's rules refuse")
def test_the_tracer_shows_cp_transfers_in_flight_under_block_attention():
    """With transfers longer than the blocks (16 tokens, 2 ms a transfer), overlapped, every ring
    transfer is in flight over a block's attention; serialised, none is. With blocks longer than
    the transfers (2048 tokens, 1 ms: the modelled link well above gloo's own sub-millisecond
    transfers, whose CPU time on two shared cores is noise either way), the overlap hides what
    serialised exposes, both ranks' link time counted where compute could have covered it (CI saw
    rank 0's whole link share overlapped at 0.6 of serialised: it ran ahead and waited for its
    peer, then for the link). The exposed-communication table has the CP kinds."""
    (on, _, text), (off, _, _) = (
        run_world(2, _in_flight_under_attention, overlap)[0] for overlap in (True, False)
    )
    assert min(on.values()) > 0, on
    assert max(off.values()) == 0, off
    assert "cp_kv" in text and "cp_dkv" in text
    hidden, shown = (
        [sum(exposed.values()) for _, exposed, _ in run_world(2, _in_flight_under_attention, *a)]
        for a in ((True, 2048, 1e-3), (False, 2048, 1e-3))
    )
    assert sum(hidden) < 0.5 * sum(shown), (hidden, shown)


def test_cp4_a2a_trains_like_one_rank():
    """a2a at CP 4 needs a TP rank's heads and query groups divisible by 4: the tiny model with 4
    query groups (one per head)."""
    shape = ["model.num_query_groups=4"]
    ref = run_world(1, _train, 2, shape)[0]
    for losses in run_world(4, _train, 2, shape + CP4 + ["model.cp_comm_type=a2a"]):
        assert losses == pytest.approx(ref, rel=1e-5)
