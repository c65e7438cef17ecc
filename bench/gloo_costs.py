"""What a gloo collective costs on this machine, in wall time and in CPU: the facts behind two
choices in `overlap.parallel.comm` and behind the ceiling of every overlap measured on a CPU box.

    python bench/gloo_costs.py [RANKS] [FLOATS]      # default: 4 ranks, 2.8M fp32 (11 MB)

1. Reduce-scatter: gloo's `reduce_scatter_single` against an all-to-all of the chunks plus a local
   sum (what `comm.reduce_scatter` runs on gloo).
2. The fixed cost of one all-to-all, 1 KB and 64 KB per rank, run back to back: on ranks that share
   cores, the CPU each op burns (gloo's threads, socket calls, wake-ups) is CPU the compute does not
   get, so no schedule can hide it (`comm.all_to_all_many` sends an MoE dispatch's rows and weights
   as one op for this reason).

Each rank uses one intra-op thread; rank 0 prints per-call wall time and its process CPU time
(gloo's threads included), after a warm-up call, between barriers.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(rank: int, name: str, fn, reps: int) -> None:
    dist.barrier()
    fn()
    dist.barrier()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    wall = (time.perf_counter() - wall0) / reps * 1e3
    cpu = (time.process_time() - cpu0) / reps * 1e3
    if rank == 0:
        print(f"{name:34s} wall {wall:7.2f} ms   cpu {cpu:6.2f} ms (rank 0)")


def _worker(rank: int, ranks: int, floats: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    x = torch.randn(floats)
    shard = torch.empty(floats // ranks)
    recv = torch.empty_like(x)
    gathered = torch.empty_like(x)

    def a2a_sum() -> None:
        dist.all_to_all_single(recv, x, async_op=True).wait()
        torch.sum(recv.view(ranks, -1), dim=0, out=shard)

    _time(
        rank,
        "reduce_scatter_single",
        lambda: dist.reduce_scatter_single(shard, x, async_op=True).wait(),
        10,
    )
    _time(rank, "all_to_all_single + sum", a2a_sum, 10)
    _time(rank, "all_reduce (reference)", lambda: dist.all_reduce(x, async_op=True).wait(), 10)
    _time(
        rank,
        "all_gather_single (reference)",
        lambda: dist.all_gather_single(gathered, shard, async_op=True).wait(),
        10,
    )
    for kb in (1, 64):
        small = torch.randn(kb * 256 // ranks * ranks)
        out = torch.empty_like(small)
        _time(
            rank,
            f"all_to_all_single {kb} KB",
            lambda out=out, small=small: dist.all_to_all_single(out, small, async_op=True).wait(),
            300,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 2_800_000
    print(
        f"gloo, {n} ranks on {os.cpu_count()} cores, {size} fp32 ({size * 4 / 1e6:.1f} MB) per rank"
    )
    mp.spawn(_worker, args=(n, size - size % n, 29600 + os.getpid() % 300), nprocs=n)
