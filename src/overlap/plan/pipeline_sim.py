"""The pipeline schedule run as a discrete-event simulation: the step time of the real program,
bubble and p2p included, instead of the (p - 1) / (m v) formula alone.

Why simulate: the bubble formula assumes free transfers, and "overlapped p2p hides every transfer
behind the micro-batch's own compute" is wrong where a transfer sits on the schedule's critical
cycle. In plain 1F1B the last stage cannot start micro-batch i + 1 before its activation has
arrived, and the stage before it needs the gradient back first: the steady period is f + b + 2c
however early the receives are posted (the reason Megatron-Core allows `overlap_p2p_comm` only with
interleaving). The interleaved schedule has slack there, which its early receives use; our
overlapped p2p makes slack in 1F1B too by sending each input gradient before the weight gradients
(`overlap.pipeline.executor`'s notes), which also shortens the drain. All of this falls out of
running the program.

The programs are the runtime's own (`overlap.pipeline.schedules.pipeline_steps`: Megatron-Core's
warm-up / steady / cool-down and its interleaved table), with the executor's p2p rules
(`PipelineExecutor`):
- a transfer starts when the send and its receive are both posted (rendezvous, NCCL's and gloo's),
  queued behind earlier sends of the same rank and direction, and takes `transfer` seconds - or,
  given as a `Transfer` (bytes on a link), the link's time for them, with a rate-limited link's
  token bucket: each rank's share, refilled while none of its sends is on the link
  (`overlap.plan.hardware.TokenBucket`; the messages are booked in the order the ranks' programs
  meet, so a rank's two directions can book slightly out of time order, where no refill is counted);
- batched (`batch_p2p_comm`): a task's output is sent with the next task's receive, that receive is
  posted when the task is about to run and waited at once (sends never block: their link time is the
  receiver's wait);
- overlapped (`overlap_p2p_comm`): sends are posted when their tensor exists and never block; the
  receive of the next forward (and of the next backward) is posted as soon as the previous one of
  its direction has been consumed; in plain 1F1B a backward (not merged) posts its gradient after
  its input-gradient share (1 - `wgrad_share`) and then runs its weight gradients, except on the
  first stage, which sends no gradient and runs them after its next task (the last at the end),
  bringing that forward's send forward (`overlap.pipeline.executor`'s notes).

A task's time is the micro-batch's forward / backward time on the average stage, times its virtual
stage's weight (its layers; the output layer on the last stage), so unequal stages idle the others
as they do in the runtime. The step ends when the slowest rank is done.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from overlap.pipeline.schedules import Task, pipeline_steps
from overlap.plan.hardware import TokenBucket, Transfer

FWD, BWD = 0, 1


@dataclass(frozen=True)
class PipelineTimes:
    """Seconds of one step's pipeline program."""

    step_s: float  # the slowest rank's end, its sends complete
    compute_s: float  # one rank's tasks back to back


Message = tuple[int, int, int]  # (direction, receiving virtual stage, micro-batch)


