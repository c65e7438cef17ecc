"""Every bad input gets one clear answer (issue 13): exit 2, one `overlap: error:` paragraph naming
the flag or field, the value and the fix, no traceback, and nothing started - output paths, value
ranges, duplicates, Slurm options, bench configurations, resource limits, and messages that used to
blame the wrong thing. All in-process `main` calls: each one is refused before a rank or a benchmark
run could start."""

from __future__ import annotations

import json
import os
import stat

import pytest

from overlap.cli import main
from overlap.launch import paths
from overlap.launch.resources import FORCE_ENV

DENSE = ["-m", "qwen", "-mr", "dense_tiny", "-ng", "2"]
MOE = ["-m", "qwen", "-mr", "qwen3_moe_tiny", "-ng", "2"]


def run(argv, capsys):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    # nothing was started (no rank, no bench run)
    assert "[bench] round" not in err and "Network: " not in out
    return code, out, err


def refused(argv, capsys, *needles):
    code, out, err = run(argv, capsys)
    assert code == 2, err
    assert err.startswith("overlap: error: ") and "Fix:" in err or "Run 'overlap" in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# --- output paths ---------------------------------------------------------------------------------
def test_metrics_into_a_missing_folder(tmp_path, capsys):
    path = tmp_path / "nope" / "m.jsonl"
    refused(
        ["run", *DENSE, "--metrics", str(path)],
        capsys,
        "--metrics=",
        str(path),
        "does not exist",
        f"mkdir -p {tmp_path / 'nope'}",
    )


