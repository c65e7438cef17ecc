"""The runtime under NCCL's rules, on CPU: every layout we support trains like one rank, and the
ranks' recorded programs replay under NCCL's streams without a mismatch or a deadlock
(`overlap.parallel.program`).

gloo forgives what NCCL does not: it returns one work per op of a batch, its futures complete when
the data is there, it matches point-to-point messages by tag, and its sends do not wait for their
receives. `tests.world .run_world_nccl_rules` runs a job with comm under NCCL's rules
(`comm.CommSession(nccl_rules=True)`: one work per batch, futures complete at posting, tags dropped
on the wire) and replays every rank's program with rendezvous sends and one stream per communicator,
in issue order. Tolerances: as the layout tests they mirror (fp32 rel 1e-5, bf16 MoE rel 2e-2): the
rules change no arithmetic, only when the host learns what.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch.distributed as dist

from overlap.parallel.program import check, early_send_waits, queue_stalls
from tests.configs import tiny_config
from tests.world import (
    _under_nccl_rules,
    close_world,
    run_world,
    run_world_in,
    run_world_nccl_rules,
)

STEPS = 3
DISTOPT = [
    "ddp.use_distributed_optimizer=true",
    "optimizer.use_distributed_optimizer=true",
    "ddp.overlap_grad_reduce=true",
    "ddp.overlap_param_gather=true",
    "ddp.bucket_size=20000",
]
EP_OVERLAP = [
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=true",
]
OVERLAPPED_P2P = ["comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=false"]
BATCHED_P2P = ["comm_overlap.overlap_p2p_comm=false", "comm_overlap.batch_p2p_comm=true"]


def _train(moe: bool, precision: str, layers: int, overrides: list[str]) -> list[float]:
    from overlap.parallel.state import ParallelState
    from overlap.training.runtime_refusals import check_runtime_support
    from overlap.training.trainer import Trainer

    cfg = tiny_config(moe, precision, layers, overrides, STEPS)
    res = cfg.finalize(dist.get_world_size())
    check_runtime_support(cfg)
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


def _one_queue_by_launch_rule(
    world: int, moe: bool, precision: str, layers: int, overrides: list[str]
) -> bool:
    """Whether the launch rules give this layout one hardware queue on an H100
    (CUDA_DEVICE_MAX_CONNECTIONS=1: TP > 1 without EP overlap, `overlap.launch.env`)."""
    from overlap.harness import launch_env_inputs
    from overlap.launch.env import CUDA_DEVICE_MAX_CONNECTIONS, compute_launch_env

    cfg = tiny_config(moe, precision, layers, overrides, STEPS)
    res = cfg.finalize(world)
    settings = compute_launch_env(launch_env_inputs(res, "h100"), cfg.env_vars, {})
    return {s.name: s.value for s in settings}[CUDA_DEVICE_MAX_CONNECTIONS] == "1"


def _train_as_launched(
    moe: bool, precision: str, layers: int, overrides: list[str]
) -> tuple[list[float], bool]:
    """`_train` under NCCL's rules with the tracer's timing waits placed as the launch rules'
    connection count makes a GPU run place them; (losses, one hardware queue)."""
    from overlap.parallel import comm

    one_queue = _one_queue_by_launch_rule(dist.get_world_size(), moe, precision, layers, overrides)
    # the job's session (`_under_nccl_rules`) with the timing waits placed for the launch's queues,
    # recording into the same program
    with comm.using(dataclasses.replace(comm.session(), one_queue=one_queue)):
        return _train(moe, precision, layers, overrides), one_queue


@functools.cache
def _reference(moe: bool, precision: str, layers: int, shape: tuple[str, ...]) -> tuple[float, ...]:
    return tuple(run_world(1, _train, moe, precision, layers, list(shape))[0])


PP2, VPP2 = (
    ["model.pipeline_model_parallel_size=2"],
    ["model.virtual_pipeline_model_parallel_size=2"],
)
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]
# TP overlap's slots need ring chunks of 32 sequence rows or more (its size rule): 256 tokens, 4
# query groups for TP4
TP_SHAPE = ["model.seq_length=256", "model.num_query_groups=4"]
TIED = ["model.share_embeddings_and_output_weights=true"]
CP2 = ["model.context_parallel_size=2"]
SHAPES = (TP_SHAPE, TIED)  # the overrides the single-rank reference shares with a layout
LAYOUTS = [
    # (id, world, moe, layers, overrides)
    ("tp2_sp_tp_overlap", 2, False, 2, TP_SHAPE + TP2 + ["comm_overlap.tp_comm_overlap=true"]),
    (
        "tp4_sp_tp_overlap_aggregate",
        4,
        False,
        2,
        TP_SHAPE
        + [
            "model.tensor_model_parallel_size=4",
            "model.sequence_parallel=true",
            "comm_overlap.tp_comm_overlap=true",
            "comm_overlap.tp_comm_overlap_cfg=userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora",
        ],
    ),
    ("pp2_overlapped", 2, False, 4, PP2 + OVERLAPPED_P2P),
    # overlapped 1F1B (its weight-gradient split; with comm_overlap.p2p_warmup_depth=2 its deeper
    # warm-up, up to two sends a direction in flight) on a chain of 4 and 8 stages and uneven ones
    ("pp4_overlapped", 4, False, 4, ["model.pipeline_model_parallel_size=4"] + OVERLAPPED_P2P),
    ("pp8_overlapped", 8, False, 8, ["model.pipeline_model_parallel_size=8"] + OVERLAPPED_P2P),
    (
        "pp4_overlapped_deep",
        4,
        False,
        4,
        ["model.pipeline_model_parallel_size=4", "comm_overlap.p2p_warmup_depth=2"]
        + OVERLAPPED_P2P,
    ),
    (
        "pp8_overlapped_deep",
        8,
        False,
        8,
        ["model.pipeline_model_parallel_size=8", "comm_overlap.p2p_warmup_depth=2"]
        + OVERLAPPED_P2P,
    ),
    (
        "pp3_uneven_overlapped_deep",
        3,
        False,
        4,
        [
            "model.pipeline_model_parallel_size=3",
            "model.num_layers_in_first_pipeline_stage=2",
            "comm_overlap.p2p_warmup_depth=2",
        ]
        + OVERLAPPED_P2P,
    ),
    (
        "pp3_uneven_overlapped",
        3,
        False,
        4,
        [
            "model.pipeline_model_parallel_size=3",
            "model.num_layers_in_first_pipeline_stage=2",
        ]
        + OVERLAPPED_P2P,
    ),
    ("pp2_vpp2_overlapped", 2, False, 4, PP2 + VPP2 + OVERLAPPED_P2P),
    ("pp2_vpp2_batched", 2, False, 4, PP2 + VPP2 + BATCHED_P2P),
    (
        "pp4_vpp2_overlapped",
        4,
        False,
        8,
        ["model.pipeline_model_parallel_size=4"] + VPP2 + OVERLAPPED_P2P,
    ),
    ("pp2_deallocate", 2, False, 4, PP2 + ["model.deallocate_pipeline_outputs=true"]),
    ("pp2_vpp2_deallocate", 2, False, 4, PP2 + VPP2 + ["model.deallocate_pipeline_outputs=true"]),
    (
        "pp2_vpp2_deferred_output_wgrad",
        2,
        False,
        4,
        PP2
        + VPP2
        + [
            "comm_overlap.defer_embedding_wgrad_compute=true",
            "comm_overlap.wgrad_deferral_limit=2",
        ],
    ),
    ("dp2_distopt_overlaps", 2, False, 2, DISTOPT),
    ("dp2_pp2_overlapped_distopt", 4, False, 4, PP2 + OVERLAPPED_P2P + DISTOPT),
    ("ep2_overlap_delay_wgrad", 2, True, 2, ["model.expert_model_parallel_size=2"] + EP_OVERLAP),
    (
        "ep2_pp2_vpp2_overlap_delay_wgrad",
        4,
        True,
        4,
        ["model.expert_model_parallel_size=2"] + PP2 + VPP2 + EP_OVERLAP + OVERLAPPED_P2P,
    ),
    ("tied_pp2_dp2_distopt", 4, False, 2, TIED + PP2 + DISTOPT),
    ("guide_tp2_pp2_vpp2_dp2", 8, False, 4, TP2 + PP2 + VPP2 + DISTOPT),
    # context parallelism: the KV ring (its dKV back in backward) on the CP group, the others'
    # collectives, and CP under TP-SP, PP-VPP with the distributed optimizer, and EP with EP overlap
    ("cp2_ring", 2, False, 2, CP2),
    ("cp4_ring", 4, False, 2, ["model.context_parallel_size=4"]),
    ("cp2_all_gather", 2, False, 2, CP2 + ["model.cp_comm_type=all_gather"]),
    ("cp2_a2a", 2, False, 2, CP2 + ["model.cp_comm_type=a2a"]),
    (
        "cp4_a2a_p2p",
        4,
        False,
        2,
        [
            "model.context_parallel_size=4",
            "model.cp_comm_type=a2a+p2p",
            "model.hierarchical_context_parallel_sizes=[2,2]",
        ],
    ),
    ("cp2_tp2_sp", 4, False, 2, CP2 + TP2),
    ("cp2_pp2_vpp2_distopt", 8, False, 4, CP2 + PP2 + VPP2 + OVERLAPPED_P2P + DISTOPT),
    ("cp2_ep2_ep_overlap", 2, True, 2, CP2 + ["model.expert_model_parallel_size=2"] + EP_OVERLAP),
    # the TP/DP/PP guide's shape (TP4 PP4 VPP2, EP8 carved from it) cut to 4 ranks: MoE under TP x
    # PP x VPP without EP overlap, one hardware queue by the launch rule
    (
        "guide_tp2_pp2_vpp2_ep2_moe",
        4,
        True,
        4,
        TP2 + PP2 + VPP2 + OVERLAPPED_P2P + ["model.expert_model_parallel_size=2"],
    ),
]


@pytest.mark.parametrize("case", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_every_layout_trains_like_one_rank_under_nccl_rules(case):
    _id, world, moe, layers, overrides = case
    precision = "bf16_mixed" if moe else "fp32"
    shape = tuple(o for group in SHAPES for o in group if o in overrides)
    ref = _reference(moe, precision, layers, shape)
    out = run_world_in(
        {}, world, _under_nccl_rules, _train_as_launched, (moe, precision, layers, overrides), {}
    )
    programs = {rank: entries for rank, (_result, entries) in enumerate(out)}
    ((_losses, one_queue), _entries) = out[0]
    check(programs)
    assert early_send_waits(programs) == []
    if one_queue:
        # CUDA_DEVICE_MAX_CONNECTIONS=1: every stream of a rank is one hardware queue; no wait of
        # the timing or side streams holds a post, and nothing deadlocks (issue 47 item 6)
        check(programs, one_queue=True)
        assert queue_stalls(programs) == []
    for (losses, _one), _entries in out:
        assert losses == pytest.approx(list(ref), rel=2e-2 if moe else 1e-5)


def test_the_guide_layouts_get_one_hardware_queue_by_the_launch_rule():
    """The replay above models one queue where a GPU run has one: the TP layouts without EP
    overlap."""
    one = {case[0] for case in LAYOUTS if _one_queue_by_launch_rule(case[1], *_shape_args(case))}
    assert {"tp2_sp_tp_overlap", "guide_tp2_pp2_vpp2_dp2", "guide_tp2_pp2_vpp2_ep2_moe"} <= one
    assert not one & {"ep2_overlap_delay_wgrad", "pp2_overlapped", "dp2_distopt_overlaps"}


def _shape_args(case: tuple) -> tuple:
    _id, _world, moe, layers, overrides = case
    return moe, "bf16_mixed" if moe else "fp32", layers, overrides


# --- the defects NCCL's rules expose (each failed on the runtime before they were mended) ---------
def _programs(
    world: int, moe: bool, precision: str, layers: int, overrides: list[str]
) -> dict[int, list]:
    out = run_world_in(
        {}, world, _under_nccl_rules, _train, (moe, precision, layers, overrides), {}
    )
    return {rank: entries for rank, (_losses, entries) in enumerate(out)}


@pytest.mark.parametrize(
    "layout",
    [
        PP2,
        PP2 + OVERLAPPED_P2P,
        ["model.pipeline_model_parallel_size=4"] + OVERLAPPED_P2P,
        ["model.pipeline_model_parallel_size=4", "comm_overlap.p2p_warmup_depth=2"]
        + OVERLAPPED_P2P,
        PP2 + VPP2,
        ["model.pipeline_model_parallel_size=4"] + VPP2,
    ],
    ids=["pp2", "pp2_overlapped", "pp4_overlapped", "pp4_overlapped_deep", "pp2_vpp2", "pp4_vpp2"],
)
def test_released_outputs_never_put_their_send_on_the_critical_path(layout):
    """deallocate_pipeline_outputs under NCCL's rules: outputs are released right after their send
    is posted, and no send is waited before the step's last receive unless it is known to have
    arrived (the reference frees right after the launch; a wait on the send would stall the compute
    stream until the peer received it)."""
    world = 4 if "model.pipeline_model_parallel_size=4" in layout else 2
    programs = _programs(
        world,
        False,
        "fp32",
        8 if world == 4 else 4,
        layout + ["model.deallocate_pipeline_outputs=true"],
    )
    check(programs)
    assert early_send_waits(programs) == []


def _late_peer() -> tuple[float, float]:
    """Rank 1 posts an all-reduce 0.3 s after rank 0, which waits for it at once: (exposed, total)
    ms on rank 0."""
    import time

    import torch

    from overlap.parallel import comm
    from overlap.parallel.trace import recorder
    from overlap.profiling.exposed import exposure

    recorder().drain()
    if dist.get_rank() == 1:
        time.sleep(0.3)
    with recorder().span("compute"):
        handle = comm.all_reduce(torch.ones(1024), dist.group.WORLD, "dp_ar")
    handle.wait()
    row = exposure(*recorder().drain())["dp_ar"]
    return row.exposed_ms, row.total_ms


def test_a_wait_for_a_late_peer_is_exposed_under_nccl_rules():
    """The tracer must not take completion from a future that completes at posting (NCCL's do): the
    0.3 s rank 0 waits for its late peer is exposed communication, not "100% hidden"."""
    exposed, total = run_world_nccl_rules(2, _late_peer)[0]
    assert 250 <= exposed <= total + 1e-6, (exposed, total)


def _delayed_wgrad_in_waits() -> tuple[int, int]:
    """EP2 overlap with delay_wgrad: (delayed weight-gradient GEMMs issued between a collective's
    launch and the wait for it, all delayed weight-gradient GEMMs)."""
    from tests.ep_overlap_runs import run_ep_step

    _losses, _grads, events, spans = run_ep_step(True, True, {"ep": 2}, {}, n_mb=4)
    wgrad = [s for s in spans if s.name == "bwd.delayed_wgrad"]
    ops = [e for e in events if e.t_wait_start is not None]
    filled = [
        s for s in wgrad if any(e.t_launch <= s.t_start and s.t_end <= e.t_wait_start for e in ops)
    ]
    return len(filled), len(wgrad)


def test_delay_wgrad_fills_the_waits_under_nccl_rules():
    """On NCCL the host never sees a collective complete: delayed weight GEMMs are issued before the
    waits (the GPU runs them beside the collective), not skipped because completion 'arrived' at
    posting."""
    for filled, total in run_world_nccl_rules(2, _delayed_wgrad_in_waits):
        assert total > 0 and filled >= total // 2, (filled, total)


# --- torch's own consistency check ----------------------------------------------------------------
def _debug_level() -> str:
    return dist.get_debug_level().name


DETAIL_LAYOUTS = [
    ("tp2_sp_tp_overlap_dp2", False, 2, TP_SHAPE + TP2 + ["comm_overlap.tp_comm_overlap=true"]),
    (
        "ep2_pp2_vpp2_overlap",
        True,
        4,
        ["model.expert_model_parallel_size=2"] + PP2 + VPP2 + EP_OVERLAP + OVERLAPPED_P2P,
    ),
    ("tied_pp2_dp2_distopt", False, 2, TIED + PP2 + DISTOPT),
]


DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


@pytest.fixture(scope="module")
def detail_world():
    """The DETAIL world wraps every group in a checker with a group of its own: twice the idle
    threads, ended with the module."""
    yield DETAIL
    close_world(4, DETAIL)


@pytest.mark.parametrize("case", DETAIL_LAYOUTS, ids=[c[0] for c in DETAIL_LAYOUTS])
def test_every_layout_passes_torch_distributed_debug_detail(case, detail_world):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every group in torch's checker, which compares each
    collective's operation and tensor shapes across the group's ranks before running it: a mismatch
    raises at once. Four ranks: TP x SP with TP overlap x DP, EP overlap with delay_wgrad under PP x
    VPP, tied embeddings under PP x DP with the distributed optimizer and both DP overlaps; the same
    losses as one rank."""
    _id, moe, layers, overrides = case
    precision = "bf16_mixed" if moe else "fp32"
    shape = tuple(o for group in SHAPES for o in group if o in overrides)
    ref = _reference(moe, precision, layers, shape)
    assert run_world_in(detail_world, 4, _debug_level) == ["DETAIL"] * 4
    for losses in run_world_in(detail_world, 4, _train, moe, precision, layers, overrides):
        assert losses == pytest.approx(list(ref), rel=2e-2 if moe else 1e-5)