def simulate(
    pp: int,
    vpp: int,
    microbatches: int,
    fwd_s: float,
    bwd_s: float,
    transfer: float | Transfer,
    overlapped: bool,
    group: int | None = None,
    weights: tuple[float, ...] | None = None,
    merged: bool = False,
    wgrad_share: float = 0.5,
    exact: bool = True,
    warmup_depth: int = 1,
) -> PipelineTimes:
    """Run every rank's program with per-task times `fwd_s` / `bwd_s` (one micro-batch through one
    model chunk of average work; virtual stage v's tasks take `weights[v]` times that) and
    `transfer` per activation or gradient; see the module docstring for the p2p rules. `compute_s`
    is the average rank's work. `merged` (EP overlap): the merged program (one more warm-up
    forward), each steady step one unit that waits for both its receives first. `wgrad_share`: the
    share of a backward that is weight gradient (the planner's convention: half). `exact=False`
    (the layout search, pricing hundreds of layouts): past a few periods of the schedule the step
    grows by the same time per micro-batch group, so a long step is extrapolated from short ones
    once three of them show that slope settled (`_extrapolated`; longer ones where it has not).
    `warmup_depth`: plain 1F1B's warm-up multiple (`comm_overlap.p2p_warmup_depth`)."""
    compute = microbatches * vpp * (fwd_s + bwd_s)
    if pp <= 1:
        return PipelineTimes(compute, compute)
    whole = None if exact else _extrapolated(microbatches, pp * warmup_depth, group or pp)
    while whole is not None:
        # the same last partial group as the long program: its chunks end the table
        short = whole + microbatches % (group or pp)
        args = (pp, vpp)
        rest = (fwd_s, bwd_s, transfer, overlapped, group, weights, merged, wgrad_share)
        t1, t2, t3 = (
            simulate(*args, short + k * whole, *rest, warmup_depth=warmup_depth).step_s
            for k in range(3)
        )
        if abs((t3 - t2) - (t2 - t1)) <= 1e-9 * t3:  # settled: every group adds the same
            return PipelineTimes(t1 + (microbatches - short) * (t2 - t1) / whole, compute)
        whole = 2 * whole if microbatches > 3 * (2 * whole) else None
    weights = (1.0,) * (pp * vpp) if weights is None else weights
    if len(weights) != pp * vpp:
        raise ValueError(f"{len(weights)} stage weights for {pp * vpp} virtual stages")
    ops = _programs(pp, vpp, microbatches, group, merged, warmup_depth)

    # by message id (`_Op`): when its send and its receive were posted, when it arrived
    messages = 2 * pp * vpp * microbatches
    sent: list[float | None] = [None] * messages
    received: list[float | None] = [None] * messages
    arrival: list[float | None] = [None] * messages
    # by queue, 2 x sending rank + direction: the queue is free from
    link_free = [0.0] * (2 * pp)
    # by sending rank: its share of the link's bucket (both directions), and when its last transfer
    # so far ended
    buckets: list[TokenBucket | None] = [None] * pp
    sent_until = [0.0] * pp

    def arrived(message: int, backward: bool, sender: int) -> float | None:
        """The message's arrival once both sides have posted (booked on the sender's queue), else
        None."""
        at = arrival[message]
        if at is None and sent[message] is not None and received[message] is not None:
            queue = 2 * sender + backward
            start = max(sent[message], received[message], link_free[queue])
            if isinstance(transfer, Transfer):
                bucket = buckets[sender]
                if bucket is None:
                    bucket = buckets[sender] = TokenBucket(transfer.link)
                bucket.idle(start - sent_until[sender])
                seconds = bucket.send_s(transfer.nbytes)
                sent_until[sender] = max(sent_until[sender], start + seconds)
            else:
                seconds = transfer
            link_free[queue] = arrival[message] = at = start + seconds
        return at

    clock = [0.0] * pp
    index = [0] * pp
    # batched: an output travelling with the next task's receive (-1: none)
    pending = [-1] * pp
    # overlapped: the last receive of each direction used (forward, backward)
    consumed = [[0.0, 0.0] for _ in range(pp)]
    # overlapped: the weight-gradient seconds a rank's last backward left for after its next task
    owed = [0.0] * pp

    def advance(rank: int) -> bool:
        """Run the rank's next task if it can start; False while it waits for a message whose send
        is not posted."""
        op = ops[rank][index[rank]]
        for message, backward, _sender in op.wants:
            if received[message] is None:
                received[message] = consumed[rank][backward] if overlapped else clock[rank]
            if pending[rank] >= 0:  # batched: one exchange with the pending send
                sent[pending[rank]] = clock[rank]
                pending[rank] = -1
        times = [arrived(*want) for want in op.wants]
        if None in times:
            return False
        clock[rank] = max([clock[rank], *times])
        seconds = (bwd_s if op.backward else fwd_s) * weights[op.stage]
        split = wgrad_share if overlapped and vpp == 1 and not merged and op.backward else 0.0
        clock[rank] += seconds * (1 - split)
        consumed[rank][op.backward] = clock[rank]
        # a stage that sends its gradient pays its weight gradients right after the send (below),
        # the first stage after its next task
        first = op.stage == 0
        paid, owed[rank] = owed[rank], seconds * split if first else 0.0
        now_paid = 0.0 if first else seconds * split
        if op.out >= 0:
            if overlapped or not op.batched:
                sent[op.out] = clock[rank]
            else:
                pending[rank] = op.out
        index[rank] += 1
        clock[rank] += now_paid + paid + (owed[rank] if index[rank] == len(ops[rank]) else 0.0)
        return True

    while any(index[r] < len(ops[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while index[r] < len(ops[r]) and advance(r):
                progressed = True
        if not progressed:
            raise RuntimeError(
                f"pipeline simulation deadlocked (pp={pp}, vpp={vpp}, m={microbatches}, "
                f"{'overlapped' if overlapped else 'batched'})"
            )
    return PipelineTimes(max(clock), compute)


class _Op(NamedTuple):
    """One task of a rank's program with what the simulation asks of it: whether it is a backward,
    its virtual stage, the messages it waits for (its own receive; merged, its backward partner's
    too) as (id, whether a gradient, sending rank), the message it sends (-1: none), and whether the
    next task receives (batched p2p then sends the two together). A message (direction, receiving
    virtual stage, micro-batch) is numbered (direction x stages + stage) x micro-batches +
    micro-batch, so the simulation keeps its times in lists, not dicts keyed by tuples."""

    backward: bool
    stage: int
    wants: tuple[tuple[int, bool, int], ...]
    out: int
    batched: bool


@functools.lru_cache(maxsize=1024)
def _programs(
    pp: int, vpp: int, microbatches: int, group: int | None, merged: bool, warmup_depth: int
) -> tuple[tuple[_Op, ...], ...]:
    """Each rank's program as `_Op`s; cached, since the layout search simulates the same few
    programs under hundreds of task times."""
    stages = pp * vpp

    def numbered(message: Message) -> int:
        direction, v, mb = message
        return (direction * stages + v) * microbatches + mb

    def needs(rank: int, task: Task) -> Message | None:
        v = task.chunk * pp + rank
        if not task.backward and v > 0:
            return FWD, v, task.microbatch
        if task.backward and v < stages - 1:
            return BWD, v, task.microbatch
        return None

    def produces(rank: int, task: Task) -> Message | None:
        v = task.chunk * pp + rank
        if not task.backward and v < stages - 1:
            return FWD, v + 1, task.microbatch
        if task.backward and v > 0:
            return BWD, v - 1, task.microbatch
        return None

    def wanted(message: Message) -> tuple[int, bool, int]:
        direction, v, _mb = message
        sender = (v - 1 if direction == FWD else v + 1) % pp
        return numbered(message), direction == BWD, sender

    out = []
    for rank in range(pp):
        prog = pipeline_steps(pp, rank, vpp, microbatches, group, merged, warmup_depth)
        tasks = [t for step in prog for t in (step.forward, step.backward) if t is not None]
        # merged: a steady step waits for its backward's receive too before its forward starts
        partner = {s.forward: s.backward for s in prog if merged and s.forward and s.backward}
        ops = []
        for i, task in enumerate(tasks):
            wants = (needs(rank, task), needs(rank, partner[task]) if task in partner else None)
            following = tasks[i + 1] if i + 1 < len(tasks) else None
            sends = produces(rank, task)
            ops.append(
                _Op(
                    task.backward,
                    task.chunk * pp + rank,
                    tuple(wanted(w) for w in wants if w is not None),
                    -1 if sends is None else numbered(sends),
                    following is not None and needs(rank, following) is not None,
                )
            )
        out.append(tuple(ops))
    return tuple(out)


def _extrapolated(microbatches: int, pp: int, group: int | None) -> int | None:
    """The whole groups of the short step for `simulate(exact=False)`: a whole number of the
    interleaved table's groups, at least four pipeline depths (the fill, the drain and a settled
    steady state between them); None when the step is not much longer than twice that."""
    size = group or pp
    short = size * -(-4 * pp // size)
    return short if microbatches > 3 * short else None
