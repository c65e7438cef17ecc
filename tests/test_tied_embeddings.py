"""Tied embedding and output weights (`model.share_embeddings_and_output_weights`, Qwen3 0.6B-4B's
`tie_word_embeddings`): one parameter, whose gradient is the sum of its two uses, trained like at
one rank by every layout (TP with and without SP, DP with the distributed optimizer and both DP
overlaps, and pipeline parallelism, where the last stage holds a copy whose gradient is summed with
the embedding's over the pipeline's ends: rel 1e-5 in fp32, as tests/test_training.py); what cannot
run with it is refused by name. A checkpoint saved at PP2 holds the embedding once and resumes at
PP1 like the uninterrupted run. transformers' own tied model is the reference in
tests/test_hf_anchor.py ("dense_tied": logits and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.configs import tiny_config
from tests.world import run_world

TIED = "model.share_embeddings_and_output_weights=true"


def _train(overrides: list[str]) -> list[float]:
    """Each step's loss and gradient norm (the tied tensor counted once at every layout)."""
    from overlap.parallel.state import ParallelState
    from overlap.training.runtime_refusals import check_runtime_support
    from overlap.training.trainer import Trainer

    cfg = tiny_config(False, "fp32", 2, [TIED, *overrides], 3)
    res = cfg.finalize(dist.get_world_size())
    check_runtime_support(cfg)
    return [
        x
        for r in Trainer(cfg, ParallelState(res.layout)).train().records
        for x in (r.lm_loss, r.grad_norm)
    ]


def _chunk_parameters() -> tuple[bool, list[str]]:
    from overlap.model.gpt import model_chunks
    from overlap.parallel.state import ParallelState

    cfg = tiny_config(False, "fp32", 2, [TIED], 1)
    res = cfg.finalize(1)
    (chunk,) = model_chunks(
        cfg.model, ParallelState(res.layout), res.pipeline, res.overlap, res.precision, res.kernels
    )
    return chunk.output_layer.weight is chunk.embedding.weight, list(dict(chunk.named_parameters()))


def test_the_output_layer_is_the_embedding():
    shared, names = run_world(1, _chunk_parameters)[0]
    assert shared and "embedding.weight" in names and "output_layer.weight" not in names


@pytest.mark.parametrize(
    "world, overrides",
    [
        (2, ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]),
        (2, ["model.tensor_model_parallel_size=2"]),
        (
            2,
            [
                "ddp.use_distributed_optimizer=true",
                "optimizer.use_distributed_optimizer=true",
                "ddp.overlap_grad_reduce=true",
                "ddp.overlap_param_gather=true",
            ],
        ),
        (2, ["model.pipeline_model_parallel_size=2"]),
        (
            2,
            [
                "model.pipeline_model_parallel_size=2",
                "model.virtual_pipeline_model_parallel_size=2",
                "model.num_layers=4",
            ],
        ),
        (
            4,
            [
                "model.pipeline_model_parallel_size=2",
                "ddp.use_distributed_optimizer=true",
                "optimizer.use_distributed_optimizer=true",
                "ddp.overlap_grad_reduce=true",
                "ddp.overlap_param_gather=true",
                "ddp.bucket_size=2000",
            ],
        ),
        (
            4,
            [
                "model.pipeline_model_parallel_size=2",
                "ddp.use_distributed_optimizer=true",
                "optimizer.use_distributed_optimizer=true",
            ],
        ),  # the default buckets: the tied tensor cut out of one
        (
            4,
            [
                "model.pipeline_model_parallel_size=2",
                "model.tensor_model_parallel_size=2",
                "model.sequence_parallel=true",
            ],
        ),
        (
            4,
            ["model.pipeline_model_parallel_size=4", "model.num_layers=4"],
        ),  # two stages in between
    ],
)
def test_tied_layouts_train_like_one_rank(world, overrides):
    ref = run_world(1, _train, [o for o in overrides if o.startswith("model.num_layers")])[0]
    # tying matters
    assert ref != run_world(1, _train, ["model.share_embeddings_and_output_weights=false"])[0]
    for losses in run_world(world, _train, overrides):
        assert losses == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize(
    "override, field",
    [
        ("model.pipeline_impl=torch_pipelining", "model.share_embeddings_and_output_weights"),
        ("model.defer_embedding_wgrad_compute=true", "model.defer_embedding_wgrad_compute"),
    ],
)
def test_what_a_tied_model_cannot_run_is_refused_by_name(override, field):
    from overlap.errors import NotBuiltError
    from overlap.training.runtime_refusals import runtime_refusals

    cfg = tiny_config(False, "fp32", 2, [TIED, override, "model.pipeline_model_parallel_size=2"], 1)
    cfg.finalize(2)
    assert any(isinstance(e, NotBuiltError) and e.field == field for e in runtime_refusals(cfg))
    ep_overlap = [TIED, "model.overlap_moe_expert_parallel_comm=true"]
    moe = tiny_config(True, "bf16_mixed", 2, ep_overlap, 1, expert_model_parallel_size=2)
    moe.finalize(2)
    assert any(
        e.field == "model.share_embeddings_and_output_weights" for e in runtime_refusals(moe)
    )


def _train_saving(overrides: list[str]) -> list[float]:
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = tiny_config(False, "fp32", 2, [TIED, *overrides], 4)
    return [
        r.lm_loss
        for r in Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
        .train()
        .records
    ]


def test_a_pp2_checkpoint_holds_the_embedding_once_and_resumes_at_pp1(tmp_path):
    from overlap.training.checkpoint_format import iteration_dir, read_metadata

    straight = run_world(
        2,
        _train_saving,
        [
            "model.pipeline_model_parallel_size=2",
            f"checkpoint.save={tmp_path}",
            "checkpoint.save_interval=2",
        ],
    )[1]  # the last stage logs the losses
    keys = set(read_metadata(iteration_dir(tmp_path, 2)).state_dict_metadata)
    assert "model.embedding.weight" in keys and not any(
        k.endswith("output_layer.weight") for k in keys
    )
    resumed = run_world(
        1, _train_saving, [f"checkpoint.load={tmp_path}", "checkpoint.ckpt_step=2"]
    )[0]
    assert resumed == pytest.approx(straight[2:], rel=1e-5)


def _tied_tensors(overrides: list[str]) -> dict[str, torch.Tensor]:
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = tiny_config(False, "bf16_mixed", 2, [TIED, *overrides], 4)
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    trainer.train()
    trainer.finish_param_sync()
    return {
        n: p.detach().clone()
        for n, p in trainer._named_params()
        if n in ("embedding.weight", "output_layer.weight")
    }


def test_the_copy_stays_bit_equal_to_the_embedding_in_bf16_with_the_distributed_optimizer():
    """bf16 parameters, fp32 masters sharded over DP, both DP overlaps: after 4 steps the first
    stage's embedding and the last stage's copy (ranks 0 and 2 of PP2 x DP2: the same DP coordinate)
    are the same bits."""
    got = run_world(
        4,
        _tied_tensors,
        [
            "model.pipeline_model_parallel_size=2",
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
            "ddp.overlap_grad_reduce=true",
            "ddp.overlap_param_gather=true",
        ],
    )
    embedding, copy = got[0]["embedding.weight"], got[2]["output_layer.weight"]
    assert embedding.dtype == torch.bfloat16 and torch.equal(embedding, copy)
    start = run_world(1, _tied_tensors, ["optimizer.lr=0", "optimizer.min_lr=0"])[0][
        "embedding.weight"
    ]
    assert not torch.equal(start, embedding)  # it trained
