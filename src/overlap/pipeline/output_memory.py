"""What a pipeline stage's outputs (the activations it sends on) hold, and when that memory goes
back.

Release (`deallocate_pipeline_outputs`, Megatron's deallocate_output_tensor + custom_backward): a
stage's output is kept for backward only as the root of its autograd graph - nothing in the graph
reads its values - so as soon as it is handed to its send its storage is replaced by one element
(`out.data = torch.empty((1,))`), and the backward starts from it through the autograd engine
directly (`backward_from_released`: `torch.autograd.backward` would compare the gradient's shape
with the now one-element tensor; the engine checks it against the graph's record). The send carries
a detached alias of the data, which keeps the memory alive until the send is dropped: swapping the
output's storage under a tensor the process group holds would hand memory still being sent back to
the allocator (torch's NCCL process group keeps the tensor object, not the storage, and no longer
records its stream on it). `OutputRelease` drops each such send at the first point where that costs
nothing, decided without ever blocking the compute on it:
- where the host sees completion (gloo), by causality: with batched p2p and no virtual pipeline at
  once (activations only flow from rank r to r + 1, the last stage sends none, so a rank waiting for
  its send waits for a downstream rank whose progress never depends on it: Megatron's synchronous
  send); otherwise once this rank received a message that the consuming rank produced at or after
  the task that consumes the output (every rank runs its program in order and completes a task's
  receive before the task) - at the latest the output's own gradient. With a virtual pipeline the
  last stage feeds rank 0 and a wait could close a cycle; with overlapped p2p a wait would hold
  this rank's compute for the transfer itself (a send completes once received), the serialisation
  the overlap removes;
- on a device timeline (NCCL), once the device reports the send complete (`CommHandle.reap`, a query
  that never blocks), without a wait: the memory goes back soon after the transfer ends, and no
  stream waits for it.

Measurement: `LiveOutputs` keeps a weak reference to every output's storage and records, per step,
the most bytes alive at once into `PipelineMemory` - what the release buys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.variable import Variable
from torch.multiprocessing.reductions import StorageWeakRef

from overlap.parallel import comm
from overlap.pipeline.p2p import StageTransport
from overlap.pipeline.schedules import Message, StageRing, Task, program_tasks


class PipelineMemory:
    """What this rank's stage outputs (the activations sent to the next stage) hold, over a run.

    Measured on the storages themselves (`LiveOutputs`): the bytes of those still alive after every
    receive, release and task, whoever keeps them alive (the tensors saved for backward, a send
    buffer not yet waited, the transport). `step_peaks[i]` is step i's maximum. This is the part of
    memory `deallocate_pipeline_outputs` acts on; on CPU the process's peak RSS (`peak_memory_mb`)
    moves with the allocator and every other buffer and cannot show it."""

    def __init__(self) -> None:
        self.step_peaks: list[int] = []

    @property
    def peak_bytes(self) -> int:
        """The largest number of output bytes alive at once in any step (0 before the first step, or
        off PP)."""
        return max(self.step_peaks, default=0)


class LiveOutputs:
    """One step's live output storages (weak references) and the most bytes alive at once."""

    def __init__(self) -> None:
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.peak_bytes = 0

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as output memory from now on, until it is freed."""
        storage = tensor.untyped_storage()
        self.live.append((StorageWeakRef(storage), storage.nbytes()))
        self.sample()

    def sample(self) -> None:
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.peak_bytes = max(self.peak_bytes, sum(n for _ref, n in self.live))


def backward_from_released(seeds: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Backpropagate `grads` from `seeds` whose storage may have been released (Megatron's
    custom_backward). The autograd engine is called directly, with the arguments
    `torch.autograd.backward` passes it, minus that function's check of each gradient's shape
    against its tensor's (a released output has one element; the engine checks the gradient against
    the graph's record of the output's shape): the same gradients, bit for bit."""
    Variable._execution_engine.run_backward(
        tensors=tuple(seeds),
        grad_tensors=tuple(grads),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class OutputRelease:
    """`deallocate_pipeline_outputs` over one step: frees each sent output's storage and drops its
    send where that costs nothing (module notes). The causal rule (a virtual pipeline, or overlapped
    p2p) needs the neighbours' programs: `num_micro`, `group`, `merged` and `warmup_depth` rebuild
    them (`program_tasks`)."""

    def __init__(
        self,
        ring: StageRing,
        num_micro: int,
        group: int | None,
        merged: bool,
        overlapped: bool,
        warmup_depth: int,
    ) -> None:
        self.ring = ring
        # batched without a virtual pipeline: a send is waited at once (module notes)
        self.at_once = ring.vpp == 1 and not overlapped
        # a released output's send -> (the consuming pp rank, its consuming task's position)
        self.released: dict[Message, tuple[int, int]] = {}
        # pp rank -> the furthest position in its program that a received message left
        self.heard: dict[int, int] = {}
        self.positions: dict[int, dict[Task, int]] = {}
        if not self.at_once:
            for peer in {(ring.rank + 1) % ring.pp, (ring.rank - 1) % ring.pp}:
                tasks = program_tasks(
                    ring.pp, peer, ring.vpp, num_micro, group, merged, warmup_depth
                )
                self.positions[peer] = {t: i for i, t in enumerate(tasks)}

    def release(self, out: torch.Tensor, chunk: int, message: Message) -> None:
        """`out`, chunk `chunk`'s output, was sent as `message`: its storage goes now; its send,
        which holds an alias of the data, is dropped later."""
        _direction, virtual, mb = message
        if out._base is not None:  # Megatron's check: freeing a view would free nothing
            raise RuntimeError(
                f"deallocate_pipeline_outputs: chunk {chunk}'s output is a view of another tensor"
            )
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
        consumer = virtual % self.ring.pp
        position = (
            -1
            if self.at_once
            else self.positions[consumer][Task(False, mb, virtual // self.ring.pp)]
        )
        self.released[message] = (consumer, position)

    def heard_from(self, message: Message, transport: StageTransport) -> None:
        """A received `message` tells how far its producer got (the causal rule only); drop what
        that allows."""
        if self.at_once:
            return
        rank, task = self.ring.producer(message)
        self.heard[rank] = max(self.heard.get(rank, -1), self.positions[rank][task])
        self.drop(transport)

    def drop(self, transport: StageTransport) -> None:
        """Drop the sends of released outputs where that costs nothing (module notes): on gloo wait
        those whose consumer is known to have run; on a device timeline drop those the device
        reports complete, without a wait. A send still pending (batched mode: it travels with the
        next receive) waits for its post."""
        visible = comm.completion_visible()
        for message, (rank, position) in list(self.released.items()):
            handle = transport.posted_send(message)
            if handle is None:
                continue
            if visible:
                if self.heard.get(rank, -1) < position:
                    continue
                handle.wait()
            elif not handle.reap():
                continue
            transport.drop_send(message)
            del self.released[message]
