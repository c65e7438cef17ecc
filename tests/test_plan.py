"""`overlap plan`: the pieces of the model (FLOPs, bytes, links, bubble, windows) and the command
line."""

import json

import pytest

from overlap.cli import main
from overlap.plan.comm_model import (
    alltoall_time_s,
    expected_destinations,
    members_per_node,
    ring_time_s,
)
from overlap.plan.fitted import FITTED
from overlap.plan.hardware import builtin_cluster, load_cluster
from overlap.plan.pipeline_sim import simulate
from overlap.plan.step_times import bucket_exposure
from overlap.recipes.models import RECIPES
from overlap.training.metrics import flops_per_token, training_flops

H100 = builtin_cluster("h100", "bf16", 8)


def test_flops_per_token_is_megatrons_count():
    # planner reference 4.1: 23.006 GFLOP/token at s = 4096
    f = training_flops(RECIPES["qwen3_30b_a3b"].build(16).model)
    assert f.total / 1e9 == pytest.approx(23.006, abs=0.001)
    assert f.attention_core / 48 == pytest.approx(100.7e6, rel=1e-3)  # causal halving
    assert f.logits == pytest.approx(1.867e9, rel=1e-3)
    assert flops_per_token(RECIPES["qwen3_30b_a3b"].build(16).model) == f.total


def test_link_choice_follows_members_per_node():
    assert (
        members_per_node(16, 1, 8) == 8
        and members_per_node(16, 8, 8) == 1
        and members_per_node(4, 1, 8) == 4
    )
    n = 1e9
    assert ring_time_s(n, 8, 8, H100) == pytest.approx(10e-6 + n / 370e9)  # one node: NVLink
    # one member per node: its NIC
    assert ring_time_s(n, 16, 1, H100) == pytest.approx(20e-6 + n / 46e9)
    # rail-parallel: min(8 x 46, 370)
    assert ring_time_s(n, 16, 8, H100) == pytest.approx(20e-6 + n / 368e9)
    # EP16 over 2 nodes: 8 of the 15 peers are off-node; that share goes through this GPU's NIC
    assert alltoall_time_s(15e6, 16, 8, H100) == pytest.approx(20e-6 + 8e6 / 46e9)


def test_expected_destinations_match_the_reference():
    assert expected_destinations(16, 128, 8) == pytest.approx(6.6, abs=0.05)
    assert expected_destinations(2, 128, 8) == pytest.approx(1.99, abs=0.01)


@pytest.mark.parametrize(
    "pp, vpp, m", [(2, 1, 2), (2, 1, 8), (4, 1, 8), (2, 2, 2), (2, 2, 8), (4, 2, 8), (4, 2, 4)]
)
@pytest.mark.parametrize("overlapped", [False, True])
def test_simulated_pipeline_has_the_formulas_bubble_with_free_transfers(pp, vpp, m, overlapped):
    """Narayanan et al. 2021: idle (p - 1) / (m v) of the compute, 1F1B at v = 1, interleaved
    otherwise. Overlapped 1F1B runs the first stage's weight gradients after its next task, which
    shortens the drain beyond two stages (the zero-bubble schedules' effect): at most the
    formula's there."""
    t = simulate(pp, vpp, m, 1.0 / vpp, 2.0 / vpp, 0.0, overlapped)
    assert t.compute_s == pytest.approx(3.0 * m)
    bubble = t.step_s / t.compute_s - 1
    if overlapped and vpp == 1 and pp > 2:
        assert 0 < bubble < (pp - 1) / (m * vpp)
    else:
        assert bubble == pytest.approx((pp - 1) / (m * vpp))


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_overlapped_1f1b_exposes_at_most_the_fill_and_the_drain(pp):
    """Overlapped p2p sends each input gradient before the weight gradients (the executor's
    notes): a stage that sends gradients runs them right after the send, the first stage after its
    next forward, so in 1F1B's steady state every transfer up to a backward's weight-gradient time
    (here W = b / 2 = f) hides at PP 2, and up to half of one between middle stages; at most the
    pipeline's fill and drain, 2 x (PP - 1) transfers, stay on the critical path whatever the
    micro-batch count (less at PP > 2: the deferred weight gradients shorten the drain). Batched,
    transfers sit on every micro-batch's cycle: the cost grows with the micro-batches, and so does
    overlapped's past the bound."""
    f, b = 1.0, 2.0
    hidden = (0.1, 0.3, 0.5) + ((0.9,) if pp == 2 else ())
    for m in (8, 16):
        free = simulate(pp, 1, m, f, b, 0.0, False).step_s
        for c in hidden:
            overlapped = simulate(pp, 1, m, f, b, c, True).step_s - free
            batched = simulate(pp, 1, m, f, b, c, False).step_s - free
            assert overlapped <= 2 * (pp - 1) * c + 1e-9, c
            assert batched >= (m - 1) * c
    c = 1.5 if pp == 2 else 1.0
    past = [simulate(pp, 1, m, f, b, c, True).step_s for m in (8, 16)]
    assert past[1] - past[0] > 8 * 3.0


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_a_deeper_warm_up_hides_transfers_up_to_half_a_step(pp):
    """comm_overlap.p2p_warmup_depth=2 (`schedules.pipeline_steps`): each stage one more
    micro-batch ahead of the next, so in the steady state the two transfers of a cycle (a gradient
    down, an activation back up) travel under a whole step (f + b = 3 here) instead of the weight-
    gradient time (W = 1; half of it between middle stages): up to c = 1.5, past the split's bound,
    only the fill and the drain stay exposed, whatever the micro-batch count, where depth 1's cost
    grows with the micro-batches; past half a step depth 2's grows too, less than depth 1's."""
    f, b = 1.0, 2.0
    for c in (1.0, 1.5, 2.5):
        exposed = {}
        for depth in (1, 2):
            for m in (16, 32):
                free = simulate(pp, 1, m, f, b, 0.0, True, warmup_depth=depth).step_s
                step = simulate(pp, 1, m, f, b, c, True, warmup_depth=depth).step_s
                exposed[depth, m] = step - free
        if c <= 1.5:
            assert exposed[2, 16] <= 2 * (pp - 1) * c + 1e-9, c
            assert exposed[2, 32] == pytest.approx(exposed[2, 16])
        else:
            assert exposed[2, 32] > exposed[2, 16]
        if pp > 2 or c > 1.0:
            assert exposed[1, 32] > exposed[1, 16] + 8 * (c - 1.0) - 1e-9
            assert exposed[2, 32] < exposed[1, 32]


