"""The PyTorch-native tensor-parallel peer (`model.tensor_parallel_impl=dtensor`): the same dense
model, with the TP/SP communication of its four TP linears done by DTensor through
`parallelize_module`, the way torchtitan does it.

It exists so a benchmark can compare our TP runtime (`layers/tensor_parallel.py`:
ColumnParallelLinear / RowParallelLinear with the SP all-gather / reduce-scatter in
`parallel/comm.py`) with PyTorch's on the same weights, data and optimizer. Only the four TP linears
of each transformer layer change hands; the embedding, the QK and layer norms, the output layer and
the vocab-parallel cross-entropy stay ours (their collectives, and DDP's, go through comm.py as
usual). The peer's collectives are torch's functional collectives, which our tracer does not see
(like the DDP / FSDP2 peers in `perf/peers.py` and the pipelining peer in `pipeline/torch_peer.py`):
compare on `--network tbf:RATE`, not on a modelled link.

The plan, per transformer layer, on the 1-D "tp" sub-mesh of `ParallelState.mesh` (activations are
[seq, batch, hidden], so the sequence dim is 0; torchtitan's [batch, seq, hidden] uses Shard(1) for
the same thing):

    module                      style                                      does
    self_attention.linear_qkv   ColwiseParallel(input_layouts=Shard(0))    SP all-gather -> GEMM
    self_attention.linear_proj  RowwiseParallel(output_layouts=Shard(0))   GEMM -> SP reduce-scatter
    mlp.linear_fc1              PrepareModuleInput(Shard(0) -> Replicate)  one SP all-gather
    mlp.linear_fc1.parts.{0,1}  ColwiseParallel()                          gate, up: column GEMMs
    mlp.linear_fc2              RowwiseParallel(output_layouts=Shard(0))   GEMM -> SP reduce-scatter

The two fc1 rows are the gated MLP's (`fc1_parts` 2, see below); an ungated fc1 is one
ColwiseParallel(input_layouts=Shard(0)), as qkv is.

Without sequence parallelism the styles keep their default layouts (replicated input: identity
forward and all-reduce backward; replicated output: all-reduce forward). Both styles return local
tensors (`use_local_output`), so the attention core, SwiGLU and our norms between them see exactly
the local tensors ours do. torchtitan's `SequenceParallel` on the norms is not used (our norms are
ours), and attention's qkv is one fused GEMM, so its all-gather sits in that linear's own input
layout rather than in a block-level `PrepareModuleInput` - the same one collective either way.

The styles are torch's own, applied by `parallelize_module` unmodified (to `nn.Linear`s, which they
require). One deviation, in parameter storage, for our data-parallel runtime: the styles turn each
weight into a DTensor `nn.Parameter`, but our gradient buffers, DDP hooks (`main_grad`), distributed
optimizer (parameter data as views into its buckets) and gradient norm all work on plain tensors. So
the layer is built on the meta device at its full size, parallelized (which yields the DTensor's
placement and local shape without allocating or communicating), and then the DTensor parameter is
replaced by our plain local shard - the very Parameter our ColumnParallelLinear / RowParallelLinear
created, under the same name and with the same `shard` mark - which `forward` presents to DTensor
with `DTensor.from_local` on the placement the style chose. `from_local` is differentiable and its
backward returns the local gradient, so autograd accumulates a plain `.grad` into that parameter and
our hooks see it as always. The same move keeps the layout-independent initialisation
(`layers/init.py`: the full tensor per parameter name, each rank keeps its slice) exactly ours, so
losses match our implementation.

The gated fc1 is torchtitan's feed-forward input: one `PrepareModuleInput` (the SP all-gather, or
the replicated entry without SP, once for both) and one ColwiseParallel linear per fused part (its
w1 and w3), because ours runs gate and up as two GEMMs too (`ColumnParallelLinear(split=True)`): the
same GEMMs on the same local shards, so the losses stay bit-identical. Our weight is one Parameter
[2, ffn/tp, hidden] (each rank holds a slice of both gate and up); `FusedColumnPeer` keeps it under
its name and each part reads its slice [ffn/tp, hidden] (Shard(0) of the part's full [ffn, hidden])
at every forward, so the distributed optimizer's parameter views stay the ones read.

Wiring and scope: the Trainer builds our model chunks, `model/tensor_parallel_impl.py` calls
`parallelize_layers` on each chunk's layers, then the Trainer initialises the weights and builds DDP
and the optimizer as always. Dense models at TP >= 2, with or without sequence parallelism, under DP
(our DDP and distributed optimizer, both overlaps), PP (both pipeline runtimes) and activation
recompute. `training/runtime_refusals.py` refuses MoE models (the plan has no experts or router), TP
= 1 (nothing to hand over) and `tp_comm_overlap` (parallelize_module runs each collective whole;
torch's async TP is a torch.compile pass on CUDA). `--comm-mode none` and modelled links do not
reach the peer's collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from overlap.parallel.state import ParallelState


class LocalShardLinear(nn.Linear):
    """`y = x W^T` for a DTensor input, with W kept as this rank's plain local shard (see the module
    docstring).

    Built on the meta device at the full logical size so that a ColwiseParallel / RowwiseParallel
    style can partition it; `adopt` then swaps in the real local Parameter (or, for a part of a
    fused weight, a function returning its slice of the parent's Parameter) and remembers the
    placement the style gave the weight.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=False, device="meta", dtype=dtype)
        self.weight_placements: tuple | None = None
        self._slice: Callable[[], torch.Tensor] | None = None

    def adopt(self, local: nn.Parameter | Callable[[], torch.Tensor]) -> None:
        """Replace the (meta) DTensor weight the style made with `local`, our shard of the same
        logical weight: a Parameter registered here, or a function returning a slice of a Parameter
        registered elsewhere."""
        planned = self.weight
        if not isinstance(planned, DTensor):
            raise RuntimeError(
                f"{type(self).__name__}.adopt: parallelize_module has not partitioned this linear"
            )
        tensor = local if isinstance(local, nn.Parameter) else local()
        local_2d = tensor.reshape(-1, tensor.shape[-1]).shape
        if tuple(planned.to_local().shape) != tuple(local_2d):
            raise RuntimeError(
                f"{type(self).__name__}.adopt: the style's local weight is "
                f"{tuple(planned.to_local().shape)}, ours is {tuple(local_2d)} (placements "
                f"{planned.placements})"
            )
        self.weight_placements = planned.placements
        if isinstance(local, nn.Parameter):
            self.register_parameter("weight", local)
        else:
            self.register_parameter("weight", None)
            self._slice = local

    def forward(self, x: DTensor) -> DTensor:
        weight = self.weight if self._slice is None else self._slice()
        weight = weight.reshape(-1, weight.shape[-1])  # a fused qkv weight keeps its own shape
        return F.linear(
            x, DTensor.from_local(weight, x.device_mesh, self.weight_placements, run_check=False)
        )


