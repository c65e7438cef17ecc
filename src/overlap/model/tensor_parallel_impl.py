"""Which tensor-parallel implementation the model's layers communicate through
(`model.tensor_parallel_impl`).

Ours ("overlap") is built into the layers (`overlap.layers.tensor_parallel`: ColumnParallelLinear /
RowParallelLinear with the SP all-gather / reduce-scatter in `overlap.parallel.comm`), so the chunks
`model_chunks` builds are tensor-parallel as they are. The PyTorch-native peer ("dtensor",
`overlap.layers.dtensor_tp`) hands the same layers' TP linears to DTensor (`parallelize_module`)
once they are built. Both are a `TensorParallelImpl`, applied by the trainer to the built chunks
before their weights are initialised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from overlap.model.gpt import GPTModel
from overlap.parallel.state import ParallelState

if TYPE_CHECKING:
    from overlap.config.model import ModelConfig

log = logging.getLogger("overlap.train")

TensorParallelImpl = Callable[[Sequence[GPTModel], ParallelState, "ModelConfig"], None]


def _ours(chunks: Sequence[GPTModel], ps: ParallelState, config: ModelConfig) -> None:
    """Our layers are tensor-parallel as built: nothing to apply."""


def _dtensor(chunks: Sequence[GPTModel], ps: ParallelState, config: ModelConfig) -> None:
    """Hand every chunk's TP linears to DTensor (`parallelize_layers`)."""
    # imported here: DTensor costs ~1 s of import, which only the peer pays
    from overlap.layers.dtensor_tp import parallelize_layers

    for chunk in chunks:
        parallelize_layers(chunk.layers, ps, ps.layout.sequence_parallel)
    if ps.rank == 0:
        log.info(
            "model.tensor_parallel_impl=dtensor: the layers' TP linears communicate through "
            "DTensor (parallelize_module), which the communication tables below do not see"
        )


IMPLEMENTATIONS: dict[str, TensorParallelImpl] = {"overlap": _ours, "dtensor": _dtensor}


def apply_tensor_parallel_impl(
    chunks: Sequence[GPTModel], ps: ParallelState, config: ModelConfig
) -> None:
    """Make the built `chunks` communicate through the implementation `config.tensor_parallel_impl`
    names."""
    IMPLEMENTATIONS[config.tensor_parallel_impl](chunks, ps, config)
