"""Attention of a block of queries on a block of keys and values, in pieces that add up: the
kernels context-parallel attention runs once per KV block (`overlap.layers.cp_attention`).

A block returns its output and its softmax statistics (the log-sum-exp of each query row's scores,
LSE); `merge` combines two blocks' results into the attention over both as if computed at once
(out = sum of outputs weighted by exp(LSE_block - LSE_total)). The backward of one block needs only
the final output and the final LSE of its rows (as flash attention's backward): with P = exp(S -
LSE) the block's probabilities in the full softmax, dV = P^T dO, dS = P (dO V^T - D) with D =
rowsum(dO * O), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d). So the ring never keeps a block's
probabilities, only what flash would keep: Q, K, V, O and the LSE.

Shapes: queries [b, heads, sq, d], keys and values [b, groups, sk, d] (grouped-query attention:
query head i reads group i // (heads / groups); a group's key gradient sums its heads'). Arithmetic
in fp32 whatever the inputs' dtype (the softmax statistics must be: the merge subtracts LSEs), as
the plain path's softmax is; the results are fp32.

`mask` (bool [sq, sk], True: hidden; None: every query sees every key): `causal_mask` for a
sequence's diagonal block, whose query i sees keys 0..i (a load-balanced rank's own two chunks are
in increasing position order, so this is also their mask), `position_mask` for queries and keys at
any global positions.
"""

from __future__ import annotations

import torch

Mask = torch.Tensor | None


def causal_mask(n: int, device: torch.device) -> torch.Tensor:
    """The diagonal block's mask: query i does not see keys after i."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu_(1)


def position_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """Causal attention between tokens at global positions: a key after its query is hidden."""
    return k_positions.unsqueeze(0) > q_positions.unsqueeze(1)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: Mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scores q k^T / sqrt(d), -inf where masked; k repeated per query head, fp32)."""
    per_group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(per_group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    return scores, kf


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.float().repeat_interleave(heads // t.shape[1], dim=1)


def _per_group(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum a per-query-head gradient [b, heads, s, d] over each group's heads."""
    b, heads, s, d = t.shape
    return t.view(b, groups, heads // groups, s, d).sum(dim=2)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, heads, sq, d], lse [b, heads, sq]), both fp32, of softmax(q k^T / sqrt(d)) v."""
    scores, _kf = _scores(q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs, _per_head(v, q.shape[1])), lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """Fold a block's (out, lse) into the running (out, lse) of the same query rows, in place (they
    may be views of the whole result: the rows a half-block covers)."""
    total = torch.logaddexp(lse, block_lse)
    out.mul_((lse - total).exp_().unsqueeze(-1))
    out.add_(block_out.mul_((block_lse - total).exp_().unsqueeze(-1)))
    lse.copy_(total)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    mask: Mask,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv), fp32, of one block given its rows' FINAL lse, the output gradient `dout` and
    `delta` = rowsum(dout * final out) (fp32, [b, heads, sq])."""
    heads, groups = q.shape[1], k.shape[1]
    scores, kf = _scores(q, k, mask)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    dout = dout.float()
    dv = _per_group(torch.matmul(probs.transpose(-1, -2), dout), groups)
    dscores = torch.matmul(dout, _per_head(v, heads).transpose(-1, -2))
    dscores.sub_(delta.unsqueeze(-1)).mul_(probs).mul_(q.shape[-1] ** -0.5)
    dq = torch.matmul(dscores, kf)
    dk = _per_group(torch.matmul(dscores.transpose(-1, -2), q.float()), groups)
    return dq, dk, dv