def test_interleaving_hides_the_transfers_too():
    """At PP = 2 the interleaved schedule's slack hides most of the batched mode's link cost."""
    c = 0.2
    free = simulate(2, 2, 8, 0.5, 1.0, 0.0, True).step_s
    batched = simulate(2, 2, 8, 0.5, 1.0, c, False).step_s - free
    overlapped = simulate(2, 2, 8, 0.5, 1.0, c, True).step_s - free
    assert overlapped < 0.5 * batched


def test_a_token_bucket_lets_transfers_after_idle_compute_pass_at_the_line_rate():
    """`--network tbf:RATE`'s bucket (per queue in the simulation): with compute long enough between
    a queue's transfers to refill it, every transfer passes at the line rate, as free as the
    bubble-only run at an infinite line; without a burst the same messages cost what a plain link
    charges."""
    from overlap.plan.hardware import Link, Transfer

    plain = Link(1e6, 0.0, "1 MB/s")  # 100 KB: 0.1 s
    bursty = Link(1e6, 0.0, "1 MB/s, 100 KB bucket", burst_bytes=100e3)
    for overlapped in (False, True):
        free = simulate(2, 1, 8, 1.0, 2.0, 0.0, overlapped).step_s
        fixed = simulate(2, 1, 8, 1.0, 2.0, 0.1, overlapped).step_s
        assert simulate(
            2, 1, 8, 1.0, 2.0, Transfer(plain, 100e3), overlapped
        ).step_s == pytest.approx(fixed)
        assert simulate(
            2, 1, 8, 1.0, 2.0, Transfer(bursty, 100e3), overlapped
        ).step_s == pytest.approx(free)
        assert fixed > free
        # twice the bucket per message: the bucket covers half, the rest pays the rate
        half = simulate(2, 1, 8, 1.0, 2.0, Transfer(bursty, 200e3), overlapped).step_s
        assert half == pytest.approx(fixed)


def test_the_schedules_bound_in_the_p2p_overlap_benchmark():
    """bench/commands.sh 27's regime (pp_p2p_overlap_vpp: PP=2, 16 micro-batches, a micro-batch
    forward 44 ms and backward 86 ms as its faked-p2p floor measured, a 256 KB activation on the
    1 ms + 20 MB/s link): the share of the batched mode's link cost that the overlapped interleaved
    schedule can hide at best is ~0.88, and 0.76 on the 10 MB/s link where 0.67 was measured;
    overlapped 1F1B, its input gradients sent before the weight gradients, as much (the transfer,
    ~14 ms, is under the weight-gradient time). The 0.8 target is judged where the bound allows
    it."""

    def hidden(vpp: int, transfer_s: float) -> float:
        f, b = 0.044 / vpp, 0.086 / vpp
        free = simulate(2, vpp, 16, f, b, 0.0, True).step_s
        batched = simulate(2, vpp, 16, f, b, transfer_s, False).step_s
        overlapped = simulate(2, vpp, 16, f, b, transfer_s, True).step_s
        return (batched - overlapped) / (batched - free)

    at_20, at_10 = 1e-3 + 262144 / 20e6, 1e-3 + 262144 / 10e6
    assert hidden(2, at_20) == pytest.approx(0.88, abs=0.02)
    assert hidden(2, at_10) == pytest.approx(0.76, abs=0.02)
    assert hidden(1, at_20) == pytest.approx(0.88, abs=0.02)