class FusedColumnPeer(nn.Module):
    """The peer's gated fc1: one ColwiseParallel `LocalShardLinear` per fused part (`parts`, behind
    the layer plan's PrepareModuleInput), holding our fused Parameter [parts, ffn/tp, hidden] as
    `weight` (the name and the gradient buckets stay ours); part i reads `weight[i]`."""

    def __init__(self, local: nn.Parameter, tp: int) -> None:
        super().__init__()
        parts, out_local, in_features = local.shape
        self.parts = nn.ModuleList(
            LocalShardLinear(in_features, out_local * tp, local.dtype) for _ in range(parts)
        )

    def adopt(self, local: nn.Parameter) -> None:
        self.register_parameter("weight", local)
        for i, part in enumerate(self.parts):
            part.adopt(lambda i=i: self.weight[i])

    def forward(self, x: DTensor, split: bool = False) -> tuple[torch.Tensor, ...]:
        """The parts' outputs one by one: the MLP calls this module with `split=True`, as it calls
        ours."""
        if not split:
            raise ValueError(
                "FusedColumnPeer returns the fused parts' outputs one by one: call it with "
                "split=True"
            )
        return tuple(part(x) for part in self.parts)


FC1 = "mlp.linear_fc1"


def layer_plan(sequence_parallel: bool, fc1_parts: int) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of one transformer layer (module paths relative to the layer).
    `fc1_parts`: the fused parts of the MLP's fc1 (2 with a gated linear unit: see
    `FusedColumnPeer`)."""
    entry = Shard(0) if sequence_parallel else Replicate()  # activations are [seq, batch, hidden]
    plan: dict[str, ParallelStyle] = {
        "self_attention.linear_qkv": ColwiseParallel(input_layouts=entry),
        "self_attention.linear_proj": RowwiseParallel(output_layouts=entry),
    }
    if fc1_parts == 1:
        plan[FC1] = ColwiseParallel(input_layouts=entry)
    else:
        plan[FC1] = PrepareModuleInput(input_layouts=entry, desired_input_layouts=Replicate())
        plan.update({f"{FC1}.parts.{i}": ColwiseParallel() for i in range(fc1_parts)})
    plan["mlp.linear_fc2"] = RowwiseParallel(output_layouts=entry)
    return plan


def _full_shape(local: nn.Parameter, style: ParallelStyle, tp: int) -> tuple[int, int]:
    """(out, in) of the logical nn.Linear whose style-partitioned shard is `local` (2-D view)."""
    out_local, in_local = local.reshape(-1, local.shape[-1]).shape
    if isinstance(style, ColwiseParallel):
        return out_local * tp, in_local
    return out_local, in_local * tp


def parallelize_layers(layers: nn.Module, ps: ParallelState, sequence_parallel: bool) -> None:
    """Hand the TP linears of every (dense) layer in `layers` to DTensor: swap each of our
    Column/RowParallelLinear for a LocalShardLinear (the gated fc1 for a FusedColumnPeer),
    `parallelize_module` the layer with `layer_plan`, and give each linear back our Parameter.
    Parameter names and order are unchanged, so initialisation and gradient buckets are ours."""
    mesh = ps.mesh["tp"]
    for layer in layers:
        fc1 = layer.get_submodule(FC1).weight
        plan = layer_plan(sequence_parallel, fc1.shape[0] if fc1.dim() == 3 else 1)
        ours: dict[str, nn.Parameter] = {}
        for path in (
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            FC1,
            "mlp.linear_fc2",
        ):
            old = layer.get_submodule(path)
            # a dropped bias would be a silently different model
            if getattr(old, "bias", None) is not None:
                raise RuntimeError(
                    f"{path}: the DTensor peer has no linear biases (runtime_refusals refuses them)"
                )
            ours[path] = old.weight
            if path == FC1 and fc1.dim() == 3:
                new: nn.Module = FusedColumnPeer(old.weight, ps.layout.tp)
            else:
                out_features, in_features = _full_shape(old.weight, plan[path], ps.layout.tp)
                new = LocalShardLinear(in_features, out_features, old.weight.dtype)
            parent, name = path.rsplit(".", 1)
            setattr(layer.get_submodule(parent), name, new)
        # The weights are ours (layout-independent init), not rank 0's: src_data_rank=None keeps the
        # local (meta) data, so partitioning neither allocates nor communicates.
        parallelize_module(layer, mesh, plan, src_data_rank=None)
        for path, local in ours.items():
            layer.get_submodule(path).adopt(local)
