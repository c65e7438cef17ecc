"""What a GPU run goes through, checked on CPU: the world joins bound to its device, GPU runs start
under torchrun (the benchmark's and the calibration's runs included), the CPU stand-ins for an
interconnect are refused on GPUs, and `overlap run --nccl-rules` replays a CPU run with NCCL's
rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from overlap.parallel import groups
from overlap.perf.bench import BenchConfig, run_command

ROOT = Path(__file__).resolve().parents[1]


def _overlap(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_cuda_world_binds_its_device(monkeypatch):
    """device_id: NCCL builds its communicators at start-up, not inside the first step's first
    collective."""
    seen = {}
    monkeypatch.setattr(groups.dist, "init_process_group", lambda **kw: seen.update(kw))
    groups.init_world("nccl", 30, torch.device("cuda", 3))
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 3)
    assert seen["timeout"].total_seconds() == 30
    seen.clear()
    groups.init_world("gloo", 30, None)
    assert "device_id" not in seen


def test_gpu_runs_of_the_benchmark_and_the_calibration_start_under_torchrun(tmp_path):
    options = ["-m", "qwen", "-mr", "qwen3_moe_tiny", "-g", "h100", "-ng", "1", "-ms", "5"]
    command = run_command(
        options, ["model.num_layers=2"], BenchConfig("probe", [], []), tmp_path / "m.jsonl"
    )
    assert command[1:6] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "-m",
    ]
    assert command[6:8] == ["overlap.cli", "run"] and "model.num_layers=2" in command
    cpu = run_command(["-g", "cpu", "-ng", "2"], [], BenchConfig("a", [], []), tmp_path / "m.jsonl")
    assert cpu[1:4] == ["-m", "overlap.cli", "run"]


@pytest.mark.parametrize("network", ["model:1ms,1GB/s", "tbf:800mbit", "nic:200mbit"])
def test_the_cpu_interconnect_stand_ins_are_refused_on_gpus(tmp_path, network):
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
        "--network",
        network,
        "--emit-slurm",
        str(tmp_path / "job.sh"),
    )
    assert out.returncode == 2 and "--network" in out.stderr and "GPU timeline" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "job.sh").exists()


def test_nccl_rules_are_for_cpu_ranks():
    out = _overlap(
        "run",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-g",
        "h100",
        "-ng",
        "8",
        "--nccl-rules",
        "--emit-slurm",
        "/dev/null",
    )
    assert out.returncode == 2 and "--nccl-rules" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "override, field",
    [
        (["ddp.impl=torch_ddp"], "ddp.impl"),
        (["model.pipeline_impl=torch_pipelining"], "model.pipeline_impl"),
        (["model.tensor_parallel_impl=dtensor"], "model.tensor_parallel_impl"),
        (["--network", "model:1ms,1GB/s"], "--network"),
    ],
)
def test_nccl_rules_refuse_what_they_cannot_check(override, field):
    """The PyTorch peers bypass our comm layer, and the modelled link matches by tag and delays the
    host: a replay would pass a run it never checked."""
    out = _overlap(
        "run", "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "2", "--nccl-rules", *override
    )
    assert out.returncode == 2 and field in out.stderr and "Traceback" not in out.stderr, (
        out.stderr[-2000:]
    )


def test_a_cpu_run_under_nccl_rules_replays_its_program():
    """PP2 x VPP2: the layout that hung on NCCL before its pipeline had a group per direction."""
    out = _overlap(
        "run",
        "-m",
        "qwen",
        "-mr",
        "qwen3_moe_tiny",
        "-g",
        "cpu",
        "-ng",
        "2",
        "-ms",
        "2",
        "-pp",
        "2",
        "-vp",
        "2",
        "--nccl-rules",
        "model.num_layers=4",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replays with NCCL's streams" in out.stderr
    assert "timeline: host clock under NCCL's rules" in out.stderr


def test_a_gpu_benchmark_refuses_the_stand_ins_before_any_run():
    out = _overlap(
        "bench",
        "-m",
        "qwen",
        "-mr",
        "dense_tiny",
        "-g",
        "h100",
        "-ng",
        "8",
        "--ab",
        "ddp.overlap_grad_reduce=false,true",
        "--network",
        "model:1ms,1GB/s",
    )
    assert out.returncode == 2 and "--network" in out.stderr and "Traceback" not in out.stderr
