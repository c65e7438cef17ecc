"""The distributed world and its process groups: joining the world (`init_world`), and every group
and device mesh built once per process and world, then reused.

Process groups are built once per process and world, then reused by every later job of that process
(a test worker, a notebook, `overlap convert` then a run): a gloo group is three threads and a
socket per peer that wake to poll even when idle (about 0.08% of a core per group, measured), and it
is freed only when every Python reference to it is gone, which the hooks of a finished model's DDP
can prevent. Hundreds of leaked groups once cost a test process a fifth of a core while it waited.
Building is collective, and every rank builds the same groups in the same order, so every rank finds
a group in the cache, or none does. `overlap.parallel.teardown.shutdown` empties the cache.

The cache is process-wide on purpose, unlike a run's communication session and recorder: process
groups belong to the process's world (torch.distributed's default group is itself process-wide), and
every run of the process uses that one world, so a cache per run would build each group again per
run - the leak just described. The cache is tied to the world it was built in (`_built_for`), so a
new world never sees an old world's groups.

The only module that creates process groups; collectives on them go through `overlap.parallel.comm`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def init_world(backend: str, timeout_s: float, device: torch.device | None = None) -> None:
    """Join the world the launcher set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun, Slurm
    or our local launcher). With a CUDA device the default group is bound to it (`device_id`), as
    NCCL wants: its communicator is built now, at start-up, and every group made from it is split
    from it there and then - not lazily inside the first step's first collective, where a problem
    would hang a step instead of failing the start - and point-to-point operations run on their
    group's communicator (the program `overlap.parallel.program` replays)."""
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
    if device is not None and device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)


_built: dict[tuple, Any] = {}
# the default group the cache was built under
_built_for: weakref.ref[ProcessGroup] | None = None


def _cached(key: tuple, build: Callable[[], Any]) -> Any:
    global _built_for
    world = dist.group.WORLD
    # a new world (or the first): nothing cached is valid
    if _built_for is None or _built_for() is not world:
        _built.clear()
        _built_for = weakref.ref(world)
    if key not in _built:
        _built[key] = build()
    return _built[key]


def forget_groups() -> None:
    """Drop the cached groups (`teardown.shutdown` does it too): for code that destroys the default
    group itself, so that the groups are freed with it, not at interpreter exit."""
    _built.clear()


def device_mesh(device_type: str, shape: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """`init_device_mesh(device_type, shape, mesh_dim_names=names)`, built once per process."""
    return _cached(
        ("mesh", device_type, tuple(shape), tuple(names)),
        lambda: init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names)),
    )


def twin_group(mesh: DeviceMesh, dim: str) -> ProcessGroup:
    """A second process group over the same ranks as `mesh`'s `dim` (collective), built once per
    process: small metadata exchanges (the MoE split sizes) run on their own communicator, so they
    never queue behind bulk traffic of another micro-batch on the first."""
    return _groups_along(mesh, dim, "twin", lambda ranks: {None: ranks}).get(None)


def _groups_along(
    mesh: DeviceMesh,
    dims: str | Sequence[str],
    name: str,
    groups: Callable[[list[int]], dict[Any, list[int]]],
) -> dict[Any, ProcessGroup]:
    """For every line of `mesh` along `dims` (one dimension, or several at once: for each
    combination of the other dimensions' coordinates, the ranks that differ only along `dims`, in
    mesh order), the groups `groups(ranks)` names (key -> members), created by every rank in the
    same order, once per process; this rank's groups by key (empty where it is in none)."""
    dims = (dims,) if isinstance(dims, str) else tuple(dims)

    def build() -> dict[Any, ProcessGroup]:
        mine = {}
        axes = [mesh.mesh_dim_names.index(d) for d in dims]
        rest = [a for a in range(mesh.mesh.dim()) if a not in axes]
        size = math.prod(mesh.size(a) for a in axes)
        for ranks in mesh.mesh.permute(*rest, *axes).reshape(-1, size).tolist():
            for key, members in groups(ranks).items():
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    mine[key] = group
        return mine

    return _cached(
        (
            name,
            mesh.device_type,
            tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh.shape),
            mesh.mesh_dim_names,
            dims,
        ),
        build,
    )


