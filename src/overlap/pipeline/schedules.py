"""Pipeline-parallel programs: non-interleaved 1F1B and interleaved 1F1B (virtual pipeline), as pure
functions.

The program (`pipeline_steps`) is a pure function of (PP, this rank, VPP, micro-batches, group size)
giving the rank's compute in order as `Step`s. Warm-up steps carry one forward, steady steps one
forward AND one backward, cool-down steps one backward. The steady step is the unit that EP overlap
merges (the forward of one (micro-batch, chunk) and the backward of another, layer piece by layer
piece: `merged=True`, one more warm-up forward, and the executor runs each step through
`combined_1f1b.run_merged`); without it the two tasks run one after the other. The interleaved
program is Megatron-Core's: a table maps virtual micro-batch k to (micro-batch, chunk) in groups of
`microbatch_group_size_per_vp_stage` micro-batches per chunk; warm-up =
(PP - rank - 1) x 2 + (VPP - 1) x group forwards (PP - rank - 1 without VPP); backward chunks are
mirrored. VPP = 1 is the non-interleaved 1F1B: one implementation for both.

`warmup_depth` (plain 1F1B only; `comm_overlap.p2p_warmup_depth`, ours) runs depth x (PP - rank - 1)
warm-up forwards, each stage that many micro-batches ahead of the next. Why: in 1F1B's steady state
the gradient of B(k) going down from stage p + 1 to p and the activation of p's next forward going
back up sit on one cycle with stage p + 1's program. With each stage one more micro-batch ahead
(depth 2, the interleaved schedule's doubling) the forward that activation feeds comes a whole step
later, so the cycle's two transfers travel under a step of compute (each up to half a forward-
backward hides) instead of a weight-gradient time.
The price: (depth - 1) x (PP - rank - 1) more micro-batches' activations alive on pipeline rank r.

`StageRing` places a rank's chunks among the virtual stages: virtual stage v = chunk x PP + rank, so
the next stage is always on rank + 1 (mod PP) and the previous on rank - 1: a ring. It names the
message each task consumes (`Message`: direction, receiving virtual stage, micro-batch) and who
produced it. Running a program is `overlap.pipeline.executor`'s business; moving its messages,
`overlap.pipeline.p2p`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

FWD, BWD = 0, 1  # the direction a message travels: activations forward, their gradients backward
Message = tuple[int, int, int]  # (direction, receiving virtual stage, micro-batch)


@dataclass(frozen=True)
class Task:
    backward: bool
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Step:
    """One schedule step: a forward, a backward, or (steady state) both."""

    forward: Task | None
    backward: Task | None


def schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """Virtual micro-batch k -> (micro-batch, chunk): micro-batches in groups of `group`, each group
    through every chunk before the next group starts (the last group may be shorter)."""
    table = []
    for first in range(0, num_microbatches, group):
        members = range(first, min(first + group, num_microbatches))
        table += [(mb, chunk) for chunk in range(vpp) for mb in members]
    return table


def pipeline_steps(
    pp: int,
    rank: int,
    vpp: int,
    num_microbatches: int,
    group: int | None = None,
    merged: bool = False,
    warmup_depth: int = 1,
) -> list[Step]:
    """This rank's program: warm-up forwards, steady (forward, backward) pairs, cool-down backwards.
    `merged` (EP overlap runs each steady pair as one merged step): one more warm-up forward, as
    Megatron-Core adds, so that a steady step never pairs a backward with its own micro-batch's
    forward; at PP = 1 this is the combined 1F1B, F(0) alone, F(i) with B(i-1), B(last) alone.
    `warmup_depth`: plain 1F1B's warm-up multiple (module notes)."""
    if warmup_depth < 1 or (warmup_depth != 1 and vpp != 1):
        raise ValueError(f"warmup_depth={warmup_depth}: a positive multiple, in plain 1F1B only")
    table = schedule_table(num_microbatches, vpp, group or pp)
    total = len(table)
    if vpp == 1:
        warmup = (pp - rank - 1) * warmup_depth
    else:
        warmup = (pp - rank - 1) * 2 + (vpp - 1) * (group or pp)
    warmup = min(warmup + merged, total)
    forwards = [Task(False, mb, chunk) for mb, chunk in table]
    backwards = [Task(True, mb, vpp - 1 - chunk) for mb, chunk in table]
    steps = [Step(forwards[k], None) for k in range(warmup)]
    steps += [Step(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
    steps += [Step(None, backwards[k]) for k in range(total - warmup, total)]
    return steps


def step_tasks(steps: list[Step]) -> list[Task]:
    """The tasks of `steps` in the order they run (a steady step's forward, then its backward)."""
    return [t for s in steps for t in (s.forward, s.backward) if t is not None]


def program_tasks(
    pp: int,
    rank: int,
    vpp: int,
    num_microbatches: int,
    group: int | None = None,
    merged: bool = False,
    warmup_depth: int = 1,
) -> list[Task]:
    """The rank's tasks in the order it runs them."""
    return step_tasks(pipeline_steps(pp, rank, vpp, num_microbatches, group, merged, warmup_depth))


@dataclass(frozen=True)
class StageRing:
    """Where this rank's `vpp` chunks sit among the PP x VPP virtual stages (module notes)."""

    pp: int
    rank: int
    vpp: int

    def virtual(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.pp * self.vpp - 1

    def consumes(self, task: Task) -> Message | None:
        """The message `task` receives before it runs, if any (none on the pipeline's ends)."""
        if not task.backward and not self.is_first(task.chunk):
            return FWD, self.virtual(task.chunk), task.microbatch
        if task.backward and not self.is_last(task.chunk):
            return BWD, self.virtual(task.chunk), task.microbatch
        return None

    def producer(self, message: Message) -> tuple[int, Task]:
        """(pp rank, task) that produced `message`."""
        direction, virtual, mb = message
        source = virtual - 1 if direction == FWD else virtual + 1
        return source % self.pp, Task(direction == BWD, mb, source // self.pp)
