import gc
import os

import torch
import torch.distributed as dist

from overlap.layout import ParallelLayout
from overlap.parallel import comm, groups
from overlap.parallel.state import ParallelState
from tests.world import run_world


def _ranks_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    comm.all_reduce(t, dist.group.WORLD, "test_ar").wait()
    return dist.get_rank(), t.item()


def _groups(tp, ep):
    ps = ParallelState(ParallelLayout(world_size=dist.get_world_size(), tp=tp, ep=ep))
    return (
        dist.get_process_group_ranks(ps.tp_group),
        dist.get_process_group_ranks(ps.dp_group),
        dist.get_process_group_ranks(ps.ep_group),
        dist.get_process_group_ranks(ps.edp_group),
    )


def _uneven_a2a():
    r, n = dist.get_rank(), dist.get_world_size()
    send = [r + 1] * n  # rank r sends r+1 rows to everybody
    x = torch.full((sum(send), 2), float(r))
    recv = [s + 1 for s in range(n)]
    out = comm.all_to_all(x, dist.group.WORLD, "test_a2a", recv, send).wait()
    return out[:, 0].tolist()


def test_world_runs_functions():
    assert run_world(2, _ranks_and_sum) == [(0, 1.0), (1, 1.0)]


def test_parallel_state_groups_follow_megatron_order():
    res = run_world(4, _groups, 2, 2)
    assert res[0] == ([0, 1], [0, 2], [0, 1], [0, 2])
    assert res[3] == ([2, 3], [1, 3], [2, 3], [1, 3])


def test_uneven_all_to_all():
    assert run_world(2, _uneven_a2a) == [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]


def _groups_reused():
    """Two jobs of one layout in one process share their groups (a gloo group is threads that poll
    while idle); another layout gets its own."""
    layout = ParallelLayout(world_size=dist.get_world_size(), tp=2)
    first, second = ParallelState(layout), ParallelState(layout)
    other = ParallelState(ParallelLayout(world_size=dist.get_world_size(), ep=2))
    cpu = groups.cpu_group()
    gc.collect()  # groups leaked by earlier tests' models go now, not while counting
    before = len(os.listdir("/proc/self/task"))  # native threads too: gloo's are not Python threads
    for _ in range(5):
        ParallelState(layout)
        ParallelState(ParallelLayout(world_size=dist.get_world_size(), ep=2))
    return (
        first.tp_group is second.tp_group,
        first.ep_meta_group is second.ep_meta_group,
        groups.cpu_group() is cpu,
        other.mesh is not first.mesh,
        len(os.listdir("/proc/self/task")) - before,
    )


def test_parallel_state_reuses_its_groups():
    for same_tp, same_twin, same_cpu, other_new, new_threads in run_world(2, _groups_reused):
        assert same_tp and same_twin and same_cpu and other_new
        assert new_threads <= 0


_NEW_WORLD = """
import torch.distributed as dist
from overlap.parallel import groups, teardown

def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

world()
first = groups.cpu_group()
assert groups.cpu_group() is first
teardown.shutdown()  # empties the cache with the world
world()
second = groups.cpu_group()
groups.forget_groups()
dist.destroy_process_group()
world()
third = groups.cpu_group()
print(second is not first and third is not second)
teardown.shutdown()
"""


def test_a_new_world_gets_new_groups():
    """Cached groups belong to the world they were built in: after `shutdown` (or `forget_groups` +
    destroy) a new world builds its own."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _NEW_WORLD], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