@pytest.mark.parametrize("gather", [False, True])
def test_bucket_exposure(gather):
    # one bucket: nothing hides (the reduce is ready as the backward ends; the gather is needed as
    # the forward starts)
    assert bucket_exposure([1.0], 10.0, gather) == pytest.approx(1.0)
    # four small buckets under a long window: only one bucket's time shows
    assert bucket_exposure([0.5] * 4, 10.0, gather) == pytest.approx(0.5)
    # a link slower than the window: the reduce starts when the first bucket is ready (1 of the 4 s)
    # and runs 20 s; the gather's forward waits for each bucket in turn and computes its last
    # quarter (1 s) after the last one
    assert bucket_exposure([5.0] * 4, 4.0, gather) == pytest.approx(17.0)


def _plan(tmp_path, *argv):
    out = tmp_path / "plan.json"
    assert main(["plan", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_plan_json_mirrors_bench_and_gives_verdicts(tmp_path, caplog):
    caplog.set_level("INFO")
    doc = _plan(
        tmp_path, "-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-ep", "16"
    )
    # the command line's start-up lines once, not again for each switch flipped off and on
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("perf recipe")]
    assert len(said) == 1 and "qwen3_30b_a3b_pretrain_16gpu_h100" in said[0]
    row = doc["configs"][0]
    for key in (
        "name",
        "overrides",
        "step_time_ms",
        "tflops_per_gpu",
        "compute_ms",
        "bubble_ms",
        "exposed_comm_ms",
        "total_comm_ms",
        "hidden_comm_ms",
        "bytes_per_iter",
        "peak_mem_gb",
    ):
        assert key in row
    assert doc["cluster"]["gpu"] == "h100"
    assert "fitted on" in doc["cluster"]["compute_efficiency_source"]
    # every prediction carries the GPU group's leave-one-out error on published runs
    expected = (FITTED["h100"]["median_error"], FITTED["h100"]["worst_error"])
    assert (doc["expected_error"]["median"], doc["expected_error"]["worst"]) == expected
    for c in doc["configs"]:
        assert (c["expected_error"]["median"], c["expected_error"]["worst"]) == expected
    verdicts = " | ".join(doc["verdicts"])
    assert (
        "EP overlap: -" in verdicts
        and "pays" in verdicts
        and "TP overlap: not applicable at TP=1" in verdicts
    )


def test_fp8_plans_the_reference_run_and_says_so(tmp_path, capsys):
    common = ["-m", "llama", "-mr", "llama3_8b", "-g", "h100", "-ng", "8", "-gb", "128"]
    bf16 = _plan(tmp_path, *common, "-c", "bf16", "--config", "a:", "--config", "b:")
    fp8 = _plan(tmp_path, *common, "-c", "fp8_cs", "--config", "a:", "--config", "b:")
    assert fp8["cluster"]["precision"] == "fp8"
    assert fp8["cluster"]["peak_tflops"] == pytest.approx(1978.9)
    assert "reference system's FP8 run" in fp8["expected_error"]["text"]
    # FP8 GEMMs at twice the rate; attention, glue and the output layer are not: faster, but not
    # twice
    ratio = fp8["configs"][0]["compute_ms"] / bf16["configs"][0]["compute_ms"]
    assert 0.5 < ratio < 0.8
    for dtype in ("nvfp4", "fp8_mx"):  # no FP4 figures; no MXFP8 on an H100
        assert main(["plan", *common, "-c", dtype]) == 2
        assert "-c/--compute_dtype" in capsys.readouterr().err


def test_a_cluster_files_own_efficiency_is_not_validated(tmp_path):
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"gpu": "h100", "compute_efficiency": 0.3}))
    doc = _plan(
        tmp_path,
        "-m",
        "llama",
        "-mr",
        "llama3_8b",
        "-g",
        "h100",
        "-ng",
        "8",
        "--cluster",
        str(cluster),
    )
    assert doc["expected_error"]["median"] is None
    assert "not validated" in doc["expected_error"]["text"]


