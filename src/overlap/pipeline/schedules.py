"""Pipeline-parallel schedules: non-interleaved 1F1B and interleaved 1F1B (virtual pipeline), with batched or
overlapped p2p.

A schedule is two things kept apart:

1. The program (`pipeline_steps`): a pure function of (PP, this rank, VPP, micro-batches, group size) giving the
   rank's compute in order as `Step`s. Warm-up steps carry one forward, steady steps one forward AND one backward,
   cool-down steps one backward. The steady step is the unit that EP overlap under PP merges (the forward of one
   (micro-batch, chunk) and the backward of another, layer piece by layer piece); here its two tasks run one after
   the other. The interleaved program is Megatron-Core's: a table maps virtual micro-batch k to (micro-batch,
   chunk) in groups of `microbatch_group_size_per_vp_stage` micro-batches per chunk; warm-up =
   (PP - rank - 1) x 2 + (VPP - 1) x group forwards (PP - rank - 1 without VPP); backward chunks are mirrored.
   VPP = 1 is the non-interleaved 1F1B: one implementation for both.
2. The executor (`PipelineExecutor`): runs the program on this rank's model chunks and moves activations (forward)
   and their gradients (backward) between neighbouring virtual stages. Virtual stage v = chunk x PP + rank, so the
   next stage is always on rank+1 (mod PP) and the previous on rank-1: a ring. Every message is tagged with its
   receiving virtual stage, micro-batch and direction, so a receive posted early matches exactly its send.

p2p modes (the resolution picks one; `explain` shows it):
- batched (`batch_p2p_comm`): a receive is posted only when its task is about to run, in one exchange with the
  pending send (Megatron's send_forward_recv_backward / send_backward_recv_forward), and waited at once: the receive
  is exposed. Sends are waited only at the end of the step: transports with rendezvous sends (NCCL; gloo too) would
  otherwise deadlock the interleaved schedule, where a neighbour may need a later message first (the reason
  Megatron forbids unoverlapped interleaving at PP = 2).
- overlapped (`overlap_p2p_comm`): sends are posted as soon as their tensor exists and waited lazily; the receive
  for the next forward is posted right after this forward's send, and waited only just before that forward (the same
  for backward), so its transfer runs while this rank computes. Gradients travel on a second process group over the
  same ranks (`ParallelState.pp_bwd_group`): with PP = 2 both directions connect the same two ranks and must not
  queue on one channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from overlap.parallel import comm
from overlap.parallel.comm import P2P_RECV, P2P_SEND, CommHandle
from overlap.parallel.trace import RECORDER

FWD, BWD = 0, 1


@dataclass(frozen=True)
class Task:
    backward: bool
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Step:
    """One schedule step: a forward, a backward, or (steady state) both."""

    forward: Task | None
    backward: Task | None


def schedule_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """Virtual micro-batch k -> (micro-batch, chunk): micro-batches in groups of `group`, each group through every
    chunk before the next group starts (the last group may be shorter)."""
    table = []
    for first in range(0, num_microbatches, group):
        members = range(first, min(first + group, num_microbatches))
        table += [(mb, chunk) for chunk in range(vpp) for mb in members]
    return table


def pipeline_steps(pp: int, rank: int, vpp: int, num_microbatches: int, group: int | None = None) -> list[Step]:
    """This rank's program: warm-up forwards, steady (forward, backward) pairs, cool-down backwards."""
    table = schedule_table(num_microbatches, vpp, group or pp)
    total = len(table)
    warmup = pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * (group or pp)
    warmup = min(warmup, total)
    forwards = [Task(False, mb, chunk) for mb, chunk in table]
    backwards = [Task(True, mb, vpp - 1 - chunk) for mb, chunk in table]
    steps = [Step(forwards[k], None) for k in range(warmup)]
    steps += [Step(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
    steps += [Step(None, backwards[k]) for k in range(total - warmup, total)]
    return steps


class PipelineExecutor:
    """Runs one optimizer step's program on this rank's chunks; returns the lm losses (last stage) per micro-batch.

    `chunks[c]` is model chunk c (`GPTModel` with a `Stage`), `batches[mb]` the (tokens, labels) of micro-batch mb,
    `scale` the loss scale (1 / (micro-batches x DP)), `before_backward(chunk, is_last)` tells data parallelism
    which backward is a chunk's last micro-batch (its gradients can then be reduced), `shape` / `dtype` describe
    the activation between stages ([seq (local under SP), micro-batch, hidden])."""

    def __init__(self, chunks: Sequence[torch.nn.Module], ps, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 scale: float, overlap_p2p: bool, before_backward: Callable[[int, bool], None],
                 shape: tuple[int, ...], dtype: torch.dtype, microbatch_group: int | None = None) -> None:
        self.chunks, self.ps, self.batches, self.scale = chunks, ps, batches, scale
        self.overlap = overlap_p2p
        self.before_backward = before_backward
        self.shape, self.dtype = shape, dtype
        self.pp, self.rank, self.vpp = ps.pp_size, ps.pp_rank, len(chunks)
        self.num_micro = len(batches)
        self.steps = pipeline_steps(self.pp, self.rank, self.vpp, self.num_micro, microbatch_group)
        self.tasks = [t for s in self.steps for t in (s.forward, s.backward) if t is not None]
        self.recvs: dict[tuple[int, int, int], CommHandle] = {}  # (direction, virtual stage, micro-batch)
        self.sends: list[CommHandle] = []
        self.pending_sends: list[tuple[int, torch.Tensor, int]] = []  # batched mode: (direction, tensor, tag)
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: dict[int, torch.Tensor] = {}

    # --- geometry -------------------------------------------------------------------------------------------------
    def _virtual(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _is_first(self, chunk: int) -> bool:
        return self._virtual(chunk) == 0

    def _is_last(self, chunk: int) -> bool:
        return self._virtual(chunk) == self.pp * self.vpp - 1

    def _tag(self, direction: int, virtual: int, mb: int) -> int:
        """The message to `virtual` stage's micro-batch `mb` in `direction`."""
        return (virtual * self.num_micro + mb) * 2 + direction

    def _needs_recv(self, task: Task) -> tuple[int, int, int] | None:
        """(direction, virtual stage, micro-batch) of the message `task` consumes, if any."""
        if not task.backward and not self._is_first(task.chunk):
            return FWD, self._virtual(task.chunk), task.microbatch
        if task.backward and not self._is_last(task.chunk):
            return BWD, self._virtual(task.chunk), task.microbatch
        return None

    # --- p2p ------------------------------------------------------------------------------------------------------
    def _group(self, direction: int):
        return self.ps.pp_group if direction == FWD else self.ps.pp_bwd_group

    def _post(self, sends: list[tuple[int, torch.Tensor, int]], recvs: list[tuple[int, int, int]]) -> list[CommHandle]:
        """Post sends (direction, tensor, tag) and receives (direction, virtual stage, micro-batch), one p2p call per
        direction's group; receives are remembered by key."""
        handles: list[CommHandle] = []
        for direction in (FWD, BWD):
            kind = "fwd" if direction == FWD else "bwd"
            peer_out = self.ps.pp_next if direction == FWD else self.ps.pp_prev
            peer_in = self.ps.pp_prev if direction == FWD else self.ps.pp_next
            ops = [(f"pp_send_{kind}", P2P_SEND, t, peer_out, tag) for d, t, tag in sends if d == direction]
            keys = [k for k in recvs if k[0] == direction]
            ops += [(f"pp_recv_{kind}", P2P_RECV, torch.empty(self.shape, dtype=self.dtype), peer_in,
                     self._tag(*k)) for k in keys]
            if not ops:
                continue
            posted = comm.p2p(ops, self._group(direction))
            n_send = len(ops) - len(keys)
            handles += posted[:n_send]
            for key, handle in zip(keys, posted[n_send:]):
                self.recvs[key] = handle
                handles.append(handle)
        return handles

    def _send(self, direction: int, tensor: torch.Tensor, virtual_to: int, mb: int, next_task: Task | None) -> None:
        item = (direction, tensor.detach().contiguous(), self._tag(direction, virtual_to, mb))
        if not self.overlap and next_task is not None and self._needs_recv(next_task) is not None:
            self.pending_sends.append(item)  # travels with the next task's receive, in one batched exchange
        else:
            self.sends += self._post([item], [])

    def _receive(self, key: tuple[int, int, int]) -> torch.Tensor:
        if key not in self.recvs:  # batched mode (or not prefetched): one exchange with the pending sends
            self.sends += [h for h in self._post(self.pending_sends, [key]) if h is not self.recvs.get(key)]
            self.pending_sends = []
        return self.recvs.pop(key).wait()

    def _prefetch(self, position: int) -> None:
        """Overlapped mode: post the receives of the next forward and the next backward after `position`."""
        if not self.overlap:
            return
        wanted = {}
        for task in self.tasks[position + 1:]:
            if task.backward not in wanted:
                wanted[task.backward] = self._needs_recv(task)
            if len(wanted) == 2:
                break
        keys = [k for k in wanted.values() if k is not None and k not in self.recvs]
        if keys:
            self._post([], keys)

    # --- compute --------------------------------------------------------------------------------------------------
    def _forward(self, task: Task, next_task: Task | None) -> None:
        c, mb = task.chunk, task.microbatch
        hidden = None
        if not self._is_first(c):
            hidden = self._receive((FWD, self._virtual(c), mb)).requires_grad_()
        tokens, labels = self.batches[mb]
        with RECORDER.span("forward"):
            out, aux = self.chunks[c].stage_forward(hidden, tokens, labels)
        if self._is_last(c):
            self.losses[mb] = out.detach()
            self.saved[(mb, c)] = (hidden, [(out + aux) * self.scale], [None])
            return
        seeds, grads = [out], [None]
        if aux.requires_grad:  # this chunk's MoE aux losses enter the loss here, scaled like it
            seeds.append(aux * self.scale)
            grads.append(torch.ones_like(aux))
        self.saved[(mb, c)] = (hidden, seeds, grads)
        self._send(FWD, out, self._virtual(c) + 1, mb, next_task)

    def _backward(self, task: Task, next_task: Task | None) -> None:
        c, mb = task.chunk, task.microbatch
        hidden, seeds, grads = self.saved.pop((mb, c))
        if not self._is_last(c):
            grads[0] = self._receive((BWD, self._virtual(c), mb))
        self.before_backward(c, mb == self.num_micro - 1)
        with RECORDER.span("backward"):
            torch.autograd.backward(seeds, grads if grads[0] is not None else None)
        if not self._is_first(c):
            self._send(BWD, hidden.grad, self._virtual(c) - 1, mb, next_task)

    def run(self) -> list[torch.Tensor]:
        """The whole program; every send is complete on return. Returns the lm losses (empty off the last stage)."""
        self._prefetch(-1)
        for i, task in enumerate(self.tasks):
            following = self.tasks[i + 1] if i + 1 < len(self.tasks) else None
            (self._backward if task.backward else self._forward)(task, following)
            self._prefetch(i)
        for handle in self._post(self.pending_sends, []) + self.sends:
            handle.wait()
        self.pending_sends, self.sends = [], []
        if self.recvs:
            raise RuntimeError(f"pipeline: receives posted but never consumed: {sorted(self.recvs)}")
        return [self.losses[mb] for mb in sorted(self.losses)]
