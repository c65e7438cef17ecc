"""Shared multi-process worlds for tests.

Starting a world costs seconds (every rank imports torch), so each world size is started once per
test session and then runs many test functions: `run_world(n, fn, *args)` sends a module-level
function (pickled by reference) to every rank of the n-rank world and returns the per-rank results
in rank order. Ranks run gloo with a short timeout so a bug fails fast instead of hanging CI, and
one compute thread each. An exception on any rank is re-raised here with that rank's traceback; the
world is then torn down and restarted on next use, so one failing test cannot poison the rest.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

_CTX = mp.get_context("spawn")
_WORLDS: dict[tuple, _World] = {}  # (size, environment) -> its world
RANK_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, inbox, outbox, env: dict[str, str]) -> None:
    # before torch.distributed reads it (TORCH_DISTRIBUTED_DEBUG wraps the groups at creation)
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    from overlap.parallel.trace import Recorder, recording

    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            # each job is a run of its own: its own tracer recorder (overlap.parallel.trace)
            with recording(Recorder()):
                result = fn(*args, **kwargs)
            # fail here, with a message, rather than in the queue's feeder thread
            ForkingPickler.dumps(result)
            outbox.put((rank, True, result, len(dist.distributed_c10d._world.pg_map)))
        except BaseException:  # report any failure, including assertion errors, to the test process
            outbox.put((rank, False, traceback.format_exc(), 0))
    from overlap.parallel import groups

    groups.forget_groups()
    dist.destroy_process_group()
    # the worker's exit skips the teardown's collections over torch's objects, as the `overlap`
    # command's does (`overlap.cli.entry`)
    gc.freeze()


class _World:
    def __init__(self, size: int, env: dict[str, str]) -> None:
        self.size = size
        self.groups = 0  # process groups a rank held after the last job
        port = _free_port()
        self.inboxes = [_CTX.Queue() for _ in range(size)]
        self.outbox = _CTX.Queue()
        self.procs = [
            _CTX.Process(
                target=_worker, args=(r, size, port, self.inboxes[r], self.outbox, env), daemon=True
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, kwargs: dict) -> list[Any]:
        for box in self.inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: list[str] = []
        for _ in range(self.size):
            try:
                rank, ok, value, self.groups = self.outbox.get(timeout=RANK_TIMEOUT_S)
            except Exception:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise RuntimeError(
                    f"world of {self.size}: no answer within {RANK_TIMEOUT_S}s (dead ranks: {dead})"
                ) from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(self.size)]

    def close(self) -> None:
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


# Every process group keeps gloo threads that wake every 10 ms (its TCP loop's epoll timeout) for as
# long as the world lives, and a rank keeps every group it built (comm caches them per layout): a
# 4-rank world that had held 40 groups burned a quarter of a core doing nothing, slowing every later
# test. A world whose ranks hold more is retired after its job and the next job starts a fresh one
# (a few seconds).
MAX_GROUPS = 32
# =1: every run_world job under NCCL's rules, its program replayed
NCCL_RULES_ENV = "OVERLAP_TEST_NCCL_RULES"


def run_world(size: int, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every rank of a shared `size`-rank gloo world; return results in
    rank order. With OVERLAP_TEST_NCCL_RULES=1 in the test process's environment every job runs as
    `run_world_nccl_rules`: the layout tests under NCCL's rules (tests that measure gloo's own
    behaviour are marked `gloo_only`)."""
    if os.environ.get(NCCL_RULES_ENV) == "1":
        return run_world_nccl_rules(size, fn, *args, **kwargs)
    return run_world_in({}, size, fn, *args, **kwargs)


def run_world_in(
    env: dict[str, str], size: int, fn: Callable, *args: Any, **kwargs: Any
) -> list[Any]:
    """`run_world` in a world whose ranks start with `env` set (a world per size and environment,
    shared too)."""
    key = (size, tuple(sorted(env.items())))
    world = _WORLDS.get(key)
    if world is None or not all(p.is_alive() for p in world.procs):
        if world is not None:
            world.close()
        world = _WORLDS[key] = _World(size, env)
    try:
        results = world.run(fn, args, kwargs)
    except BaseException:
        world.close()
        del _WORLDS[key]
        raise
    if world.groups > MAX_GROUPS:  # retired: the next job starts a fresh world
        close_world(size, env)
    return results


def close_world(size: int, env: dict[str, str] | None = None) -> None:
    """End the shared world of `size` ranks (and `env`) if one is running."""
    world = _WORLDS.pop((size, tuple(sorted((env or {}).items()))), None)
    if world is not None:
        world.close()


def _under_nccl_rules(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """On a rank: `fn` with comm under NCCL's rules (a `comm.CommSession(nccl_rules=True)` of the
    job's own); (its result, this rank's recorded program)."""
    from overlap.parallel import comm

    with comm.using(comm.CommSession(nccl_rules=True)) as rules:
        result = fn(*args, **kwargs)
    return result, rules.program.stop()


def run_world_nccl_rules(size: int, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
    """`run_world` with every rank under NCCL's rules: gloo carries the data, but batches give one
    work, futures complete at posting and tags are ignored; afterwards the ranks' recorded programs
    are replayed together with NCCL's streams (`overlap.parallel.program.check`: mismatched
    collectives, unmatched messages, deadlocks raise ProgramError). Returns the per-rank results."""
    from overlap.parallel.program import check

    out = run_world_in({}, size, _under_nccl_rules, fn, args, kwargs)
    check({rank: entries for rank, (_result, entries) in enumerate(out)})
    return [result for result, _entries in out]


@atexit.register
def _close_all() -> None:
    for world in _WORLDS.values():
        world.close()
