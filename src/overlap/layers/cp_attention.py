"""Context-parallel attention: each CP rank holds the queries, keys and values of its two
load-balanced chunks of the sequence (`overlap.parallel.cp_chunks`) and needs every earlier key.
Megatron's `cp_comm_type` picks how the keys and values meet the queries:

- `p2p` (Transformer Engine's AttnFuncWithCPAndKVP2P): the KV blocks travel around the ring of CP
  ranks (`overlap.parallel.ring`, kind `cp_kv`). With `cp_comm_overlap` the next block's transfer is
  posted before the current block's attention and waited after it, so the transfer hides behind the
  attention; off, every transfer is waited at once (the same messages, serialised: the benchmark's
  baseline). Blocks merge by log-sum-exp (`overlap.layers.block_attention`). With the load-balanced
  split, rank r's own block is causal and every other block is half work: from a rank before it
  (origin o < r) every query sees only the block's early chunk; from a rank after it only the
  rank's late chunk sees the block (all of it). The backward runs the ring the other way: KV blocks
  travel back (`cp_kv`), and each block's key/value gradient sum travels with them (kind
  `cp_dkv`), each rank adding its share, until it reaches its owner (`RingAttention`); every
  transfer is waited only after the block computed beside it, so it hides there too.
- `all_gather` (AttnFuncWithCPAndKVAllGather): the keys and values gathered once (`cp_ag`), the
  local queries attend the whole sequence under their global positions' mask; the key/value
  gradients reduce-scattered back (`cp_dkv`).
- `a2a` (Ulysses, AttnFuncWithCPAndQKVOA2A): an all-to-all (`cp_a2a`) trades the sequence split
  for a head split, each rank runs ordinary causal attention over the whole sequence for heads/CP
  heads (the layer's own kernel: flash on a GPU), and a second all-to-all trades back.
- `a2a+p2p` (hierarchical, `hierarchical_context_parallel_sizes` = [A, P]): the all-to-all inside
  groups of A consecutive CP ranks, the p2p ring across the P groups (`hierarchical_attention`).

The p2p and all_gather blocks run `block_attention`'s fp32 arithmetic (what they keep for backward
is flash's: Q, K, V, the output and its log-sum-exp), on any device. Shapes: [b, heads, s_local,
d] queries and [b, groups, s_local, d] keys and values, as the layer's kernel takes them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Function
from torch.distributed import ProcessGroup

from overlap.layers.block_attention import (
    block_backward,
    block_forward,
    causal_mask,
    merge,
    position_mask,
)
from overlap.parallel import comm
from overlap.parallel.cp_chunks import cp_positions, gathered_positions
from overlap.parallel.ring import Ring, Shift
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _fresh(tensors) -> list[torch.Tensor]:
    """Receive buffers for one ring step (never the buffers being sent)."""
    return [torch.empty_like(t) for t in tensors]


class _Ring:
    """One ring pass's transfers: `post` a step (its `Shift`; `wait()` it where the result is
    needed). Serialised (`overlap` off) the step is also waited as it is posted, so no compute runs
    under it (a second wait returns at once)."""

    def __init__(self, ring: Ring, overlap: bool, back: bool) -> None:
        self.ring, self.overlap, self.back = ring, overlap, back

    def post(self, send, recv) -> Shift:
        shift = self.ring.shift(send, recv, back=self.back)
        if not self.overlap:
            shift.wait()
        return shift


def _block_kind(origin: int, rank: int) -> str:
    """Which part of a block rank `rank`'s queries attend under the load-balanced split: its own
    block causally; an earlier rank's block only its early chunk (every query is after it); a
    later rank's block only from the rank's late chunk (which is after all of it)."""
    return "own" if origin == rank else "early_kv" if origin < rank else "late_q"


class RingAttention(Function):
    """`cp_comm_type=p2p` (module docstring). The forward visits the blocks in the order they
    arrive: its own, then the rank behind's, ... ending with the block of the rank ahead, which it
    keeps (one more KV block per layer). The backward visits them the other way round, starting
    from that kept block with no transfer to wait for and ending with its own: the KV blocks and
    the dKV sums travel backwards around the ring (to the rank behind), so each block's dKV sum
    reaches its owner while the owner computes its own block's backward. Against Transformer
    Engine's backward (which starts from the own block and leaves the last dKV transfer exposed)
    the ring sends one KV block fewer and hides every transfer it sends."""

    @staticmethod
    def forward(ctx, q, k, v, group: ProcessGroup, overlap: bool):
        ring = Ring(group, "cp_kv")
        rank, half = ring.rank, q.shape[2] // 2
        kv_ring = _Ring(ring, overlap, back=False)
        kv = (k.contiguous(), v.contiguous())
        out = lse = None
        for step in range(ring.steps):
            posted = kv_ring.post(kv, _fresh(kv)) if step < ring.steps - 1 else None
            kind = _block_kind(ring.origin(step), rank)
            with recorder().span("cp.attention"):
                if kind == "own":
                    out, lse = block_forward(q, *kv, causal_mask(q.shape[2], q.device))
                elif kind == "early_kv":
                    merge(out, lse, *block_forward(q, kv[0][:, :, :half], kv[1][:, :, :half], None))
                else:
                    merge(
                        out[:, :, half:],
                        lse[:, :, half:],
                        *block_forward(q[:, :, half:], *kv, None),
                    )
            if posted is not None:
                kv = posted.wait()
        out = out.to(q.dtype)
        # kv: the last block received, the rank ahead's: where the backward starts
        ctx.save_for_backward(q, k, v, *kv, out, lse)
        ctx.group, ctx.overlap = group, overlap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, k_ahead, v_ahead, out, lse = ctx.saved_tensors
        kv_ring = _Ring(Ring(ctx.group, "cp_kv"), ctx.overlap, back=True)
        dkv_ring = _Ring(Ring(ctx.group, "cp_dkv"), ctx.overlap, back=True)
        ring = kv_ring.ring
        rank, steps, half = ring.rank, ring.steps, q.shape[2] // 2
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, dkv_posted = (k_ahead, v_ahead), None
        for step in range(steps):
            # step s: the block of the rank s + 1 ahead (the last step: this rank's own); the next
            # one (not this rank's own, which is here) comes from the rank ahead
            kv_posted = kv_ring.post(kv, _fresh(kv)) if step < steps - 2 else None
            kind = _block_kind((rank + 1 + step) % steps, rank)
            dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv)
            with recorder().span("cp.attention_bwd"):
                if kind == "own":
                    mask = causal_mask(q.shape[2], q.device)
                    dq_b, dk[:], dv[:] = block_backward(q, *kv, lse, dout, delta, mask)
                    dq += dq_b
                elif kind == "early_kv":
                    early = (kv[0][:, :, :half], kv[1][:, :, :half])
                    dq_b, dk[:, :, :half], dv[:, :, :half] = block_backward(
                        q, *early, lse, dout, delta, None
                    )
                    dq += dq_b
                else:
                    rows = slice(half, None)
                    dq_b, dk[:], dv[:] = block_backward(
                        q[:, :, rows],
                        *kv,
                        lse[:, :, rows],
                        dout[:, :, rows],
                        delta[:, :, rows],
                        None,
                    )
                    dq[:, :, rows] += dq_b
            if dkv_posted is not None:  # the block's dKV sum from the ranks ahead that had it
                dk_in, dv_in = dkv_posted.wait()
                dk += dk_in
                dv += dv_in
            if step < steps - 1:
                dkv_posted = dkv_ring.post((dk, dv), _fresh((dk, dv)))
                kv = kv_posted.wait() if kv_posted is not None else (k, v)
        # the last step's block was this rank's own: dk, dv are its whole gradient
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _gather_seq(t: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """[b, g, s_local, d] -> [b, g, CP x s_local, d], the CP ranks' shares in rank order."""
    seq_first = t.permute(2, 0, 1, 3)
    gathered = comm.all_gather(seq_first, ps.cp_group, "cp_ag").wait()
    return gathered.permute(1, 2, 0, 3)