def test_ab_uses_bench_semantics(tmp_path):
    doc = _plan(
        tmp_path,
        "-m",
        "llama",
        "-mr",
        "llama3_8b",
        "-g",
        "h100",
        "-ng",
        "16",
        "-tp",
        "2",
        "--ab",
        "comm_overlap.tp_comm_overlap=false,true",
    )
    assert [c["name"] for c in doc["configs"]] == [
        "comm_overlap.tp_comm_overlap=false",
        "comm_overlap.tp_comm_overlap=true",
    ]
    assert doc["configs"][1]["step_time_ms"]["mean"] < doc["configs"][0]["step_time_ms"]["mean"]
    assert doc["configs"][0]["total_comm_ms"]["tp_ag"] > 0


def test_pipeline_bubble_and_interleaving(tmp_path):
    common = [
        "-m",
        "llama",
        "-mr",
        "llama3_70b",
        "-g",
        "h100",
        "-ng",
        "64",
        "-tp",
        "8",
        "-pp",
        "4",
        "-gb",
        "32",
    ]
    one = _plan(tmp_path, *common, "-vp", "None", "--config", "a:", "--config", "b:")["configs"][0]
    inter = _plan(tmp_path, *common, "-vp", "5", "--config", "a:", "--config", "b:")["configs"][0]
    assert (
        inter["bubble_ms"] < one["bubble_ms"]
        and inter["bytes_per_iter"]["pp_send"] > one["bytes_per_iter"]["pp_send"]
    )


