"""EP-overlap schedule (combined 1F1B): same math as the plain micro-batch loop, and the all-to-alls really overlap.

Tolerance: fp32, rtol 1e-6 / atol 1e-6 on gradients. The pieces run the same operations as the plain model forward,
so losses are identical; gradients differ only in accumulation order (the aux-loss and residual branches are summed
at piece boundaries instead of inside one autograd graph).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap.config import ModelConfig
from overlap.layers.wgrad_store import WGRAD_STORE
from overlap.model.gpt import GPTModel
from overlap.parallel.state import ParallelLayout, ParallelState
from overlap.parallel.trace import RECORDER
from overlap.pipeline.combined_1f1b import combined_1f1b
from tests.world import run_world


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8,
                ffn_hidden_size=64, vocab_size=128, seq_length=16, qk_layernorm=True, num_moe_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2, init_method_std=0.1)
    base.update(kw)
    return ModelConfig(**base)


def _batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(50 + rank)
    rows = torch.randint(0, 128, (n, 2, 17), generator=gen)
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def _grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(overlap: bool, delay: bool, layout: dict, cfg_kw: dict, n_mb: int = 3):
    world = dist.get_world_size()
    cfg = _config(**cfg_kw, expert_model_parallel_size=layout.get("ep", 1),
                  tensor_model_parallel_size=layout.get("tp", 1), sequence_parallel=layout.get("tp", 1) > 1)
    ps = ParallelState(ParallelLayout(world_size=world, tp=layout.get("tp", 1), ep=layout.get("ep", 1)))
    model = GPTModel(cfg, ps)
    model.init_weights(7)
    batches = _batches(ps.dp_rank, n_mb)
    scale = 1.0 / n_mb
    RECORDER.drain()
    if overlap:
        losses = [float(l) for l, _ in combined_1f1b(model, batches, scale, delay)]
    else:
        losses = []
        for tokens, labels in batches:
            lm, aux = model(tokens, labels)
            ((lm + aux) * scale).backward()
            losses.append(float(lm))
    assert not WGRAD_STORE.queue
    events, spans = RECORDER.drain()
    return losses, _grads(model), events, spans


def _compare(layout: dict, world: int, cfg_kw: dict, delay: bool) -> None:
    off = run_world(world, _run, False, False, layout, cfg_kw)
    on = run_world(world, _run, True, delay, layout, cfg_kw)
    for (l_off, g_off, _, _), (l_on, g_on, _, _) in zip(off, on):
        assert l_on == pytest.approx(l_off, rel=1e-6)
        assert g_on.keys() == g_off.keys()
        for name in g_off:
            torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("delay", [False, True], ids=["overlap", "overlap+delay_wgrad"])
def test_ep2_overlap_matches_plain_loop(delay):
    _compare({"ep": 2}, 2, {}, delay)


def test_ep4_overlap_with_dense_layer_and_shared_expert():
    _compare({"ep": 4}, 4, {"moe_layer_freq": 2, "moe_shared_expert_intermediate_size": 32}, True)


def test_tp2_ep2_overlap_matches_plain_loop():
    _compare({"ep": 2, "tp": 2}, 4, {}, True)


def test_all_to_alls_are_in_flight_while_the_other_micro_batch_computes():
    """Structural: in merged phases, every dispatch / combine (forward or backward) is launched before, and completes
    after the start of, a compute span that belongs to the other micro-batch's work (the interleave really happens)."""
    _, _, events, spans = run_world(2, _run, True, True, {"ep": 2}, {})[0]
    a2a = [e for e in events if e.kind in ("ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd")]
    compute = [s for s in spans if s.name.startswith(("fwd.layer", "bwd.layer", "bwd.delayed_wgrad"))]
    covered = 0
    for e in a2a:
        end = e.t_wait_start if e.t_wait_start is not None else e.t_done
        if any(s.t_start >= e.t_launch and s.t_start < end for s in compute):
            covered += 1
    # Only the first micro-batch's forward and the last one's backward run alone (no partner to overlap with).
    assert covered >= len(a2a) // 2, (covered, len(a2a))
    kinds = {e.kind for e in a2a}
    assert kinds == {"ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd"}


def test_needs_two_micro_batches():
    with pytest.raises(ValueError, match="at least 2 micro-batches"):
        combined_1f1b(None, [(None, None)], 1.0, False)