def merged_group(mesh: DeviceMesh, dims: Sequence[str]) -> ProcessGroup:
    """This rank's group over several of `mesh`'s dimensions at once (collective), built once per
    process: the ranks that differ only along `dims`, in mesh order. Megatron's data-parallel group
    with context parallelism (dims "dp", "cp"), over which the dense gradients are reduced."""
    return _groups_along(mesh, dims, "merged", lambda ranks: {None: ranks})[None]


def split_groups(mesh: DeviceMesh, dim: str, inner: int) -> tuple[ProcessGroup, ProcessGroup]:
    """Each line of `mesh`'s `dim` cut in two levels (collective), built once per process: groups of
    `inner` consecutive members, and groups of the members `inner` apart (one from each inner
    group); this rank's (inner, outer) pair. Hierarchical context parallelism's all-to-all and p2p
    groups (Megatron's `hierarchical_context_parallel_sizes`: the first level the all-to-all)."""

    def levels(ranks: list[int]) -> dict[tuple[str, int], list[int]]:
        outer = len(ranks) // inner
        cut = {("inner", i): ranks[i * inner : (i + 1) * inner] for i in range(outer)}
        return cut | {("outer", j): ranks[j::inner] for j in range(inner)}

    mine = _groups_along(mesh, dim, f"levels {inner}", levels)
    return (
        next(g for (level, _i), g in mine.items() if level == "inner"),
        next(g for (level, _i), g in mine.items() if level == "outer"),
    )


def ring_edge_groups(mesh: DeviceMesh, dim: str, wrap: bool) -> dict[tuple[str, int], ProcessGroup]:
    """Two groups per edge of the ring of ranks along `mesh`'s `dim` (collective), built once per
    process: for the edge i of each line (its rank i and rank i + 1; the edge from the last rank
    back to the first only with `wrap`), ("up", i) carries what travels from rank i to rank i + 1
    and ("down", i) what travels back. This rank's groups, by (direction, edge index along the
    line).

    A pipeline's point-to-point messages need them on NCCL: it matches the messages between two
    ranks on a group in posting order and runs them on one stream per communicator, so a group that
    carried both directions (PP = 2, where the next and the previous stage are the same rank) or
    both activations and gradients would need every rank to post them in exactly the order its peer
    does. On a group of one sender, one receiver and one kind of message, the k-th send is the k-th
    receive by construction. (Two members: the group's communicator is also the pair's, whether
    torch runs a single point-to-point op on the group's or on a two-rank one.)"""

    def edges(ranks: list[int]) -> dict[tuple[str, int], list[int]]:
        size = len(ranks)
        return {
            (direction, i): [ranks[i], ranks[(i + 1) % size]]
            for i in range(size if wrap else size - 1)
            for direction in ("up", "down")
        }

    return _groups_along(mesh, dim, f"edges wrap={wrap}", edges)


def ends_group(mesh: DeviceMesh, dim: str) -> ProcessGroup | None:
    """The group of the first and the last rank along `mesh`'s `dim` (collective), built once per
    process: a pipeline's two ends, which hold the tied embedding and its copy on the output layer
    (Megatron's embedding group). None for a rank in between."""
    return _groups_along(mesh, dim, "ends", lambda ranks: {None: [ranks[0], ranks[-1]]}).get(None)


def cpu_group() -> ProcessGroup:
    """A second gloo group over every rank (collective: all ranks call it in the same order), built
    once per process. Checkpoints use it: an asynchronous save coordinates its ranks from a
    background thread, which must not share a communicator with the training's collectives, and on
    GPUs the DCP control messages need a CPU backend anyway."""
    return _cached(("cpu",), lambda: dist.new_group(backend="gloo"))