def test_metrics_under_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    refused(
        ["run", *DENSE, "--metrics", str(tmp_path / "f" / "m.jsonl")],
        capsys,
        "--metrics=",
        "is a file",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_metrics_into_a_read_only_folder(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        refused(
            ["run", *DENSE, "--metrics", str(ro / "m.jsonl")], capsys, "--metrics=", "cannot write"
        )
    finally:
        ro.chmod(stat.S_IRWXU)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs sysfs")
def test_metrics_into_a_folder_nobody_can_write(capsys):
    """/sys refuses new files even to root: the probe asks the system, not the mode bits."""
    refused(
        ["run", *DENSE, "--metrics", "/sys/m.jsonl"],
        capsys,
        "--metrics='/sys/m.jsonl'",
        "cannot write",
    )


def test_empty_and_folder_values(tmp_path, capsys):
    refused(["run", *DENSE, "--metrics="], capsys, "--metrics=''", "empty")
    refused(
        ["run", *DENSE, "--metrics", str(tmp_path)],
        capsys,
        "is a folder",
        str(tmp_path / "metrics.jsonl"),
    )
    refused(["run", *DENSE, "--trace="], capsys, "--trace=''", "empty")


def test_metrics_sibling_that_cannot_be_written(tmp_path, capsys):
    (tmp_path / "m.jsonl.summary.json").mkdir()
    refused(
        ["run", *DENSE, "--metrics", str(tmp_path / "m.jsonl")],
        capsys,
        ".summary.json",
        "is a folder",
    )


def test_trace_to_an_existing_file(tmp_path, capsys):
    f = tmp_path / "t"
    f.write_text("x")
    refused(["run", *DENSE, "--trace", str(f)], capsys, "--trace=", "this is a file")


def test_trace_folder_is_created_up_front(tmp_path):
    from types import SimpleNamespace

    target = tmp_path / "a" / "b"
    paths.check_run_outputs(SimpleNamespace(metrics=None, trace=str(target), emit_slurm=None))
    assert target.is_dir() and not list(target.iterdir())  # the write probe left nothing behind


def test_emit_slurm_to_a_missing_folder_or_a_folder(tmp_path, capsys):
    base = ["run", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-g", "h100", "-ng", "16"]
    refused(
        [*base, "--emit-slurm", str(tmp_path / "no" / "j.sbatch")],
        capsys,
        "--emit-slurm=",
        "does not exist",
    )
    refused([*base, "--emit-slurm", str(tmp_path)], capsys, "--emit-slurm=", "is a folder")


def test_checkpoint_folders_are_checked_before_any_rank_starts(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    refused(
        ["run", *DENSE, f"checkpoint.save={tmp_path / 'f'}"],
        capsys,
        "checkpoint.save=",
        "is a file",
    )
    refused(
        ["run", *DENSE, f"checkpoint.load={tmp_path / 'f'}"],
        capsys,
        "checkpoint.load=",
        "a checkpoint is a folder",
    )
    refused(
        ["run", *DENSE, f"checkpoint.pretrained_checkpoint={tmp_path / 'none'}"],
        capsys,
        "checkpoint.pretrained_checkpoint=",
        "does not exist",
    )
    refused(
        [
            "run",
            *DENSE,
            f"checkpoint.load={tmp_path / 'none'}",
            "checkpoint.exit_on_missing_checkpoint=true",
        ],
        capsys,
        "checkpoint.load=",
        "does not exist",
    )
    refused(
        ["run", *DENSE, "checkpoint.ckpt_format=torch"],
        capsys,
        "checkpoint.ckpt_format='torch'",
        "not built",
    )
    refused(
        ["run", *DENSE, "ddp.impl=torch_ddp", "-c", "fp32", f"checkpoint.save={tmp_path}"],
        capsys,
        "ddp.impl='torch_ddp'",
        "Checkpoints",
    )


def test_bench_outputs_checked_before_the_first_run(tmp_path, capsys):
    base = ["bench", *DENSE, "--ab", "ddp.overlap_grad_reduce=false,true"]
    refused([*base, "--json", str(tmp_path / "no" / "b.json")], capsys, "--json=", "does not exist")
    refused(
        [*base, "--markdown", str(tmp_path / "no" / "b.md")],
        capsys,
        "--markdown=",
        "does not exist",
    )
    same = str(tmp_path / "b.out")
    refused(
        [*base, "--json", same, "--markdown", same],
        capsys,
        "--markdown",
        "--json writes the same file",
    )


# --- duplicates, Slurm options --------------------------------------------------------------------
def test_the_same_override_twice(capsys):
    refused(
        ["explain", *DENSE, "model.num_layers=2", "model.num_layers=4"],
        capsys,
        "model.num_layers='4'",
        "given twice (model.num_layers=2 and model.num_layers=4)",
    )


def test_a_preset_after_one_of_its_fields(capsys):
    refused(
        ["explain", *DENSE, "mixed_precision.grad_reduce_in_fp32=true", "mixed_precision=fp32"],
        capsys,
        "mixed_precision='fp32'",
        "dropping the earlier mixed_precision.grad_reduce_in_fp32=true",
    )


def test_the_same_flag_twice_with_different_values(capsys):
    refused(
        ["explain", *DENSE, "-ms", "2", "--max_steps", "3"],
        capsys,
        "-ms/--max_steps",
        "given twice with different values (-ms 2 and --max_steps 3)",
    )
    code, _out, err = run(["explain", *DENSE, "-ms", "2", "-ms", "2"], capsys)
    assert code == 0, err  # the same value twice says nothing contradictory


def test_overrides_may_be_mixed_with_flags(capsys):
    code, out, err = run(
        ["explain", *DENSE, "model.num_layers=2", "-ms", "3", "train.seed=5", "--json"], capsys
    )
    assert code == 0, err
    assert json.loads(out)["world_size"] == 2


def test_gpus_per_node_zero(tmp_path, capsys):
    refused(
        [
            "run",
            "-m",
            "qwen",
            "-mr",
            "qwen3_30b_a3b",
            "-g",
            "h100",
            "-ng",
            "16",
            "-gn",
            "0",
            "--emit-slurm",
            str(tmp_path / "j.sbatch"),
        ],
        capsys,
        "-gn/--gpus_per_node=0",
        "at least one rank",
    )


def test_cpu_slurm_script_requests_no_gpus_and_the_time_limit_is_an_option(tmp_path, capsys):
    script = tmp_path / "j.sbatch"
    code, out, err = run(
        ["run", *DENSE, "--emit-slurm", str(script), "--time_limit", "04:00:00"], capsys
    )
    assert code == 0, err
    text = script.read_text()
    assert "--gpus-per-node" not in text and "#SBATCH --time=04:00:00" in text
    # the ranks do not get the script's own options
    assert "--time_limit" not in text.split("srun", 1)[1]
    gpu = tmp_path / "g.sbatch"
    code, out, err = run(
        [
            "run",
            "-m",
            "qwen",
            "-mr",
            "qwen3_30b_a3b",
            "-g",
            "h100",
            "-ng",
            "16",
            "--emit-slurm",
            str(gpu),
        ],
        capsys,
    )
    assert (
        code == 0
        and "#SBATCH --gpus-per-node=8" in gpu.read_text()
        and "#SBATCH --time=00:30:00" in gpu.read_text()
    )
    refused(
        ["run", *DENSE, "--time_limit", "04:00:00"],
        capsys,
        "--time_limit='04:00:00'",
        "add --emit-slurm",
    )
    refused(
        ["run", *DENSE, "--emit-slurm", str(script), "-t", "soon"], capsys, "--time_limit='soon'"
    )


# --- bench checks every configuration first -------------------------------------------------------
def test_bench_refuses_a_configuration_run_would_refuse_before_any_run(capsys):
    refused(
        [
            "bench",
            *["-m", "qwen", "-mr", "dense_tiny", "-ng", "4", "-pp", "2", "-cp", "2"],
            *["--ab", "model.pipeline_impl=overlap,torch_pipelining"],
        ],
        capsys,
        "model.context_parallel_size=2",
        "not built",
    )


def test_bench_config_repeating_a_common_override(capsys):
    refused(
        [
            "bench",
            *DENSE,
            "--config",
            "a:ddp.bucket_size=1000",
            "--config",
            "b:ddp.bucket_size=2000",
            "ddp.bucket_size=10",
        ],
        capsys,
        "--config='a'",
        "common overrides set too",
    )


def test_bench_link_floor_on_the_plain_loopback(capsys):
    refused(
        ["bench", *DENSE, "--ab", "ddp.overlap_grad_reduce=false,true", "--ideal-link"],
        capsys,
        "--ideal-link",
        "--network model:",
    )


# --- resources ------------------------------------------------------------------------------------
def test_a_model_that_cannot_fit_this_host(capsys, monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    err = refused(
        ["run", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "4"],
        capsys,
        "-mr/--model_recipe_name='qwen3_30b_a3b'",
        "GiB per rank",
        "4 local rank(s)",
        FORCE_ENV,
    )
    assert "parameters" in err and "optimizer state" in err


def test_absurd_sizes_are_refused_before_allocation(capsys):
    refused(
        ["explain", *DENSE, "model.hidden_size=100000000000000000000"],
        capsys,
        "model.hidden_size=100000000000000000000",
        "cannot be represented",
    )
    refused(
        ["run", *DENSE, "model.num_layers=100000"],
        capsys,
        "model.num_layers=100000",
        "GiB on this host",
    )
    # the pipeline's stages are spelt out layer by layer: both layer counts are bounded first (an
    # MTP count of 10^20 once reached Python's string repetition)
    for field in ("num_layers", "mtp_num_layers"):
        refused(
            ["explain", *DENSE, f"model.{field}=100000000000000000000"],
            capsys,
            f"model.{field}=100000000000000000000",
            "more than 100,000 layers",
        )
    code, out, err = run(
        ["explain", *DENSE, "model.num_layers=100000", "ddp.overlap_grad_reduce=true", "--json"],
        capsys,
    )  # a target may hold it: explained (quickly, no layer-by-layer meta model)
    assert code == 0 and json.loads(out)["memory_per_rank"]["params"] > 10**10


def test_too_many_local_ranks(capsys, monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    refused(["run", *DENSE[:-1], "1000"], capsys, "-ng/--num_gpus=1000", "per core", FORCE_ENV)
    refused(["explain", *DENSE[:-1], "10000000"], capsys, "-ng/--num_gpus=10000000", "typo")


def test_explain_shows_the_estimate_and_what_run_would_refuse(capsys):
    code, out, err = run(
        ["explain", "-m", "qwen", "-mr", "qwen3_30b_a3b", "-ng", "4", "--json"], capsys
    )
    doc = json.loads(out)
    assert code == 0 and doc["memory_per_rank"]["total_bytes"] > 2**30
    assert any("GiB on this host" in r["why"] for r in doc["run_refuses"])
    code, out, err = run(["explain", *DENSE], capsys)
    assert "Memory at the peak of the rank that needs the most" in out


# --- messages that blamed the wrong thing ---------------------------------------------------------
def test_micro_batch_zero_names_the_micro_batch(capsys):
    refused(["explain", *DENSE, "-mb", "0"], capsys, "train.micro_batch_size=0", "-mb 1")


def test_flex_backend_beaten_by_an_alltoall_override_is_named_as_typed(capsys):
    code, out, err = run(
        [
            "explain",
            *MOE,
            "--moe_flex_dispatcher_backend",
            "torch",
            "model.moe_token_dispatcher_type=alltoall",
            "--json",
        ],
        capsys,
    )
    beaten = {d["field"]: d for d in json.loads(out)["command_line"]}[
        "model.moe_token_dispatcher_type"
    ]
    assert "beats --moe_flex_dispatcher_backend torch" in beaten["reason"]
    assert "beats --moe_flex_dispatcher_backend flex" not in out + err
    assert "inactive" not in err  # the backend went with the flag the override beat


def test_strict_tp_overlap_runs_at_tp2_and_refuses_a_preset_the_size_rule_changes(capsys):
    base = [
        "explain",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-ng",
        "2",
        "-tp",
        "2",
        "--strict",
        "comm_overlap.tp_comm_overlap=true",
    ]
    code, out, err = run(base, capsys)
    assert code == 0, err
    assert "model.tp_comm_overlap_cfg.proj_fprop" in out and "pipeline x4" in out
    err = refused(
        [
            *base,
            "-sl",
            "128",
            "comm_overlap.tp_comm_overlap_cfg=userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048",
        ],
        capsys,
        "model.tp_comm_overlap_cfg.proj_fprop",
        "size rule",
    )
    assert "Traceback" not in err


def test_ep_overlap_on_one_rank_does_not_suggest_ep_2(capsys):
    err = refused(
        ["explain", "-m", "qwen", "-mr", "qwen3_moe_tiny", "-ng", "1", "--moe_a2a_overlap", "true"],
        capsys,
        "at least 2 ranks",
        "-ng 2 -ep 2",
    )
    assert "Fix: use -ep 2" not in err


def test_unknown_flag_suggests_the_right_one(capsys):
    refused(
        ["explain", *DENSE, "--max-steps", "3"],
        capsys,
        "unrecognized arguments: --max-steps",
        "did you mean --max_steps?",
    )
    refused(
        ["explain", *DENSE, "--emit-slurm", "x"], capsys, "--emit-slurm is a flag of `overlap run`"
    )


def test_flag_override_contradictions_name_the_flag(capsys):
    code, out, err = run(
        [
            "explain",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-ng",
            "2",
            "-tp",
            "2",
            "model.tensor_model_parallel_size=1",
            "-ms",
            "3",
            "train.train_iters=5",
            "--json",
        ],
        capsys,
    )
    reasons = {d["field"]: d["reason"] for d in json.loads(out)["command_line"]}
    assert "beats -tp 2" in reasons["model.tensor_model_parallel_size"]
    assert "beats -ms/--max_steps 3" in reasons["train.train_iters"]
    assert "moe_a2a_overlap" not in json.dumps(reasons)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--skip_first_percent_time", "150"], "train.skip_first_percent_time=150.0"),
        (["--skip_first_percent_time", "-0.5"], "train.skip_first_percent_time=-0.5"),
        (
            ["--eval_time_start_step", "2", "--eval_time_end_step", "1"],
            "train.eval_time_end_step=1",
        ),
        (["-ms", "10", "--eval_time_end_step", "20"], "train.eval_time_end_step=20"),
        (["-ms", "10", "--eval_time_start_step", "10"], "train.eval_time_start_step=10"),
        (["model.kv_channels=33"], "model.kv_channels=33"),
        (
            ["model.vocab_size=-1"],
            "model.vocab_size=-1",
        ),  # once a traceback from the mock-data decision's ln(vocab)
        (["--vocab_size", "0"], "model.vocab_size=0"),
    ],
)
def test_windows_and_sizes_the_run_would_silently_change(argv, field, capsys):
    refused(["explain", *DENSE, *argv], capsys, field)


@pytest.mark.parametrize(
    "value, needle",
    [
        ("[0,1,1]", "one entry per layer (2)"),  # the tiny MoE recipe has 2 layers
        ("[0,2]", "each 1 (MoE) or 0 (dense)"),
        ("[0,0]", "no layer is MoE"),
        ("0", "it must be >= 1"),
    ],
)
def test_moe_layer_freq_pattern_is_checked(value, needle, capsys):
    """Megatron's per-layer form of moe_layer_freq: a wrong length, a value other than 0/1, or no
    MoE layer at all are refused by name before anything is built."""
    refused(
        ["explain", *MOE, f"model.moe_layer_freq={value}"], capsys, "model.moe_layer_freq=", needle
    )


def test_moe_layer_freq_pattern_counts_like_the_int_form(capsys):
    """[0, 1] is one MoE and one dense layer, as k=2 ([1, 0]) is: the same parameter count, fewer
    than all-MoE."""
    params = {}
    for value in ("[0,1]", "2", "1"):
        code, out, err = run(["explain", *MOE, f"model.moe_layer_freq={value}", "--json"], capsys)
        assert code == 0, err
        params[value] = json.loads(out)["memory_per_rank"]["params"]
    assert params["[0,1]"] == params["2"] < params["1"]
