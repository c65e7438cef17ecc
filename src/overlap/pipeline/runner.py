"""The one interface the trainer runs a step's micro-batches through, whichever pipeline
implementation `model.pipeline_impl` names: ours (`PipelineExecutor`, PP = 1 included) or PyTorch's
(`TorchPipeline`, the benchmark peer). Both are built once per run, by every rank at the same point
(ours creates its p2p groups then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from overlap.config.container import ConfigContainer
from overlap.pipeline.executor import PipelineExecutor
from overlap.pipeline.output_memory import PipelineMemory
from overlap.pipeline.torch_peer import TorchPipeline


class PipelineRunner(Protocol):
    def step(
        self, batches: list[tuple[torch.Tensor, torch.Tensor]], scale: float
    ) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch in `batches`, each loss scaled by `scale`;
        returns the lm losses per micro-batch (empty off the last stage)."""
        ...


PipelineFactory = Callable[
    [
        ConfigContainer,
        Sequence[torch.nn.Module],
        object,
        Callable[[int, bool], None],
        PipelineMemory,
    ],
    PipelineRunner,
]
IMPLEMENTATIONS: dict[str, PipelineFactory] = {
    "overlap": PipelineExecutor.from_config,
    "torch_pipelining": TorchPipeline.from_config,
}


def build_pipeline(
    cfg: ConfigContainer,
    chunks: Sequence[torch.nn.Module],
    ps,
    before_backward: Callable[[int, bool], None],
    memory: PipelineMemory,
) -> PipelineRunner:
    """The runner `model.pipeline_impl` names, over this rank's `chunks`. `before_backward(chunk,
    is_last)` tells data parallelism which backward is a chunk's last micro-batch; `memory` records
    the live stage-output bytes per step (ours measures them)."""
    return IMPLEMENTATIONS[cfg.resolved.model.pipeline_impl](
        cfg, chunks, ps, before_backward, memory
    )
