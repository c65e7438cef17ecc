"""The PyTorch peer of our pipeline schedules: `torch.distributed.pipelining` trains the same split.

`model.pipeline_impl=torch_pipelining` runs each optimizer step's micro-batches through
`Schedule1F1B` (no virtual pipeline) or `ScheduleInterleaved1F1B` (VPP chunks), with PyTorch's own
p2p (batched, waited before compute, as its schedules do), on the same model chunks, data, gradient
buffers and optimizer as ours - so a benchmark compares the schedules and their p2p, nothing else.
Its p2p goes around our tracer (like the DDP / FSDP2 peers' collectives).

Scope: dense models (an MoE chunk's aux loss has no way through `PipelineStage`'s single output) and
PP > 1. The loss is scaled inside `loss_fn` (1 / (micro-batches x DP)), `scale_grads=False`: our
gradient hooks move every `.grad` into the buffers during backward, so there is nothing left for the
schedule to rescale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn


class _StageModule(nn.Module):
    """One chunk as PipelineStage wants it: one tensor in (tokens on the first stage, hidden after),
    one out (hidden, or logits on the last stage, which the schedule hands to `loss_fn` with the
    labels)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stage = self.chunk.stage
        hidden, _aux = self.chunk.stage_body(None if stage.pre_process else x, x)
        return self.chunk.logits(hidden) if stage.post_process else hidden


class TorchPipeline:
    """torch's schedule over this rank's chunks, a `PipelineRunner` like our executor. Its schedule
    is built on the first step (its stages infer shapes then) and kept for the run."""

    def __init__(
        self, chunks: Sequence[nn.Module], ps, before_backward: Callable[[int, bool], None]
    ) -> None:
        self.chunks, self.ps, self.before_backward = chunks, ps, before_backward
        self.first = chunks[0].stage.pre_process
        self.last = chunks[-1] if chunks[-1].stage.post_process else None
        self.scale = 1.0
        self.schedule = None

    @classmethod
    def from_config(
        cls,
        cfg,
        chunks: Sequence[nn.Module],
        ps,
        before_backward: Callable[[int, bool], None],
        memory,
    ) -> TorchPipeline:
        """The factory's signature (`overlap.pipeline.runner`); `memory` stays empty: the stage
        outputs are torch's, which this side does not measure."""
        return cls(chunks, ps, before_backward)

    def _build(self, num_micro: int):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        chunks, pp, rank = self.chunks, self.ps.layout.pp, self.ps.pp_rank
        vpp = len(chunks)
        device = next(chunks[0].parameters()).device
        stages = [
            PipelineStage(
                _StageModule(chunk), c * pp + rank, pp * vpp, device, group=self.ps.pp_group
            )
            for c, chunk in enumerate(chunks)
        ]
        if vpp == 1:
            return Schedule1F1B(stages[0], num_micro, loss_fn=self._loss, scale_grads=False)
        return ScheduleInterleaved1F1B(stages, num_micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.last.loss_from_logits(logits, labels) * self.scale

    def step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> list[torch.Tensor]:
        """One step's forward and backward, each loss scaled by `scale` (which changes between steps
        with the optimizer's loss scale); returns the lm losses (last stage only) per micro-batch.
        Its schedule is opaque to data parallelism: no backward is announced as a chunk's last, so
        every bucket is reduced after it."""
        for c in range(len(self.chunks)):
            self.before_backward(c, False)
        if self.schedule is None:
            self.schedule = self._build(len(batches))
        self.scale = scale
        args = (torch.cat([t for t, _ in batches]),) if self.first else ()
        labels = torch.cat([label for _, label in batches]) if self.last is not None else None
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *args,
            target=labels,
            losses=losses if self.last is not None else None,
            return_outputs=False,
        )
        return [loss.detach() / self.scale for loss in losses]
