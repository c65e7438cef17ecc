"""EP all-to-all overlap under interleaved pipeline parallelism: the steady steps of the interleaved
1F1B program merged, forward of one (micro-batch, chunk) and backward of another, layer piece by
layer piece (`ExecutorOptions(overlap_moe_expert_parallel_comm=True)`, the same merged step the
PP = 1 schedule runs).

Tolerances: fp32 (the executor driven directly), EP overlap on vs off rel 1e-6 on the losses and
rtol / atol 1e-6 on every gradient (the pieces run the same operations; only gradient accumulation
order differs, at piece boundaries, as in test_ep_overlap.py); against the single-process reference
rel 1e-5 on the losses (as test_pipeline.py). The trainer end to end needs bf16 (EP overlap's rule):
rel 2e-2 against the reference.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.distributed as dist

from overlap.config import ModelConfig
from overlap.config.mixed_precision import Precision
from overlap.layout import ParallelLayout, resolve_pipeline_layout
from overlap.model.gpt import model_chunks
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.pipeline.executor import ExecutorOptions, PipelineExecutor
from overlap.pipeline.schedules import pipeline_steps
from overlap.training.trainer import Trainer
from tests.configs import bare_kernels, bare_plan, ep_overlap_model, tiny_config
from tests.world import run_world

STEPS = 3
EP2_PP2_VPP2 = dict(
    pipeline_model_parallel_size=2,
    virtual_pipeline_model_parallel_size=2,
    expert_model_parallel_size=2,
)
ON = ["comm_overlap.overlap_moe_expert_parallel_comm=true"]


@pytest.mark.parametrize(
    "pp, vpp, micro, group",
    [
        (1, 1, 2, None),
        (1, 1, 5, None),
        (2, 2, 4, None),
        (2, 2, 8, None),
        (4, 2, 8, None),
        (4, 2, 4, None),
        (2, 3, 6, None),
        (4, 2, 8, 8),
        (3, 2, 6, 3),
        (2, 2, 6, 3),
        (4, 3, 12, 4),
    ],
)
def test_merged_program_leaves_each_last_backward_alone_and_never_merges_a_microbatch_with_itself(
    pp, vpp, micro, group
):
    for rank in range(pp):
        steps = pipeline_steps(pp, rank, vpp, micro, group, merged=True)
        tasks = [
            (t.backward, t.microbatch, t.chunk) for s in steps for t in (s.forward, s.backward) if t
        ]
        assert sorted(tasks) == sorted(itertools.product((False, True), range(micro), range(vpp)))
        for s in steps:
            if s.forward and s.backward:
                assert s.backward.microbatch != micro - 1  # a chunk's last backward runs alone
                assert (s.forward.microbatch, s.forward.chunk) != (
                    s.backward.microbatch,
                    s.backward.chunk,
                )
    if pp == 1:
        kinds = [
            "F" if s.backward is None else "B" if s.forward is None else "FB"
            for s in pipeline_steps(1, 0, 1, micro, merged=True)
        ]
        # Megatron's combined 1F1B without pipelining
        assert kinds == ["F"] + ["FB"] * (micro - 1) + ["B"]


def _config(layers: int, pp: int, vpp: int | None, ep: int, **kw) -> ModelConfig:
    return ep_overlap_model(
        **{
            "num_layers": layers,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vpp,
            "expert_model_parallel_size": ep,
            **kw,
        }
    )


def _step(
    overlap: bool,
    delay: bool,
    layout: dict,
    cfg_kw: dict,
    data_rank: int | None = None,
    n_mb: int = 4,
    layers: int = 4,
    overlap_p2p: bool = True,
):
    """One pipeline step of every micro-batch (fp32, no DP wrapper: gradients land in .grad):
    (losses, grads). Each DP rank draws its own micro-batches (`data_rank`: those of that DP rank
    instead)."""
    world = dist.get_world_size()
    pp, vpp, ep = layout.get("pp", 1), layout.get("vpp"), layout.get("ep", 1)
    cfg = _config(layers, pp, vpp, ep, **cfg_kw)
    pipeline = resolve_pipeline_layout(cfg, pp)
    ps = ParallelState(ParallelLayout(world_size=world, pp=pp, ep=ep, vpp=pipeline.vpp))
    defer = bool(cfg.defer_embedding_wgrad_compute)
    chunks = model_chunks(
        cfg,
        ps,
        pipeline,
        bare_plan(defer_embedding_wgrad_compute=defer),
        Precision.of(cfg),
        bare_kernels(cfg),
    )
    for chunk in chunks:
        chunk.init_weights(7)
    gen = torch.Generator().manual_seed(50 + (ps.dp_rank if data_rank is None else data_rank))
    rows = torch.randint(0, 128, (n_mb, 2, 17), generator=gen)
    batches = [(r[:, :-1], r[:, 1:]) for r in rows]
    # (chunk, is its last micro-batch, weight gradients still queued)
    hooks: list[tuple[int, bool, int]] = []
    options = ExecutorOptions(
        (cfg.seq_length, 2, cfg.hidden_size),
        torch.float32,
        overlap_p2p_comm=overlap_p2p,
        overlap_moe_expert_parallel_comm=overlap,
        delay_wgrad_compute=delay,
        defer_embedding_wgrad_compute=defer,
    )

    def before_backward(chunk: int, last: bool) -> None:
        hooks.append((chunk, last, len(store.queue)))

    store = chunks[0].wgrad_store
    losses = PipelineExecutor(chunks, ps, options, before_backward).step(batches, 1.0 / n_mb)
    assert not store.queue
    # data parallelism's rule: every chunk's last backward is announced (again by the flush of
    # deferred output-layer GEMMs, which completes that weight), and never while delayed weight
    # gradients are still queued
    assert {c for c, last, _ in hooks if last} == set(range(len(chunks)))
    assert all(queued == 0 for _, last, queued in hooks if last)
    grads = {
        n: p.grad.clone() for c in chunks for n, p in c.named_parameters() if p.grad is not None
    }
    return [float(x) for x in losses], grads, ps.dp_rank


@functools.cache
def _reference(cfg_items: tuple, data_rank: int) -> tuple[float, ...]:
    """The single-process losses on the micro-batches of DP rank `data_rank`."""
    return tuple(run_world(1, _step, False, False, {}, dict(cfg_items), data_rank)[0][0])


CASES = [
    # (id, world, layout, model fields, delay_wgrad[, overlapped p2p])
    ("ep2_pp2_vpp2", 4, dict(pp=2, vpp=2, ep=2), {}, False),
    ("ep2_pp2_vpp2_delay_wgrad", 4, dict(pp=2, vpp=2, ep=2), {}, True),
    (
        "ep2_pp2_vpp2_dense_layer_delay_wgrad",
        4,
        dict(pp=2, vpp=2, ep=2),
        {"moe_layer_freq": 2},
        True,
    ),
    (
        "ep2_pp2_vpp2_deferred_output_wgrad",
        4,
        dict(pp=2, vpp=2, ep=2),
        {"defer_embedding_wgrad_compute": True},
        True,
    ),
    ("ep2_pp2_vpp2_batched_p2p_delay_wgrad", 4, dict(pp=2, vpp=2, ep=2), {}, True, False),
    (
        "ep2_pp2_vpp2_shared_expert_uneven",
        4,
        dict(pp=2, vpp=2, ep=2),
        {
            "moe_shared_expert_intermediate_size": 32,
            "num_layers": 6,
            "num_layers_in_first_pipeline_stage": 2,
        },
        True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ep_overlap_under_pp_matches_off_and_the_single_process_reference(case):
    _id, world, layout, cfg_kw, delay, *p2p = case
    off = run_world(world, _step, False, False, layout, cfg_kw, None, 4, 4, *p2p)
    on = run_world(world, _step, True, delay, layout, cfg_kw, None, 4, 4, *p2p)
    model_kw = tuple(sorted((k, v) for k, v in cfg_kw.items() if not k.startswith("num_layers_in")))
    for (l_off, g_off, _), (l_on, g_on, dp_rank) in zip(off, on):
        assert l_on == pytest.approx(l_off, rel=1e-6)
        if l_on:  # the last stage's ranks
            assert l_on == pytest.approx(list(_reference(model_kw, dp_rank)), rel=1e-5)
        assert g_on.keys() == g_off.keys() and g_on
        for name in g_off:
            torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-6, atol=1e-6, msg=name)


def _train(overrides: list[str], layout: dict) -> list[float]:
    cfg = tiny_config(True, "bf16_mixed", 4, overrides, STEPS, **layout)
    res = cfg.finalize(dist.get_world_size())
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


def test_ep_overlap_under_pp_trains_with_dp2_and_the_distributed_optimizer():
    """8 ranks, the trainer end to end: EP2 x PP2 x VPP2 x DP2 (bf16: EP overlap needs it),
    distributed optimizer with both DP overlaps (per-chunk buckets), delay_wgrad; against the
    single-process reference (bf16 rel 2e-2, as test_pipeline.py) and against EP overlap off."""
    extra = [
        "ddp.use_distributed_optimizer=true",
        "optimizer.use_distributed_optimizer=true",
        "ddp.overlap_grad_reduce=true",
        "ddp.overlap_param_gather=true",
        "ddp.bucket_size=20000",
    ]
    on = run_world(8, _train, ON + ["comm_overlap.delay_wgrad_compute=true"] + extra, EP2_PP2_VPP2)
    off = run_world(8, _train, extra, EP2_PP2_VPP2)
    ref = run_world(1, _train, [], {})[0]
    for l_on, l_off in zip(on, off):
        assert l_on == pytest.approx(ref, rel=2e-2)
        assert l_on == pytest.approx(l_off, rel=5e-3)


def _traced_step(overrides: list[str]):
    cfg = tiny_config(True, "bf16_mixed", 4, ON + overrides, STEPS, **EP2_PP2_VPP2)
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    trainer.train_step(0)
    recorder().drain()
    trainer.train_step(1)
    return recorder().drain()


def test_under_pp_all_to_alls_fly_while_the_other_microbatch_computes_and_receives_post_early():
    """Structural, from the tracer: (1) in merged steps, dispatch / combine of one micro-batch are
    in flight while a layer piece of the other computes; (2) the pipeline receives a merged step
    consumes were posted before it began."""
    for events, spans in run_world(4, _traced_step, []):
        merged = [s for s in spans if s.name == "merged"]
        assert merged
        a2a = [
            e
            for e in events
            if e.kind in ("ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd")
            and any(m.t_start <= e.t_launch <= m.t_end for m in merged)
        ]
        pieces = [s for s in spans if s.name.startswith(("fwd.layer", "bwd.layer"))]
        covered = sum(
            any(e.t_launch <= s.t_start < (e.t_wait_start or e.t_done) for s in pieces) for e in a2a
        )
        assert a2a and covered >= len(a2a) * 3 // 4, (covered, len(a2a))
        steps = sorted(
            (s for s in spans if s.name in ("merged", "forward", "backward")),
            key=lambda s: s.t_start,
        )
        early = 0
        for e in (e for e in events if e.kind.startswith("pp_recv") and e.t_wait_start is not None):
            later = [i for i, s in enumerate(steps) if s.t_start >= e.t_wait_start]
            if later and steps[later[0]].name == "merged" and later[0] > 0:
                # in flight during the step before its consumer
                assert e.t_launch < steps[later[0] - 1].t_end
                early += 1
        assert early > 0
