"""The ring exchange: the members of a process group, closed into a ring, pass chunks on to the
member ahead while they receive from the member behind, one step at a time.

It is the transport of the ring algorithms that hide a transfer behind compute: tensor-parallel
overlap's all-gather -> GEMM (a sequence shard travels on while the GEMM runs on the shard already
here) and GEMM -> reduce-scatter (a running partial sum travels on while the next partial is
computed), both in `overlap.layers.tp_overlap`; context-parallel ring attention is a third
(`overlap.layers.cp_attention`), where each rank's K/V chunk visits every rank while attention runs
on the chunk here, and its backward sends the chunks and their gradient sums the other way round
(`shift(..., back=True)`):

    ring = Ring(cp_group, "cp_kv")
    kv = (k, v)
    for step in range(ring.steps):
        last = step == ring.steps - 1
        shift = None if last else ring.shift(kv, [torch.empty_like(t) for t in kv])
        attend(q, *kv, source=ring.origin(step))  # whose chunk this is: the causal mask's offset
        if shift is not None:
            kv = shift.wait()

Right for NCCL by construction:
- a step's sends and receives are posted as ONE call (`comm.p2p`: one `batch_isend_irecv`, one
  work on NCCL), so two ranks that exchange with each other (a ring of two, a pair swap) never wait
  on each other, and the step is waited for once, as a whole (`Shift.wait`);
- no tags: NCCL meets the k-th send from A to B with the k-th receive at B from A on the group, and
  so does the ring. Every member posts its steps in the same order, so the k-th message between two
  members is the same step on both sides. A group that also carries other point-to-point traffic
  must post it in the same order on every member (or use a group of its own);
- the received chunk is written into the receive buffer in place: a buffer being sent must not be
  the one a step receives into, and neither may be touched before the step's `wait()`.

Every transfer is traced under the ring's kind (the family prefix of a `comm` kind, e.g. `tp_ag`),
so the timeline shows which compute each step's transfer hides behind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from overlap.parallel import comm

Chunks = torch.Tensor | Sequence[torch.Tensor]


class Shift:
    """One posted step of an exchange: its sends and receives in flight as one batch. `wait()` waits
    for the batch once (every op's handle: their trace events and their buffers) and returns what
    was received, shaped as the receive buffers were given (a tensor, or a tuple of them). The sent
    tensors are held until then, so a caller that drops its own reference (a running sum passed on)
    cannot free a buffer still in flight."""

    def __init__(self, handles: list[comm.CommHandle], received: Chunks, sent: Chunks = ()) -> None:
        self._handles = handles
        self._received = received
        self._sent: Chunks | None = sent

    def wait(self) -> Chunks:
        for handle in self._handles:
            handle.wait()
        self._sent = None
        if isinstance(self._received, torch.Tensor):
            return self._received
        return tuple(self._received)


def exchange(
    send: Chunks, recv: Chunks, to: int, frm: int, group: ProcessGroup, kind: str
) -> Shift:
    """Send `send` to group rank `to` and receive `recv` (filled in place) from group rank `frm`, as
    one batched call: a ring step (`Ring.shift`), or a pair swap where `to` and `frm` are the same
    partner. Tensors (or equal-length sequences of them) whose shapes and dtypes match the
    peers'."""
    sends = [send] if isinstance(send, torch.Tensor) else list(send)
    recvs = [recv] if isinstance(recv, torch.Tensor) else list(recv)
    members = comm.group_members(group)
    ops = [(kind, comm.P2P_SEND, t, members[to], 0) for t in sends]
    ops += [(kind, comm.P2P_RECV, t, members[frm], 0) for t in recvs]
    handles = comm.p2p(ops, group)
    # the receives' handles first: a wait ends with the data here, then the sends' (same batch)
    return Shift(handles[len(sends) :] + handles[: len(sends)], recv, send)


class Ring:
    """The members of `group` in group-rank order, closed into a ring: at each step a member sends
    to the member `stride` places ahead and receives from the one `stride` places behind. With a
    stride of s (dividing the group size) the members r, r + s, r + 2s, ... form a ring of their
    own, of `steps` = size / s members (tensor-parallel overlap's `aggregate` moves pairs of shards
    around a stride-2 ring). One Ring per group and purpose; creating one is free (no
    communication)."""

    def __init__(self, group: ProcessGroup, kind: str, stride: int = 1) -> None:
        self.group, self.kind, self.stride = group, kind, stride
        self.size, self.rank = comm.group_size(group), comm.group_rank(group)
        if stride < 1 or self.size % stride:
            raise ValueError(
                f"ring ({kind}): stride {stride} does not divide the group size {self.size}"
            )
        self.steps = self.size // stride
        self.ahead = (self.rank + stride) % self.size  # group rank a shift sends to
        self.behind = (self.rank - stride) % self.size  # group rank a shift receives from

    def origin(self, shifts: int) -> int:
        """The group rank whose chunk this member holds after `shifts` shifts (0: its own)."""
        return (self.rank - shifts * self.stride) % self.size

    def shift(self, send: Chunks, recv: Chunks, back: bool = False) -> Shift:
        """Post one step: `send` goes to the member ahead, `recv` is filled from the member behind,
        as one batch (`back`: the other way round, to the member behind from the one ahead); wait
        for it with the returned `Shift`. Every member must call it the same number of times, in
        the same order."""
        to, frm = (self.behind, self.ahead) if back else (self.ahead, self.behind)
        return exchange(send, recv, to, frm, self.group, self.kind)
