"""Start N local ranks (one process each) and watch them: a rank that dies takes the job down with its name.

Each rank is the same `overlap run ...` command line with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, exactly
what torchrun would give it, so local and cluster runs share one code path. If a rank exits with an error, the others
get a short grace period (they usually fail on their next collective) and are then killed, and the launcher exits
non-zero naming the first failed rank. A rank that hangs is bounded by the process-group timeout.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from overlap.errors import RankFailure

GRACE_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(base: Mapping[str, str], rank: int, world: int, addr: str, port: int) -> dict[str, str]:
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR=addr, MASTER_PORT=str(port))
    env.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank: ranks share the machine's cores
    return env


def launch_local(command: Sequence[str], world: int, env: Mapping[str, str], addr: str = "127.0.0.1",
                 prefix: Sequence[str] = ()) -> None:
    """Run `prefix + command` once per rank and wait; raise RankFailure naming the first rank that failed."""
    port = free_port()  # free here; a fresh network namespace (prefix) has an empty port space anyway
    procs = [subprocess.Popen([*prefix, *command], env=rank_env(env, r, world, addr, port)) for r in range(world)]
    failed: tuple[int, int] | None = None
    deadline: float | None = None
    # SIGTERM (timeout, a scheduler, a killed bench) must unwind like Ctrl-C, so the ranks are stopped and the
    # caller's `finally` (e.g. deleting the network namespace) runs.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if failed is None:
                for r, c in enumerate(codes):
                    if c not in (None, 0):
                        failed, deadline = (r, c), time.monotonic() + GRACE_S
                        break
            if all(c is not None for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGKILL)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        stop_by = time.monotonic() + GRACE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.0, stop_by - time.monotonic()))
            except subprocess.TimeoutExpired:  # a rank stuck in a collective ignores SIGINT: do not wait for it
                p.kill()
                p.wait()
    if failed is not None:
        rank, code = failed
        raise RankFailure(f"rank {rank} of {world} failed (exit code {code}); the other ranks were stopped")


def _raise_interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def python_module_command(module: str, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", module, *argv]
