"""The script `overlap run ... --emit-slurm` writes, under a real Slurm: a one-node cluster on this
machine (munge, slurmctld, slurmd; CPU partition, no cgroups), configured here in a temporary
folder. One job trains and its output carries the losses and the summary; a second is preempted by
`scancel` (SIGTERM through srun and torchrun to the ranks: `train.exit_signal_handler=true` saves a
checkpoint at the step boundary), and the same script resubmitted resumes from it, the losses
continuing exactly as the uninterrupted run's.

Needs root and the Debian packages slurm-wlm and munge (`.ci/setup_slurm.sh` installs them as root);
skipped, naming what is missing, elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from overlap.launch.local import free_port
from tests.local_run import metrics_losses, run_locally

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "sinfo")
MUNGE_SOCKET_DIR = Path("/run/munge")
RECIPE = "-m qwen -mr dense_tiny -g cpu -ng 2".split()


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "a Slurm cluster on this machine needs root (slurmd starts jobs as their user)"
    absent = [
        tool
        for tool in DAEMONS
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()
    ]
    if absent:
        return (
            f"{', '.join(absent)} not installed: .ci/setup_slurm.sh installs the Debian packages "
            "slurm-wlm and munge as root (apt-get); its output in the CI log says why it could not"
        )
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _munge_works() -> bool:
    try:
        encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
        if encoded.returncode != 0:
            return False
        decoded = subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True, timeout=10)
        return decoded.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _start_munge() -> int | None:
    """Start munged as the munge user unless one already answers; returns the pid of the one started
    here."""
    if _munge_works():
        return None
    MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        subprocess.run(
            ["runuser", "-u", "munge", "--", _tool("mungekey"), "--create"], check=True, timeout=30
        )
    subprocess.run(["runuser", "-u", "munge", "--", _tool("munged")], check=True, timeout=30)
    until = time.monotonic() + 20
    while not _munge_works():
        assert time.monotonic() < until, "munged started but does not answer"
        time.sleep(0.2)
    pid_file = MUNGE_SOCKET_DIR / "munged.pid"
    return int(pid_file.read_text()) if pid_file.exists() else None


def _stop(pid_file: Path) -> None:
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        return
    until = time.monotonic() + 15
    while Path(f"/proc/{pid}").exists() and time.monotonic() < until:
        time.sleep(0.1)
    if Path(f"/proc/{pid}").exists():
        os.kill(pid, signal.SIGKILL)


SLURM_CONF = """\
ClusterName=overlaptest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
# processes tracked by parentage, no cgroups (containers seldom delegate them)
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/linear
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
# scancel: SIGTERM, then SIGKILL this many seconds later (the ranks' time to save)
KillWait=30
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class Cluster:
    dir: Path
    env: dict[str, str]

    def slurm(self, *args: str, timeout: float = 30) -> str:
        done = subprocess.run(
            list(args), env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
        return done.stdout

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
            for p in sorted(self.dir.glob("*.log"))
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool"):
        (root / sub).mkdir()
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(
        SLURM_CONF.format(
            host=host, dir=root, ctld_port=free_port(), slurmd_port=free_port(), cpus=os.cpu_count()
        )
    )
    bin_dir = os.path.dirname(sys.executable)  # this environment's torchrun, for the jobs too
    env = {
        **os.environ,
        "SLURM_CONF": str(conf),
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    munged = _start_munge()
    try:
        for daemon in ("slurmctld", "slurmd"):
            subprocess.run([_tool(daemon), "-f", str(conf)], env=env, check=True, timeout=30)
        up = Cluster(root, env)
        until = time.monotonic() + 30
        while up.slurm("sinfo", "-h", "-o", "%t").strip() != "idle":
            assert time.monotonic() < until, f"the node never became idle:\n{up.logs()}"
            time.sleep(0.3)
        yield up
    finally:
        subprocess.run(
            ["scancel", "--full", "-u", "root"], env=env, capture_output=True, timeout=30
        )
        for daemon in ("slurmd", "slurmctld"):
            _stop(root / f"{daemon}.pid")
        if munged is not None:
            _stop(MUNGE_SOCKET_DIR / "munged.pid")


def _emit(tmp_path: Path, name: str, args: list[str]) -> Path:
    script = tmp_path / f"{name}.sbatch"
    done = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "run", *args, "--emit-slurm", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return script


def _sbatch(cluster: Cluster, script: Path, out: Path) -> str:
    # kept by the script: no clash with another run on this machine
    env = {**cluster.env, "MASTER_PORT": str(free_port())}
    done = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        cwd=script.parent,
    )
    assert done.returncode == 0, f"{done.stderr}\n{_text(out)}\n{cluster.logs()}"
    return done.stdout.strip().split(";")[0]


def _wait_gone(cluster: Cluster, job: str, out: Path, timeout: float = 120) -> str:
    """Wait until `job` leaves the queue (polled here: `sbatch --wait` sleeps up to half a minute
    between looks); returns its final state."""
    until = time.monotonic() + timeout
    while cluster.slurm("squeue", "-h", "-j", job).strip():
        assert time.monotonic() < until, f"job {job} still queued or running:\n{_text(out)}"
        time.sleep(0.3)
    shown = cluster.slurm("scontrol", "show", "job", job)
    return next(word.split("=", 1)[1] for word in shown.split() if word.startswith("JobState="))


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(nothing written)"


def test_the_emitted_script_trains_under_slurm(cluster, tmp_path):
    args = [*RECIPE, "-ms", "3", "--metrics", str(tmp_path / "job.jsonl")]
    out = tmp_path / "job.out"
    job = _sbatch(cluster, _emit(tmp_path, "job", args), out)
    assert _wait_gone(cluster, job, out) == "COMPLETED", out.read_text()[-3000:]
    text = out.read_text()
    assert "steady-state step time over iterations 2-3" in text, text[-3000:]
    assert "exposed communication" in text
    summary = json.loads((tmp_path / "job.jsonl.summary.json").read_text())
    assert summary["window_iterations"] == [2, 3] and summary["stopped"] is None
    want = run_locally(RECIPE + ["-ms", "3"], tmp_path / "local.jsonl")
    # tolerance 0: the same ranks and operations
    assert metrics_losses(tmp_path / "job.jsonl") == want


def test_scancel_preempts_with_a_checkpoint_and_the_resubmitted_job_continues_exactly(
    cluster, tmp_path
):
    total = 24
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "job.jsonl"
    resumable = f"checkpoint.save={ckpt} checkpoint.load={ckpt} train.exit_signal_handler=true"
    args = [*RECIPE, "-ms", str(total), *resumable.split(), "--metrics", str(metrics)]
    script = _emit(tmp_path, "preempt", args)
    first = tmp_path / "first.out"
    job = _sbatch(cluster, script, first)
    until = time.monotonic() + 90
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < until, f"no progress:\n{_text(first)}"
        time.sleep(0.2)
    # what a preemption does: SIGTERM to the job's processes, SIGKILL after KillWait
    cluster.slurm("scancel", job)
    assert _wait_gone(cluster, job, first, timeout=60) == "CANCELLED"
    text = first.read_text()
    saved = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < total, text[-3000:]
    assert (
        f"stopping after iteration {saved} of {total}: SIGTERM received "
        f"(train.exit_signal_handler); checkpoint of iteration {saved} in {ckpt}"
    ) in text
    before = metrics_losses(metrics)

    second = tmp_path / "second.out"
    job = _sbatch(cluster, script, second)  # the same script: it loads what the first job saved
    assert _wait_gone(cluster, job, second) == "COMPLETED", second.read_text()[-3000:]
    assert f"training resumes at iteration {saved}" in second.read_text()
    want = run_locally(RECIPE + ["-ms", str(total)], tmp_path / "uninterrupted.jsonl")
    assert {it: before[it] for it in range(1, saved + 1)} == {
        it: want[it] for it in range(1, saved + 1)
    }
    assert metrics_losses(metrics) == {
        it: loss for it, loss in want.items() if it > saved
    }  # tolerance 0
