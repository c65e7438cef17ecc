"""The PyTorch-native tensor-parallel peer (`model.tensor_parallel_impl=dtensor`): the same dense model, with the
TP/SP communication of its four TP linears done by DTensor through `parallelize_module`, the way torchtitan does it.

It exists so a benchmark can compare our TP runtime (`layers/tensor_parallel.py`: ColumnParallelLinear /
RowParallelLinear with the SP all-gather / reduce-scatter in `parallel/comm.py`) with PyTorch's on the same weights,
data and optimizer. Only the four TP linears of each transformer layer change hands; the embedding, the QK and layer
norms, the output layer and the vocab-parallel cross-entropy stay ours (their collectives, and DDP's, go through
comm.py as usual). The peer's collectives are torch's functional collectives, which our tracer does not see (like the
DDP / FSDP2 peers in `perf/peers.py` and the pipelining peer in `pipeline/torch_peer.py`): compare on `--network
tbf:RATE`, not on a modelled link.

The plan, per transformer layer, on the 1-D "tp" sub-mesh of `ParallelState.mesh` (activations are [seq, batch,
hidden], so the sequence dim is 0; torchtitan's [batch, seq, hidden] uses Shard(1) for the same thing):

    self_attention.linear_qkv   ColwiseParallel(input_layouts=Shard(0))   SP all-gather -> column GEMM
    self_attention.linear_proj  RowwiseParallel(output_layouts=Shard(0))  row GEMM -> SP reduce-scatter
    mlp.linear_fc1              ColwiseParallel(input_layouts=Shard(0))   (gate and up fused, see below)
    mlp.linear_fc2              RowwiseParallel(output_layouts=Shard(0))

Without sequence parallelism the styles keep their default layouts (replicated input: identity forward and
all-reduce backward; replicated output: all-reduce forward). Both styles return local tensors (`use_local_output`),
so the attention core, SwiGLU and our norms between them see exactly the local tensors ours do. torchtitan's
`SequenceParallel` on the norms and `PrepareModuleInput` on the attention / MLP blocks are not used: our norms are
ours, and since qkv and gate/up are fused GEMMs each block has one column-parallel input, so the all-gather sits in
that linear's own input layout instead of in a block-level PrepareModuleInput - the same one collective either way.

The styles are torch's own, applied by `parallelize_module` unmodified (to `nn.Linear`s, which they require). One
deviation, in parameter storage, for our data-parallel runtime: the styles turn each weight into a DTensor
`nn.Parameter`, but our gradient buffers, DDP hooks (`main_grad`), distributed optimizer (parameter data as views
into its buckets) and gradient norm all work on plain tensors. So the layer is built on the meta device at its full
size, parallelized (which yields the DTensor's placement and local shape without allocating or communicating), and
then the DTensor parameter is replaced by our plain local shard - the very Parameter our ColumnParallelLinear /
RowParallelLinear created, under the same name and with the same `shard` mark - which `forward` presents to DTensor
with `DTensor.from_local` on the placement the style chose. `from_local` is differentiable and its backward returns
the local gradient, so autograd accumulates a plain `.grad` into that parameter and our hooks see it as always. The
same move keeps the layout-independent initialisation (`layers/init.py`: the full tensor per parameter name, each
rank keeps its slice) exactly ours, so losses match our implementation.

The fused fc1 weight is [2, ffn/tp, hidden] per rank: each rank holds a slice of both gate and up ([gate_r; up_r]).
It is presented to DTensor as its 2-D view [2*ffn/tp, hidden] with Shard(0), so DTensor's notion of the full fc1
weight is [gate_0; up_0; gate_1; up_1; ...] (rank-blocked rows) rather than our logical [2, ffn, hidden]: a
permutation of the same rows that nothing reads, since the output goes back to local tensors at once and SwiGLU
splits each rank's local [gate_r, up_r] as ours does.

Wiring and scope: the Trainer builds our model chunks, calls `parallelize_layers` on each chunk's layers, then
initialises the weights and builds DDP and the optimizer as always. Dense models at TP >= 2, with or without
sequence parallelism, under DP (our DDP and distributed optimizer, both overlaps), PP (both pipeline runtimes) and
activation recompute. `training/support.py` refuses MoE models (the plan has no experts or router), TP = 1 (nothing
to hand over) and `tp_comm_overlap` (parallelize_module runs each collective whole; torch's async TP is a
torch.compile pass on CUDA). `--comm-mode none` and modelled links do not reach the peer's collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from overlap.parallel.state import ParallelState


class LocalShardLinear(nn.Linear):
    """`y = x W^T` for a DTensor input, with W kept as this rank's plain local shard (see the module docstring).

    Built on the meta device at the full logical size so that a ColwiseParallel / RowwiseParallel style can partition
    it; `adopt` then swaps in the real local Parameter and remembers the placement the style gave the weight.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=False, device="meta", dtype=dtype)
        self.weight_placements: tuple | None = None

    def adopt(self, local: nn.Parameter) -> None:
        """Replace the (meta) DTensor weight the style made with `local`, our shard of the same logical weight."""
        planned = self.weight
        if not isinstance(planned, DTensor):
            raise RuntimeError(f"{type(self).__name__}.adopt: parallelize_module has not partitioned this linear")
        local_2d = local.reshape(-1, local.shape[-1]).shape
        if tuple(planned.to_local().shape) != tuple(local_2d):
            raise RuntimeError(f"{type(self).__name__}.adopt: the style's local weight is "
                               f"{tuple(planned.to_local().shape)}, ours is {tuple(local_2d)} (placements "
                               f"{planned.placements})")
        self.weight_placements = planned.placements
        self.register_parameter("weight", local)

    def forward(self, x: DTensor) -> DTensor:
        weight = self.weight.reshape(-1, self.weight.shape[-1])  # fused fc1: [2, ffn/tp, in] -> its rows [gate_r; up_r]
        return F.linear(x, DTensor.from_local(weight, x.device_mesh, self.weight_placements, run_check=False))


