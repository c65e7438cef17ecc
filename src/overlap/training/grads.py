"""Gradient accumulation into fp32 `main_grad` and the synchronous (non-overlapped) gradient reduction.

Every micro-batch's gradient is added into `param.main_grad` by a post-accumulate hook (then `.grad` is dropped), so
bf16 parameters still accumulate in fp32. After the last micro-batch, `reduce()` sums gradients where the math needs
it: sequence-parallel replicas over TP, dense parameters over data parallel, expert parameters over expert-data
parallel. The loss is pre-scaled by 1 / (micro-batches x DP), so sums are exactly the reference's mean gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from overlap.parallel import comm
from overlap.parallel.state import ParallelState


def attach_main_grads(params: list[nn.Parameter]) -> None:
    """Give each parameter an fp32 `main_grad` and a hook that moves every fresh `.grad` into it."""
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)

        def accumulate(param: nn.Parameter) -> None:
            param.main_grad.add_(param.grad)
            param.grad = None

        p.register_post_accumulate_grad_hook(accumulate)


def zero_main_grads(params: list[nn.Parameter]) -> None:
    for p in params:
        p.main_grad.zero_()


def reduce_main_grads(params: list[nn.Parameter], ps: ParallelState, sequence_parallel: bool) -> None:
    """Synchronous reduction: one flat all-reduce per group (TP for SP replicas, DP for dense, EDP for experts)."""
    groups = []
    if sequence_parallel and ps.tp_size > 1:
        groups.append(([p for p in params if getattr(p, "sequence_parallel", False)], ps.tp_group, "tp_ar_sp"))
    groups.append(([p for p in params if not getattr(p, "is_expert", False)], ps.dp_group, "dp_ar"))
    groups.append(([p for p in params if getattr(p, "is_expert", False)], ps.edp_group, "edp_ar"))
    for members, group, kind in groups:
        if not members or comm.group_size(group) == 1:
            continue
        flat = torch.cat([p.main_grad.reshape(-1) for p in members])
        comm.all_reduce(flat, group, kind).wait()
        offset = 0
        for p in members:
            n = p.main_grad.numel()
            p.main_grad.copy_(flat[offset:offset + n].view_as(p.main_grad))
            offset += n
