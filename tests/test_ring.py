"""The ring exchange primitive (`overlap.parallel.ring`) alone, on 2 and 4 gloo ranks.

Each rank starts with chunks that name it, rotates them around the ring, and after every shift
must hold exactly the chunks of the rank `Ring.origin` names: a transfer is a copy, so the
tolerance is zero (bitwise equality). Also: several tensors (K and V of different dtypes) in one
shift, a stride-2 ring, a pair swap, and that a shift is ONE posted batch of a send and a receive
(what NCCL needs: one group call, one wait). With OVERLAP_TEST_NCCL_RULES=1 every run goes under
NCCL's rules (tags ignored, programs replayed against NCCL's streams).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from overlap.parallel import comm
from overlap.parallel.program import Post, ProgramRecorder
from overlap.parallel.ring import Ring, exchange
from tests.world import run_world


def _chunk(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank `rank`'s chunk: values no other rank's chunk has."""
    return (torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank).to(dtype)


def _rotations() -> list[str]:
    """Every check on this rank; the failures, as text (empty: all good)."""
    group = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    bad = []

    ring = Ring(group, "cp_kv")
    held = _chunk(r)
    for step in range(ring.steps):  # one full turn: back to the own chunk
        if not torch.equal(held, _chunk(ring.origin(step))):
            bad.append(f"after {step} shifts: {held.tolist()}, expected rank {ring.origin(step)}'s")
        held = ring.shift(held, torch.empty_like(held)).wait()
    if not torch.equal(held, _chunk(r)):
        bad.append("a full turn does not bring the own chunk back")

    kv = (_chunk(r), _chunk(r, torch.bfloat16))  # two tensors, two dtypes, one shift
    for step in range(1, n):
        kv = ring.shift(kv, [torch.empty_like(t) for t in kv]).wait()
        want = (_chunk(ring.origin(step)), _chunk(ring.origin(step), torch.bfloat16))
        if not all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(kv, want)):
            bad.append(f"k/v after {step} shifts are not rank {ring.origin(step)}'s")

    if n % 2 == 0:
        swapped = exchange(
            _chunk(r), torch.empty_like(_chunk(r)), r ^ 1, r ^ 1, group, "cp_kv"
        ).wait()
        if not torch.equal(swapped, _chunk(r ^ 1)):
            bad.append(f"the pair swap gave {swapped.tolist()}")
    if n == 4:
        pairs = Ring(group, "cp_kv", stride=2)
        got = pairs.shift(_chunk(r), torch.empty_like(_chunk(r))).wait()
        behind = (r - 2) % n
        if pairs.steps != 2 or pairs.origin(1) != behind or not torch.equal(got, _chunk(behind)):
            bad.append(f"stride 2: {got.tolist()} (steps {pairs.steps}, origin {pairs.origin(1)})")

    # One shift is one posted unit holding a send to the member ahead and a receive from behind.
    program = ProgramRecorder(enabled=True)  # under OVERLAP_TEST_NCCL_RULES=1: the job's rules kept
    with comm.using(dataclasses.replace(comm.session(), program=program)):
        ring.shift(_chunk(r), torch.empty_like(_chunk(r))).wait()
    entries = program.stop()
    posts = [e for e in entries if isinstance(e, Post)]
    members = comm.group_members(group)
    if len(posts) != 1 or sorted((op.op, op.peer) for op in posts[0].ops) != sorted(
        [("send", members[ring.ahead]), ("recv", members[ring.behind])]
    ):
        bad.append(f"one shift posted {posts}")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_ends_each_shift_with_the_expected_chunks(world):
    for rank, bad in enumerate(run_world(world, _rotations)):
        assert not bad, f"rank {rank}: " + "; ".join(bad)


def test_a_stride_that_does_not_divide_the_group_is_refused():
    assert run_world(2, _bad_stride) == [True, True]


def _bad_stride() -> bool:
    try:
        Ring(dist.group.WORLD, "cp_kv", stride=3)
    except ValueError as exc:
        return "stride 3" in str(exc)
    return False
