"""Pipeline point-to-point transport: moves activations (forward) and their gradients (backward)
between this rank's virtual stages and its neighbours', batched or overlapped. Every call goes
through `comm.p2p`.

Groups: each direction of travel of each edge of the ring has its own process group
(`ParallelState.pipeline_p2p_groups`): activations from rank r to r + 1 on one, gradients from r + 1
to r on another. NCCL matches the messages between two ranks on a group in posting order, ignores
tags and runs a communicator's operations on one stream in issue order, with sends that wait for
their receives. On a group that carries one kind of message from one sender to one receiver, the
k-th send meets the k-th receive whatever the timing (both ranks walk the same schedule table, so
their orders agree), and no send can sit behind a receive that waits for the peer's send behind its
own receive: with PP = 2 and a virtual pipeline both ranks send activations to each other, which on
one group deadlocks (Megatron-Core's `megatron/core/pipeline_parallel/p2p_communication.py` orders
each call's sends and receives by rank parity for the same reason). Tags still name every message
for gloo and the traces. Several messages posted together on a group are one `comm.p2p` call (one
batch, one work on NCCL: waiting for any of its messages waits for the batch).

Modes (the resolution picks one; `explain` shows it):
- batched (`batch_p2p_comm`): a receive is posted only when its task is about to run, together with
  the pending send (Megatron's send_forward_recv_backward / send_backward_recv_forward; here on two
  groups), and waited at once: the receive is exposed.
- overlapped (`overlap_p2p_comm`): sends are posted as soon as their tensor exists; the receives of
  the next forward and backward are posted early (`prefetch`), and waited only just before their
  task, so their transfer runs while this rank computes.
In both, sends are waited at the end of the step (`finish`), or dropped earlier by the
output-release policy (`overlap.pipeline.output_memory`): a send's completion is never on the
compute's critical path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from overlap.parallel import comm
from overlap.parallel.comm import P2P_RECV, P2P_SEND, CommHandle
from overlap.pipeline.schedules import BWD, FWD, Message


class StageTransport:
    """One optimizer step's pipeline messages on this rank. `groups`: this rank's four p2p groups by
    name ("fwd_out", "fwd_in", "bwd_out", "bwd_in"); `shape` / `dtype`: every message's tensor (the
    activation between stages); `overlapped`: the overlapped mode, else batched (module notes)."""

    def __init__(
        self,
        ps,
        groups: dict[str, ProcessGroup],
        shape: tuple[int, ...],
        dtype: torch.dtype,
        num_micro: int,
        overlapped: bool,
    ) -> None:
        self.ps, self.groups, self.shape, self.dtype = ps, groups, shape, dtype
        self.num_micro = num_micro
        self.overlapped = overlapped
        self.recvs: dict[Message, CommHandle] = {}  # posted, not yet consumed
        self.sends: dict[Message, CommHandle] = {}  # posted, until waited or dropped
        # batched mode: the sends that travel with the next receive
        self.pending: list[tuple[Message, torch.Tensor]] = []

    def tag(self, message: Message) -> int:
        """The message's tag (gloo matches on it; NCCL ignores it)."""
        direction, virtual, mb = message
        return (virtual * self.num_micro + mb) * 2 + direction

    def _post(
        self, sends: Sequence[tuple[Message, torch.Tensor]], recvs: Sequence[Message]
    ) -> None:
        """Post sends and receives, one p2p call per group (module notes); receives are remembered
        by message, sends kept until known complete."""
        for direction in (FWD, BWD):
            kind = "fwd" if direction == FWD else "bwd"
            outgoing = [(m, t) for m, t in sends if m[0] == direction]
            if outgoing:
                peer = self.ps.pp_next if direction == FWD else self.ps.pp_prev
                posted = comm.p2p(
                    [(f"pp_send_{kind}", P2P_SEND, t, peer, self.tag(m)) for m, t in outgoing],
                    self.groups[f"{kind}_out"],
                )
                self.sends.update(zip((m for m, _t in outgoing), posted))
            incoming = [m for m in recvs if m[0] == direction]
            if incoming:
                peer = self.ps.pp_prev if direction == FWD else self.ps.pp_next
                buffers = [
                    torch.empty(self.shape, dtype=self.dtype, device=self.ps.device)
                    for _m in incoming
                ]
                posted = comm.p2p(
                    [
                        (f"pp_recv_{kind}", P2P_RECV, b, peer, self.tag(m))
                        for m, b in zip(incoming, buffers)
                    ],
                    self.groups[f"{kind}_in"],
                )
                self.recvs.update(zip(incoming, posted))

    def send(self, message: Message, tensor: torch.Tensor, next_receives: bool) -> torch.Tensor:
        """Send `tensor` as `message`; returns what travels (a detached contiguous alias, or a copy
        of a non-contiguous tensor). Batched, when the next task receives (`next_receives`), the
        send waits to travel with that receive; otherwise it is posted now."""
        travelling = tensor.detach().contiguous()
        if not self.overlapped and next_receives:
            self.pending.append((message, travelling))
        else:
            self._post([(message, travelling)], [])
        return travelling

    def receive(self, message: Message) -> torch.Tensor:
        """Wait for `message` (posted now, with the pending sends, if it was not prefetched)."""
        if message not in self.recvs:
            self._post(self.pending, [message])
            self.pending = []
        return self.recvs.pop(message).wait()

    def prefetch(self, messages: Sequence[Message]) -> None:
        """Overlapped mode: post the receives of `messages` not posted yet (batched: nothing)."""
        if not self.overlapped:
            return
        wanted = [m for m in messages if m not in self.recvs]
        if wanted:
            self._post([], wanted)

    def posted_send(self, message: Message) -> CommHandle | None:
        """The posted send of `message` not yet waited or dropped (None while it is pending or
        gone)."""
        return self.sends.get(message)

    def drop_send(self, message: Message) -> None:
        """Forget a posted send known complete: its tensor goes back to the allocator."""
        del self.sends[message]

    def finish(self) -> None:
        """End of the step: post the pending sends and wait for every send; every receive must be
        consumed."""
        self._post(self.pending, [])
        for handle in self.sends.values():
            handle.wait()
        self.pending, self.sends = [], {}
        if self.recvs:
            raise RuntimeError(
                f"pipeline: receives posted but never consumed: {sorted(self.recvs)}"
            )