def test_cluster_file(tmp_path, capsys):
    cluster = tmp_path / "c.json"
    cluster.write_text(
        json.dumps(
            {
                "gpu": "cpu",
                "gpus_per_node": 4,
                "peak_tflops": 0.05,
                "compute_efficiency": 1.0,
                "nvlink": {"bandwidth_GBps": 1, "latency_us": 50},
                "nic": {"bandwidth_GBps": 1, "latency_us": 50},
            }
        )
    )
    doc = _plan(
        tmp_path,
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-g",
        "cpu",
        "-ng",
        "4",
        "--cluster",
        str(cluster),
    )
    assert doc["cluster"]["peak_tflops"] == 0.05
    cluster.write_text(json.dumps({"gpu": "cpu", "peak_tflops": 0.05}))
    assert (
        main(
            [
                "plan",
                "-m",
                "qwen",
                "-mr",
                "dense_tiny",
                "-g",
                "cpu",
                "-ng",
                "4",
                "--cluster",
                str(cluster),
            ]
        )
        == 2
    )
    assert "--cluster gpus_per_node" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, field",
    [
        (["-g", "vr200"], "-g/--gpu"),
        (["-g", "cpu"], "-g/--gpu"),
        (["-g", "h100", "--ab", "nokey"], "--ab"),
        (["-g", "h100", "--json", "/nonexistent/dir/x.json"], "--json"),
        # what the model would price as another configuration: refused, never priced silently
        (["-g", "h100", "-ep", "8", "-et", "2"], "model.expert_tensor_parallel_size"),
        (["-g", "h100", "-ep", "8", "model.mtp_num_layers=1"], "model.mtp_num_layers"),
        (["-g", "h100", "model.mtp_num_layers=1", "--search", "3"], "model.mtp_num_layers"),
        (["-g", "h100", "-pp", "2", "model.pipeline_impl=torch_pipelining"], "model.pipeline_impl"),
        (
            ["-g", "h100", "-tp", "2", "model.tensor_parallel_impl=dtensor"],
            "model.tensor_parallel_impl",
        ),
        (["-g", "h100", "ddp.impl=fsdp2"], "ddp.impl"),
        (
            ["-g", "h100", "model.moe_token_dispatcher_type=allgather"]
            + ["comm_overlap.overlap_moe_expert_parallel_comm=false"],
            "model.moe_token_dispatcher_type",
        ),
        (["-g", "h100", "model.attention_backend=local"], "model.attention_backend"),
        (["-g", "h100", "model.rms_norm_fusion=false"], "model.rms_norm_fusion"),
        (["-g", "h100", "model.moe_permute_fusion=false"], "model.moe_permute_fusion"),
        (
            ["-g", "h100", "comm_overlap.overlap_moe_expert_parallel_comm=false"]
            + ["model.moe_router_force_load_balancing=false"]
            + ["model.recompute_granularity=full", "model.recompute_method=block"]
            + ["model.recompute_num_layers=2"],
            "model.recompute_num_layers",
        ),
    ],
)
def test_bad_input_is_a_config_error(capsys, argv, field):
    assert main(["plan", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert f"overlap: error: {field}" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_outputs_are_not_written_through_a_planted_link(tmp_path, capsys, flag):
    """A link at an output's path is refused before anything is planned (the write itself goes to
    a fresh name renamed into place, so a link planted after the check is replaced, not
    followed); the link's target, any file the user can write, is left as it was."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "plan.out"
    out.symlink_to(target)
    argv = ["plan", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-ep", "16"]
    assert main([*argv, flag, str(out)]) == 2
    assert f"overlap: error: {flag}=" in capsys.readouterr().err
    assert target.read_text() == "keep me" and out.is_symlink()


CALIBRATION = [
    "-m",
    "qwen",
    "-mr",
    "qwen3_moe_tiny",
    "-g",
    "cpu",
    "-ng",
    "2",
    "-ms",
    "3",
    "-gb",
    "4",
    "-mb",
    "1",
]


def test_calibrate_writes_a_profile_whose_compute_is_the_measured_floor(tmp_path, capsys):
    profile = tmp_path / "cpu.json"
    doc = _plan(
        tmp_path,
        *CALIBRATION,
        "--network",
        "model:1ms,10MB/s,ep",
        "--calibrate",
        "--cluster",
        str(profile),
        "--ab",
        "comm_overlap.overlap_moe_expert_parallel_comm=false,true",
    )
    cluster = load_cluster(str(profile), "cpu", "bf16", None)
    assert cluster.link_families == ("ep",) and cluster.nvlink.latency_s == pytest.approx(1e-3)
    assert cluster.nvlink.bandwidth_Bps == pytest.approx(10e6) and cluster.gpus_per_node == 2
    floor_ms = float(cluster.efficiency.source.split(" ran ")[1].split(" ms")[0])
    off, on = doc["configs"]
    # the fit: compute = the faked-comm run
    assert off["compute_ms"] == pytest.approx(floor_ms, rel=1e-3)
    assert set(off["exposed_comm_ms"]) <= {
        "ep_dispatch",
        "ep_combine",
        "ep_dispatch_bwd",
        "ep_combine_bwd",
        "ep_counts",
        "all",
    }  # only the link's family is charged
    assert on["step_time_ms"]["mean"] < off["step_time_ms"]["mean"]
    assert "wrote the machine profile" in capsys.readouterr().out


GPU_PLAN = ["-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16", "-ep", "16"]


@pytest.mark.parametrize(
    "argv, field, why",
    [
        ([*GPU_PLAN, "--calibrate", "--cluster", "x.json"], "--calibrate", "no CUDA device"),
        (
            [*GPU_PLAN, "--calibrate", "--cluster", "x.json", "--network", "real"],
            "--network",
            "published links",
        ),
        ([*CALIBRATION, "--calibrate"], "--calibrate", "needs a file"),
        (
            [*CALIBRATION, "--network", "model:1ms,1GB/s", "--cluster", "x.json"],
            "--network",
            "only --calibrate",
        ),
    ],
)
def test_calibrate_refusals(argv, field, why, capsys, monkeypatch):
    import torch

    # the same refusal on a machine with a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert f"error: {field}" in err and why in err


def test_the_gpu_probe_is_the_plans_model_cut_to_one_device(tmp_path):
    """A GPU type's calibration runs the plan's model on one device: the layout, the batch, the
    run's length and window, the overlap switches, --strict and checkpoints are the plan's, not the
    probe's; the model's shape and numerics are kept (-rl at most the probe's layers). The cut
    command line is a valid run (here on CPU)."""
    from overlap.harness import resolve_run
    from overlap.perf.bench import BenchConfig, run_once
    from overlap.plan.calibrate import PROBE_MICROBATCHES, PROBE_STEPS, gpu_probe

    argv = [
        "-m",
        "qwen",
        "-mr",
        "qwen3_moe_tiny",
        "-g",
        "cpu",
        "-ng",
        "4",
        "-tp",
        "2",
        "-ep",
        "2",
        "-gb",
        "32",
        "-mb",
        "2",
        "-ms",
        "100",
        "--moe_a2a_overlap",
        "true",
        "--strict",
        "-rl",
        "4",
        "--eval_time_start_step=50",
    ]
    overrides = [
        "model.num_layers=6",
        "train.train_iters=50",
        "model.hidden_size=128",
        "checkpoint.save=/nowhere",
        "comm_overlap.delay_wgrad_compute=true",
        "model.moe_layer_freq=[1,1,1,1,1,1]",
        "ddp.overlap_grad_reduce=true",
        "train.micro_batch_size=2",
    ]
    options, kept = gpu_probe(argv, overrides, 2, 2)
    assert kept == ["model.hidden_size=128", "train.micro_batch_size=2", "model.num_layers=2"]
    assert options[:8] == ["-m", "qwen", "-mr", "qwen3_moe_tiny", "-g", "cpu", "-mb", "2"]
    assert (
        options[8:10] == ["-rl", "2"]
        and "--strict" not in options
        and "--moe_a2a_overlap" not in options
    )
    probe = resolve_run(options, kept)
    assert probe.resolution.layout.world_size == 1 and probe.cfg.model.num_layers == 2
    assert (
        probe.cfg.train.global_batch_size == PROBE_MICROBATCHES * 2
        and probe.cfg.train.train_iters == PROBE_STEPS
    )
    assert probe.cfg.model.hidden_size == 128 and probe.cfg.model.recompute_granularity == "full"
    run = run_once(options, kept, BenchConfig("probe", [], []), tmp_path / "probe.jsonl")
    assert run.step_ms > 0


def test_gpu_calibration_fits_the_layers_between_the_two_probes(tmp_path, monkeypatch, capsys):
    """The GPU branch end to end, with this machine's CUDA and the probe runs stood in for (their
    step times are given: 100 ms + 50 ms per layer): the efficiency is the predicted peak time of
    the layers between the probes over their measured 100 ms, the output layer and the optimizer
    step left out; the profile keeps the GPU type's published figures, says where its efficiency
    came from, and the plan runs on it."""
    import torch

    from overlap.harness import resolve_run
    from overlap.perf import bench
    from overlap.plan.calibrate import PROBE_LAYERS, predicted_floor_ms

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Stand-in GPU")
    ran = []

    def run_once(options, overrides, config, metrics):
        layers = int(next(o for o in overrides if o.startswith("model.num_layers=")).split("=")[1])
        ran.append((options, overrides))
        return bench.RunResult(100.0 + 50.0 * layers, {}, {}, 0.0, [2, 8], "real")

    monkeypatch.setattr(bench, "run_once", run_once)
    profile = tmp_path / "h100.json"
    doc = _plan(tmp_path, *GPU_PLAN, "--calibrate", "--cluster", str(profile))
    cluster = load_cluster(str(profile), "h100", "bf16", None)
    builtin = builtin_cluster("h100", "bf16", None)
    assert cluster.peak_tflops == builtin.peak_tflops
    assert cluster.nvlink.bandwidth_Bps == pytest.approx(builtin.nvlink.bandwidth_Bps)
    assert cluster.nvlink.latency_s == pytest.approx(builtin.nvlink.latency_s)
    lo, hi = (resolve_run(*run) for run in ran)
    measured_ms = 50.0 * (PROBE_LAYERS[1] - PROBE_LAYERS[0])
    expected = (
        predicted_floor_ms(hi.cfg, hi.resolution.layout, builtin)
        - predicted_floor_ms(lo.cfg, lo.resolution.layout, builtin)
    ) / measured_ms
    assert cluster.efficiency.value == pytest.approx(expected, rel=1e-9)
    assert (
        "Stand-in GPU" in cluster.efficiency.source
        and "200.0 ms per step at 2 layers" in cluster.efficiency.source
    )
    assert doc["cluster"]["compute_efficiency"] == pytest.approx(expected, rel=1e-9)
    assert "TFLOP/s (built-in table" in capsys.readouterr().out
    # calibrating again over that file keeps its figures (a user's own NIC here), only the
    # efficiency is new
    figures = json.loads(profile.read_text())
    figures["nic"]["bandwidth_GBps"] = 25.0
    profile.write_text(json.dumps(figures))
    _plan(tmp_path, *GPU_PLAN, "--calibrate", "--cluster", str(profile))
    again = load_cluster(str(profile), "h100", "bf16", None)
    assert again.nic.bandwidth_Bps == pytest.approx(
        25e9
    ) and again.efficiency.value == pytest.approx(expected)


def test_a_failed_calibration_run_is_a_config_error(tmp_path, monkeypatch, capsys):
    import torch

    from overlap.perf import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def run_once(options, overrides, config, metrics):
        raise bench.RunFailed(
            config.name, 1, ["overlap", "run"], "overlap: error: model.x=1: out of memory"
        )

    monkeypatch.setattr(bench, "run_once", run_once)
    assert main(["plan", *GPU_PLAN, "--calibrate", "--cluster", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "error: --calibrate" in err and "out of memory" in err and "Traceback" not in err


def test_simulated_pipeline_with_unequal_stages_and_groups():
    even = simulate(2, 2, 8, 0.5, 1.0, 0.0, True)
    heavy_last = simulate(2, 2, 8, 0.5, 1.0, 0.0, True, weights=(1.0, 1.0, 1.0, 1.5))
    # the others idle
    assert heavy_last.compute_s == even.compute_s and heavy_last.step_s > even.step_s
    # microbatch_group_size_per_vp_stage = m
    grouped = simulate(4, 2, 8, 0.5, 1.0, 0.0, True, group=8)
    # the group moves work, not the bubble
    assert grouped.step_s / grouped.compute_s - 1 == pytest.approx(3 / 16)
    with pytest.raises(ValueError, match="3 stage weights for 4"):
        simulate(2, 2, 8, 0.5, 1.0, 0.0, True, weights=(1.0, 1.0, 1.0))


def test_the_merged_program_pays_its_coarser_dependencies():
    for pp, vpp in ((2, 2), (4, 2)):
        plain = simulate(pp, vpp, 8, 0.5, 1.0, 0.2, True).step_s
        merged = simulate(pp, vpp, 8, 0.5, 1.0, 0.2, True, merged=True).step_s
        assert merged > plain
    assert simulate(1, 1, 4, 1.0, 2.0, 0.0, True, merged=True).step_s == pytest.approx(12.0)


def _floor_job(argv: str):
    from overlap.harness import resolve_run

    job = resolve_run(argv.split(), [])
    return job.cfg, job.resolution.layout


@pytest.mark.parametrize(
    "faked, measure",
    [(None, "first_rank_compute_s"), (("pp",), "slowest_rank_compute_s"), (("ep",), "step")],
)
def test_fit_efficiency_fits_what_the_floor_measured(faked, measure):
    """Every collective faked: rank 0's compute; the pipeline's p2p faked, the ranks still meeting:
    the busiest rank's compute; the p2p real: the whole step (bubble included)."""
    from dataclasses import replace

    from overlap.launch.network import parse_network
    from overlap.plan.calibrate import cpu_cluster, fit_efficiency
    from overlap.plan.predict import predict

    cfg, layout = _floor_job(
        "-m qwen -mr dense_tiny -g cpu -ng 2 -pp 2 -gb 8 -mb 1 model.num_layers=8"
    )
    cluster = cpu_cluster(parse_network("model:1ms,10MB/s,ep"), 2, 1.0, "fp32", None)
    fitted = fit_efficiency(cfg, layout, cluster, 1000.0, "test", faked)
    times = predict("x", [], cfg, layout, replace(fitted, link_families=())).times
    got = times.total_s if measure == "step" else getattr(times, measure)
    assert got * 1e3 == pytest.approx(1000.0, rel=1e-6)
    # the last stage holds the output layer
    assert times.slowest_rank_compute_s > times.first_rank_compute_s


def test_the_floor_a_result_is_fitted_on():
    from overlap.plan.versus_bench import _floor

    doc = {
        "command": "x",
        "floors_step_time_ms": {
            "ideal (no communication)": 1.0,
            "ideal (no ep communication)": 2.0,
        },
    }
    assert _floor(doc, ("ep",)) == (2.0, ("ep",))
    assert _floor({**doc, "floors_step_time_ms": {"ideal (no communication)": 1.0}}, ("ep",)) == (
        1.0,
        None,
    )
    assert _floor(
        {"command": "x", "floors_step_time_ms": {"ideal (no pp communication)": 3.0}}, None
    ) == (3.0, ("pp",))
    with pytest.raises(KeyError, match="no floor"):
        _floor({"command": "x", "floors_step_time_ms": {}}, None)


def test_a_tbf_profile_carries_the_token_bucket_through_its_cluster_file(tmp_path):
    """`--network tbf:RATE`: each of the ranks gets RATE / ranks and its share of tc's 1 MiB bucket,
    passing at the loopback's rate; the profile written by --calibrate (Cluster.to_json) reads back
    with the bucket."""
    from dataclasses import replace

    from overlap.launch.network import NIC_BURST_BYTES, TBF_BURST_BYTES, parse_network
    from overlap.plan.calibrate import cpu_cluster
    from overlap.plan.hardware import Link

    loopback = Link(0.6e9, 600e-6, "probe")
    cluster = cpu_cluster(parse_network("tbf:400mbit"), 2, 1.0, "fp32", loopback)
    assert cluster.nvlink.bandwidth_Bps == pytest.approx(25e6)
    assert cluster.nvlink.burst_bytes == TBF_BURST_BYTES / 2 and cluster.nvlink.burst_Bps == 0.6e9
    profile = tmp_path / "cpu.json"
    profile.write_text(
        json.dumps(replace(cluster, efficiency=replace(cluster.efficiency, value=0.5)).to_json())
    )
    again = load_cluster(str(profile), "cpu", "fp32", None)
    assert again.nvlink == replace(cluster.nvlink, source=again.nvlink.source)
    assert again.nic.burst_bytes == TBF_BURST_BYTES / 2
    # `nic:RATE`: every rank a NIC of its own, RATE each way and a 64 KiB bucket per direction
    nics = cpu_cluster(parse_network("nic:400mbit"), 4, 1.0, "fp32", loopback).nic
    assert nics.bandwidth_Bps == pytest.approx(50e6) and nics.burst_bytes == NIC_BURST_BYTES
    assert nics.burst_Bps == 0.6e9 and "full-duplex" in nics.source


def test_a_tied_pipeline_sums_the_embedding_gradient_over_its_ends_once_a_step():
    """The copy's gradient (vocab / TP x hidden, a 1/DP shard with the distributed optimizer)
    crosses between the first and the last stage once a step, after the DP reduction: exposed whole;
    none without PP or untied."""
    from overlap.plan.comm_model import comm_plan
    from overlap.plan.predict import predict

    base = "-m qwen -mr dense_tiny -g cpu -ng 8 -pp 2 -tp 2 -gb 8 -mb 1"
    for extra in (
        "",
        " ddp.use_distributed_optimizer=true optimizer.use_distributed_optimizer=true",
    ):
        cfg, layout = _floor_job(base + " model.share_embeddings_and_output_weights=true" + extra)
        plan = comm_plan(cfg, layout, H100)
        shard = layout.dp if extra else 1
        # dense_tiny's fp32 gradients
        want = cfg.model.vocab_size // 2 * cfg.model.hidden_size * 4 / shard
        assert plan.kinds["pp_tied_grad"].bytes_each == pytest.approx(want)
        times = predict("x", [], cfg, layout, H100).times
        assert times.exposed_s["pp_tied_grad"] == pytest.approx(
            plan.kinds["pp_tied_grad"].seconds_each
        )
    for argv in (
        base,
        base.replace("-pp 2", "-pp 1") + " model.share_embeddings_and_output_weights=true",
    ):
        cfg, layout = _floor_job(argv)
        assert "pp_tied_grad" not in comm_plan(cfg, layout, H100).kinds


def test_the_kv_ring_hides_each_step_under_a_block():
    from overlap.plan.step_times import cp_ring_exposure

    # blocks longer than every step: nothing shows; the backward's loads under its 4 blocks are
    # kv, kv + dkv, dkv, dkv (the first block the forward kept, the last the rank's own)
    kv_exposed, dkv_exposed, hidden = cp_ring_exposure(1.0, 2.0, 4, 10.0, True)
    assert kv_exposed + dkv_exposed == 0.0
    assert hidden == pytest.approx(3 * 1.0 + 1.0 + 3.0 + 2.0 + 2.0)
    # serialised: every transfer, forward CP - 1 KV, backward CP - 2 KV and CP - 1 dKV
    assert cp_ring_exposure(1.0, 2.0, 4, 10.0, False) == (5.0, 6.0, 0.0)
    # no compute to hide behind: as serialised
    on = cp_ring_exposure(1.0, 2.0, 4, 0.0, True)
    assert on[0] + on[1] == pytest.approx(11.0) and on[2] == 0.0
    # CP 2: one KV step forward, one dKV step backward, both hidden
    assert cp_ring_exposure(1.0, 2.0, 2, 10.0, True)[:2] == (0.0, 0.0)


def test_the_llama3_70b_cp2_perf_layout_is_planned_with_its_cp_kinds(tmp_path):
    """Bridge's Llama3-70B H100 BF16 perf layout (TP4 PP4 CP2 VPP5): predicted, the KV ring priced,
    its overlap judged (and hiding part of the ring)."""
    doc = _plan(
        tmp_path,
        *"-m llama -mr llama3_70b -g h100 -c bf16 -ng 64 -tp 4 -pp 4 -cp 2 -vp 5".split(),
    )
    rows = {c["name"]: c for c in doc["configs"]}
    on, off = rows["CP overlap on"], rows["CP overlap off"]
    for kind in ("cp_kv", "cp_dkv"):
        assert on["total_comm_ms"][kind] == off["total_comm_ms"][kind] > 0
    exposed = {
        name: sum(r["exposed_comm_ms"].get(k, 0) for k in ("cp_kv", "cp_dkv"))
        for name, r in (("on", on), ("off", off))
    }
    assert exposed["on"] < exposed["off"]
    assert any(v.startswith("CP overlap:") for v in doc["verdicts"])


@pytest.mark.parametrize(
    "pp, vpp, m, c, overlapped, group",
    [
        (4, 1, 256, 0.1, False, None),
        (4, 1, 256, 0.1, True, None),
        (8, 4, 256, 0.05, True, None),
        (2, 12, 512, 0.02, True, None),
        (8, 1, 130, 0.3, True, None),
        (4, 2, 97, 0.1, True, 6),
        (4, 2, 160, 0.05, False, None),  # settles late: longer short programs
    ],
)
def test_a_long_program_extrapolates_from_two_short_ones(pp, vpp, m, c, overlapped, group):
    """`simulate(exact=False)` (the layout search): past a few pipeline depths every group of
    micro-batches adds the same time, so the long step is a short one plus that slope, taken once
    three short programs agree on it."""
    exact = simulate(pp, vpp, m, 1.0 / vpp, 2.0 / vpp, c, overlapped, group).step_s
    fast = simulate(pp, vpp, m, 1.0 / vpp, 2.0 / vpp, c, overlapped, group, exact=False).step_s
    assert fast == pytest.approx(exact, rel=1e-9)
