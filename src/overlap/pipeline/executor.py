"""The pipeline executor: runs one optimizer step's program (`overlap.pipeline.schedules`) on this
rank's model chunks, PP = 1 included.

One loop walks the program's steps. Without EP overlap a step's tasks run one after the other (a
sequential step: the forward, then the backward); with it each step runs as one merged step of layer
pieces (`combined_1f1b.run_merged`: the forward of one (micro-batch, chunk) interleaved with the
backward of another). Both paths share what surrounds the compute: the receive a task consumes, the
last stage's loss, the send of an output or an input gradient. The concerns around them live in
their own units: the p2p transport (`overlap.pipeline.p2p`), the release of sent outputs and the
measure of their memory (`overlap.pipeline.output_memory`), and the deferral of the output layer's
weight gradients (`overlap.pipeline.output_wgrad`).

Overlapped p2p in plain 1F1B sends each input gradient before its weight gradients: a backward runs
with its weight-gradient GEMMs queued (the chunks' `WeightGradStore`) and posts its gradient's send
first. Why: in 1F1B every stage alternates forward and backward, and the gradient of B(k) going
down from stage p + 1 and the activation of a later forward coming back up from p sit on one cycle
that both programs wait on; posting receives early cannot take a transfer off it (at PP = 2 the
steady period stays f + b + 2c, the reason Megatron-Core allows `overlap_p2p_comm` only with a
virtual pipeline). The weight-gradient time W, placed inside the cycle on both of its sides, is its
slack: stage p + 1 runs its queued GEMMs right after its gradient's send, before the forward that
waits for p's next activation; the first stage, which sends no gradient, runs them after its next
forward, between that forward's activation send and the backward that waits for the gradient. So
the (0, 1) cycle gets two W of slack and every other cycle one (its later stage's): transfers up to
a weight-gradient time hide at PP = 2, up to half of one between middle stages, and the pipeline's
drain shortens (the zero-bubble schedules' split of B and W; the planner's simulation,
`overlap.plan.pipeline_sim`, runs the same rule). Paying at once also keeps the GEMMs' inputs
cache-warm and frees them one task sooner on every stage but the first, whose cost is one
backward's weight-gradient inputs (its linear layers' inputs and output gradients) kept one task
longer. Data parallelism hears of each delayed gradient with the last-micro-batch flag of the
backward that queued it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from overlap.config.container import ConfigContainer
from overlap.layers.tensor_parallel import params_dtype
from overlap.layers.wgrad_store import WeightGradStore
from overlap.layout.prerequisites import keeps_sent_outputs
from overlap.parallel.trace import recorder
from overlap.pipeline.combined_1f1b import ChunkRun, run_merged
from overlap.pipeline.output_memory import (
    LiveOutputs,
    OutputRelease,
    PipelineMemory,
    backward_from_released,
)
from overlap.pipeline.output_wgrad import OutputWgradDeferral
from overlap.pipeline.p2p import StageTransport
from overlap.pipeline.schedules import (
    BWD,
    FWD,
    Message,
    StageRing,
    Step,
    Task,
    pipeline_steps,
    step_tasks,
)


@dataclass(frozen=True)
class ExecutorOptions:
    """How the executor runs a program: the resolved fields it reads, in one place; the overlap
    switches under their Bridge names, as `OverlapPlan` and the config spell them."""

    # the activation between stages, [seq (local under SP), micro-batch, hidden], and its dtype
    shape: tuple[int, ...]
    dtype: torch.dtype
    overlap_p2p_comm: bool = False  # overlapped p2p (else batched; `overlap.pipeline.p2p`)
    # plain 1F1B's warm-up multiple (`schedules.pipeline_steps`): slack for overlapped transfers
    p2p_warmup_depth: int = 1
    microbatch_group: int | None = None  # micro-batches per chunk group, interleaved (None: PP)
    deallocate_outputs: bool = False  # free each sent output's storage (`output_memory`)
    # defer the output layer's weight gradients to the flush
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int | None = None  # how many micro-batches to defer (None, 0, -1: all)
    # run the steps merged (`overlap.pipeline.combined_1f1b`)
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False  # merged steps: weight gradients fill the waits

    @classmethod
    def from_config(cls, cfg: ConfigContainer, tp_size: int) -> ExecutorOptions:
        m, plan, layout = cfg.resolved.model, cfg.resolved.overlap, cfg.resolved.layout
        # a context-parallel rank's share of the sequence, split again over TP under SP
        seq = m.seq_length // layout.cp
        seq = seq // tp_size if layout.sequence_parallel else seq
        return cls(
            (seq, cfg.train.micro_batch_size, m.hidden_size),
            params_dtype(cfg.resolved.precision),
            overlap_p2p_comm=plan.overlap_p2p_comm,
            p2p_warmup_depth=plan.p2p_warmup_depth,
            microbatch_group=m.microbatch_group_size_per_vp_stage,
            deallocate_outputs=m.deallocate_pipeline_outputs,
            defer_embedding_wgrad_compute=plan.defer_embedding_wgrad_compute,
            wgrad_deferral_limit=plan.wgrad_deferral_limit,
            overlap_moe_expert_parallel_comm=plan.overlap_moe_expert_parallel_comm,
            delay_wgrad_compute=plan.delay_wgrad_compute,
        )


class PipelineExecutor:
    """Runs each optimizer step's program on this rank's chunks (`step`); built once per run, which
    creates the pipeline's p2p groups (collective: every rank builds its executor at the same
    point).

    `chunks[c]` is model chunk c (`GPTModel` with a `Stage`), `before_backward(chunk, is_last)`
    tells data parallelism which backward is a chunk's last micro-batch (its gradients can then be
    reduced), `memory`: where each step's peak of live output bytes is recorded. The chunks share
    one weight-gradient store (`model_chunks`), which the executor switches and drains. With
    `options.defer_embedding_wgrad_compute` the last stage's model must have been built with an
    overlap plan whose `defer_embedding_wgrad_compute` is on, which gives its output layer the
    store."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        ps,
        options: ExecutorOptions,
        before_backward: Callable[[int, bool], None],
        memory: PipelineMemory | None = None,
    ) -> None:
        # the run-time refusal table refuses this before launch (`keeps_sent_outputs`, the rule):
        # only an executor built outside `overlap run` reaches this guard
        if options.deallocate_outputs and keeps_sent_outputs(
            ps.layout.pp, options.overlap_moe_expert_parallel_comm
        ):
            raise ValueError(
                "deallocate_pipeline_outputs is not built for the EP-overlap schedule (the merged "
                "pieces keep each output for their own backward)"
            )
        self.chunks, self.ps, self.options = chunks, ps, options
        self.wgrad = shared_wgrad_store(chunks)
        self.before_backward, self.memory = before_backward, memory
        self.ring = StageRing(ps.layout.pp, ps.pp_rank, len(chunks))
        self.groups = ps.pipeline_p2p_groups(wrap=len(chunks) > 1) if ps.layout.pp > 1 else {}

    @classmethod
    def from_config(
        cls,
        cfg: ConfigContainer,
        chunks: Sequence[torch.nn.Module],
        ps,
        before_backward: Callable[[int, bool], None],
        memory: PipelineMemory,
    ) -> PipelineExecutor:
        return cls(
            chunks, ps, ExecutorOptions.from_config(cfg, ps.layout.tp), before_backward, memory
        )

    def step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> list[torch.Tensor]:
        """One step's program over `batches` (micro-batch mb's tokens and labels), each loss scaled
        by `scale` (1 / (micro-batches x DP), times the optimizer's loss scale); every send is
        complete on return. Returns the lm losses per micro-batch (empty off the last stage)."""
        o, ring = self.options, self.ring
        # an internal guard: the config's batch rule (`ConfigContainer._cross_section_rules`)
        # refuses a run with EP overlap and fewer than 2 micro-batches, so no user reaches it
        if o.overlap_moe_expert_parallel_comm and len(batches) < 2:
            raise ValueError("the EP-overlap schedule needs at least 2 micro-batches per step")
        self.batches, self.scale, self.num_micro = batches, scale, len(batches)
        self.steps: list[Step] = pipeline_steps(
            ring.pp,
            ring.rank,
            ring.vpp,
            self.num_micro,
            o.microbatch_group,
            o.overlap_moe_expert_parallel_comm,
            o.p2p_warmup_depth,
        )
        self.tasks = step_tasks(self.steps)
        self.transport = StageTransport(
            self.ps, self.groups, o.shape, o.dtype, self.num_micro, o.overlap_p2p_comm
        )
        self.release = (
            OutputRelease(
                ring,
                self.num_micro,
                o.microbatch_group,
                o.overlap_moe_expert_parallel_comm,
                o.overlap_p2p_comm,
                o.p2p_warmup_depth,
            )
            if o.deallocate_outputs
            else None
        )
        self.live = LiveOutputs()
        self.deferral = OutputWgradDeferral(
            self.chunks,
            ring,
            self.num_micro,
            self.before_backward,
            o.defer_embedding_wgrad_compute,
            o.wgrad_deferral_limit,
        )
        # by (micro-batch, chunk): a sequential forward's backward roots, a merged forward's pieces
        self.saved: dict[tuple[int, int], tuple] = {}
        # overlapped p2p: the last backward's queued weight gradients, as (chunk, the
        # last-micro-batch flag data parallelism was given for it, how many GEMMs), run after the
        # next task
        self.owed: tuple[int, bool, int] | None = None
        self.runs: dict[tuple[int, int], ChunkRun] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self._prefetch(-1)
        position = -1  # the program position of the step's last task
        for step in self.steps:
            position += (step.forward is not None) + (step.backward is not None)
            if o.overlap_moe_expert_parallel_comm:
                self._merged_step(step, position)
            else:
                self._sequential_step(step, position)
        self._pay_owed(self.owed)
        self.deferral.flush()
        self.transport.finish()
        self.live.sample()
        if self.memory is not None:
            self.memory.step_peaks.append(self.live.peak_bytes)
        return [self.losses[mb] for mb in sorted(self.losses)]

    # --- shared by both kinds of step: receive, loss, send ----------------------------------------
    def _receive(self, task: Task) -> torch.Tensor | None:
        """The activation (forward) or gradient (backward) `task` consumes; None on the pipeline's
        ends."""
        message = self.ring.consumes(task)
        if message is None:
            return None
        tensor = self.transport.receive(message)
        if self.release is not None:
            self.release.heard_from(message, self.transport)
        return tensor

    def _send(self, message: Message, tensor: torch.Tensor, position: int) -> None:
        """Send `tensor`; batched, it travels with the receive of the task after program position
        `position`."""
        following = self.tasks[position + 1] if position + 1 < len(self.tasks) else None
        travelling = self.transport.send(
            message, tensor, following is not None and self.ring.consumes(following) is not None
        )
        # a non-contiguous output travels as a copy: that copy is output memory too
        copied = travelling.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        if message[0] == FWD and copied:
            self.live.track(travelling)

    def _forward_done(self, task: Task, out: torch.Tensor, position: int) -> None:
        """A forward finished: the last stage keeps its lm loss (`out`), any other stage sends its
        output on (and, with deallocate_pipeline_outputs, releases it)."""
        c, mb = task.chunk, task.microbatch
        if self.ring.is_last(c):
            self.losses[mb] = out.detach()
            return
        self.live.track(out)
        message = (FWD, self.ring.virtual(c) + 1, mb)
        self._send(message, out, position)
        if self.release is not None:
            self.release.release(out, c, message)

    def _backward_done(self, task: Task, input_grad: torch.Tensor | None, position: int) -> None:
        """A backward finished: any stage but the first sends the gradient of its input back."""
        if not self.ring.is_first(task.chunk):
            self._send(
                (BWD, self.ring.virtual(task.chunk) - 1, task.microbatch), input_grad, position
            )

    def _prefetch(self, position: int) -> None:
        """Overlapped p2p: post the receives of the next forward and the next backward after
        `position`."""
        if not self.transport.overlapped:
            return
        wanted: dict[bool, Message | None] = {}
        for task in self.tasks[position + 1 :]:
            if task.backward not in wanted:
                wanted[task.backward] = self.ring.consumes(task)
            if len(wanted) == 2:
                break
        self.transport.prefetch([m for m in wanted.values() if m is not None])

    # --- a sequential step: its tasks one after the other -----------------------------------------
    def _sequential_step(self, step: Step, last: int) -> None:
        tasks = [t for t in (step.forward, step.backward) if t is not None]
        for position, task in enumerate(tasks, last - len(tasks) + 1):
            owed, self.owed = self.owed, None
            (self._backward if task.backward else self._forward)(task, position)
            self._prefetch(position)
            self._pay_owed(owed)
            if self.release is not None:
                self.release.drop(self.transport)
            self.live.sample()

    def _forward(self, task: Task, position: int) -> None:
        c, mb = task.chunk, task.microbatch
        hidden = self._receive(task)
        if hidden is not None:
            hidden.requires_grad_()
        tokens, labels = self.batches[mb]
        with recorder().span("forward"):
            out, aux = self.chunks[c].stage_forward(hidden, tokens, labels)
        if self.ring.is_last(c):
            self.saved[(mb, c)] = (hidden, [(out + aux) * self.scale], [None])
        else:
            seeds, grads = [out], [None]
            if aux.requires_grad:  # this chunk's MoE aux losses enter the loss here, scaled like it
                seeds.append(aux * self.scale)
                grads.append(torch.ones_like(aux))
            self.saved[(mb, c)] = (hidden, seeds, grads)
        self._forward_done(task, out, position)

    def _backward(self, task: Task, position: int) -> None:
        c, mb = task.chunk, task.microbatch
        hidden, seeds, grads = self.saved.pop((mb, c))
        received = self._receive(task)
        if received is not None:
            grads[0] = received
        deferral = self.deferral.before(task)
        # overlapped p2p: the input gradient goes before the weight gradients (module notes)
        split = self.transport.overlapped and self.ring.pp > 1 and self.ring.vpp == 1
        queued = len(self.wgrad.queue)
        with recorder().span("backward"), deferral, self.wgrad.delaying(split):
            if self.release is not None and not self.ring.is_last(c):
                backward_from_released(seeds, grads)
            else:
                torch.autograd.backward(seeds, grads if grads[0] is not None else None)
        self._backward_done(task, None if hidden is None else hidden.grad, position)
        if split:
            owed = (c, self.deferral.announced, len(self.wgrad.queue) - queued)
            # a stage that sent its gradient pays at once, before the next forward's receive is
            # needed; the first stage, which sends none, after its next forward (module notes)
            if self.ring.is_first(c):
                self.owed = owed
            else:
                self._pay_owed(owed)

    def _pay_owed(self, owed: tuple[int, bool, int] | None) -> None:
        """Run the weight gradients a backward queued (`owed`, if any), data parallelism told first
        whether they are their chunk's last micro-batch's."""
        if owed is None:
            return
        chunk, last, count = owed
        self.before_backward(chunk, last)
        self.wgrad.drain(count)

    # --- a merged step: forward and backward interleaved piece by piece (EP overlap) --------------
    def _merged_step(self, step: Step, position: int) -> None:
        """EP overlap: the step's forward and backward as one merged step of layer pieces
        (`run_merged`), or either alone. Both receives are waited before it starts, and the next
        step's are posted right then (overlapped p2p), to arrive while this step computes; with
        overlapped p2p the forward's output is sent as soon as the forward is done, under the
        backward's remaining pieces, and the backward's input gradient right after it (batched p2p
        holds both for the next step's first receive, as in a sequential step). `position`: the
        program position of the step's last task. Delayed weight gradients fill the waits of this
        step and the next (`end_phase`), except around a chunk's last backward: everything queued is
        delivered before it, and it runs its own at fixed slots, since a delivered gradient may fire
        a data-parallel collective and collectives must be issued in the same order on every rank
        (where a filled wait delivers depends on timing). The merged program puts every chunk's last
        backward in the cool-down, alone (`pipeline_steps(merged=True)`)."""
        f, b = step.forward, step.backward
        f_run = b_run = None
        if f is not None:
            hidden = self._receive(f)
            tokens, labels = self.batches[f.microbatch]
            f_run = ChunkRun(
                self.chunks[f.chunk],
                tokens,
                labels,
                self.scale,
                self.options.delay_wgrad_compute,
                hidden,
            )
        last_backward = b is not None and b.microbatch == self.num_micro - 1
        deferral = nullcontext()
        if b is not None:
            b_run = self.runs.pop((b.microbatch, b.chunk))
            received = self._receive(b)
            if received is not None:
                b_run.grad_output = received
            if last_backward:
                if f is not None:
                    raise RuntimeError(
                        f"EP overlap: chunk {b.chunk}'s last backward is merged with a forward; "
                        "the merged program must leave it alone in the cool-down"
                    )
                self.wgrad.flush()
            deferral = self.deferral.before(b)
        self._prefetch(position)

        def forward_done() -> None:
            if f is None:
                return
            self._forward_done(
                f, f_run.lm_loss if self.ring.is_last(f.chunk) else f_run.output, position
            )
            self.runs[(f.microbatch, f.chunk)] = f_run

        with (
            recorder().span("merged" if f_run and b_run else "forward" if f_run else "backward"),
            deferral,
        ):
            run_merged(f_run, b_run, fixed_wgrad_slots=last_backward, after_forward=forward_done)
        if b is not None:
            self._backward_done(b, b_run.input_grad, position)
            if last_backward:
                self.wgrad.flush()
            elif self.options.delay_wgrad_compute:
                self.wgrad.end_phase()
            # else (fixed slots): the last layer's expert weight gradients wait for the next step's
            # first slot
        self.live.sample()


def shared_wgrad_store(chunks: Sequence[torch.nn.Module]) -> WeightGradStore:
    """The one weight-gradient store of this rank's chunks: the executor queues and drains across
    chunks (the first stage's queued GEMMs run after its next task, whichever chunk it runs), so
    chunks built with stores of their own cannot be run together."""
    stores = {id(chunk.wgrad_store): chunk.wgrad_store for chunk in chunks}
    if len(stores) != 1:
        raise ValueError(
            f"the pipeline executor runs chunks that share one WeightGradStore; these have "
            f"{len(stores)}: build them with model_chunks (or pass one store to each GPTModel)"
        )
    return next(iter(stores.values()))
