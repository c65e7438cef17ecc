"""Sync-free dropless dispatch (`model.moe_expert_rank_capacity_factor`,
`overlap.layers.moe.rank_capacity`).

What is checked:
- the MoE layer in fixed blocks equals the DROPLESS single-process layer (outputs, input and
  parameter gradients) at EP 2 and 4, under TP 2 x EP 2 sequence parallel and with a shared expert,
  when no block overflows; its overflow counter stays 0 then, and counts the blocks when the factor
  is too small (the rows past a block are not sent: that output is not the dropless one, which is
  why the trainer re-runs such a step);
- training steps (the trainer's re-run included) equal the dropless all-to-all run's losses, grad
  norms, loss scales and weights at EP 2 and 4, with EP overlap + delay_wgrad, at PP 2 x VPP 2;
  with an overflow forced on one rank at a chosen step (EP overlap, TP 2 x EP 2, the MoE layer
  recomputed, fp16 loss scaling), that step (only) re-runs and the run stays the dropless one; with
  a factor small enough that blocks really overflow, every step re-runs and the run is still the
  dropless one; a resume across a re-run step too; all of it again under NCCL's rules (program
  replay) for EP overlap and PP 2 x VPP 2;
- the host reads: none per layer in a step without overflow, and what a re-run step adds;
- `overlap run` logs the re-runs, `metrics.jsonl` marks them, FILE.summary.json lists them with the
  factor the fullest block needed; `overlap bench` counts them in its window; the planner prices the
  full blocks;
- the configuration errors name the field; the flex dispatcher, and GPUs (or rows) whose experts
  would take the per-expert loop, are refused, never run another way.

Tolerance: fp32, atol = rtol = 1e-5 (test_moe.py's: rounding-level differences, the last expert's
grouped-GEMM group holds the padding rows so BLAS may block it otherwise; a wrong row or weight is
O(1)).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from overlap.config.model import expert_rank_capacity
from overlap.errors import ConfigError, NotBuiltError
from overlap.kernels.device import TARGET_DEVICES
from overlap.layers.init import init_model_params
from overlap.layers.moe.rank_capacity import RankCapacityDispatcher
from overlap.layout import ParallelLayout
from overlap.parallel.state import ParallelState
from overlap.perf import bench
from overlap.perf.host_syncs import HOST_TENSOR, INTENDED_READS, SPLIT_SIZES, HostSyncRecorder
from overlap.perf.memory_model import gib
from overlap.training.trainer import Trainer
from tests.configs import container, moe_layer_model, moe_model, tiny_config
from tests.moe_layer_runs import bare_moe_layer, check_against_reference, none_mode_step
from tests.world import run_world, run_world_nccl_rules

TOL = dict(atol=1e-5, rtol=1e-5)
# a block for every pair a rank routes whatever the layout (factor >= EP): never overflows
ROOMY = 4.0


# --------------------------------------------------------------------------------------------------
# The layer
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "world, tp, ep, extra",
    [
        (2, 1, 2, {}),
        (4, 1, 4, {}),
        (4, 2, 2, {}),
        (2, 1, 2, {"moe_shared_expert_intermediate_size": 48}),
    ],
    ids=["ep2", "ep4", "tp2-ep2-sp", "ep2-shared-expert"],
)
def test_layer_equals_the_dropless_reference(world, tp, ep, extra):
    dropless = dict(num_experts=8, moe_permute_fusion=True, **extra)
    check_against_reference(
        world,
        tp=tp,
        ep=ep,
        cfg_overrides=dict(moe_expert_rank_capacity_factor=ROOMY, **dropless),
        reference_overrides=dropless,
    )


def _overflow_count(factor: float) -> tuple[int, int, int]:
    """EP 2, one forward + backward: (blocks over capacity, block rows, rows this rank routed to the
    busiest peer)."""
    ps = ParallelState(ParallelLayout(world_size=2, ep=2))
    cfg = moe_layer_model(
        expert_model_parallel_size=2,
        moe_expert_rank_capacity_factor=factor,
        moe_permute_fusion=True,
    )
    layer = bare_moe_layer(cfg, ps)
    init_model_params(layer, seed=1234, std=0.2)
    assert isinstance(layer.dispatcher, RankCapacityDispatcher)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    x = torch.randn(8, 2, 32, generator=g).requires_grad_()
    y, aux = layer(x)
    (y.sum() + aux).backward()
    topk_idx, _, _ = layer.router(x)
    per_peer = torch.stack([(topk_idx // 4 == r).sum() for r in range(2)])
    return int(layer.dispatcher.overflow), layer.dispatcher.block_rows(16), int(per_peer.max())


def test_no_communication_mode_keeps_shapes():
    """The bench's floors run without communication (`--comm-mode none`): the received counts are
    then no routing's, and the blocks still give the layer's shapes."""
    shapes = run_world(2, none_mode_step, moe_expert_rank_capacity_factor=1.5)
    assert shapes == [(8, 2, 32)] * 2


def test_the_overflow_counter_counts_the_blocks_without_room():
    for blocks, rows, _busiest in run_world(2, _overflow_count, ROOMY):
        assert blocks == 0 and rows == expert_rank_capacity(16, 2, 2, ROOMY) == 64
    # factor 0.25: 4 rows a block for 16 pairs over 2 peers: some block overflows on every rank
    for blocks, rows, busiest in run_world(2, _overflow_count, 0.25):
        assert rows == 4 and busiest > rows and blocks >= 1


def test_the_configuration_errors_name_the_field():
    with pytest.raises(ConfigError, match="moe_expert_rank_capacity_factor"):
        moe_model(moe_expert_rank_capacity_factor=0.0).validate()
    with pytest.raises(ConfigError, match="moe_expert_rank_capacity_factor.*finite"):
        moe_model(moe_expert_rank_capacity_factor=float("inf")).validate()
    with pytest.raises(ConfigError, match="exclude each other"):
        moe_model(moe_expert_rank_capacity_factor=1.5, moe_expert_capacity_factor=1.0).validate()
    with pytest.raises(ConfigError, match="model.moe_paged_stash.*moe_expert_rank_capacity_factor"):
        moe_model(moe_paged_stash=True).validate()
    for pool in (1.2, 0.0, float("nan")):  # a pool without the stash; a pool of nothing; NaN
        with pytest.raises(ConfigError, match="moe_paged_stash_buffer_size_factor_cuda"):
            moe_model(
                moe_expert_rank_capacity_factor=1.5,
                moe_paged_stash=pool != 1.2,
                moe_paged_stash_buffer_size_factor_cuda=pool,
            ).validate()


def test_the_decision_table_row_states_the_contract():
    res = container(moe_model(moe_expert_rank_capacity_factor=1.5)).finalize(2, on_cuda=False)
    row = res.decisions.get("model.moe_expert_rank_capacity_factor")
    assert row.effective == 1.5
    for said in ("no host read of split sizes", "re-run dropless before the optimizer", "Memory"):
        assert said in row.reason, said


@pytest.mark.parametrize(
    "gpu, precision, refused",
    [("h100", "bfloat16", False), ("b200", "bfloat16", True), ("h100", "float32", True)],
)
def test_gpus_whose_experts_take_the_loop_are_refused_by_run_not_by_the_resolution(
    gpu, precision, refused
):
    """The experts' per-expert loop needs host counts: where the grouped-GEMM rule gives the loop
    for the target GPU, `overlap run` refuses the sync-free dispatch before any rank starts, naming
    the field; the resolution (explain, the planner) accepts it, as the reference runs it there
    (Bridge's GB200 / GB300 recipes set it), and `run` also refuses it at the layer's build."""
    from overlap.training.runtime_refusals import runtime_refusals

    model = moe_model(moe_expert_rank_capacity_factor=1.5)
    cfg = container(model, mp="bf16_mixed" if precision == "bfloat16" else "fp32")
    target = TARGET_DEVICES[gpu]
    res = cfg.finalize(2, device=lambda: target, on_cuda=True, require_libraries=False)
    found = [
        e
        for e in runtime_refusals(cfg, gpu=True)
        if e.field == "model.moe_expert_rank_capacity_factor"
    ]
    assert res.kernels.moe_grouped_gemm is not refused
    if not refused:
        assert not found
        return
    (error,) = found
    assert isinstance(error, NotBuiltError) and "per-expert loop" in str(error)


def _flex_refused() -> str:
    flex = moe_layer_model(
        moe_expert_rank_capacity_factor=1.5,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="torch",
    )
    with pytest.raises(NotBuiltError) as info:
        bare_moe_layer(flex, ParallelState(ParallelLayout(world_size=1)))
    return str(info.value)


def _misaligned_rows_refused() -> str:
    """hidden 4 in bf16: 8-byte rows, which the grouped kernel does not take (16-byte rule)."""
    cfg = moe_layer_model(
        hidden_size=4,
        num_attention_heads=1,
        moe_ffn_hidden_size=4,
        params_dtype="bfloat16",
        bf16=True,
        moe_expert_rank_capacity_factor=1.5,
    )
    layer = bare_moe_layer(cfg, ParallelState(ParallelLayout(world_size=1)))
    init_model_params(layer, seed=0, std=0.2)
    with pytest.raises(NotBuiltError) as info:
        layer(torch.randn(4, 1, 4, dtype=torch.bfloat16))
    return str(info.value)


def test_experts_the_grouped_kernel_cannot_run_are_refused_not_looped():
    (message,) = run_world(1, _misaligned_rows_refused)
    assert "model.moe_expert_rank_capacity_factor=1.5" in message
    assert "hidden size 4" in message and "per-expert loop needs the split sizes" in message


def test_flex_dispatch_with_the_factor_is_refused_not_built():
    (message,) = run_world(1, _flex_refused)
    assert "model.moe_expert_rank_capacity_factor" in message and "flex" in message


# --------------------------------------------------------------------------------------------------
# Training: the trainer's fold of the overflow into the step's reductions, and the re-run
# --------------------------------------------------------------------------------------------------

ITERS = 4
OVERLAP = [
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=true",
]


def _train(
    overrides: list[str], fields: dict, force_at: int | None = None, force_rank: int = 1
) -> tuple[list[tuple], dict[str, torch.Tensor]]:
    """ITERS training steps of the tiny MoE (fp32, 2 layers, 4 micro-batches): per step (loss, grad
    norm, re-runs, (loss scale, skipped)), and this rank's parameters after them. `force_at`: at
    that step, rank `force_rank`'s first MoE layer reports an overflow its blocks did not have (the
    re-run must then leave exactly the dropless step)."""
    # EP overlap runs bf16 or fp16 models only: bf16 mixed precision there (fp32 master weights);
    # an override may set another
    precision = "bf16_mixed" if OVERLAP[0] in overrides else None
    cfg = tiny_config(
        True, precision, 2, ["model.moe_permute_fusion=true", *overrides], ITERS, **fields
    )
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    # the static run really dispatches in blocks (and the dropless one does not)
    static = any("moe_expert_rank_capacity_factor" in o for o in overrides)
    assert (trainer.static_dispatch is not None) == static
    steps = []
    for it in range(ITERS):
        forced = it == force_at and dist.get_rank() == force_rank
        if forced:
            dispatcher = trainer.static_dispatch.dispatchers[0]
            dispatcher.route = lambda *args, d=dispatcher: _overflowing(d, args)
        loss, norm = trainer.train_step(it)
        if forced:
            del dispatcher.route
        steps.append((loss, norm, trainer.last_step_reruns, trainer.loss_scaling()))
    params = {
        f"{i}.{n}": p.detach().clone()
        for i, c in enumerate(trainer.chunks)
        for n, p in c.named_parameters()
    }
    return steps, params


def _same_run(static: list, dropless: list) -> list[int]:
    """Assert the runs are the same training (fp32 1e-5); returns the static run's re-run count per
    step (rank 0's; every rank re-runs the same steps)."""
    for (s_steps, s_params), (d_steps, d_params) in zip(static, dropless):
        for (s_loss, s_norm, _, s_scaling), (d_loss, d_norm, d_reruns, d_scaling) in zip(
            s_steps, d_steps
        ):
            assert d_reruns == 0
            assert s_loss == pytest.approx(d_loss, rel=1e-5, abs=1e-5)
            assert s_norm == pytest.approx(d_norm, rel=1e-5, abs=1e-5, nan_ok=True)
            # fp16: the same loss scale after the step, and the same overflow skip
            assert s_scaling == d_scaling
        assert s_params.keys() == d_params.keys()
        for name, p in d_params.items():
            torch.testing.assert_close(s_params[name], p, **TOL, msg=name)
    reruns = [[step[2] for step in steps] for steps, _ in static]
    assert all(r == reruns[0] for r in reruns), reruns
    return reruns[0]


FACTOR = [f"model.moe_expert_rank_capacity_factor={ROOMY}"]


@pytest.mark.parametrize(
    "world, fields, overrides",
    [
        (2, {"expert_model_parallel_size": 2}, []),
        (4, {"expert_model_parallel_size": 4}, []),
        (2, {"expert_model_parallel_size": 2}, OVERLAP),
        (
            4,
            {
                "expert_model_parallel_size": 2,
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": 2,
            },
            [],
        ),
    ],
    ids=["ep2", "ep4", "ep2-overlap-delay_wgrad", "pp2-vpp2-ep2"],
)
def test_training_equals_the_dropless_run(world, fields, overrides):
    layers = 4 if "pipeline_model_parallel_size" in fields else 2
    static = run_world(world, _train_layers, layers, overrides + FACTOR, fields)
    dropless = run_world(world, _train_layers, layers, overrides, fields)
    assert _same_run(static, dropless) == [0] * ITERS


def _train_layers(layers: int, overrides: list[str], fields: dict, force_at: int | None = None):
    """`_train` with `layers` layers (PP 2 x VPP 2 needs 4)."""
    if layers == 2:
        return _train(overrides, fields, force_at)
    return _train([f"model.num_layers={layers}", *overrides], fields, force_at)


# fp16 from a loss scale the first steps overflow at (skipped, the scale backing off): the re-run
# step must leave the scaler as the dropless step does
FP16 = ["mixed_precision=fp16_mixed", "mixed_precision.initial_loss_scale=1e20"]
SHARED_EXPERT = ["model.moe_shared_expert_intermediate_size=32"]
# routing by random logits from the routers' own generators: the re-run must draw what the dropless
# step draws (the generators rewound, `StaticDispatchSteps.rerun`)
FORCED_BALANCE = ["model.moe_router_force_load_balancing=true"]
# the whole MoE layer recomputed in backward: its blocks are laid out (and counted) again there
RECOMPUTE_MOE = ["model.recompute_granularity=selective", "model.recompute_modules=[moe]"]
TP2_EP2 = {
    "expert_model_parallel_size": 2,
    "tensor_model_parallel_size": 2,
    "sequence_parallel": True,
}


@pytest.mark.parametrize(
    "world, fields, overrides",
    [
        (2, {"expert_model_parallel_size": 2}, OVERLAP),
        (4, TP2_EP2, []),
        (2, {"expert_model_parallel_size": 2}, RECOMPUTE_MOE),
        (2, {"expert_model_parallel_size": 2}, FP16),
        (2, {"expert_model_parallel_size": 2}, OVERLAP + SHARED_EXPERT),
        (2, {"expert_model_parallel_size": 2}, FORCED_BALANCE),
    ],
    ids=[
        "ep2-overlap-delay_wgrad",
        "tp2-ep2-sp",
        "ep2-moe-recomputed",
        "ep2-fp16-loss-scaling",
        "ep2-overlap-shared-expert",
        "ep2-random-routing",
    ],
)
def test_an_overflow_forced_on_one_rank_reruns_that_step_as_the_dropless_one(
    world, fields, overrides
):
    """Rank 1 alone overflows at step 2 (under TP 2 it has a TP peer whose blocks had room: the
    count reaches it through the grad norm's TP reduction): every rank re-runs that step only."""
    static = run_world(world, _train_layers, 2, overrides + FACTOR, fields, 2)
    dropless = run_world(world, _train_layers, 2, overrides, fields)
    assert _same_run(static, dropless) == [0, 0, 1, 0]
    if overrides is FP16:  # the scaler really worked: fp16 overflows skipped steps
        assert any(skipped for *_, (_scale, skipped) in static[0][0])


def test_real_overflows_rerun_and_the_run_stays_the_dropless_one():
    # factor 0.3 at EP 2: blocks of 0.15 x a rank's pairs where each peer gets about half of them
    fields = {"expert_model_parallel_size": 2}
    static = run_world(2, _train_layers, 2, ["model.moe_expert_rank_capacity_factor=0.3"], fields)
    dropless = run_world(2, _train_layers, 2, [], fields)
    assert _same_run(static, dropless) == [1] * ITERS


PP2_VPP2_EP2 = {
    "expert_model_parallel_size": 2,
    "pipeline_model_parallel_size": 2,
    "virtual_pipeline_model_parallel_size": 2,
}


@pytest.mark.parametrize(
    "world, layers, fields, overrides",
    [(2, 2, {"expert_model_parallel_size": 2}, OVERLAP), (4, 4, PP2_VPP2_EP2, [])],
    ids=["ep2-overlap-delay_wgrad", "pp2-vpp2-ep2"],
)
def test_under_nccl_rules_the_blocks_and_the_rerun_are_the_dropless_run(
    world, layers, fields, overrides
):
    """Every rank's program (the blocks' all-to-alls, the counts exchange, the folded reductions,
    the re-run's dropless collectives) replayed under NCCL's rules, an overflow forced at step 1."""
    static = run_world_nccl_rules(world, _train_layers, layers, overrides + FACTOR, fields, 1)
    dropless = run_world(world, _train_layers, layers, overrides, fields)
    assert _same_run(static, dropless) == [0, 1, 0, 0]


DISTOPT = [
    "ddp.use_distributed_optimizer=true",
    "ddp.overlap_grad_reduce=true",
    "ddp.overlap_param_gather=true",
]


def _train_loop(items: list[str], force_at: int | None) -> tuple[list, dict[str, torch.Tensor]]:
    """`Trainer.train()` (checkpoints, the log's records) of the tiny MoE at EP 2, the distributed
    optimizer with overlapped grad reduce and param gather: ([(iteration, loss, re-runs)], this
    rank's parameters); `force_at`: rank 1 reports an overflow at that iteration."""
    cfg = tiny_config(
        True,
        None,
        2,
        ["model.moe_permute_fusion=true", "model.expert_model_parallel_size=2", *DISTOPT, *items],
        ITERS,
    )
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    if force_at is not None and dist.get_rank() == 1:
        step = trainer.train_step

        def forced_step(iteration: int) -> tuple[float, float]:
            if iteration != force_at:
                return step(iteration)
            dispatcher = trainer.static_dispatch.dispatchers[-1]
            dispatcher.route = lambda *args: _overflowing(dispatcher, args)
            try:
                return step(iteration)
            finally:
                del dispatcher.route

        trainer.train_step = forced_step
    summary = trainer.train()
    params = {n: p.detach().clone() for n, p in trainer._named_params()}
    return [(r.iteration, r.lm_loss, r.moe_reruns) for r in summary.records], params


def _overflowing(dispatcher: RankCapacityDispatcher, args: tuple):
    """The dispatcher's own route, reporting one overflowing block more than it had."""
    plan = type(dispatcher).route(dispatcher, *args)
    dispatcher.overflow += 1
    return plan


def test_a_resume_across_a_rerun_stays_the_dropless_run(tmp_path):
    """Saved before the re-run step and resumed across it (the distributed optimizer, its grad
    reduce and param gather overlapped): the same losses and weights as the dropless run's."""
    save = [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=2"]
    dropless = run_world(2, _train_loop, [], None)
    static = run_world(2, _train_loop, FACTOR + save, 2)
    resumed = run_world(
        2, _train_loop, FACTOR + [f"checkpoint.load={tmp_path}", "checkpoint.ckpt_step=2"], 2
    )
    for (d_losses, d_params), (s_losses, s_params), (r_losses, r_params) in zip(
        dropless, static, resumed
    ):
        assert [r for _, _, r in s_losses] == [0, 0, 1, 0]
        assert [(i, r) for i, _, r in r_losses] == [(2, 1), (3, 0)]
        for (_, d_loss, _), (_, s_loss, _) in zip(d_losses, s_losses):
            assert s_loss == pytest.approx(d_loss, rel=1e-5, abs=1e-5)
        for (_, d_loss, _), (_, r_loss, _) in zip(d_losses[2:], r_losses):
            assert r_loss == pytest.approx(d_loss, rel=1e-5, abs=1e-5)
        for name, p in d_params.items():
            torch.testing.assert_close(s_params[name], p, **TOL, msg=name)
            torch.testing.assert_close(r_params[name], p, **TOL, msg=name)


def test_the_bench_counts_the_window_steps_that_reran():
    """`overlap bench` reads each run's re-run iterations (FILE.summary.json) and says, per repeat,
    how many steps of the window did two forward-backwards."""
    configs = [bench.BenchConfig("all-to-all", []), bench.BenchConfig("sync-free", FACTOR)]
    doc = bench.summarize(
        configs,
        {
            "all-to-all": [bench.RunResult(100, {}, {}, 1.0, [2, 6], "real")],
            "sync-free": [
                bench.RunResult(90, {}, {}, 1.0, [2, 6], "real", moe_rerun_iterations=[1, 3, 4]),
                bench.RunResult(95, {}, {}, 1.0, [2, 6], "real"),
            ],
        },
        "real",
        "overlap bench ...",
    )
    assert [r["moe_reruns_in_window"] for r in doc["configs"]] == [[0], [2, 0]]
    assert "re-run dropless" in bench.format_markdown(doc) and "`sync-free` 2, 0" in (
        bench.format_markdown(doc)
    )


def test_overlap_run_logs_and_summarises_the_rerun_steps(tmp_path):
    """`overlap run` at EP 2 with blocks too small for the routing (factor 0.3): every step re-runs,
    which the log says per iteration, metrics.jsonl marks and FILE.summary.json lists, with the
    factor the fullest block would have needed (the run's closing line says both)."""
    metrics = tmp_path / "m.jsonl"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlap.cli",
            "run",
            "-m",
            "qwen",
            "-mr",
            "qwen3_moe_tiny",
            "-g",
            "cpu",
            "-ng",
            "2",
            "-ep",
            "2",
            "-ms",
            "3",
            "--metrics",
            str(metrics),
            "model.moe_expert_rank_capacity_factor=0.3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["moe_reruns"] for m in lines] == [1, 1, 1]
    summary = json.loads(metrics.with_name(metrics.name + ".summary.json").read_text())
    assert summary["moe_rerun_iterations"] == [1, 2, 3]
    # every step overflowed its blocks: the fullest needed more than the factor, at most EP
    assert 0.3 < summary["moe_needed_rank_capacity_factor"] <= 2.0
    said = done.stdout + done.stderr
    assert "iteration 2: a sync-free MoE block overflowed" in said
    assert "3 of 3 iterations re-ran dropless" in said


def test_the_planner_prices_the_full_blocks():
    """`overlap plan`'s EP all-to-alls at Qwen3-30B-A3B EP16: the blocks are full whatever the
    routing, factor 1.5 -> 1.5x the dropless bytes (its per-layer host read is not priced)."""
    from overlap.harness import resolve_run
    from overlap.plan.comm_model import comm_plan
    from overlap.plan.hardware import builtin_cluster

    cluster = builtin_cluster("h100", "bf16", 8)
    args = ["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-ep", "16"]
    jobs = (resolve_run(args, []), resolve_run(args, ["model.moe_expert_rank_capacity_factor=1.5"]))
    dropless, blocks = (
        comm_plan(job.cfg, job.resolution.layout, cluster).kinds["ep_dispatch"].bytes_each
        for job in jobs
    )
    assert blocks == pytest.approx(1.5 * dropless, rel=1e-3)


def test_the_planner_keeps_the_paged_stash_pool_and_run_refuses_the_stash():
    """Megatron's paged stash (`model.moe_paged_stash`, the 26.08 GB200 / GB300 recipes'): the
    memory model keeps the experts' activations of a pool of 1.2x the rows routed (the factor) for
    each layer in flight, not the 1.5x padded blocks, which are the working buffers of the layer in
    its backward; the decision table says it, and `overlap run` refuses it (not built)."""
    from overlap.harness import resolve_run
    from overlap.launch.activations import EXPERTS
    from overlap.perf.memory_model import rank_memory
    from overlap.training.runtime_refusals import runtime_refusals

    args = ["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-ep", "16"]
    sync_free = ["model.moe_expert_rank_capacity_factor=1.5"]
    stash = [*sync_free, "model.moe_paged_stash=true"]
    jobs = [resolve_run(args, o) for o in ([], sync_free, stash, [*stash, _POOL])]
    estimates = [rank_memory(job.cfg, job.resolution.layout) for job in jobs]
    experts = [dict((b.name, b.ours) for b in est.blocks)[EXPERTS] for est in estimates]
    dropless, padded, pool_110, pool_120 = experts
    assert padded == pytest.approx(1.5 * dropless, rel=1e-3)
    assert pool_110 == pytest.approx(1.1 * dropless) and pool_120 == pytest.approx(1.2 * dropless)
    # the stash saves the pool's difference per layer in flight, and pays one layer's padded rows
    assert estimates[3].activation_bytes < estimates[1].activation_bytes
    assert estimates[3].transient_bytes > estimates[1].transient_bytes
    row = jobs[3].resolution.decisions.get("model.moe_paged_stash")
    assert row.effective is True and "1.2x the average routed rows" in row.reason
    refused = [e.field for e in runtime_refusals(jobs[3].cfg, gpu=True)]
    assert "model.moe_paged_stash" in refused and "model.moe_paged_stash" not in [
        e.field for e in runtime_refusals(jobs[1].cfg, gpu=True)
    ]
    assert "Paged stashing" in run_world(1, _stash_refused)[0]


def _stash_refused() -> str:
    """A MoE layer built with the paged stash (a bare config: nothing resolved it) is refused."""
    stash = moe_layer_model(moe_expert_rank_capacity_factor=1.5, moe_paged_stash=True)
    with pytest.raises(NotBuiltError) as info:
        bare_moe_layer(stash, ParallelState(ParallelLayout(world_size=1)))
    return str(info.value)


def test_the_memory_advice_drops_the_stash_with_the_sync_free_dispatch():
    """Where the sync-free dispatch with its paged stash does not fit, the advice prices the
    dropless all-to-all without both (the stash needs the factor), as a configuration the rules
    accept."""
    from overlap.harness import resolve_run
    from overlap.perf.memory_model import fit, rank_memory

    args = "-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -ep 16 -mb 2".split()
    job = resolve_run(
        args, ["model.moe_expert_rank_capacity_factor=1.5", "model.moe_paged_stash=true"]
    )
    verdict = fit(job.cfg, job.resolution.layout, "h100")
    (advice,) = [a for a in verdict.advice if "moe_expert_rank_capacity_factor=null" in a]
    assert "model.moe_paged_stash=false" in advice
    dropless = resolve_run(args, [])
    peak = rank_memory(dropless.cfg, dropless.resolution.layout).total
    assert f": {gib(peak)} (saves" in advice


_POOL = "model.moe_paged_stash_buffer_size_factor_cuda=1.2"


def _recorded_step(force: bool) -> tuple[dict, list[str], int]:
    """One recorded training step at EP 2 (fused permutation, EP overlap + delay_wgrad, bf16) after
    a warm-up step; `force`: rank 1 reports an overflow, so the step re-runs dropless. (syncs by
    kind, the unneeded ones, micro-batches)."""
    cfg = tiny_config(
        True,
        "bf16_mixed",
        2,
        ["model.moe_permute_fusion=true", *OVERLAP, "model.moe_expert_rank_capacity_factor=1.5"],
        2,
        expert_model_parallel_size=2,
    )
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    trainer.train_step(0)
    steps = [state["step"] for state in trainer.optimizer.adam.state.values()]
    dispatcher = trainer.static_dispatch.dispatchers[0]
    if force and dist.get_rank() == 1:
        dispatcher.route = lambda *args: _overflowing(dispatcher, args)
    with HostSyncRecorder(host_tensors=steps) as rec:
        trainer.train_step(1)
    assert trainer.last_step_reruns == int(force)
    by_kind = rec.by_kind()
    by_kind.pop(HOST_TENSOR, None)
    return dict(by_kind), rec.unneeded(), trainer.num_micro_batches


@pytest.mark.parametrize("force", [False, True], ids=["no-overflow", "re-run"])
def test_the_host_reads_of_a_step_and_of_its_rerun(force):
    """The host-sync budget: a step without overflow reads the loss and the grad norm (which
    carries the overflow count) and nothing per layer; a re-run step reads the norm once more and
    the dropless path's split sizes, once per MoE layer and micro-batch (what the re-run costs)."""
    loss, norm = (why for _path, _fn, _code, why in INTENDED_READS)
    for by_kind, unneeded, microbatches in run_world(2, _recorded_step, force):
        assert not unneeded, "\n".join(unneeded)
        expected = (
            {loss: 1, norm: 2, SPLIT_SIZES: 2 * microbatches} if force else {loss: 1, norm: 1}
        )
        assert by_kind == expected


def _train_dense_first_stage(overrides: list[str], force_at: int | None) -> tuple:
    """`_train` at PP 2 x EP 2 with 4 layers, the first stage's two dense (moe_layer_freq [0, 0, 1,
    1]); the overflow, if any, forced on rank 3 (the second stage's)."""
    return _train(
        ["model.num_layers=4", "model.moe_layer_freq=[0,0,1,1]", *overrides],
        {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
        force_at,
        force_rank=3,
    )


def test_a_stage_without_moe_layers_carries_the_count_too():
    """The first pipeline stage holds no MoE layer: its ranks still carry a count (0) through the
    same reductions as the MoE stage's, and re-run with them (the collectives match by position;
    under NCCL's rules the replay would find a mismatch)."""
    static = run_world_nccl_rules(4, _train_dense_first_stage, FACTOR, 1)
    dropless = run_world(4, _train_dense_first_stage, [], None)
    assert _same_run(static, dropless) == [0, 1, 0, 0]
