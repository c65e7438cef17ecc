"""MoE expert-parallel overlap: the forward of one (micro-batch, model chunk) interleaved, layer piece by layer
piece, with the backward of another - the merged step of the combined 1F1B schedule.

Every MoE layer is cut into pieces: attention (+ pre-MLP norm, router, shared expert; the router launches the
split-size exchange), the permutation, the dispatch all-to-all, the experts, the combine all-to-all, and the combine
postprocessing (un-permute + residual). Dense layers are one piece with empty dispatch/combine. Which forward is
merged with which backward is the pipeline program's business (`overlap.pipeline.schedules`: with EP overlap its
steady steps are merged, and one extra warm-up forward makes room): without pipelining that is Megatron-Core's
`combined_1f1b_schedule_for_no_pipelining`, F(0) alone, F(i) merged with B(i-1), B(last) alone; with an interleaved
pipeline the F chunk's layers walk up while the B chunk's walk down, and when their layer counts differ the longer
one's last pieces run alone at the end.

Per merged layer pair (F walks up, B walks down), the order of work on this rank's one compute thread is:

    B  combine-postprocess backward, LAUNCH combine-backward all-to-all
    F  attention piece (LAUNCH split sizes), WAIT split sizes, permute, LAUNCH dispatch   (hides B's combine-bwd)
    B  WAIT combine-backward, experts backward, LAUNCH dispatch-backward all-to-all       (hides F's dispatch)
    F  WAIT dispatch, experts, LAUNCH combine all-to-all                                  (hides B's dispatch-bwd)
    B  WAIT dispatch-backward, permute + attention backward                               (hides F's combine)
    (F's combine is waited for at the start of the next layer's attention piece, after B's next combine backward)

This is the reference's per-layer order (runtime-mechanisms 1.4) translated from two CUDA streams to one host
thread: on a GPU a communication kernel starts as soon as its inputs are ready, whatever the host issue order, so
here each all-to-all is launched the moment its input exists and waited for only when its output is needed. Every
all-to-all has a piece of the other micro-batch between its launch and its wait, and no two of them queue on the
EP link (the pieces are longer than a transfer).

What that order cannot hide is a peer that is late. An all-to-all completes only once every rank has launched it,
and routing is uneven: per layer one rank's experts get up to 2-3x the rows of the other's, so its expert pieces
(the backward most: 3x the forward) run tens of ms longer, ten times an all-to-all's link time. The rank that is
ahead then waits at its next wait for the peer, not for the link; on the issue's benchmark about three quarters of
all EP wait time was of that kind, and the synchronous split-size exchange inside the attention piece added one
such rendezvous per layer with nothing to cover it. Hence two rules here:
- each wait runs queued weight gradients while it would block (`WGRAD_STORE.wait_filling`); with
  delay_wgrad_compute the expert and attention weight GEMMs are queued, not run at fixed slots, so the rank that is
  ahead does its own weight-gradient work while its peer catches up (the reference's third stream of wgrad GEMMs
  beside the communication, 1.13). What a phase leaves fills the next phase's waits; all of it is delivered
  before a model chunk's last backward, which keeps the reference's fixed slots (see `PipelineExecutor`).
- the split sizes leave at routing and are waited for (filling) right before the dispatch; with a padded expert
  capacity they are not exchanged at all.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from overlap.layers.moe.dispatcher import DispatchPlan, PendingAllToAll, PendingPlan
from overlap.layers.recompute import maybe_checkpoint
from overlap.layers.wgrad_store import WGRAD_STORE
from overlap.model.gpt import GPTModel, TransformerLayer
from overlap.parallel.comm import ManyHandle
from overlap.pipeline.schedule_node import ScheduleNode


def _a2a(tensors: tuple[torch.Tensor, ...], group, kind: str, out_splits: list[int],
         in_splits: list[int]) -> ManyHandle:
    """Launch one raw all-to-all of `tensors` (no autograd link: the schedule runs each piece's backward itself)."""
    return PendingAllToAll.launch(tensors, group, kind, out_splits, in_splits).handle


class LayerRun:
    """One micro-batch's pass through one transformer layer, as schedulable steps (forward, then backward).

    Every wait goes through `WGRAD_STORE.wait_filling`: queued weight gradients (delay_wgrad_compute) run while the
    awaited collective is in flight, so the rank that is ahead of its peers computes instead of idling."""

    def __init__(self, layer: TransformerLayer, loss_scale: float, delay_wgrad: bool) -> None:
        self.layer = layer
        self.moe = layer.mlp if layer.is_moe else None
        self.loss_scale = loss_scale
        self.delay_wgrad = delay_wgrad
        self.pending_plan: PendingPlan | None = None
        self.plan: DispatchPlan | None = None
        self.pending: ManyHandle | None = None
        self.aux_loss: torch.Tensor | None = None

    # ---------------- forward ----------------------------------------------------------------------------------
    def attention_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Dense layer: the whole layer, returns its output. MoE layer: the attention piece (which launches the
        split-size exchange), the wait for the split sizes, the permutation; launches the dispatch."""
        if self.moe is None:
            self.dense = ScheduleNode(f"layer{self.layer.layer_number}", lambda h: self.layer(h)[0])
            return self.dense.forward(x)[0]
        self.attn = ScheduleNode(f"layer{self.layer.layer_number}.attn", self._attention_piece)
        h, normed, topk_weights, aux, shared = self.attn.forward(x)
        self.aux_loss, self.h, self.shared = aux, h, shared
        self.plan = self.pending_plan.resolve(WGRAD_STORE.wait_filling)
        self.permute = ScheduleNode(f"layer{self.layer.layer_number}.permute",
                                    lambda n, w: self.moe.permute(n, w, self.plan))
        rows, weights = self.permute.forward(normed, topk_weights)
        self.pending = _a2a((rows, weights), self.moe.dispatcher.group, "ep_dispatch",
                            self.plan.output_splits, self.plan.input_splits)
        return None

    def _attention_piece(self, x: torch.Tensor):
        layer, moe = self.layer, self.moe
        h = layer.attention_block(x)
        normed = maybe_checkpoint(layer.recompute_norm, layer.pre_mlp_layernorm, h)
        topk_weights, self.pending_plan, aux = moe.route(normed)  # the split sizes travel from here on
        return h, normed, topk_weights, aux, moe.shared_experts_compute(normed)

    def experts_forward(self) -> None:
        """Wait for the dispatch, run the experts, launch the combine."""
        if self.moe is None:
            return
        rows, weights = WGRAD_STORE.wait_filling(self.pending)
        self.experts = ScheduleNode(f"layer{self.layer.layer_number}.experts",
                                    lambda r, w: self.moe.experts_compute(r, w, self.plan))
        (out,) = self.experts.forward(rows, weights)
        self.pending = _a2a((out,), self.moe.dispatcher.group, "ep_combine", self.plan.input_splits,
                            self.plan.output_splits)

    def combine_forward(self, dense_out: torch.Tensor | None) -> torch.Tensor:
        """Wait for the combine and add the residual; returns the layer output."""
        if self.moe is None:
            return dense_out
        (rows,) = WGRAD_STORE.wait_filling(self.pending)
        self.post = ScheduleNode(f"layer{self.layer.layer_number}.combine",
                                 lambda r, h, s: h + self.moe.combine_postprocess(r, self.plan, s))
        return self.post.forward(rows, self.h, self.shared)[0]

    # ---------------- backward ---------------------------------------------------------------------------------
    def combine_backward(self, grad_y: torch.Tensor) -> torch.Tensor | None:
        """Dense layer: the whole layer's backward, returns its input grad. MoE: launches the combine backward."""
        if self.moe is None:
            return self.dense.backward(grad_y)[0]
        g_rows, self.g_h, self.g_shared = self.post.backward(grad_y)
        self.pending = _a2a((g_rows,), self.moe.dispatcher.group, "ep_combine_bwd", self.plan.output_splits,
                            self.plan.input_splits)
        return None

    def experts_backward(self) -> None:
        """Wait for the combine backward, run the experts' backward (weight grads queued when delayed) and launch
        the dispatch backward."""
        if self.moe is None:
            return
        (g_out,) = WGRAD_STORE.wait_filling(self.pending)
        with WGRAD_STORE.delaying(self.delay_wgrad):
            g_rows, g_weights = self.experts.backward(g_out)
        self.pending = _a2a((g_rows, g_weights), self.moe.dispatcher.group, "ep_dispatch_bwd",
                            self.plan.input_splits, self.plan.output_splits)

    def attention_backward(self, dense_grad: torch.Tensor | None) -> torch.Tensor:
        """Wait for the dispatch backward and run the permutation's and the attention piece's backward; returns the
        layer's input grad."""
        if self.moe is None:
            return dense_grad
        g_rows, g_weights = WGRAD_STORE.wait_filling(self.pending)
        g_normed, g_topk_weights = self.permute.backward(g_rows, g_weights)
        aux_grad = torch.full_like(self.aux_loss, self.loss_scale)
        with WGRAD_STORE.delaying(self.delay_wgrad):  # attention + shared-expert weight GEMMs: queued when delaying
            (g_x,) = self.attn.backward(self.g_h, g_normed, g_topk_weights, aux_grad, self.g_shared)
        self.plan = self.pending_plan = self.h = self.shared = self.g_h = self.g_shared = None
        return g_x


class ChunkRun:
    """One micro-batch through one model chunk (`GPTModel` with its `Stage`): the embedding piece on the first
    pipeline stage (else `hidden`, the received activation), one LayerRun per layer, the loss piece on the last stage
    (else `output`, the activation to send). The backward starts from the loss (last stage) or from `grad_output`,
    the received gradient, and ends in the embedding (first stage) or in `input_grad`, the gradient to send."""

    def __init__(self, model: GPTModel, tokens: torch.Tensor, labels: torch.Tensor, loss_scale: float,
                 delay_wgrad: bool, hidden: torch.Tensor | None = None) -> None:
        self.model = model
        self.loss_scale = loss_scale
        self.first, self.last = model.stage.pre_process, model.stage.post_process
        self.embed = ScheduleNode("embedding", lambda: model.embed(tokens)) if self.first else None
        self.loss_node = ScheduleNode("lm_loss", lambda h: model.lm_loss(h, labels)) if self.last else None
        self.layers = [LayerRun(layer, loss_scale, delay_wgrad) for layer in model.layers]
        self.hidden = None if hidden is None else hidden.detach().requires_grad_()
        self.lm_loss: torch.Tensor | None = None
        self.output: torch.Tensor | None = None
        self.grad_output: torch.Tensor | None = None
        self.input_grad: torch.Tensor | None = None


def _forward_layers(f: ChunkRun) -> Iterator[None]:
    """F's steps; each yield is where B's next step runs (B yields 3 times per layer, F 3 times per layer minus one,
    after B's first step was run up front: see `run_merged`)."""
    x = f.embed.forward()[0] if f.first else f.hidden
    previous: LayerRun | None = None
    dense_out = None
    for run in f.layers:
        if previous is not None:
            yield  # B: the next layer's combine backward goes first; F's combine keeps flying meanwhile
            x = previous.combine_forward(dense_out)
        dense_out = run.attention_forward(x)
        yield  # B: wait combine-backward, experts backward, launch dispatch backward, delayed expert wgrad
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
    """B's steps, yielding where F's work is interleaved (mirrors `_forward_layers`). Delayed weight gradients are
    queued here and run inside the waits (`LayerRun`), of this phase or the next (`PipelineExecutor`).
    `fixed_wgrad_slots`: run them at the reference's fixed slots instead."""
    if b.last:
        (g,) = b.loss_node.backward(torch.full((), b.loss_scale, dtype=torch.float32))
    else:
        g = b.grad_output
    for i, run in enumerate(reversed(b.layers)):
        if i > 0:
            yield  # F: wait its combine, next attention piece, launch its dispatch
        dense_grad = run.combine_backward(g)
        if fixed_wgrad_slots:
            WGRAD_STORE.flush()  # the previous layer's attention weight gradients, under this combine backward
        yield  # F: attention piece + dispatch launch
        run.experts_backward()
        if fixed_wgrad_slots:
            WGRAD_STORE.flush()  # this layer's expert weight gradients, under its dispatch backward
        yield  # F: experts + combine launch
        g = run.attention_backward(dense_grad)
    if b.first:
        b.embed.backward(g)
    else:
        b.input_grad = g


def _drain(it: Iterator[None]) -> None:
    for _ in it:
        pass


def run_merged(f: ChunkRun | None, b: ChunkRun | None, fixed_wgrad_slots: bool = False,
               after_forward: Callable[[], None] = lambda: None) -> None:
    """One step of the schedule: F alone, B alone, or both interleaved piece by piece. `after_forward` runs as soon as
    F is done, before B's remaining pieces (the pipeline sends F's output there, under B's tail)."""
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
