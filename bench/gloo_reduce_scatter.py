"""Why `comm.reduce_scatter` runs as all-to-all + local sum on gloo: wall and CPU time of the candidates.

    python bench/gloo_reduce_scatter.py [RANKS] [FLOATS]      # default: 4 ranks, 2.8M fp32 (11 MB)

Each rank uses one intra-op thread; each candidate runs 10 times between barriers; rank 0 prints per-call wall time
and its process CPU time (gloo's threads included).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(rank: int, name: str, fn, reps: int = 10) -> None:
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
        print(f"{name:28s} wall {wall:7.1f} ms   cpu {cpu:7.1f} ms")


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

    _time(rank, "reduce_scatter_single", lambda: dist.reduce_scatter_single(shard, x, async_op=True).wait())
    _time(rank, "all_to_all_single + sum", a2a_sum)
    _time(rank, "all_reduce (reference)", lambda: dist.all_reduce(x, async_op=True).wait())
    _time(rank, "all_gather_single (reference)", lambda: dist.all_gather_single(gathered, shard, async_op=True).wait())
    dist.destroy_process_group()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 2_800_000
    print(f"gloo, {n} ranks, {size} fp32 ({size * 4 / 1e6:.1f} MB) per rank")
    mp.spawn(_worker, args=(n, size - size % n, 29600 + os.getpid() % 300), nprocs=n)
