"""The CUDA branch of the MoE split-size read (`overlap.layers.moe.split_sizes.read_split_sizes`),
forced on the CPU with stand-in streams (tests/stand_in_cuda.py): the counts are copied to
(stand-in) pinned memory on the named side stream, which waits for the counts exchange - or, where
the counts group has one member (EP 1, or the `ep` family free) and nothing was exchanged, follows
the compute stream. Issue 47 item 2: with one member the branch asked a handle that never had works
for its output and raised, in every single-GPU MoE run's first MoE layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.layers.moe.split_sizes import read_split_sizes
from overlap.parallel import comm, streams
from overlap.parallel.state import ParallelState
from overlap.training.trainer import Trainer
from tests.configs import tiny_config
from tests.stand_in_cuda import StandInStreams
from tests.world import run_world


def _read() -> tuple[list[int], list[int], list[str], list[str], bool]:
    """One read of [3, 1] sent, exchanged over the world; (host counts, received, the streams that
    waited, the streams the inputs were kept for, whether the side stream is high-priority)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sent = torch.tensor([3 + rank, 1], dtype=torch.int64)
    handle = comm.all_to_all(
        sent, dist.group.WORLD, "ep_counts", [2 // size] * size, [2 // size] * size
    )
    api = StandInStreams()
    with streams.set_api(api):
        host, received = read_split_sizes(sent, handle, lambda h: h.wait(), lambda: [0])
    (side,) = api.made
    return (
        host,
        received.tolist(),
        [name for name, _w in api.waits],
        [name for _t, name in api.kept],
        side.high_priority,
    )


def test_a_one_member_counts_group_reads_its_own_counts_on_the_side_stream():
    ((host, received, waited, kept, high),) = run_world(1, _read)
    assert host == [3, 1, 3, 1] and received == [3, 1]
    # nothing was exchanged: no work to wait for; the side stream followed the compute stream
    assert waited == [] and kept == ["pool-high-0", "pool-high-0"] and high


def test_two_members_read_after_the_exchange_on_the_side_stream():
    for rank, (host, received, waited, kept, high) in enumerate(run_world(2, _read)):
        assert host == [3 + rank, 1, 3, 4] if rank == 0 else host == [4, 1, 1, 1]
        assert len(received) == 2 and waited == [] and len(kept) == 2 and high


def _train_single_rank_moe(forced: bool) -> list[float]:
    """Two steps' losses of the tiny MoE on one rank (EP 1), the CUDA branch of the split-size read
    `forced` or not."""
    cfg = tiny_config(True, "bf16_mixed", 2, [], 2)
    trainer = Trainer(cfg, ParallelState(cfg.finalize(1).layout))
    api = StandInStreams() if forced else streams.api()
    with streams.set_api(api):
        return [trainer.train_step(i)[0] for i in range(2)]


def test_a_single_rank_moe_trains_with_the_cuda_branch_of_the_split_size_read():
    (forced,) = run_world(1, _train_single_rank_moe, True)
    (plain,) = run_world(1, _train_single_rank_moe, False)
    assert forced == plain
