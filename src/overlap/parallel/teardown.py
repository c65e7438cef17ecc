"""Tearing a rank's distributed world down at the end of a run, in the one order safe at exit.

Every op launched by `overlap.parallel.comm` is registered until it has been waited for, completion
callback included, so the end of a run can drain whatever is still in flight before the groups go;
`shutdown` says the order and why the groups themselves must be freed before the interpreter exits.
"""

from __future__ import annotations

import gc
import logging
import weakref

import torch.distributed as dist

from overlap.parallel import comm, groups

log = logging.getLogger("overlap.comm")

# How long a failing rank waits for its outstanding ops at teardown (the launcher's grace: 10 s).
FAILING_DRAIN_S = 5.0


def shutdown(failing: bool = False) -> None:
    """Tear this rank's distributed world down, in the one order that is safe at exit:

    1. wait for every outstanding op and its completion callback (`comm.drain_outstanding`); while
       `failing` (an exception is on its way out) for at most FAILING_DRAIN_S, since a peer that
       died never completes its side;
    2. barrier (not while failing: the peers may be gone), so no rank frees its groups while a peer
       still talks to it;
    3. forget the parallel layer's references to the groups (comm's lookups, the group cache; a
       run's modelled link holds them weakly), `dist.destroy_process_group()`, and collect garbage,
       so that groups nobody else references are freed now (not while failing: joining a worker
       stuck on a dead peer hangs).

    Why: after wait() returns, gloo's worker thread may still hold the last reference to the
    finished op; releasing it frees the op's tensors, which takes the GIL. If that happens once the
    interpreter has begun to finalize, CPython ends the thread with pthread_exit, whose unwind
    through a noexcept C++ frame aborts the process ("terminate called without an active exception",
    exit -6). The barrier gives such a worker the GIL (the main thread releases it while it waits)
    before the rank can leave; a freed group's destructor joins its workers. destroy_process_group()
    alone joins nothing: gloo's threads live as long as a Python reference to their group. The
    caller should drop its own references (parallel state, model) first. Groups still alive
    afterwards are logged at debug level: today every run's are, since torch's garbage collector
    cannot see through the post-accumulate-grad hooks of DistributedDataParallel, which keep the
    model, and through it the groups, alive.
    """
    abandoned = comm.drain_outstanding(FAILING_DRAIN_S if failing else None)
    if abandoned:
        log.warning(
            "teardown: gave up waiting for %d op(s) still in flight (%s)",
            len(abandoned),
            ", ".join(sorted(set(abandoned))),
        )
    if not failing:
        comm.barrier()
    known = [weakref.ref(g) for g in {dist.group.WORLD, *comm.forget_lookups()}]
    groups.forget_groups()
    dist.destroy_process_group()
    if failing:
        return
    gc.collect()
    alive = sum(ref() is not None for ref in known)
    if alive:  # debug: today DDP's hooks keep every group (see above), nothing a user can act on
        log.debug(
            "teardown: %d process group(s) still referenced after shutdown; their worker threads "
            "stay alive until those references go",
            alive,
        )
