"""Overlap switches that are on but cannot do anything for this model: found before anything starts,
and said.

A data-parallel overlap works bucket by bucket: the reduction of bucket 0 runs while backward
computes the gradients of bucket 1, and the gathered parameters of bucket k+1 arrive while the
forward computes with bucket k. With a single bucket per buffer there is nothing to run under (the
reduction can only start after the last gradient, the forward needs the only bucket first), so the
switch is a no-op - the rule default of 128M parameters is larger than a small model. The bucket
count comes from the model itself, built on the meta device (no memory) with this layout's shapes
and cut by the same function as the real buffers.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import torch

from overlap.config.container import ConfigContainer, Resolution
from overlap.data_parallel.ddp import buffer_members
from overlap.data_parallel.grad_buffer import bucket_sizes

# what a suggested bucket size aims for: enough pieces to pipeline, few enough to stay large
_TARGET_BUCKETS = 4


def _meta_chunk_params(cfg: ConfigContainer, res: Resolution) -> list[list[torch.nn.Parameter]]:
    """Rank 0's trainable parameters per model chunk for this layout, as meta tensors (shapes
    only)."""
    from overlap.model.gpt import model_chunks

    rank0 = SimpleNamespace(
        layout=res.layout,
        tp_rank=0,
        ep_rank=0,
        dp_rank=0,
        cp_rank=0,
        pp_rank=0,
        rank=0,
        tp_group=None,
        cp_group=None,
        tp_cp_group=None,
        ep_group=None,
        ep_meta_group=None,
        device=torch.device("meta"),
    )
    # Parameters do not depend on the token dispatcher, the experts' GEMM kernel or where their
    # activations are kept; the stand-ins are ones the runtime builds everywhere, so the count also
    # works for a configuration `run` will refuse (explain still lists its buckets).
    kernels = replace(
        res.kernels,
        moe_token_dispatcher_type="alltoall",
        moe_flex_dispatcher_backend=None,
        moe_grouped_gemm=True,
    )
    model = copy.copy(cfg.resolved.model)
    model.moe_paged_stash = False
    chunks = model_chunks(model, rank0, res.pipeline, res.overlap, res.precision, kernels)
    return [[p for p in chunk.parameters() if p.requires_grad] for chunk in chunks]


def detect_model_noops(cfg: ConfigContainer, res: Resolution) -> None:
    """Record a no-op for each DP overlap switch whose buffers (per model chunk) all have one bucket
    (rank 0's view: the first pipeline stage; the others are alike or smaller)."""
    d, plan = cfg.ddp, res.overlap
    switches = [
        name for name in ("overlap_grad_reduce", "overlap_param_gather") if getattr(plan, name)
    ]
    if not switches or d.impl != "overlap":
        return
    # dense gradients are reduced over DP x CP (`overlap.data_parallel.ddp`)
    sizes = {"dp": res.layout.dp_cp, "edp": res.layout.edp}
    buffers = []
    chunks = _meta_chunk_params(cfg, res)
    for c, params in enumerate(chunks):
        for prefix, members in buffer_members(params):
            if sizes[prefix] > 1:  # a buffer over one rank communicates nothing, overlapped or not
                buckets = bucket_sizes(members, plan.bucket_size, sizes[prefix])
                name = f"chunk {c} {prefix}" if len(chunks) > 1 else prefix
                buffers.append(
                    (name, members[0].dtype, len(buckets), sum(p.numel() for p in members))
                )
    described = "; ".join(
        f"{name} {str(dtype).removeprefix('torch.')}: {n} bucket{'s' * (n != 1)} of {total:,} "
        "parameters"
        for name, dtype, n, total in buffers
    )
    single = [b for b in buffers if b[2] == 1]
    # some buffer pipelines its buckets: the switch does something
    if not single or len(single) < len(buffers):
        return
    largest = max(total for _p, _d, _n, total in single)
    suggestion = max(1, largest // _TARGET_BUCKETS)
    for name in switches:
        what = (
            "the reduction can only start after the last gradient is ready"
            if name == "overlap_grad_reduce"
            else "the next forward needs the only bucket's parameters before it can compute "
            "anything"
        )
        res.decisions.noop(
            f"ddp.{name}",
            True,
            f"ddp.bucket_size={plan.bucket_size} leaves a single bucket ({described}): {what}, so "
            "nothing overlaps",
            f"set ddp.bucket_size={suggestion} (about {_TARGET_BUCKETS} buckets per buffer), or "
            "turn "
            f"ddp.{name} off.",
        )