def layer_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan of one transformer layer (module paths relative to the layer)."""
    sequence = Shard(0)  # activations are [seq, batch, hidden]
    if sequence_parallel:
        return {"self_attention.linear_qkv": ColwiseParallel(input_layouts=sequence),
                "self_attention.linear_proj": RowwiseParallel(output_layouts=sequence),
                "mlp.linear_fc1": ColwiseParallel(input_layouts=sequence),
                "mlp.linear_fc2": RowwiseParallel(output_layouts=sequence)}
    return {"self_attention.linear_qkv": ColwiseParallel(), "self_attention.linear_proj": RowwiseParallel(),
            "mlp.linear_fc1": ColwiseParallel(), "mlp.linear_fc2": RowwiseParallel()}


def _full_shape(local: nn.Parameter, style: ParallelStyle, tp: int) -> tuple[int, int]:
    """(out, in) of the logical nn.Linear whose style-partitioned shard is `local` (2-D view)."""
    out_local, in_local = local.reshape(-1, local.shape[-1]).shape
    if isinstance(style, ColwiseParallel):
        return out_local * tp, in_local
    return out_local, in_local * tp


def parallelize_layers(layers: nn.Module, ps: ParallelState, sequence_parallel: bool) -> None:
    """Hand the TP linears of every (dense) layer in `layers` to DTensor: swap each of our Column/RowParallelLinear
    for a LocalShardLinear, `parallelize_module` the layer with `layer_plan`, and give each linear back our
    Parameter. Parameter names and order are unchanged, so initialisation and gradient buckets are ours."""
    mesh = ps.mesh["tp"]
    for layer in layers:
        plan = layer_plan(sequence_parallel)
        ours: dict[str, nn.Parameter] = {}
        for path, style in plan.items():
            old = layer.get_submodule(path)
            if getattr(old, "bias", None) is not None:  # a dropped bias would be a silently different model
                raise RuntimeError(f"{path}: the DTensor peer has no linear biases (runtime_refusals refuses them)")
            ours[path] = old.weight
            out_features, in_features = _full_shape(old.weight, style, ps.tp_size)
            parent, name = path.rsplit(".", 1)
            setattr(layer.get_submodule(parent), name, LocalShardLinear(in_features, out_features, old.weight.dtype))
        # The weights are ours (layout-independent init), not rank 0's: src_data_rank=None keeps the local (meta)
        # data, so partitioning neither allocates nor communicates.
        parallelize_module(layer, mesh, plan, src_data_rank=None)
        for path, local in ours.items():
            layer.get_submodule(path).adopt(local)