def _scatter_seq(t: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The sum over CP of [b, g, CP x s_local, d] gradients, this rank's share back: the
    all-gather's transpose."""
    seq_first = t.permute(2, 0, 1, 3).contiguous()
    return comm.reduce_scatter(seq_first, ps.cp_group, "cp_dkv").wait().permute(1, 2, 0, 3)


class AllGatherAttention(Function):
    """`cp_comm_type=all_gather` (module docstring)."""

    @staticmethod
    def _mask(q: torch.Tensor, ps: ParallelState) -> torch.Tensor:
        """This rank's queries against the gathered keys, by global position (made again in
        backward rather than kept: [s_local, s] per layer)."""
        seq = q.shape[2] * ps.layout.cp
        return position_mask(
            cp_positions(seq, ps.cp_rank, ps.layout.cp, q.device),
            gathered_positions(seq, ps.layout.cp, q.device),
        )

    @staticmethod
    def forward(ctx, q, k, v, ps: ParallelState):
        k_all, v_all = _gather_seq(k, ps), _gather_seq(v, ps)
        with recorder().span("cp.attention"):
            out, lse = block_forward(q, k_all, v_all, AllGatherAttention._mask(q, ps))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ps = ps
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # gathered again rather than kept: the backward holds one rank's share, as p2p's does
        k_all, v_all = _gather_seq(k, ctx.ps), _gather_seq(v, ctx.ps)
        delta = (dout.float() * out.float()).sum(-1)
        mask = AllGatherAttention._mask(q, ctx.ps)
        with recorder().span("cp.attention_bwd"):
            dq, dk_all, dv_all = block_backward(q, k_all, v_all, lse, dout, delta, mask)
        dk, dv = _scatter_seq(dk_all, ctx.ps), _scatter_seq(dv_all, ctx.ps)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, h, s_local, d] -> [b, h / n, n x s_local, d] over the n members of `group`: head slice j
    goes to member j, every member's share of the sequence comes back (in member order)."""
    b, h, s, d = x.shape
    n = comm.group_size(group)
    out = comm.all_to_all(x.view(b, n, h // n, s, d).transpose(0, 1), group, "cp_a2a")
    return out.wait().permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [b, h / n, n x s_local, d] -> [b, h, s_local, d]."""
    b, hn, s_all, d = x.shape
    n = comm.group_size(group)
    s = s_all // n
    out = comm.all_to_all(x.view(b, hn, n, s, d).permute(2, 0, 1, 3, 4), group, "cp_a2a")
    return out.wait().transpose(0, 1).reshape(b, hn * n, s, d)


class _SeqToHeads(Function):
    """`_seq_to_heads` with its inverse as the backward (`to_heads` False: the other way)."""

    @staticmethod
    def forward(ctx, x, group: ProcessGroup, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        back = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
        return back, None, None


def _in_position_order(q, k, v, group: ProcessGroup, gathered: torch.Tensor, attend: Attend):
    """Sequence -> heads over `group`, whose members' shares hold the global positions `gathered`
    (in member order); `attend` on them sorted by position (their causal order); back again."""
    order = torch.argsort(gathered)  # the gathered rows in position order
    q, k, v = (_SeqToHeads.apply(t, group, True).index_select(2, order) for t in (q, k, v))
    out = attend(q, k, v).index_select(2, torch.argsort(order))  # back to member order
    return _SeqToHeads.apply(out, group, False)


def a2a_attention(q, k, v, ps: ParallelState, attend: Attend) -> torch.Tensor:
    """`cp_comm_type=a2a` (module docstring): `attend` is the layer's causal kernel over the whole
    sequence in position order."""
    seq = q.shape[2] * ps.layout.cp
    gathered = gathered_positions(seq, ps.layout.cp, q.device)
    return _in_position_order(q, k, v, ps.cp_group, gathered, attend)


def hierarchical_attention(q, k, v, ps: ParallelState, overlap: bool) -> torch.Tensor:
    """`cp_comm_type=a2a+p2p`: an all-to-all inside each group of A consecutive CP ranks
    (`ps.cp_a2a_group`) trades their 2A chunks for 1/A of the heads; sorted by position, the group's
    chunks are its A early chunks then its A late ones, so the P groups are the members of a
    load-balanced ring of their own (group g's early chunks all before group g+1's, its late ones
    all after), and the p2p ring runs across them (`ps.cp_p2p_group`) exactly as `RingAttention`
    runs across CP ranks; then the all-to-all back. With an all-to-all size of 1 it is the plain
    ring."""
    if ps.cp_a2a_group is None:
        return RingAttention.apply(q, k, v, ps.cp_group, overlap)
    a2a = comm.group_size(ps.cp_a2a_group)
    first = ps.cp_rank // a2a * a2a  # the CP rank of this group's first member
    seq = q.shape[2] * ps.layout.cp
    gathered = torch.cat(
        [cp_positions(seq, r, ps.layout.cp, q.device) for r in range(first, first + a2a)]
    )

    def ring(q, k, v):
        return RingAttention.apply(q, k, v, ps.cp_p2p_group, overlap)

    return _in_position_order(q, k, v, ps.cp_a2a_group, gathered, ring)


def cp_attention(q, k, v, ps: ParallelState, kind: str, overlap: bool, attend: Attend):
    """Causal attention of this CP rank's queries over the whole sequence, by `kind`
    (`cp_comm_type`)."""
    if kind == "p2p":
        return RingAttention.apply(q, k, v, ps.cp_group, overlap)
    if kind == "all_gather":
        return AllGatherAttention.apply(q, k, v, ps)
    if kind == "a2a":
        return a2a_attention(q, k, v, ps, attend)
    if kind == "a2a+p2p":
        return hierarchical_attention(q, k, v, ps, overlap)
    raise ValueError(f"cp_attention: unknown cp_comm_type {kind!r}")
