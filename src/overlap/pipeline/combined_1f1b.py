"""MoE expert-parallel overlap: the forward of one (micro-batch, model chunk) interleaved, layer
piece by layer piece, with the backward of another - the merged step of the combined 1F1B schedule.

Every MoE layer is cut into pieces: attention (+ pre-MLP norm, router, shared expert; the router
launches the split-size exchange), the permutation, the dispatch all-to-all, the experts, the
combine all-to-all, and the combine postprocessing (un-permute + residual). Dense layers are one
piece with empty dispatch/combine. Which forward is merged with which backward is the pipeline
program's business (`overlap.pipeline.schedules`: with EP overlap its steady steps are merged, and
one extra warm-up forward makes room): without pipelining that is Megatron-Core's
`combined_1f1b_schedule_for_no_pipelining`, F(0) alone, F(i) merged with B(i-1), B(last) alone; with
an interleaved pipeline the F chunk's layers walk up while the B chunk's walk down, and when their
layer counts differ the longer one's last pieces run alone at the end.

Per merged layer pair (F walks up, B walks down), the order of work on this rank's one compute
thread is:

    step                                                                   hides
    B  combine-postprocess backward, LAUNCH combine-bwd all-to-all
    F  WAIT previous combine, attention piece (LAUNCH split sizes)         B's combine-bwd
    B  the previous layer's experts weight gradients (fixed slot)          F's split sizes,
                                                                           B's combine-bwd
    F  WAIT split sizes, permute, LAUNCH dispatch
    B  WAIT combine-bwd, experts input-gradient bwd, LAUNCH dispatch-bwd   F's dispatch
    F  WAIT dispatch, experts, LAUNCH combine                              B's dispatch-bwd
    B  WAIT dispatch-bwd, permute + attention backward                     F's combine

F's combine is waited for at the start of the next layer's attention piece, after B's next combine
backward.

This is Megatron-Core's per-layer order (`TransformerLayerSchedulePlan.run` in
`megatron/core/models/common/model_chunk_schedule_plan.py`) translated from two CUDA streams to one
host thread: on a GPU a communication kernel starts as soon as its inputs are ready, whatever the
host issue order, so here each all-to-all is launched the moment its input exists and waited for
only when its output is needed. Every all-to-all has a piece of the other micro-batch between its
launch and its wait, and no two of them queue on the EP link (the pieces are longer than a
transfer).

Two things differ from a GPU and shape the order. The split-size exchange is a host rendezvous here
(gloo's uneven all-to-all needs the sizes on the host before the dispatch can be posted), as
Megatron-Core's device-to-host sync is, so it needs a piece of cover of its own between the
attention piece and the dispatch: the experts' backward is cut into its input-gradient and
weight-gradient halves, and the weight GEMMs of one layer run one layer later, under the next
layer's split sizes. Weight gradients reach their parameters later in the same merged step, in the
same order, so the numbers are those of the unsplit backward. And ranks drift apart (below), so the
longest pieces sit where a late peer hurts most: the experts' input-gradient backward, the longest
and most uneven piece, covers the dispatch, and F's experts cover the dispatch backward that a late
B launches.

What no order can hide is a peer that is late. An all-to-all completes only once every rank has
launched it, and routing is uneven: per layer one rank's experts get up to 2-3x the rows of the
other's, so its expert pieces (the backward most: 3x the forward) run tens of ms longer, ten times
an all-to-all's link time. The rank that is ahead then waits at its next wait for the peer, not for
the link. With delay_wgrad_compute every wait runs queued weight gradients while it would block (the
model's `WeightGradStore.wait_filling`), expert and attention GEMMs alike, instead of the fixed
slots: the rank that is ahead does its own weight-gradient work while its peer catches up
(DeepSeek's published training trace runs its expert weight-gradient GEMMs on a third stream beside
the communication the same way). On a GPU, where the host cannot see a collective complete, every
queued GEMM is issued before the wait instead, and the device runs them beside the collective. What
a phase leaves fills the next phase's waits; all of it is delivered before a model chunk's last
backward, which runs its weight gradients at the fixed slots (see `PipelineExecutor`). With a padded
expert capacity the split sizes are not exchanged at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from overlap.layers.moe.dispatcher import DispatchPlan, PendingAllToAll, PendingPlan
from overlap.layers.recompute import maybe_checkpoint
from overlap.layers.wgrad_store import InFlight, WeightGradStore
from overlap.model.gpt import GPTModel, TransformerLayer
from overlap.parallel.comm import ManyHandle
from overlap.pipeline.schedule_node import ScheduleNode


def _plain_wait(handle: InFlight) -> Any:
    """A wait that runs nothing meanwhile (without delay_wgrad: the weight GEMMs keep their fixed
    slots)."""
    return handle.wait()


def _a2a(
    tensors: tuple[torch.Tensor, ...], group, kind: str, out_splits: list[int], in_splits: list[int]
) -> ManyHandle:
    """Launch one raw all-to-all of `tensors` (no autograd link: the schedule runs each piece's
    backward itself)."""
    return PendingAllToAll.launch(tensors, group, kind, out_splits, in_splits).handle


class LayerRun:
    """One micro-batch's pass through one transformer layer, as schedulable steps (forward, then
    backward).

    With delay_wgrad_compute every wait goes through `store.wait_filling` (the model's store):
    queued weight gradients run while the awaited collective is in flight, so the rank that is ahead
    of its peers computes instead of idling. Without it the waits are plain: the experts' queued
    weight GEMMs then run only at the schedule's fixed slots."""

    def __init__(
        self,
        layer: TransformerLayer,
        loss_scale: float,
        delay_wgrad_compute: bool,
        store: WeightGradStore,
    ) -> None:
        self.layer = layer
        self.store = store
        self.moe = layer.mlp if layer.is_moe else None
        self.loss_scale = loss_scale
        self.delay_wgrad_compute = delay_wgrad_compute
        self._wait = store.wait_filling if delay_wgrad_compute else _plain_wait
        self.pending_plan: PendingPlan | None = None
        self.plan: DispatchPlan | None = None
        self.pending: ManyHandle | None = None
        self.aux_loss: torch.Tensor | None = None

    def _take_pending(self) -> Any:
        """Wait for the all-to-all in flight and let go of its handle: a handle keeps what it
        received, which would stay alive until the next all-to-all of this layer replaced it (the
        combine's received rows: until this layer's backward, a hidden-wide row per routed token
        held per layer per micro-batch in flight)."""
        pending, self.pending = self.pending, None
        return self._wait(pending)

    # ---------------- forward
    # ----------------------------------------------------------------------------------
    def attention_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Dense layer: the whole layer, returns its output. MoE layer: the attention piece, which
        launches the split-size exchange."""
        if self.moe is None:
            self.dense = ScheduleNode(f"layer{self.layer.layer_number}", lambda h: self.layer(h)[0])
            return self.dense.forward(x)[0]
        self.attn = ScheduleNode(f"layer{self.layer.layer_number}.attn", self._attention_piece)
        h, self.normed, self.topk_weights, aux, shared = self.attn.forward(x)
        self.aux_loss, self.h, self.shared = aux, h, shared
        return None

    def dispatch_forward(self) -> None:
        """Wait for the split sizes, permute, launch the dispatch."""
        if self.moe is None:
            return
        self.plan = self.pending_plan.resolve(self._wait)
        self.permute = ScheduleNode(
            f"layer{self.layer.layer_number}.permute",
            lambda n, w: self.moe.permute(n, w, self.plan),
        )
        rows, weights = self.permute.forward(self.normed, self.topk_weights)
        self.normed = self.topk_weights = None
        self.pending = self.moe.dispatch(rows, weights, self.plan).handle

    def _attention_piece(self, x: torch.Tensor):
        layer, moe = self.layer, self.moe
        h = layer.attention_block(x)
        normed = maybe_checkpoint(layer.recompute_norm, layer.pre_mlp_layernorm, h)
        # the split sizes travel from here on
        topk_weights, self.pending_plan, aux = moe.route(normed)
        return h, normed, topk_weights, aux, moe.shared_experts_compute(normed)

    def experts_forward(self) -> None:
        """Wait for the dispatch, run the experts, launch the combine."""
        if self.moe is None:
            return
        rows, weights = self._take_pending()
        self.experts = ScheduleNode(
            f"layer{self.layer.layer_number}.experts",
            lambda r, w: self.moe.experts_compute(r, w, self.plan),
        )
        (out,) = self.experts.forward(rows, weights)
        self.pending = self.moe.combine(out, self.plan).handle

    def combine_forward(self, dense_out: torch.Tensor | None) -> torch.Tensor:
        """Wait for the combine and add the residual; returns the layer output."""
        if self.moe is None:
            return dense_out
        (rows,) = self._take_pending()
        self.post = ScheduleNode(
            f"layer{self.layer.layer_number}.combine",
            lambda r, h, s: h + self.moe.combine_postprocess(r, self.plan, s),
        )
        return self.post.forward(rows, self.h, self.shared)[0]

    # ---------------- backward
    # ---------------------------------------------------------------------------------
    def combine_backward(self, grad_y: torch.Tensor) -> torch.Tensor | None:
        """Dense layer: the whole layer's backward, returns its input grad. MoE: launches the
        combine backward."""
        if self.moe is None:
            return self.dense.backward(grad_y)[0]
        g_rows, self.g_h, self.g_shared = self.post.backward(grad_y)
        self.pending = _a2a(
            (g_rows,),
            self.moe.dispatcher.group,
            "ep_combine_bwd",
            self.plan.output_splits,
            self.plan.input_splits,
        )
        return None

    def experts_backward(self) -> None:
        """Wait for the combine backward, run the experts' input-gradient backward and launch the
        dispatch backward. The experts' weight-gradient GEMMs are queued: they run in waits
        (delay_wgrad_compute) or at the schedule's fixed slots (`_backward_layers`)."""
        if self.moe is None:
            return
        (g_out,) = self._take_pending()
        with self.store.delaying(True):
            g_rows, g_weights = self.experts.backward(g_out)
        self.pending = _a2a(
            (g_rows, g_weights),
            self.moe.dispatcher.group,
            "ep_dispatch_bwd",
            self.plan.input_splits,
            self.plan.output_splits,
        )

    def attention_backward(self, dense_grad: torch.Tensor | None) -> torch.Tensor:
        """Wait for the dispatch backward and run the permutation's and the attention piece's
        backward; returns the layer's input grad."""
        if self.moe is None:
            return dense_grad
        g_rows, g_weights = self._take_pending()
        g_normed, g_topk_weights = self.permute.backward(g_rows, g_weights)
        aux_grad = torch.full_like(self.aux_loss, self.loss_scale)
        # attention + shared-expert weight GEMMs: queued when delaying
        with self.store.delaying(self.delay_wgrad_compute):
            (g_x,) = self.attn.backward(self.g_h, g_normed, g_topk_weights, aux_grad, self.g_shared)
        self.plan = self.pending_plan = self.h = self.shared = self.g_h = self.g_shared = None
        return g_x


class ChunkRun:
    """One micro-batch through one model chunk (`GPTModel` with its `Stage`): the embedding piece on
    the first pipeline stage (else `hidden`, the received activation), one LayerRun per layer, the
    loss piece on the last stage (else `output`, the activation to send). The backward starts from
    the loss (last stage) or from `grad_output`, the received gradient, and ends in the embedding
    (first stage) or in `input_grad`, the gradient to send."""

    def __init__(
        self,
        model: GPTModel,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_scale: float,
        delay_wgrad_compute: bool,
        hidden: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.loss_scale = loss_scale
        self.first, self.last = model.stage.pre_process, model.stage.post_process
        self.embed = ScheduleNode("embedding", lambda: model.embed(tokens)) if self.first else None
        self.loss_node = (
            ScheduleNode("lm_loss", lambda h: model.lm_loss(h, labels)) if self.last else None
        )
        self.delay_wgrad_compute = delay_wgrad_compute
        self.layers = [
            LayerRun(layer, loss_scale, delay_wgrad_compute, model.wgrad_store)
            for layer in model.layers
        ]
        self.hidden = None if hidden is None else hidden.detach().requires_grad_()
        self.lm_loss: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.grad_output: torch.Tensor | None = None
        self.input_grad: torch.Tensor | None = None


def _forward_layers(f: ChunkRun) -> Iterator[None]:
    """F's steps; each yield is where B's next step runs (B and F yield 4 times per layer minus one,
    after B's first step was run up front: see `run_merged`)."""
    x = f.embed.forward()[0] if f.first else f.hidden
    previous: LayerRun | None = None
    dense_out = None
    for run in f.layers:
        if previous is not None:
            # B: its next combine backward follows its attention backward; F's combine keeps flying
            yield
            x = previous.combine_forward(dense_out)
        dense_out = run.attention_forward(x)
        yield  # B: the previous layer's expert weight gradients (at fixed slots)
        run.dispatch_forward()
        yield  # B: wait combine-backward, experts input-gradient backward, launch dispatch backward
        run.experts_forward()
        yield  # B: wait dispatch backward, attention backward
        previous = run
    if previous is not None:
        x = previous.combine_forward(dense_out)
    if f.last:
        (f.lm_loss,) = f.loss_node.forward(x)
    else:
        f.output = x


def _backward_layers(b: ChunkRun, fixed_wgrad_slots: bool) -> Iterator[None]:
    """B's steps, yielding where F's work is interleaved (mirrors `_forward_layers`). With
    delay_wgrad_compute the queued weight gradients run inside the waits (`LayerRun`), of this phase
    or the next (`PipelineExecutor`); without it, or with `fixed_wgrad_slots`, at a fixed slot:
    everything the previous layer queued (its experts' weight GEMMs; delayed, its attention's too)
    right after F's attention piece, under F's split sizes and B's own combine backward. What the
    chunk's last layer queues is left to the caller: `PipelineExecutor` keeps it for the next step's
    first slot (the first layer has no previous one), and delivers everything before a chunk's last
    backward."""
    fixed = fixed_wgrad_slots or not b.delay_wgrad_compute
    if b.last:
        (g,) = b.loss_node.backward(
            torch.full((), b.loss_scale, dtype=torch.float32, device=b.model.ps.device)
        )
    else:
        g = b.grad_output
    for i, run in enumerate(reversed(b.layers)):
        if i > 0:
            yield  # F: nothing (its experts are done; its combine waits for this combine backward)
        dense_grad = run.combine_backward(g)
        yield  # F: wait its combine, attention piece (launches its split sizes)
        if fixed:
            b.model.wgrad_store.flush()
        yield  # F: wait split sizes, permute, launch dispatch
        run.experts_backward()
        yield  # F: wait dispatch, experts, launch combine
        g = run.attention_backward(dense_grad)
    if b.first:
        b.embed.backward(g)
    else:
        b.input_grad = g


def _drain(it: Iterator[None]) -> None:
    for _ in it:
        pass


def run_merged(
    f: ChunkRun | None,
    b: ChunkRun | None,
    fixed_wgrad_slots: bool = False,
    after_forward: Callable[[], None] = lambda: None,
) -> None:
    """One step of the schedule: F alone, B alone, or both interleaved piece by piece.
    `after_forward` runs as soon as F is done, before B's remaining pieces (the pipeline sends F's
    output there, under B's tail)."""
    if f is None:
        _drain(_backward_layers(b, fixed_wgrad_slots))
        return
    fwd = _forward_layers(f)
    if b is None:
        _drain(fwd)
        after_forward()
        return
    bwd = _backward_layers(b, fixed_wgrad_slots)
    next(bwd, None)  # B: loss backward + first layer's combine backward (launched)
    for _ in fwd:  # F step, then the matching B step
        next(bwd, None)
    after_forward()
    _drain(bwd)
