"""EP-overlap schedule (combined 1F1B): same math as the plain micro-batch loop, and the all-to-alls
really overlap.

Tolerance: fp32, rtol 1e-6 / atol 1e-6 on gradients. The pieces run the same operations as the plain
model forward, so losses are identical; gradients differ only in accumulation order (the aux-loss
and residual branches are summed at piece boundaries instead of inside one autograd graph).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from overlap.layers.wgrad_store import WeightGradStore
from overlap.layout import ParallelLayout
from overlap.parallel import comm, link_model
from overlap.parallel.trace import CommEvent, now
from overlap.pipeline.executor import ExecutorOptions, PipelineExecutor
from tests.ep_overlap_runs import compare_ep_overlap, run_ep_step
from tests.world import run_world


@pytest.mark.parametrize("delay", [False, True], ids=["overlap", "overlap+delay_wgrad"])
def test_ep2_overlap_matches_plain_loop(delay):
    compare_ep_overlap({"ep": 2}, 2, {}, delay)


def test_ep4_overlap_with_dense_layer_and_shared_expert():
    compare_ep_overlap(
        {"ep": 4}, 4, {"moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 32}, True
    )


def test_ep2_overlap_with_forced_load_balancing_matches_plain_loop():
    # The forced random routing gives the same losses and gradients in the merged schedule as in the
    # plain loop.
    compare_ep_overlap({"ep": 2}, 2, {"moe_router_force_load_balancing": True}, False)


def test_tp2_ep2_overlap_matches_plain_loop():
    compare_ep_overlap({"ep": 2, "tp": 2}, 4, {}, True)


def test_all_to_alls_are_in_flight_while_the_other_micro_batch_computes():
    """Structural: in merged phases, every dispatch / combine (forward or backward) is launched
    before, and completes after the start of, a compute span that belongs to the other micro-batch's
    work (the interleave really happens)."""
    _, _, events, spans = run_world(2, run_ep_step, True, True, {"ep": 2}, {})[0]
    a2a = [
        e
        for e in events
        if e.kind in ("ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd")
    ]
    compute = [
        s for s in spans if s.name.startswith(("fwd.layer", "bwd.layer", "bwd.delayed_wgrad"))
    ]
    covered = 0
    for e in a2a:
        end = e.t_wait_start if e.t_wait_start is not None else e.t_done
        if any(s.t_start >= e.t_launch and s.t_start < end for s in compute):
            covered += 1
    # Only the first micro-batch's forward and the last one's backward run alone (no partner to
    # overlap with).
    assert covered >= len(a2a) // 2, (covered, len(a2a))
    kinds = {e.kind for e in a2a}
    assert kinds == {"ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd"}


class _FakeHandle:
    """A collective that arrives when `arrive()` is called."""

    def __init__(self) -> None:
        self.event = CommEvent(
            kind="ep_dispatch", op="all_to_all", group_size=2, nbytes=0, t_launch=now()
        )
        self.waited = False

    def arrive(self) -> None:
        self.event.t_done = now()

    def wait(self) -> str:
        self.waited = True
        return "data"


def test_wait_filling_runs_queued_weight_gradients_only_while_the_collective_is_in_flight():
    store, handle, ran = WeightGradStore(), _FakeHandle(), []
    for i in range(4):
        store.put(lambda i=i: (ran.append(i), i == 1 and handle.arrive()))
    assert store.wait_filling(handle) == "data" and handle.waited
    assert ran == [0, 1] and len(store.queue) == 2  # the rest waits for the next wait or the flush
    assert store.wait_filling(handle) == "data" and ran == [0, 1]  # already there: a plain wait
    store.flush()
    assert ran == [0, 1, 2, 3] and not store.queue


def test_a_phase_leaves_its_weight_gradients_to_the_next_phase_only():
    store, ran = WeightGradStore(), []
    for name in "ab":
        store.put(lambda name=name: ran.append(name))
    store.end_phase()
    assert ran == []  # this phase's leftovers wait for the next phase's waits
    store.put(lambda: ran.append("c"))
    store.end_phase()
    assert ran == ["a", "b"]  # the previous phase's are run now, "c" is carried
    store.flush()
    assert ran == ["a", "b", "c"] and not store.queue


def _run_on_slow_link(latency_ms: float):
    """The merged schedule with delay_wgrad on a modelled link slow enough that every all-to-all is
    still in flight when the rank reaches its wait."""
    link = link_model.LinkModel(latency_s=latency_ms / 1e3, bandwidth_Bps=1e9)
    with comm.using(comm.CommSession(link=link)):
        return run_ep_step(True, True, {"ep": 2}, {})


@pytest.mark.gloo_only(
    reason="reads when collectives finish on the modelled link's host clock; under NCCL's rules "
    "completion is hidden from the host, so the times it compares do not exist"
)
def test_waits_are_filled_with_delayed_wgrads_and_split_sizes_are_waited_outside_attention():
    """Structural, from the tracer: (1) delayed weight-gradient GEMMs run inside waits, i.e. each
    starts after some collective was launched, while it was still in flight, and before this rank
    waited on it; (2) the split-size exchange is launched inside the attention piece and waited for
    only after that piece ended."""
    _, _, events, spans = run_world(2, _run_on_slow_link, 20.0)[0]
    wgrad = [s for s in spans if s.name == "bwd.delayed_wgrad"]
    ops = [e for e in events if e.t_wait_start is not None]
    in_waits = [
        s
        for s in wgrad
        if any(e.t_launch <= s.t_start < e.t_done and s.t_end <= e.t_wait_start for e in ops)
    ]
    assert len(in_waits) >= len(wgrad) // 2, (len(in_waits), len(wgrad))
    attention = [s for s in spans if s.name.startswith("fwd.layer") and s.name.endswith(".attn")]
    counts = [e for e in events if e.kind == "ep_counts"]
    assert len(counts) == len(attention) > 0
    for e in counts:
        (piece,) = [s for s in attention if s.t_start <= e.t_launch <= s.t_end]
        assert e.t_wait_start >= piece.t_end


def _run_without_delay_on_slow_link(latency_ms: float):
    link = link_model.LinkModel(latency_s=latency_ms / 1e3, bandwidth_Bps=1e9)
    with comm.using(comm.CommSession(link=link)):
        return run_ep_step(True, False, {"ep": 2}, {}, n_mb=4)


def test_without_delay_wgrad_the_split_sizes_and_the_dispatch_have_backward_pieces_as_cover():
    """Structural, without delay_wgrad: in the merged steps F's dispatch is in flight while B's
    experts input-gradient backward runs, and F's split-size exchange while B's expert weight GEMMs
    of the layer before run (their fixed slot; a step's first layer gets the previous step's last
    layer's), each launched before that piece starts and waited for after it ends. Only the first
    merged step's first layer has no weight GEMMs queued before it (the step before it was a forward
    alone)."""
    _, _, events, spans = run_world(2, _run_without_delay_on_slow_link, 20.0)[0]
    merged = [s for s in spans if s.name == "merged"]
    assert len(merged) == 3

    def covered(kind: str, piece) -> tuple[int, int]:
        ops = [
            e
            for e in events
            if e.kind == kind and any(m.t_start <= e.t_launch <= m.t_end for m in merged)
        ]
        hits = [
            e
            for e in ops
            if any(
                e.t_launch <= s.t_start and s.t_end <= e.t_wait_start
                for s in spans
                if piece(s.name)
            )
        ]
        return len(hits), len(ops)

    hits, total = covered(
        "ep_dispatch", lambda name: name.startswith("bwd.layer") and name.endswith(".experts")
    )
    assert total == 3 * 3 and hits == total, (hits, total)
    hits, total = covered("ep_counts", lambda name: name == "bwd.delayed_wgrad")
    assert total == 3 * 3 and hits == total - 1, (hits, total)


def test_needs_two_micro_batches():
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        one_stage = SimpleNamespace(layout=ParallelLayout(world_size=1), pp_rank=0)
        options = ExecutorOptions((1,), torch.float32, overlap_moe_expert_parallel_comm=True)
        chunk = SimpleNamespace(wgrad_store=WeightGradStore())
        executor = PipelineExecutor([chunk], one_stage, options, lambda chunk, last: None)
        executor.step([(None, None)], 1.0)
