"""`overlap run` end to end: the README's main job trains, and user mistakes exit 2 without a
traceback."""

import json
import subprocess
import sys


def _overlap(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_main_job_trains_moe_on_four_ranks(tmp_path):
    metrics = tmp_path / "m.jsonl"
    out = _overlap(
        "run",
        "-m",
        "qwen",
        "-mr",
        "qwen3_moe_tiny",
        "-g",
        "cpu",
        "-ng",
        "4",
        "-ms",
        "3",
        "--moe_a2a_overlap",
        "true",
        "--metrics",
        str(metrics),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    assert all(0 < r["lm_loss"] < 20 and r["step_time_ms"] > 0 for r in rows)
    assert rows[0]["comm_bytes"]["ep_dispatch"] > 0
    assert "elapsed time per iteration (ms)" in out.stderr
    assert "Overlap decisions" in out.stderr and "steady-state step time" in out.stderr
    assert "model.overlap_moe_expert_parallel_comm              True" in out.stderr


def test_bad_layout_exits_2_with_message():
    out = _overlap("run", "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "3", "-tp", "2")
    assert out.returncode == 2
    assert (
        "-ng/--num_gpus=3" in out.stderr and "Fix:" in out.stderr and "Traceback" not in out.stderr
    )


def test_unbuilt_feature_exits_2_before_starting_ranks():
    out = _overlap(
        "run",
        *("-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "2"),
        "model.gradient_accumulation_fusion=true",
    )
    assert out.returncode == 2
    assert "not built" in out.stderr and "Traceback" not in out.stderr


def test_emit_slurm_writes_a_script(tmp_path):
    path = tmp_path / "job.sbatch"
    out = _overlap(
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
        "8",
        "--emit-slurm",
        str(path),
    )
    assert out.returncode == 0, out.stderr
    text = path.read_text()
    assert "#SBATCH --nodes=2" in text and "torchrun" in text and "--emit-slurm" not in text
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in text


def test_context_parallelism_in_a_pytorch_peer_exits_2_not_built():
    out = _overlap(
        "run",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-g",
        "cpu",
        "-ng",
        "4",
        "-pp",
        "2",
        "-cp",
        "2",
        "model.pipeline_impl=torch_pipelining",
    )
    assert out.returncode == 2
    assert "model.context_parallel_size=2" in out.stderr and "not built" in out.stderr
    assert "Traceback" not in out.stderr


def test_benchmark_floor_mistakes_exit_2_before_any_run():
    out = _overlap(
        "run", "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "2", "--comm-mode", "none:epp"
    )
    assert out.returncode == 2 and "--comm-mode" in out.stderr and "Traceback" not in out.stderr
    out = _overlap(
        "bench",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-g",
        "cpu",
        "-ng",
        "2",
        "--ab",
        "ddp.overlap_grad_reduce=false,true",
        "--ideal-family",
        "ep",
        "--ideal-family",
        "ep",
    )
    assert out.returncode == 2 and "--ideal-family" in out.stderr and "Traceback" not in out.stderr
