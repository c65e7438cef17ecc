"""The PyTorch peer of our pipeline schedules: `torch.distributed.pipelining` trains the same split.

`model.pipeline_impl=torch_pipelining` runs each optimizer step's micro-batches through `Schedule1F1B` (no virtual
pipeline) or `ScheduleInterleaved1F1B` (VPP chunks), with PyTorch's own p2p (batched, waited before compute, as its
schedules do), on the same model chunks, data, gradient buffers and optimizer as ours - so a benchmark compares the
schedules and their p2p, nothing else. Its p2p goes around our tracer (like the DDP / FSDP2 peers' collectives).

Scope: dense models (an MoE chunk's aux loss has no way through `PipelineStage`'s single output) and PP > 1. The loss
is scaled inside `loss_fn` (1 / (micro-batches x DP)), `scale_grads=False`: our gradient hooks move every `.grad`
into the buffers during backward, so there is nothing left for the schedule to rescale.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class _StageModule(nn.Module):
    """One chunk as PipelineStage wants it: one tensor in (tokens on the first stage, hidden after), one out
    (hidden, or logits on the last stage, which the schedule hands to `loss_fn` with the labels)."""

    def __init__(self, chunk: nn.Module) -> None:
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stage = self.chunk.stage
        hidden, _aux = self.chunk.stage_body(None if stage.pre_process else x, x)
        return self.chunk.logits(hidden) if stage.post_process else hidden


class TorchPipeline:
    """torch's schedule over this rank's chunks, built once per run (its stages infer shapes on the first step)."""

    def __init__(self, chunks: Sequence[nn.Module], ps, num_micro: int, scale: float) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        pp, rank, vpp = ps.pp_size, ps.pp_rank, len(chunks)
        device = next(chunks[0].parameters()).device
        stages = [PipelineStage(_StageModule(chunk), c * pp + rank, pp * vpp, device, group=ps.pp_group)
                  for c, chunk in enumerate(chunks)]
        self.first = chunks[0].stage.pre_process
        self.last = chunks[-1] if chunks[-1].stage.post_process else None
        self.scale = scale
        if vpp == 1:
            self.schedule = Schedule1F1B(stages[0], num_micro, loss_fn=self._loss, scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, num_micro, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.last.loss_from_logits(logits, labels) * self.scale

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """One step's forward and backward; returns the lm losses (last stage only) per micro-batch."""
        args = (torch.cat([t for t, _ in batches]),) if self.first else ()
        labels = torch.cat([l for _, l in batches]) if self.last is not None else None
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=labels, losses=losses if self.last is not None else None,
                           return_outputs=False)
        return [loss.detach() / self.scale for loss in losses]
