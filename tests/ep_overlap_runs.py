"""The EP-overlap runs several test files compare: a tiny MoE model stepped through the merged
(combined 1F1B) schedule or the plain micro-batch loop, and the on-vs-off comparison
(`tests/test_ep_overlap.py` states the tolerance: fp32, rtol 1e-6 / atol 1e-6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap.config.mixed_precision import Precision
from overlap.layout import ParallelLayout
from overlap.model.gpt import GPTModel
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.pipeline.executor import ExecutorOptions, PipelineExecutor
from tests.configs import bare_kernels, bare_plan, ep_overlap_model
from tests.world import run_world


def ep_batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` micro-batches of (tokens, labels) [2, 16] for DP rank `rank`."""
    gen = torch.Generator().manual_seed(50 + rank)
    rows = torch.randint(0, 128, (n, 2, 17), generator=gen)
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def param_grads(model: GPTModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run_ep_step(overlap: bool, delay: bool, layout: dict, cfg_kw: dict, n_mb: int = 3):
    """One step of `ep_overlap_model(**cfg_kw)` on this rank's `layout` ({"ep": .., "tp": ..}):
    merged with EP overlap (`delay`: delay_wgrad_compute) or the plain loop; returns (losses,
    gradients, comm events, compute spans)."""
    world, tp, ep = dist.get_world_size(), layout.get("tp", 1), layout.get("ep", 1)
    sp = tp > 1  # sequence parallel wherever there is TP (MoE with TP needs it)
    cfg = ep_overlap_model(
        **cfg_kw, expert_model_parallel_size=ep, tensor_model_parallel_size=tp, sequence_parallel=sp
    )
    ps = ParallelState(ParallelLayout(world_size=world, tp=tp, ep=ep, sequence_parallel=sp))
    model = GPTModel(cfg, ps, bare_plan(), Precision.of(cfg), bare_kernels(cfg))
    model.init_weights(7)
    batches = ep_batches(ps.dp_rank, n_mb)
    scale = 1.0 / n_mb
    recorder().drain()
    if overlap:
        losses = [float(loss) for loss in _merged(model, ps, batches, scale, delay)]
    else:
        losses = []
        for tokens, labels in batches:
            lm, aux = model(tokens, labels)
            ((lm + aux) * scale).backward()
            losses.append(float(lm))
    assert not model.wgrad_store.queue
    events, spans = recorder().drain()
    return losses, param_grads(model), events, spans


def _merged(
    model: GPTModel, ps: ParallelState, batches, scale: float, delay: bool
) -> list[torch.Tensor]:
    """The EP-overlap schedule without pipelining: the pipeline executor's PP = 1 program,
    merged."""
    shape = (model.config.seq_length, batches[0][0].shape[0], model.config.hidden_size)
    options = ExecutorOptions(
        shape, torch.float32, overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=delay
    )
    return PipelineExecutor([model], ps, options, lambda chunk, last: None).step(batches, scale)


def compare_ep_overlap(layout: dict, world: int, cfg_kw: dict, delay: bool) -> None:
    """EP overlap on (with or without delay_wgrad) gives the plain loop's losses and gradients."""
    off = run_world(world, run_ep_step, False, False, layout, cfg_kw)
    on = run_world(world, run_ep_step, True, delay, layout, cfg_kw)
    for (l_off, g_off, _, _), (l_on, g_on, _, _) in zip(off, on):
        assert l_on == pytest.approx(l_off, rel=1e-6)
        assert g_on.keys() == g_off.keys()
        for name in g_off:
            torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-6, atol=1e-6, msg=name)
