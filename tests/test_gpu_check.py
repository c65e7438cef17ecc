"""bench/gpu_check.sh, the device script, checked on CPU before it ever meets a GPU: the shell is
valid, every GPU step starts through torchrun against the source tree, and the whole script runs end
to end on CPU ranks (gloo), writing the files the device tool brings back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_shell_wrapper_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")]).returncode == 0


def test_every_gpu_step_starts_through_torchrun():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "run", "--dry", "--gpu", "h100"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    commands = dict(line.split(": ", 1) for line in out.strip().splitlines())
    assert list(commands) == [
        "env",
        "nccl",
        "sync",
        "moe_tiny",
        "dense_tiny",
        "calibrate",
        "plan",
        "sync_free",
        "moe_sync_free",
    ]
    for step in ("nccl", "sync", "moe_tiny", "dense_tiny", "sync_free", "moe_sync_free"):
        assert "-m torch.distributed.run --standalone --nproc-per-node=1" in commands[step], step
    assert "-g h100 -ng 1" in commands["moe_tiny"] and "--trace" in commands["moe_tiny"]
    assert "--calibrate" in commands["calibrate"] and "-g h100" in commands["calibrate"]
    for step in ("sync_free", "moe_sync_free"):
        assert "model.moe_expert_rank_capacity_factor=1.5" in commands[step], step


def test_the_script_runs_end_to_end_on_cpu_ranks(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)  # the machine's python3 there
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 8 and "gpu_check.json" in files and "gpu_check.log" in files, files
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert {n: s["status"] for n, s in steps.items()} == {
        "env": "pass",
        "nccl": "pass",
        "sync": "skipped",
        "moe_tiny": "pass",
        "dense_tiny": "pass",
        "calibrate": "skipped",
        "plan": "pass",
        "sync_free": "skipped",
        "moe_sync_free": "pass",
    }
    assert steps["moe_tiny"]["findings"]["steady_step_ms"] > 0
    assert steps["moe_sync_free"]["findings"]["steady_step_ms"] > 0
    assert steps["nccl"]["findings"]["gathered_correct"] is True


def test_the_documented_wheels_install_on_the_device_images_python(tmp_path):
    """Issue 47 item 3: `bash bench/gpu_check.sh wheels` downloads for the image's interpreter
    (Python 3.12), not this machine's 3.11 (whose cp311 PyYAML the image cannot install): a dry
    install of what the script installs, for Python 3.12 from those wheels alone, resolves."""
    wheels = tmp_path / "wheels"
    env = dict(os.environ, WHEELS=str(wheels), PYTHON=sys.executable)
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "wheels"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert any("cp312" in p.name for p in wheels.iterdir()), sorted(wheels.iterdir())
    dry = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links"]
        + [str(wheels), "--python-version", "3.12", "--only-binary=:all:"]
        + ["--target", str(tmp_path / "target"), "omegaconf", "PyYAML"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]


def test_the_script_goes_on_when_the_optional_install_fails(tmp_path):
    """An interpreter without omegaconf and a wheel folder that cannot install it: the script says
    so and runs its steps (here --dry: their commands) instead of ending under `set -e`."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True
    )
    (tmp_path / "wheels").mkdir()
    env = dict(
        os.environ, WHEELS=str(tmp_path / "wheels"), PYTHON=str(tmp_path / "bare/bin/python")
    )
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "h100", "--dry"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "going on" in done.stderr and "env: " in done.stdout
