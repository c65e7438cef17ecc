"""Tied embedding and output weights (`model.share_embeddings_and_output_weights`, Qwen3 0.6B-4B's
`tie_word_embeddings`): one parameter, whose gradient is the sum of its two uses, trained like at one rank by every
layout that can hold it (TP with and without SP, DP with the distributed optimizer and both DP overlaps:
rel 1e-5 in fp32, as tests/test_training.py); the layouts that cannot are refused by name. transformers' own tied
model is the reference in tests/test_hf_anchor.py ("dense_tied": logits and gradients)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.tiny import tiny_config
from tests.world import run_world

TIED = "model.share_embeddings_and_output_weights=true"


def _train(overrides: list[str]) -> list[float]:
    from overlap.parallel.state import ParallelState
    from overlap.training.support import check_runtime_support
    from overlap.training.trainer import Trainer

    cfg = tiny_config(False, "fp32", 2, [TIED, *overrides], 3)
    res = cfg.finalize(dist.get_world_size())
    check_runtime_support(cfg)
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


def _chunk_parameters() -> tuple[bool, list[str]]:
    from overlap.model.gpt import model_chunks
    from overlap.parallel.state import ParallelState

    cfg = tiny_config(False, "fp32", 2, [TIED], 1)
    (chunk,) = model_chunks(cfg.model, ParallelState(cfg.finalize(1).layout))
    return chunk.output_layer.weight is chunk.embedding.weight, list(dict(chunk.named_parameters()))


def test_the_output_layer_is_the_embedding():
    shared, names = run_world(1, _chunk_parameters)[0]
    assert shared and "embedding.weight" in names and "output_layer.weight" not in names


@pytest.mark.parametrize("world, overrides", [
    (2, ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
    (2, ["model.tensor_model_parallel_size=2"]),
    (2, ["ddp.use_distributed_optimizer=true", "optimizer.use_distributed_optimizer=true",
         "ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"]),
])
def test_tied_layouts_train_like_one_rank(world, overrides):
    ref = run_world(1, _train, [])[0]
    assert ref != run_world(1, _train, ["model.share_embeddings_and_output_weights=false"])[0]  # tying matters
    for losses in run_world(world, _train, overrides):
        assert losses == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("override, field", [
    ("model.pipeline_model_parallel_size=2", "model.share_embeddings_and_output_weights"),
    ("model.defer_embedding_wgrad_compute=true", "model.defer_embedding_wgrad_compute"),
])
def test_what_a_tied_model_cannot_run_is_refused_by_name(override, field):
    from overlap.errors import NotBuiltError
    from overlap.training.support import runtime_refusals

    cfg = tiny_config(False, "fp32", 2, [TIED, override], 1)
    assert any(isinstance(e, NotBuiltError) and e.field == field for e in runtime_refusals(cfg))
    moe = tiny_config(True, "fp32", 2, [TIED, "model.overlap_moe_expert_parallel_comm=true"], 1)
    assert any(e.field == "model.share_embeddings_and_output_weights" for e in runtime_refusals(moe))
