"""Pipeline parallelism: the layer split, the schedule programs (checked by simulation: every task
once, in a dependency-respecting order, never deadlocking), and every PP layout training like the
single-process reference.

Tolerances: fp32 rel 1e-5 (the same operations per micro-batch; gradients summed in the same
micro-batch order; only the TP / DP reduction order differs); batched vs overlapped p2p
bit-identical (the same operations in the same order, only the waits move). bf16 MoE rel 2e-2, as in
test_training.py.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch.distributed as dist

from overlap.config import ConfigContainer, ModelConfig, TrainConfig
from overlap.errors import ConfigError
from overlap.layout.pipeline import resolve_pipeline_layout
from overlap.parallel.state import ParallelState
from overlap.pipeline.schedules import pipeline_steps, schedule_table
from overlap.training.trainer import Trainer
from tests.configs import layer_ranges, tiny_config
from tests.world import run_world

STEPS = 3


# --- the split ------------------------------------------------------------------------------------
def _ranges(
    layers: int, pp: int, vpp: int | None = None, first: int | None = None, last: int | None = None
):
    model = ModelConfig(
        num_layers=layers,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
    )
    return layer_ranges(resolve_pipeline_layout(model, pp))


def test_layers_are_assigned_as_megatron_does():
    assert _ranges(8, 2) == [[(0, 4)], [(4, 8)]]
    # virtual stage v = chunk x PP + rank: rank 0 holds layers 0-1 and 4-5
    assert _ranges(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert _ranges(8, 4, 2)[1] == [(1, 2), (5, 6)]
    assert _ranges(6, 3, None, 1, 1) == [[(0, 1)], [(1, 5)], [(5, 6)]]
    assert _ranges(7, 3, None, 3) == [[(0, 3)], [(3, 5)], [(5, 7)]]


@pytest.mark.parametrize(
    "args, field",
    [
        ((6, 4), "model.num_layers"),
        ((8, 2, 3), "virtual_pipeline"),
        ((9, 4, None, 1, 1), "model.num_layers"),
        ((4, 1, None, 2), "first_pipeline_stage"),
        ((8, 2, None, 0), "first_pipeline_stage"),
    ],
)
def test_an_indivisible_split_names_the_fields(args, field):
    with pytest.raises(ConfigError) as err:
        _ranges(*args)
    assert field in str(err.value)


def test_the_config_check_uses_the_split_and_the_interleaving_rules():
    def finalize(world: int, **kw) -> None:
        train = TrainConfig(global_batch_size=kw.pop("gb", 8), micro_batch_size=1)
        ConfigContainer(model=ModelConfig(num_layers=8, **kw), train=train).finalize(world)

    finalize(4, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ConfigError, match="global_batch_size"):  # 6 micro-batches, PP 4
        finalize(4, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, gb=6)
    with pytest.raises(ConfigError, match="microbatch_group_size_per_vp_stage"):
        finalize(
            2,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            microbatch_group_size_per_vp_stage=1,
        )
    with pytest.raises(ConfigError, match="microbatch_group_size_per_vp_stage"):
        finalize(2, pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=2)


# --- the programs ---------------------------------------------------------------------------------
def test_schedule_table_groups_micro_batches_per_chunk():
    assert schedule_table(4, 2, 2) == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
        (2, 0),
        (3, 0),
        (2, 1),
        (3, 1),
    ]
    assert schedule_table(3, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]


def test_non_interleaved_1f1b_shape():
    steps = pipeline_steps(4, 0, 1, 8)
    kinds = ["F" if s.backward is None else "B" if s.forward is None else "FB" for s in steps]
    assert kinds == ["F"] * 3 + ["FB"] * 5 + ["B"] * 3  # warm-up PP - rank - 1, steady, cool-down
    assert kinds_of(pipeline_steps(4, 3, 1, 8)) == ["FB"] * 8
    # PP = 1: forward then backward per micro-batch
    assert kinds_of(pipeline_steps(1, 0, 1, 3)) == ["FB"] * 3
    # a deeper warm-up (comm_overlap.p2p_warmup_depth=2): 2 x (PP - rank - 1) forwards first
    assert (
        kinds_of(pipeline_steps(4, 0, 1, 8, warmup_depth=2)) == ["F"] * 6 + ["FB"] * 2 + ["B"] * 6
    )
    assert (
        kinds_of(pipeline_steps(4, 2, 1, 8, warmup_depth=2)) == ["F"] * 2 + ["FB"] * 6 + ["B"] * 2
    )
    assert kinds_of(pipeline_steps(4, 3, 1, 8, warmup_depth=2)) == ["FB"] * 8
    # fewer micro-batches than the warm-up: all forwards, then all backwards
    assert kinds_of(pipeline_steps(4, 0, 1, 3, warmup_depth=2)) == ["F"] * 3 + ["B"] * 3


def kinds_of(steps) -> list[str]:
    return ["F" if s.backward is None else "B" if s.forward is None else "FB" for s in steps]


def _simulate(pp: int, vpp: int, micro: int, group: int | None = None, depth: int = 1) -> None:
    """Run every rank's program against the true dependencies (F(mb, v) after F(mb, v-1); B(mb, v)
    after F(mb, v) and B(mb, v+1)); each rank advances when its next task is ready. A stall before
    the end is a deadlock."""
    programs = [
        [
            t
            for s in pipeline_steps(pp, r, vpp, micro, group, warmup_depth=depth)
            for t in (s.forward, s.backward)
            if t
        ]
        for r in range(pp)
    ]
    last = pp * vpp - 1
    for prog in programs:
        assert sorted((t.backward, t.microbatch, t.chunk) for t in prog) == sorted(
            itertools.product((False, True), range(micro), range(vpp))
        )
    done: set[tuple[bool, int, int]] = set()  # (backward, micro-batch, virtual stage)
    pos = [0] * pp
    while any(pos[r] < len(programs[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] == len(programs[r]):
                continue
            t = programs[r][pos[r]]
            v = t.chunk * pp + r
            need = [(False, t.microbatch, v - 1)] if not t.backward and v > 0 else []
            if t.backward:
                need = [(False, t.microbatch, v)] + (
                    [(True, t.microbatch, v + 1)] if v < last else []
                )
            if all(n in done for n in need):
                done.add((t.backward, t.microbatch, v))
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock: pp={pp} vpp={vpp} m={micro} at {pos}"


@pytest.mark.parametrize(
    "pp, vpp, micro, group",
    [
        (2, 1, 4, None),
        (4, 1, 8, None),
        (4, 1, 2, None),
        (2, 2, 4, None),
        (4, 2, 8, None),
        (4, 2, 4, None),
        (2, 3, 6, None),
        (4, 2, 8, 8),
        (3, 2, 6, 3),
    ],
)
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_program_is_complete_and_deadlock_free(pp, vpp, micro, group, depth):
    if depth > 1 and vpp > 1:
        with pytest.raises(ValueError, match="plain 1F1B only"):
            pipeline_steps(pp, 0, vpp, micro, group, warmup_depth=depth)
        return
    _simulate(pp, vpp, micro, group, depth)


# --- numerics on real worlds ----------------------------------------------------------------------
def _config(
    moe: bool, precision: str, layers: int, overrides: list[str], **layout
) -> ConfigContainer:
    return tiny_config(moe, precision, layers, overrides, STEPS, **layout)


def _train(
    moe: bool, precision: str, layers: int, overrides: list[str], layout: dict
) -> list[float]:
    cfg = _config(moe, precision, layers, overrides, **layout)
    res = cfg.finalize(dist.get_world_size())
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


@functools.cache
def _reference(moe: bool, precision: str, layers: int) -> tuple[float, ...]:
    """The single-process losses, computed once per model for all the layouts compared with it."""
    return tuple(run_world(1, _train, moe, precision, layers, [], {})[0])


# the distributed optimizer with both DP overlaps, small buckets (several per stage)
DP_OVERLAPS = [
    "ddp.use_distributed_optimizer=true",
    "optimizer.use_distributed_optimizer=true",
    "ddp.overlap_grad_reduce=true",
    "ddp.overlap_param_gather=true",
    "ddp.bucket_size=20000",
]
OVERLAPPED_P2P = ["comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"]

PP_CASES = [
    # (id, world, layers, layout, overrides)
    ("pp2", 2, 4, dict(pipeline_model_parallel_size=2), []),
    ("pp4", 4, 4, dict(pipeline_model_parallel_size=4), []),
    (
        "pp2_vpp2",
        2,
        4,
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        [],
    ),
    (
        "pp4_vpp2",
        4,
        8,
        dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
        [],
    ),
    (
        "tp2_pp2_sp",
        4,
        4,
        dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
        [],
    ),
    (
        "dp2_pp2_distopt_overlaps",
        4,
        4,
        dict(pipeline_model_parallel_size=2),
        DP_OVERLAPS,
    ),
    (
        # overlapped p2p: weight gradients delivered after the gradient's send (the first stage:
        # after its next task), each with its backward's last-micro-batch flag for the DP buckets
        "dp2_pp2_distopt_overlaps_overlapped_p2p",
        4,
        4,
        dict(pipeline_model_parallel_size=2),
        DP_OVERLAPS + OVERLAPPED_P2P,
    ),
    (
        # the same with the deeper warm-up: more forwards before the first backward, the buckets
        # still reduced once their last micro-batch's gradients are all in
        "dp2_pp2_distopt_overlaps_overlapped_p2p_deep",
        4,
        4,
        dict(pipeline_model_parallel_size=2),
        DP_OVERLAPS + OVERLAPPED_P2P + ["comm_overlap.p2p_warmup_depth=2"],
    ),
    (
        "pp3_uneven",
        3,
        4,
        dict(pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2),
        [],
    ),
]


@pytest.mark.parametrize("case", PP_CASES, ids=[c[0] for c in PP_CASES])
def test_pp_layout_matches_single_process_fp32(case):
    _id, world, layers, layout, overrides = case
    ref = _reference(False, "fp32", layers)
    got = run_world(world, _train, False, "fp32", layers, overrides, layout)
    for rank_losses in got:  # every rank reports the same losses, rank 0 (first stage) included
        assert rank_losses == pytest.approx(list(ref), rel=1e-5)


def test_the_guides_shape_at_8_ranks_matches_single_process():
    """TP2 x PP2 x VPP2 x DP2 with sequence parallel, the distributed optimizer and both DP
    overlaps."""
    layout = dict(
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    overrides = [
        "ddp.use_distributed_optimizer=true",
        "optimizer.use_distributed_optimizer=true",
        "ddp.overlap_grad_reduce=true",
        "ddp.overlap_param_gather=true",
        "ddp.bucket_size=20000",
    ]
    ref = _reference(False, "fp32", 4)
    got = run_world(8, _train, False, "fp32", 4, overrides, layout)
    for rank_losses in got:
        assert rank_losses == pytest.approx(list(ref), rel=1e-5)


def test_ep2_pp2_moe_matches_single_process_bf16():
    ref = _reference(True, "bf16_mixed", 4)
    got = run_world(
        4,
        _train,
        True,
        "bf16_mixed",
        4,
        [],
        dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
    )
    for rank_losses in got:
        assert rank_losses == pytest.approx(list(ref), rel=2e-2)


@pytest.mark.parametrize(
    "layout, depth",
    [
        (dict(pipeline_model_parallel_size=2), 1),
        (dict(pipeline_model_parallel_size=4), 1),
        (dict(pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2), 1),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 1),
        (dict(pipeline_model_parallel_size=2), 2),
        (dict(pipeline_model_parallel_size=4), 2),
        (dict(pipeline_model_parallel_size=3, num_layers_in_first_pipeline_stage=2), 3),
    ],
    ids=[
        "1f1b",
        "1f1b_pp4",
        "1f1b_pp3_uneven",
        "interleaved",
        "1f1b_deep",
        "1f1b_pp4_deep",
        "1f1b_pp3_uneven_depth3",
    ],
)
def test_batched_and_overlapped_p2p_are_bit_identical(layout, depth):
    """Overlapped p2p runs each backward's weight-gradient GEMMs after its gradient's send, or the
    first stage's after its next task (the executor's notes), and with a deeper warm-up
    (comm_overlap.p2p_warmup_depth) runs more forwards before the first backward: the same GEMMs on
    the same tensors, each parameter's gradient accumulated in the same micro-batch order, so the
    same bits."""
    world = layout["pipeline_model_parallel_size"]
    batched = run_world(
        world,
        _train,
        False,
        "fp32",
        4,
        ["comm_overlap.batch_p2p_comm=true", "comm_overlap.overlap_p2p_comm=false"],
        layout,
    )
    overlapped = run_world(
        world,
        _train,
        False,
        "fp32",
        4,
        [
            "comm_overlap.batch_p2p_comm=false",
            "comm_overlap.overlap_p2p_comm=true",
            f"comm_overlap.p2p_warmup_depth={depth}",
        ],
        layout,
    )
    assert batched == overlapped


def _recv_in_flight(overlap: bool) -> tuple[int, int]:
    """(receives completed while this rank computed, receives in all) on the last stage of PP2 x
    VPP1."""
    from overlap.parallel.trace import recorder

    cfg = _config(
        False,
        "fp32",
        4,
        [
            f"comm_overlap.overlap_p2p_comm={str(overlap).lower()}",
            f"comm_overlap.batch_p2p_comm={str(not overlap).lower()}",
        ],
        pipeline_model_parallel_size=2,
    )
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    trainer.train_step(0)
    recorder().drain()
    trainer.train_step(1)
    events, spans = recorder().drain()
    recvs = [e for e in events if e.kind.startswith("pp_recv")]
    forwards = [s for s in spans if s.name in ("forward", "backward")]
    # A receive overlapped compute if some forward/backward span ran between its launch and its
    # wait.
    covered = sum(
        any(e.t_launch <= s.t_start and s.t_end <= e.t_wait_start for s in forwards) for e in recvs
    )
    return covered, len(recvs)


def _split_backwards() -> list[tuple[str, float]]:
    """A PP2 stage over one overlapped step: its forward, backward and weight-gradient spans and
    its gradient sends (the last stage's), in time order."""
    from overlap.parallel.trace import recorder

    cfg = _config(
        False,
        "fp32",
        4,
        ["comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"],
        pipeline_model_parallel_size=2,
    )
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    trainer.train_step(0)
    recorder().drain()
    trainer.train_step(1)
    events, spans = recorder().drain()
    marks = [(s.name, s.t_start) for s in spans if s.name in ("forward", "backward")]
    # one weight-gradient mark per backward: the first of its GEMMs
    wgrads = [s for s in spans if s.name == "bwd.delayed_wgrad"]
    marks += [
        ("wgrad", s.t_start)
        for i, s in enumerate(wgrads)
        if i == 0 or any(wgrads[i - 1].t_end < t < s.t_start for _n, t in marks)
    ]
    marks += [("send", e.t_launch) for e in events if e.kind == "pp_send_bwd"]
    return [name for name, _t in sorted(marks, key=lambda m: m[1])]


def test_overlapped_p2p_sends_the_input_gradient_before_the_weight_gradients():
    """Overlapped 1F1B at PP 2: the last stage posts each backward's gradient send, then runs that
    backward's weight-gradient GEMMs, then the next forward; the first stage (no gradient to send)
    runs them after its next forward, the last two at the step's end. Each cycle between the stages
    then holds two weight-gradient times of slack (the executor's notes)."""
    first, last = run_world(2, _split_backwards)
    micro = last.count("backward")
    assert micro >= 3 and last.count("send") == micro and last.count("wgrad") == micro
    assert last == ["forward", "backward", "send", "wgrad"] * micro
    assert "send" not in first
    assert first == ["forward", "forward", "backward"] + ["forward", "wgrad", "backward"] * (
        micro - 2
    ) + ["backward", "wgrad"]


def test_overlapped_p2p_keeps_the_next_receive_in_flight_while_computing():
    covered, total = run_world(2, _recv_in_flight, True)[1]
    assert total > 0 and covered >= total // 2
    covered_batched, _ = run_world(2, _recv_in_flight, False)[1]
    assert covered_batched == 0  # batched: each receive is posted and waited at once


@pytest.mark.parametrize(
    "layout",
    [
        dict(pipeline_model_parallel_size=2),
        dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ],
    ids=["Schedule1F1B", "ScheduleInterleaved1F1B"],
)
def test_the_torch_pipelining_peer_trains_the_same_split_to_the_same_losses(layout):
    """model.pipeline_impl=torch_pipelining: PyTorch's schedule on the same chunks, buffers and
    optimizer (fp32, rel 1e-5: the same operations per micro-batch)."""
    ours = run_world(2, _train, False, "fp32", 4, [], layout)[0]
    peer = run_world(2, _train, False, "fp32", 4, ["model.pipeline_impl=torch_pipelining"], layout)[
        0
    ]
    assert peer == pytest.approx(ours, rel=1e-5)


def _gathers_at_step(align: bool) -> tuple[list[float], int]:
    """Losses of 3 steps, and how many parameter gathers the last optimizer step launched (inside
    its span)."""
    from overlap.parallel.trace import recorder

    cfg = _config(
        False,
        "fp32",
        4,
        [
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
            "ddp.overlap_grad_reduce=true",
            "ddp.overlap_param_gather=true",
            "ddp.bucket_size=20000",
            f"ddp.align_param_gather={str(align).lower()}",
        ],
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    losses = [trainer.train_step(it)[0] for it in range(STEPS)]
    events, spans = recorder().drain()
    opt = [s for s in spans if s.name == "optimizer"][-1]
    launched = sum(
        1 for e in events if e.kind == "dp_ag" and opt.t_start <= e.t_launch <= opt.t_end
    )
    trainer.finish_param_sync()
    return losses, launched


def test_align_param_gather_launches_every_chunks_first_gather_at_the_step_and_keeps_the_math():
    """DP2 x PP2 x VPP2 with the distributed optimizer: with align_param_gather the first bucket of
    both model chunks is gathered from the optimizer step (2 launches there), without it only chunk
    0's (1); losses identical."""
    off = run_world(4, _gathers_at_step, False)
    on = run_world(4, _gathers_at_step, True)
    assert [n for _, n in off] == [1] * 4 and [n for _, n in on] == [2] * 4
    assert [loss for loss, _ in on] == [loss for loss, _ in off]
