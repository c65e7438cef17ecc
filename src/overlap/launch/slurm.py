"""Write an sbatch script that runs ``overlap run`` under torchrun on every node of a Slurm
allocation.

Layout: one Slurm task per node (``--ntasks-per-node=1``), and torchrun in that task starts
``gpus_per_node`` workers and rendezvouses with the other nodes over c10d at the first host of the
allocation.

The launch environment (see ``overlap.launch.env``) is exported in the batch script, i.e. before
torchrun starts the workers: CUDA reads ``CUDA_DEVICE_MAX_CONNECTIONS`` at context creation, so it
cannot be set later from Python. A variable already present in the job's environment (sbatch passes
on the submitting shell's) is left as it is, so the user's own environment keeps winning on the
cluster as it does locally.
"""

from __future__ import annotations

import re
import shlex

from overlap.errors import ConfigError

DEFAULT_MASTER_PORT = 29500

# #SBATCH lines are parsed by sbatch, not by the shell: keep their values to plain tokens so nothing
# can be injected.
_SBATCH_TOKEN = re.compile(r"[A-Za-z0-9_.+-]+")
_PARTITION = re.compile(r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*")
# Slurm time formats: minutes, minutes:seconds, hours:minutes:seconds,
# days-hours[:minutes[:seconds]].
_TIME_LIMIT = re.compile(r"\d+(-\d+)?(:\d+){0,2}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _positive_int(field: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field=field, value=value, why="must be a positive integer.", fix=fix)


def _token(field: str, value: str, pattern: re.Pattern[str], fix: str) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ConfigError(
            field=field,
            value=value,
            why="not a plain Slurm value (letters, digits, '_', '.', '+', '-' only; no spaces or "
            "newlines).",
            fix=fix,
        )


DEFAULT_TIME_LIMIT = "00:30:00"

# `overlap run` flags that shape the script, named as in Megatron-Bridge's performance scripts
# (-t/--time_limit, -a/--account, -p/--partition); they only mean something with --emit-slurm.
SLURM_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (
        ("-t", "--time_limit"),
        dict(
            default=None,
            metavar="TIME",
            help=f"with --emit-slurm: the job's time limit (#SBATCH --time), e.g. 04:00:00 or "
            f"1-00:00:00 (default {DEFAULT_TIME_LIMIT})",
        ),
    ),
    (
        ("-a", "--account"),
        dict(default=None, help="with --emit-slurm: the Slurm account (#SBATCH --account)"),
    ),
    (
        ("-p", "--partition"),
        dict(default=None, help="with --emit-slurm: the Slurm partition(s) (#SBATCH --partition)"),
    ),
]


def slurm_options(args) -> dict:
    """The script options from the command line; given without --emit-slurm they would do nothing:
    an error."""
    given = {name: getattr(args, name, None) for name in ("time_limit", "account", "partition")}
    if getattr(args, "emit_slurm", None) is None:
        for name, value in given.items():
            if value is not None:
                raise ConfigError(
                    f"--{name}",
                    value,
                    "it sets an option of the Slurm script, and no script is written.",
                    f"add --emit-slurm FILE, or drop --{name}.",
                )
        return {}
    fix = {
        "time_limit": "use a Slurm time limit such as 04:00:00 or 1-00:00:00.",
        "account": "name the Slurm account as given by your site.",
        "partition": "name one partition, or several separated by commas.",
    }
    patterns = {"time_limit": _TIME_LIMIT, "account": _SBATCH_TOKEN, "partition": _PARTITION}
    for name, value in given.items():
        if value is not None:
            # named as typed, before the script is written
            _token(f"--{name}", value, patterns[name], fix[name])
    return {
        "time_limit": given["time_limit"] or DEFAULT_TIME_LIMIT,
        "account": given["account"],
        "partition": given["partition"],
    }


def render_sbatch(
    *,
    job_name: str,
    num_nodes: int,
    gpus_per_node: int,
    overlap_args: list[str],
    env: dict[str, str],
    time_limit: str = DEFAULT_TIME_LIMIT,
    partition: str | None = None,
    account: str | None = None,
    gpus: bool = True,
) -> str:
    """Return the text of an sbatch script running ``overlap run <overlap_args>`` on ``num_nodes`` x
    ``gpus_per_node``.

    ``env`` is the launch environment to export (names to values, already decided by
    ``compute_launch_env``); ``overlap_args`` are passed to ``overlap.cli run`` one word each,
    shell-quoted. ``gpus=False`` (``-g cpu``): the ranks are CPU processes, so the script requests
    no GPUs (``gpus_per_node`` is then ranks per node).
    """
    _positive_int("--nodes", num_nodes, "pass a node count of 1 or more.")
    _positive_int(
        "--gpus_per_node", gpus_per_node, "pass -gn/--gpus_per_node with 1 or more GPUs per node."
    )
    _token(
        "--job_name",
        job_name,
        _SBATCH_TOKEN,
        "use a job name such as 'overlap-qwen3-30b' (no spaces).",
    )
    _token(
        "--time",
        time_limit,
        _TIME_LIMIT,
        "use a Slurm time limit such as '00:30:00' or '1-00:00:00'.",
    )
    if partition is not None:
        _token(
            "--partition",
            partition,
            _PARTITION,
            "name one partition, or several separated by commas.",
        )
    if account is not None:
        _token("--account", account, _SBATCH_TOKEN, "name the Slurm account as given by your site.")
    for name in env:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ConfigError(
                field="env_vars",
                value=name,
                why="not a valid environment variable name.",
                fix="use names made of letters, digits and '_', not starting with a digit.",
            )

    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={num_nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={gpus_per_node}"] if gpus else []),
        f"#SBATCH --time={time_limit}",
    ]
    if partition is not None:
        lines.append(f"#SBATCH --partition={partition}")
    if account is not None:
        lines.append(f"#SBATCH --account={account}")
    lines += [
        "#SBATCH --exclusive",
        "",
        "# Generated by overlap.launch.slurm.render_sbatch.",
        "set -euo pipefail",
        "",
    ]

    if env:
        lines += [
            "# Launch environment, set before torchrun starts the workers (CUDA reads "
            "CUDA_DEVICE_MAX_CONNECTIONS at",
            "# context creation). A variable already set in the job's environment is kept.",
        ]
        lines += [
            f"[[ -v {name} ]] || export {name}={shlex.quote(str(value))}"
            for name, value in env.items()
        ]
        lines.append("")

    lines += [
        "# Rendezvous at the first host of the allocation.",
        'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')"',
        "export MASTER_ADDR",
        f'export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_MASTER_PORT}}}"',
        "",
    ]

    command = [
        "srun torchrun",
        '--nnodes="$SLURM_NNODES"',
        f"--nproc-per-node={gpus_per_node}",
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "-m overlap.cli run",
        *(shlex.quote(str(arg)) for arg in overlap_args),
    ]
    lines.append(" \\\n    ".join(command))
    return "\n".join(lines) + "\n"
