"""Pipeline-parallel schedules: non-interleaved 1F1B and interleaved 1F1B (virtual pipeline), with batched or
overlapped p2p.

A schedule is two things kept apart:

1. The program (`pipeline_steps`): a pure function of (PP, this rank, VPP, micro-batches, group size) giving the
   rank's compute in order as `Step`s. Warm-up steps carry one forward, steady steps one forward AND one backward,
   cool-down steps one backward. The steady step is the unit that EP overlap merges (the forward of one
   (micro-batch, chunk) and the backward of another, layer piece by layer piece: `merged=True`, one more warm-up
   forward, and `PipelineExecutor(ep_overlap=True)` runs each step through `combined_1f1b.run_merged`); without it
   the two tasks run one after the other. The interleaved program is Megatron-Core's: a table maps virtual
   micro-batch k to (micro-batch, chunk) in groups of `microbatch_group_size_per_vp_stage` micro-batches per chunk; warm-up =
   (PP - rank - 1) x 2 + (VPP - 1) x group forwards (PP - rank - 1 without VPP); backward chunks are mirrored.
   VPP = 1 is the non-interleaved 1F1B: one implementation for both.
2. The executor (`PipelineExecutor`): runs the program on this rank's model chunks and moves activations (forward)
   and their gradients (backward) between neighbouring virtual stages. Virtual stage v = chunk x PP + rank, so the
   next stage is always on rank+1 (mod PP) and the previous on rank-1: a ring.

Transport: each direction of travel of each edge of the ring has its own process group
(`ParallelState.pipeline_p2p_groups`): activations from rank r to r + 1 on one, gradients from r + 1 to r on
another. NCCL matches the messages between two ranks on a group in posting order, ignores tags and runs a
communicator's operations on one stream in issue order, with sends that wait for their receives. On a group that
carries one kind of message from one sender to one receiver, the k-th send meets the k-th receive whatever the
timing (both ranks walk the same schedule table, so their orders agree), and no send can sit behind a receive that
waits for the peer's send behind its own receive: with PP = 2 and a virtual pipeline both ranks send activations to
each other, which on one group deadlocks (the reference orders each call's sends and receives by rank parity for
the same reason). Tags still name every message for gloo and the traces.

p2p modes (the resolution picks one; `explain` shows it):
- batched (`batch_p2p_comm`): a receive is posted only when its task is about to run, together with the pending
  send (Megatron's send_forward_recv_backward / send_backward_recv_forward; here on two groups), and waited at once:
  the receive is exposed.
- overlapped (`overlap_p2p_comm`): sends are posted as soon as their tensor exists; the receive for the next
  forward is posted right after this forward's send, and waited only just before that forward (the same for
  backward), so its transfer runs while this rank computes.
In both, sends are waited at the end of the step (or dropped earlier when their output is released, below): a
send's completion is never on the compute's critical path.

Memory (`deallocate_pipeline_outputs`, Megatron's deallocate_output_tensor + custom_backward): a stage's output is
kept for backward only as the root of its autograd graph - nothing in the graph reads its values - so as soon as it
is handed to its send its storage is replaced by one element (`out.data = torch.empty((1,))`), and the backward
starts from it through the autograd engine directly (`torch.autograd.backward` would compare the gradient's shape
with the now one-element tensor; the engine checks it against the graph's record). The send carries a detached alias
of the data, which keeps the memory alive until the send is dropped: swapping the output's storage under a tensor
the process group holds would hand memory still being sent back to the allocator (torch's NCCL process group keeps
the tensor object, not the storage, and no longer records its stream on it). The executor drops each such send at
the first point where that costs nothing, decided without ever blocking the compute on it:
- where the host sees completion (gloo), by causality: without a virtual pipeline at once (activations only flow
  from rank r to r + 1, the last stage sends none, so a rank waiting for its send waits for a downstream rank whose
  progress never depends on it: Megatron's synchronous send); with one, the last stage feeds rank 0 and a wait could
  close a cycle, so once this rank received a message that the consuming rank produced at or after the task that
  consumes the output (every rank runs its program in order and completes a task's receive before the task) - at
  the latest the output's own gradient;
- on a device timeline (NCCL), once the device reports the send complete (`CommHandle.reap`, a query that never
  blocks), without a wait: the memory goes back soon after the transfer ends, and no stream waits for it.
`PipelineMemory` measures what it buys: the bytes of output storage still alive (weak references to the storages, so
a send not yet dropped counts).

Deferred output-layer weight gradients (`defer_embedding_wgrad_compute`): on the last virtual stage the output
layer's weight-gradient GEMMs go into its own `WeightGradStore` (`ColumnParallelLinear.wgrad_store`) instead of
running in each micro-batch's backward, and all run at the pipeline flush, after the program, before the trainer's
gradient reduction. `wgrad_deferral_limit` > 0 caps how many micro-batches are deferred (Megatron: the first `limit`
ones; later ones compute in their own backward); -1 or 0: all. Data parallelism sees the output weight's gradient as
complete only with the last deferred GEMM: the flush tells it, GEMM by GEMM, which one is last, and when a capped
micro-batch computes the step's last gradient before the flush, that backward is not reported as the last one (the
chunk's buckets are then reduced by `finish_grad_sync`).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.autograd.variable import Variable
from torch.multiprocessing.reductions import StorageWeakRef

from overlap.layers.wgrad_store import WGRAD_STORE, WeightGradStore
from overlap.parallel import comm
from overlap.parallel.comm import P2P_RECV, P2P_SEND, CommHandle
from overlap.parallel.trace import RECORDER
from overlap.pipeline.combined_1f1b import ChunkRun, run_merged

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


def pipeline_steps(pp: int, rank: int, vpp: int, num_microbatches: int, group: int | None = None,
                   merged: bool = False) -> list[Step]:
    """This rank's program: warm-up forwards, steady (forward, backward) pairs, cool-down backwards. `merged` (EP
    overlap runs each steady pair as one merged step): one more warm-up forward, as Megatron-Core adds, so that a
    steady step never pairs a backward with its own micro-batch's forward; at PP = 1 this is the combined 1F1B,
    F(0) alone, F(i) with B(i-1), B(last) alone."""
    table = schedule_table(num_microbatches, vpp, group or pp)
    total = len(table)
    warmup = pp - rank - 1 if vpp == 1 else (pp - rank - 1) * 2 + (vpp - 1) * (group or pp)
    warmup = min(warmup + merged, total)
    forwards = [Task(False, mb, chunk) for mb, chunk in table]
    backwards = [Task(True, mb, vpp - 1 - chunk) for mb, chunk in table]
    steps = [Step(forwards[k], None) for k in range(warmup)]
    steps += [Step(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
    steps += [Step(None, backwards[k]) for k in range(total - warmup, total)]
    return steps


def program_tasks(pp: int, rank: int, vpp: int, num_microbatches: int, group: int | None = None,
                  merged: bool = False) -> list[Task]:
    """The rank's tasks in the order it runs them (the steps flattened: a steady step's forward, then its backward)."""
    return [t for s in pipeline_steps(pp, rank, vpp, num_microbatches, group, merged) for t in (s.forward, s.backward)
            if t is not None]


class PipelineMemory:
    """What this rank's stage outputs (the activations sent to the next stage) hold, over a run.

    Measured on the storages themselves: the executor keeps a weak reference to every output's storage and sums the
    bytes of those still alive after every receive, release and task, whoever keeps them alive (the tensors saved for
    backward, a send buffer not yet waited, the transport). `step_peaks[i]` is step i's maximum. This is the part
    of memory `deallocate_pipeline_outputs` acts on; on CPU the process's peak RSS (`peak_memory_mb`) moves with
    the allocator and every other buffer and cannot show it."""

    def __init__(self) -> None:
        self.step_peaks: list[int] = []

    @property
    def peak_bytes(self) -> int:
        """The largest number of output bytes alive at once in any step (0 before the first step, or off PP)."""
        return max(self.step_peaks, default=0)


def backward_from_released(seeds: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    """Backpropagate `grads` from `seeds` whose storage may have been released (Megatron's custom_backward). The
    autograd engine is called directly, with the arguments `torch.autograd.backward` passes it, minus that
    function's check of each gradient's shape against its tensor's (a released output has one element; the engine
    checks the gradient against the graph's record of the output's shape): the same gradients, bit for bit."""
    Variable._execution_engine.run_backward(tensors=tuple(seeds), grad_tensors=tuple(grads), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


class PipelineExecutor:
    """Runs one optimizer step's program on this rank's chunks; returns the lm losses (last stage) per micro-batch.

    `chunks[c]` is model chunk c (`GPTModel` with a `Stage`), `batches[mb]` the (tokens, labels) of micro-batch mb,
    `scale` the loss scale (1 / (micro-batches x DP)), `before_backward(chunk, is_last)` tells data parallelism
    which backward is a chunk's last micro-batch (its gradients can then be reduced), `shape` / `dtype` describe
    the activation between stages ([seq (local under SP), micro-batch, hidden]).

    `deallocate_outputs`: free each sent output's storage once its send completed (see the module notes).
    `defer_output_wgrad` / `wgrad_deferral_limit`: defer the output layer's weight-gradient GEMMs to the flush
    (the last stage's model must have been built with `model.defer_embedding_wgrad_compute`, which gives its output
    layer the store). `memory`: where the step's peak of live output bytes is recorded (`PipelineMemory`)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], ps, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 scale: float, overlap_p2p: bool, before_backward: Callable[[int, bool], None],
                 shape: tuple[int, ...], dtype: torch.dtype, microbatch_group: int | None = None, *,
                 deallocate_outputs: bool = False, defer_output_wgrad: bool = False,
                 wgrad_deferral_limit: int | None = None, memory: PipelineMemory | None = None,
                 ep_overlap: bool = False, delay_wgrad: bool = False) -> None:
        self.chunks, self.ps, self.batches, self.scale = chunks, ps, batches, scale
        self.ep_overlap, self.delay_wgrad = ep_overlap, delay_wgrad
        if ep_overlap and len(batches) < 2:
            raise ValueError("the EP-overlap schedule needs at least 2 micro-batches per step")
        if ep_overlap and deallocate_outputs and ps.pp_size > 1:
            raise ValueError("deallocate_pipeline_outputs is not built for the EP-overlap schedule (the merged "
                             "pieces keep each output for their own backward)")
        self.runs: dict[tuple[int, int], ChunkRun] = {}  # EP overlap: (micro-batch, chunk) -> its forward's pieces
        self.overlap = overlap_p2p
        self.before_backward = before_backward
        self.shape, self.dtype = shape, dtype
        self.pp, self.rank, self.vpp = ps.pp_size, ps.pp_rank, len(chunks)
        self.num_micro = len(batches)
        self.steps = pipeline_steps(self.pp, self.rank, self.vpp, self.num_micro, microbatch_group, ep_overlap)
        self.tasks = [t for s in self.steps for t in (s.forward, s.backward) if t is not None]
        self.recvs: dict[tuple[int, int, int], CommHandle] = {}  # (direction, virtual stage, micro-batch)
        self.sends: dict[int, CommHandle] = {}  # tag -> its posted send, until waited
        self.pending_sends: list[tuple[int, torch.Tensor, int]] = []  # batched mode: (direction, tensor, tag)
        self.saved: dict[tuple[int, int], tuple] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.groups = ps.pipeline_p2p_groups(wrap=self.vpp > 1) if self.pp > 1 else {}
        # deallocate_pipeline_outputs (module notes): the sends of released outputs still to drop, by tag ->
        # (consuming pp rank, position of the consuming task in its program; -1 without a virtual pipeline)
        self.deallocate = deallocate_outputs
        self.released: dict[int, tuple[int, int]] = {}
        self.heard: dict[int, int] = {}  # pp rank -> furthest position in its program that a received message left
        self.positions: dict[int, dict[Task, int]] = {}
        if self.deallocate and self.vpp > 1:  # the causal rule needs the neighbours' programs
            for peer in {(self.rank + 1) % self.pp, (self.rank - 1) % self.pp}:
                tasks = program_tasks(self.pp, peer, self.vpp, self.num_micro, microbatch_group, ep_overlap)
                self.positions[peer] = {t: i for i, t in enumerate(tasks)}
        # live output bytes (PipelineMemory)
        self.memory = memory
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.peak_bytes = 0
        # defer_embedding_wgrad_compute
        self.deferral_limit = wgrad_deferral_limit if wgrad_deferral_limit and wgrad_deferral_limit > 0 else None
        self.deferred = 0  # micro-batches whose output-layer weight gradient is queued this step
        self.deferral_chunk: int | None = None
        self.deferral_store: WeightGradStore | None = None
        last = [c for c in range(self.vpp) if self._is_last(c)]
        if defer_output_wgrad and last:
            store = getattr(self.chunks[last[0]].output_layer, "wgrad_store", None)
            if store is None:
                raise RuntimeError("defer_embedding_wgrad_compute: the output layer has no weight-gradient store; "
                                   "build the model with model.defer_embedding_wgrad_compute=true")
            if store.queue:
                raise RuntimeError(f"defer_embedding_wgrad_compute: {len(store.queue)} output-layer weight "
                                   "gradients left over from an earlier step")
            self.deferral_chunk, self.deferral_store = last[0], store

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
    def _post(self, sends: list[tuple[int, torch.Tensor, int]], recvs: list[tuple[int, int, int]]) -> None:
        """Post sends (direction, tensor, tag) and receives (direction, virtual stage, micro-batch), one p2p call per
        group (module notes); receives are remembered by key, sends kept until known complete."""
        for direction in (FWD, BWD):
            kind = "fwd" if direction == FWD else "bwd"
            outgoing = [(t, tag) for d, t, tag in sends if d == direction]
            if outgoing:
                peer = self.ps.pp_next if direction == FWD else self.ps.pp_prev
                posted = comm.p2p([(f"pp_send_{kind}", P2P_SEND, t, peer, tag) for t, tag in outgoing],
                                  self.groups[f"{kind}_out"])
                self.sends.update(zip((tag for _t, tag in outgoing), posted))
            keys = [k for k in recvs if k[0] == direction]
            if keys:
                peer = self.ps.pp_prev if direction == FWD else self.ps.pp_next
                posted = comm.p2p([(f"pp_recv_{kind}", P2P_RECV, torch.empty(self.shape, dtype=self.dtype, device=self.ps.device), peer,
                                    self._tag(*k)) for k in keys], self.groups[f"{kind}_in"])
                self.recvs.update(zip(keys, posted))

    def _send(self, direction: int, tensor: torch.Tensor, virtual_to: int, mb: int, next_task: Task | None) -> None:
        item = (direction, tensor.detach().contiguous(), self._tag(direction, virtual_to, mb))
        if direction == FWD and item[1].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
            self._track(item[1])  # a non-contiguous output travels as a copy: that copy is output memory too
        if not self.overlap and next_task is not None and self._needs_recv(next_task) is not None:
            self.pending_sends.append(item)  # travels with the next task's receive
        else:
            self._post([item], [])

    def _receive(self, key: tuple[int, int, int]) -> torch.Tensor:
        if key not in self.recvs:  # batched mode (or not prefetched): posted now, with the pending sends
            self._post(self.pending_sends, [key])
            self.pending_sends = []
        tensor = self.recvs.pop(key).wait()
        if self.deallocate and self.vpp > 1:
            rank, task = self._producer(key)
            self.heard[rank] = max(self.heard.get(rank, -1), self.positions[rank][task])
            self._drop_released()
        return tensor

    # --- deallocate_pipeline_outputs ----------------------------------------------------------------------------
    def _release(self, out: torch.Tensor, chunk: int, mb: int) -> None:
        """The output's storage goes now; its send, which holds an alias of the data, is dropped later (module
        notes)."""
        if out._base is not None:  # Megatron's check: freeing a view would free nothing
            raise RuntimeError(f"deallocate_pipeline_outputs: chunk {chunk}'s output is a view of another tensor")
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
        virtual = self._virtual(chunk) + 1
        consumer = virtual % self.pp
        position = self.positions[consumer][Task(False, mb, virtual // self.pp)] if self.vpp > 1 else -1
        self.released[self._tag(FWD, virtual, mb)] = (consumer, position)

    def _producer(self, key: tuple[int, int, int]) -> tuple[int, Task]:
        """(pp rank, task) that produced the message `key` (direction, receiving virtual stage, micro-batch)."""
        direction, virtual, mb = key
        source = virtual - 1 if direction == FWD else virtual + 1
        return source % self.pp, Task(direction == BWD, mb, source // self.pp)

    def _drop_released(self) -> None:
        """Drop the sends of released outputs where that costs nothing (module notes): on gloo wait those whose
        consumer is known to have run; on a device timeline drop those the device reports complete, without a wait.
        A send still pending (batched mode: it travels with the next receive) waits for its post."""
        visible = comm.completion_visible()
        for tag, (rank, position) in list(self.released.items()):
            handle = self.sends.get(tag)
            if handle is None:
                continue
            if visible:
                if self.heard.get(rank, -1) < position:
                    continue
                handle.wait()
            elif not handle.reap():
                continue
            del self.sends[tag], self.released[tag]

    # --- live output bytes (PipelineMemory) -------------------------------------------------------------------
    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        self.live.append((StorageWeakRef(storage), storage.nbytes()))
        self._sample()

    def _sample(self) -> None:
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        self.peak_bytes = max(self.peak_bytes, sum(n for _ref, n in self.live))

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
        self._track(out)
        self._send(FWD, out, self._virtual(c) + 1, mb, next_task)
        if self.deallocate:
            self._release(out, c, mb)

    def _backward_setup(self, task: Task) -> tuple[bool, "WeightGradStore | None"]:
        """Before a backward: tells data parallelism whether it is its chunk's last micro-batch (not while deferred
        output-layer GEMMs are still to come); returns (whether the output layer's weight gradient is deferred, the
        deferral store of this chunk or None)."""
        c, mb = task.chunk, task.microbatch
        last = mb == self.num_micro - 1
        defer = False
        if c == self.deferral_chunk:
            defer = self.deferral_limit is None or self.deferred < self.deferral_limit
            self.deferred += defer
            if last and not defer and self.deferral_store.queue:
                last = False  # deferred GEMMs are still to come: DP must not take this as the weight's last grad
        self.before_backward(c, last)
        return defer, (self.deferral_store if c == self.deferral_chunk else None)

    def _backward(self, task: Task, next_task: Task | None) -> None:
        c, mb = task.chunk, task.microbatch
        hidden, seeds, grads = self.saved.pop((mb, c))
        if not self._is_last(c):
            grads[0] = self._receive((BWD, self._virtual(c), mb))
        defer, store = self._backward_setup(task)
        with RECORDER.span("backward"), (store.delaying(defer) if store is not None else nullcontext()):
            if self.deallocate and not self._is_last(c):
                backward_from_released(seeds, grads)
            else:
                torch.autograd.backward(seeds, grads if grads[0] is not None else None)
        if not self._is_first(c):
            self._send(BWD, hidden.grad, self._virtual(c) - 1, mb, next_task)

    def _merged_step(self, step: Step, next_task: Task | None, position: int) -> None:
        """EP overlap: the step's forward and backward as one merged step of layer pieces (`run_merged`), or either
        alone. Both receives are waited before it starts, and the next step's are posted right then (overlapped
        p2p), to arrive while this step computes; with overlapped p2p the forward's output is sent as soon as the
        forward is done, under the backward's remaining pieces, and the backward's input gradient right after it
        (batched p2p holds both for the next step's first receive, as without EP overlap). `position`: the program
        position of the step's last task. Delayed weight gradients fill the waits of this step and the next
        (`end_phase`), except around a chunk's last backward: everything queued is delivered before it, and it runs its own at fixed
        slots, since a delivered gradient may fire a data-parallel collective and collectives must be issued in the
        same order on every rank (where a filled wait delivers depends on timing). The merged program puts every
        chunk's last backward in the cool-down, alone (`pipeline_steps(merged=True)`)."""
        f, b = step.forward, step.backward
        f_run = b_run = None
        if f is not None:
            hidden = None if self._is_first(f.chunk) else self._receive((FWD, self._virtual(f.chunk), f.microbatch))
            tokens, labels = self.batches[f.microbatch]
            f_run = ChunkRun(self.chunks[f.chunk], tokens, labels, self.scale, self.delay_wgrad, hidden)
        defer, store = False, None
        if b is not None:
            b_run = self.runs.pop((b.microbatch, b.chunk))
            if not self._is_last(b.chunk):
                b_run.grad_output = self._receive((BWD, self._virtual(b.chunk), b.microbatch))
            if b.microbatch == self.num_micro - 1:
                if f is not None:
                    raise RuntimeError(f"EP overlap: chunk {b.chunk}'s last backward is merged with a forward; the "
                                       "merged program must leave it alone in the cool-down")
                WGRAD_STORE.flush()
            defer, store = self._backward_setup(b)
        self._prefetch(position)

        def forward_done() -> None:
            if f is None:
                return
            if self._is_last(f.chunk):
                self.losses[f.microbatch] = f_run.lm_loss.detach()
            else:
                self._track(f_run.output)
                self._send(FWD, f_run.output, self._virtual(f.chunk) + 1, f.microbatch, next_task)
            self.runs[(f.microbatch, f.chunk)] = f_run

        with RECORDER.span("merged" if f_run and b_run else "forward" if f_run else "backward"), \
                (store.delaying(defer) if store is not None else nullcontext()):
            run_merged(f_run, b_run, fixed_wgrad_slots=b is not None and b.microbatch == self.num_micro - 1,
                       after_forward=forward_done)
        if b is not None:
            if not self._is_first(b.chunk):
                self._send(BWD, b_run.input_grad, self._virtual(b.chunk) - 1, b.microbatch, next_task)
            if b.microbatch == self.num_micro - 1:
                WGRAD_STORE.flush()
            elif self.delay_wgrad:
                WGRAD_STORE.end_phase()
            # else (fixed slots): the last layer's expert weight gradients wait for the next step's first slot

    def _flush_deferred(self) -> None:
        """The pipeline flush of the output layer's deferred weight gradients, oldest first. Each one reaches the
        weight through its grad-ready hooks; only the last is reported to data parallelism as the chunk's last
        micro-batch, so (overlap_grad_reduce) the output layer's bucket is launched after every one of them."""
        if self.deferral_store is None:
            return
        c = self.deferral_chunk
        self.deferral_store.flush(before_each=lambda left: self.before_backward(c, left == 1))

    def run(self) -> list[torch.Tensor]:
        """The whole program; every send is complete on return. Returns the lm losses (empty off the last stage)."""
        self._prefetch(-1)
        if self.ep_overlap:
            position = -1
            for step in self.steps:
                position += (step.forward is not None) + (step.backward is not None)
                following = self.tasks[position + 1] if position + 1 < len(self.tasks) else None
                self._merged_step(step, following, position)
                self._sample()
        else:
            for i, task in enumerate(self.tasks):
                following = self.tasks[i + 1] if i + 1 < len(self.tasks) else None
                (self._backward if task.backward else self._forward)(task, following)
                self._prefetch(i)
                if self.deallocate:
                    self._drop_released()
                self._sample()
        self._flush_deferred()
        self._post(self.pending_sends, [])
        for handle in self.sends.values():
            handle.wait()
        self.pending_sends, self.sends, self.released = [], {}, {}
        if self.recvs:
            raise RuntimeError(f"pipeline: receives posted but never consumed: {sorted(self.recvs)}")
        self._sample()
        if self.memory is not None:
            self.memory.step_peaks.append(self.peak_bytes)
        return [self.losses[mb] for mb in sorted(self.losses)]
