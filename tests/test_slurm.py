"""The sbatch script writer: layout, torchrun arguments, quoting, validation, and that bash parses
the result."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from overlap.errors import ConfigError
from overlap.launch.slurm import render_sbatch


def render(**overrides) -> str:
    kwargs = dict(
        job_name="overlap-test",
        num_nodes=2,
        gpus_per_node=8,
        overlap_args=["-g", "h100", "-ng", "16"],
        env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVTE_FWD_LAYERNORM_SM_MARGIN": "16"},
    )
    kwargs.update(overrides)
    return render_sbatch(**kwargs)


def srun_line(script: str) -> str:
    """The srun command with its line continuations joined."""
    joined = script.replace(" \\\n    ", " ")
    (line,) = [ln for ln in joined.splitlines() if ln.startswith("srun ")]
    return line


def test_layout_and_torchrun_arguments():
    script = render(partition="batch", account="proj")
    assert script.startswith("#!/bin/bash\n")
    for directive in (
        "#SBATCH --job-name=overlap-test",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=00:30:00",
        "#SBATCH --partition=batch",
        "#SBATCH --account=proj",
        "#SBATCH --exclusive",
    ):
        assert directive in script.splitlines()
    assert "set -euo pipefail" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in script
    assert 'export MASTER_PORT="${MASTER_PORT:-29500}"' in script
    # Environment is exported before the workers start, and an inherited value is kept.
    assert script.index("CUDA_DEVICE_MAX_CONNECTIONS=1") < script.index("srun ")
    assert "[[ -v CUDA_DEVICE_MAX_CONNECTIONS ]] || export CUDA_DEVICE_MAX_CONNECTIONS=1" in script

    words = shlex.split(srun_line(script))
    assert words[:2] == ["srun", "torchrun"]
    assert "--nnodes=$SLURM_NNODES" in words
    assert "--nproc-per-node=8" in words
    assert "--rdzv-backend=c10d" in words
    assert "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" in words
    assert "--rdzv-id=$SLURM_JOB_ID" in words
    module = words.index("-m")
    assert words[module:] == ["-m", "overlap.cli", "run", "-g", "h100", "-ng", "16"]


def test_optional_directives_absent_by_default():
    script = render()
    assert "--partition" not in script
    assert "--account" not in script


def test_args_with_spaces_and_metacharacters_are_quoted():
    tricky = ["--name", "my run; rm -rf /", "model.note=$(whoami) `id`", "it's"]
    script = render(overlap_args=tricky, env={"NOTE": "a b $HOME"})
    words = shlex.split(srun_line(script))
    assert words[-len(tricky) :] == tricky
    assert "export NOTE='a b $HOME'" in script


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_bash_accepts_the_rendered_script(tmp_path):
    script = render(
        overlap_args=["--name", "my run; echo pwned", "x=$(id)", "it's"],
        env={"NOTE": "a 'quoted' value", "EMPTY": ""},
        partition="gpu,gpu-long",
        time_limit="1-00:00:00",
    )
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_script_words_reach_srun_unchanged(tmp_path):
    # Run the script with scontrol and srun stubbed, and check what srun receives, word for word.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'node-a\\nnode-b\\n'\n")
    (bin_dir / "srun").write_text(
        '#!/bin/bash\nprintf "%s\\n" "$@" > "$OUT_FILE"\n'
        'printf "%s\\n" "$CUDA_DEVICE_MAX_CONNECTIONS" "$NOTE" "$MASTER_ADDR" >> "$OUT_FILE"\n'
    )
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    args = ["--name", "my run; echo pwned", "x=$(id)", "it's"]
    path = tmp_path / "job.sbatch"
    path.write_text(
        render(overlap_args=args, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NOTE": "a b"})
    )
    out = tmp_path / "srun-args"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "OUT_FILE": str(out),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "42",
        "CUDA_DEVICE_MAX_CONNECTIONS": "7",  # inherited from the submitting shell: must be kept
    }
    result = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    got = out.read_text().splitlines()
    assert got[:7] == [
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a:29500",
        "--rdzv-id=42",
        "-m",
    ]
    assert got[7:9] == ["overlap.cli", "run"]
    assert got[9:13] == args
    assert got[13:] == ["7", "a b", "node-a"]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_bad_num_nodes_raises_config_error(bad):
    with pytest.raises(ConfigError) as info:
        render(num_nodes=bad)
    assert info.value.field == "--nodes"


@pytest.mark.parametrize("bad", [0, -8])
def test_bad_gpus_per_node_raises_config_error(bad):
    with pytest.raises(ConfigError) as info:
        render(gpus_per_node=bad)
    assert info.value.field == "--gpus_per_node"


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("--job_name", {"job_name": "two words"}),
        ("--job_name", {"job_name": "x\n#SBATCH --nodes=99"}),
        ("--time", {"time_limit": "soon"}),
        ("--partition", {"partition": "a b"}),
        ("--account", {"account": "acct\nrm -rf /"}),
        ("env_vars", {"env": {"BAD-NAME": "1"}}),
    ],
)
def test_values_that_could_break_the_script_are_rejected(field, overrides):
    with pytest.raises(ConfigError) as info:
        render(**overrides)
    assert info.value.field == field
