"""Per-token cross-entropy from the logits, vocabulary-parallel, without an fp32 copy of the logits.

The logits are the largest activation of a language model (Qwen3-30B-A3B: 4096 tokens x 151936
words, 1.2 GB in bf16): taken to fp32 whole, their softmax for backward is another 2.4 GB. Here the
statistics are taken a chunk of rows at a time in fp32 (`CHUNK_BYTES` of fp32 at once, in one
reused buffer, a size the memory model counts: `overlap.launch.activations`) and backward
keeps only the logits as they came (the output layer's result, which nobody else keeps), the labels
and one fp32 log-sum-exp per token; it makes the softmax again, chunk by chunk, into the gradient
(Megatron-Core's fused cross-entropy keeps the same).

Under tensor parallelism each rank holds a slice of the vocabulary: only per-token statistics cross
ranks - the max logit (for a stable softmax), then the target logit (held by the one rank owning the
label) and the sum of exponentials in one collective. The gradient, softmax - onehot(label), is
local to each rank's slice, so backward needs no communication.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup, ReduceOp

from overlap.launch.activations import LOSS_CHUNK_BYTES as CHUNK_BYTES
from overlap.parallel import comm


def _shifted_chunks(
    flat: torch.Tensor, shift: torch.Tensor, out: torch.Tensor | None = None
) -> Iterator[tuple[slice, torch.Tensor]]:
    """(rows, those rows in fp32 minus their `shift`) a chunk of `flat`'s rows at a time, in a
    space the consumer may change in place: `out`'s rows (fp32: the gradient of fp32 logits is
    made in place), else one reused buffer of at most `CHUNK_BYTES`. fp32 rows are
    subtracted straight into it; lower-precision ones copied in, then subtracted (a mixed-dtype
    subtraction runs slower on CPU than the copy and the fp32 one together)."""
    step = max(1, CHUNK_BYTES // (4 * max(1, flat.shape[-1])))
    buffer = None
    if out is None:
        buffer = flat.new_empty((min(step, flat.shape[0]), flat.shape[-1]), dtype=torch.float32)
    for start in range(0, flat.shape[0], step):
        rows = slice(start, min(start + step, flat.shape[0]))
        part = out[rows] if buffer is None else buffer[: rows.stop - start]
        if flat.dtype == torch.float32:
            torch.sub(flat[rows], shift[rows].unsqueeze(-1), out=part)
        else:
            part.copy_(flat[rows]).sub_(shift[rows].unsqueeze(-1))
        yield rows, part


def _all_reduce(t: torch.Tensor, group: ProcessGroup | None, op=ReduceOp.SUM) -> torch.Tensor:
    if group is None or comm.group_size(group) == 1:
        return t
    return comm.all_reduce(t, group, "tp_ar", op).wait()


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        group: ProcessGroup | None,
        vocab_start: int,
    ) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        local = labels.reshape(-1) - vocab_start
        outside = (local < 0) | (local >= flat.shape[-1])
        local = local.masked_fill(outside, 0)
        # the max of the rows as they are (a max rounds nothing)
        max_logit = _all_reduce(flat.max(dim=-1).values.float(), group, ReduceOp.MAX)
        target = flat.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - max_logit
        sum_exp = torch.empty_like(max_logit)
        for rows, part in _shifted_chunks(flat, max_logit):
            torch.sum(part.exp_(), dim=-1, out=sum_exp[rows])
        # one collective for both sums
        stats = _all_reduce(torch.stack([target.masked_fill(outside, 0.0), sum_exp]), group)
        log_sum = stats[1].log()
        # the logits themselves: a view made here (no grad) would be refused when unpacked
        ctx.save_for_backward(logits, local, outside, max_logit + log_sum)
        return (log_sum - stats[0]).view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, local, outside, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        grad_loss = grad_loss.reshape(-1).float()
        grad = torch.empty_like(flat)
        index = torch.arange(flat.shape[0], device=flat.device)
        inside = (~outside).float()
        in_place = grad.dtype == torch.float32  # fp32 logits: the chunks are the gradient's rows
        for rows, part in _shifted_chunks(flat, lse, out=grad if in_place else None):
            # the softmax, minus one at the label where this rank holds it, times the loss gradient
            part.exp_()
            part.index_put_((index[: part.shape[0]], local[rows]), -inside[rows], accumulate=True)
            part.mul_(grad_loss[rows].unsqueeze(-1))
            if not in_place:
                grad[rows] = part
        return grad.view(logits.shape), None, None, None


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: ProcessGroup | None = None,
    vocab_start: int = 0,
) -> torch.Tensor:
    """Per-token loss (fp32, shape of `labels`) of logits [..., vocab] or, with `group`, of this
    rank's vocabulary slice [..., vocab / tp] starting at word `vocab_start`; equals
    `F.cross_entropy(full_logits, labels, reduction="none")` (module docstring)."""
    return _CrossEntropy.apply(logits, labels, group, vocab_start)
