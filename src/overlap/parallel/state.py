"""Parallel state: the process groups of one training job, built on DeviceMesh.

Rank order follows Megatron-Core ("tp-cp-dp-pp", tensor parallel fastest), so a user's mental map of
which ranks share a node carries over. Expert parallelism is carved out of the (dp x cp x tp) block
of each pipeline stage: inside that block, expert-tensor-parallel is fastest, then expert-parallel,
then expert-data-parallel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from overlap.errors import ConfigError
from overlap.layout import ParallelLayout
from overlap.parallel import groups

__all__ = ["ParallelState"]


class ParallelState:
    """Process groups and rank coordinates of this rank for one layout.

    The sizes are the layout's, read under its names only (`ps.layout.tp`, `.dp`, `.dp_cp`, ...):
    one vocabulary for them from the resolution to the layers.

    Must be constructed by every rank of the default process group in the same order (group creation
    is collective).
    """

    def __init__(
        self,
        layout: ParallelLayout,
        device: torch.device | str = "cpu",
        mesh_device_type: str | None = None,
    ) -> None:
        """`device`: where this rank's parameters and step tensors live. No default device is
        installed (torch's set_default_device is a TorchFunctionMode that taxes every torch call),
        so every factory call of the model, the optimizer and the trainer names this device or takes
        an input's. `mesh_device_type`: the meshes' device type where it is not `device`'s (the dry
        run's fake CUDA rank on a machine without a GPU)."""
        if not dist.is_initialized():
            raise RuntimeError("ParallelState needs torch.distributed to be initialised first")
        if dist.get_world_size() != layout.world_size:
            raise ConfigError(
                "world size",
                dist.get_world_size(),
                f"the layout was resolved for {layout.world_size} ranks.",
                "launch as many ranks as the configuration was resolved for.",
            )
        self.layout = layout
        self.device = torch.device(device)
        device_type = mesh_device_type or self.device.type
        self.rank = dist.get_rank()
        # Built once per process for each layout and reused (`groups.device_mesh`): a process that
        # runs several jobs (a test worker, a notebook) would otherwise accumulate idle groups that
        # cost threads and CPU.
        self.mesh: DeviceMesh = groups.device_mesh(
            device_type, (layout.pp, layout.dp, layout.cp, layout.tp), ("pp", "dp", "cp", "tp")
        )
        self.expert_mesh: DeviceMesh = groups.device_mesh(
            device_type, (layout.pp, layout.edp, layout.ep, layout.etp), ("pp", "edp", "ep", "etp")
        )
        self.tp_group = self.mesh.get_group("tp")
        self.pp_group = self.mesh.get_group("pp")
        self.dp_group = self.mesh.get_group("dp")
        # context parallelism: the ranks that split one sequence (their KV ring / collectives)
        self.cp_group = self.mesh.get_group("cp")
        self.cp_rank = self.mesh.get_local_rank("cp")
        # Megatron's data-parallel group with CP: CP ranks hold the same weights and saw different
        # tokens of the same samples, so the dense gradients (and the distributed optimizer's
        # shards, the reported loss) are reduced over DP x CP; the expert mesh's edp already
        # counts CP (experts are carved from TP x CP x DP)
        self.dp_cp_group = (
            groups.merged_group(self.mesh, ("dp", "cp")) if layout.cp > 1 else self.dp_group
        )
        # hierarchical CP (a2a+p2p): all-to-all inside groups of cp_a2a consecutive CP ranks, the
        # KV ring across them (None without the hierarchy)
        self.cp_a2a_group = self.cp_p2p_group = None
        if layout.cp_a2a > 1:
            self.cp_a2a_group, self.cp_p2p_group = groups.split_groups(
                self.mesh, "cp", layout.cp_a2a
            )
        # the ranks that hold one sequence's tokens (Megatron's tp-cp group): the MoE router's
        # load statistics are summed over them
        self.tp_cp_group = (
            groups.merged_group(self.mesh, ("cp", "tp")) if layout.cp > 1 else self.tp_group
        )
        self.ep_group = self.expert_mesh.get_group("ep")
        self.edp_group = self.expert_mesh.get_group("edp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.ep_meta_group = groups.twin_group(self.expert_mesh, "ep")
        self.ep_rank = self.expert_mesh.get_local_rank("ep")
        self.pp_rank = self.mesh.get_local_rank("pp")
        # pipeline neighbours (global ranks)
        self.pp_ranks: list[int] = dist.get_process_group_ranks(self.pp_group)

    def pipeline_p2p_groups(self, wrap: bool) -> dict[str, ProcessGroup]:
        """This rank's four pipeline point-to-point groups (collective: every rank calls it, once
        its schedule needs them), one per direction of travel and kind of message
        (`groups.ring_edge_groups`): "fwd_out" (its activations to the next stage), "fwd_in" (from
        the previous), "bwd_out" (its input gradients to the previous stage) and "bwd_in" (from the
        next). `wrap`: the last stage feeds the first (a virtual pipeline); without it the first
        stage has no "_in"/"bwd_out" and the last no "fwd_out"/"bwd_in" groups."""
        edges = groups.ring_edge_groups(self.mesh, "pp", wrap)
        pp, r = self.layout.pp, self.pp_rank
        wanted = {
            "fwd_out": ("up", r),
            "fwd_in": ("up", (r - 1) % pp),
            "bwd_out": ("down", (r - 1) % pp),
            "bwd_in": ("down", r),
        }
        return {name: edges[key] for name, key in wanted.items() if key in edges}

    def tied_embedding_group(self) -> ProcessGroup | None:
        """The first and last pipeline stage of this rank's pipeline (collective: every rank calls
        it, once a tied model needs it; None on a stage in between): where the embedding and its
        copy on the output layer sum their gradients."""
        return groups.ends_group(self.mesh, "pp")

    @property
    def pp_next(self) -> int:
        """Global rank of the next pipeline stage (the ring wraps: the last stage feeds chunk c+1 of
        the first)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.layout.pp]

    @property
    def pp_prev(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.layout.pp]

    def describe(self) -> str:
        """One line per dimension for start-up logs: size, this rank's coordinate, and the ranks it
        talks to."""
        lines = [f"rank {self.rank}/{self.layout.world_size}"]
        for mesh, dims in (
            (self.mesh, ("tp", "cp", "dp", "pp")),
            (self.expert_mesh, ("ep", "edp")),
        ):
            for dim in dims:
                ranks = dist.get_process_group_ranks(mesh.get_group(dim))
                lines.append(
                    f"  {dim:<3} size {len(ranks)} coord {mesh.get_local_rank(dim)} ranks {ranks}"
                )
        return "\n".join(lines)
