"""The PyTorch-native TP peer (`model.tensor_parallel_impl=dtensor`, layers/dtensor_tp.py) trains
dense_tiny to the losses of our TP runtime, its layers' TP communication really leaves comm.py, and
what it cannot run is refused.

Tolerance: fp32, rel 1e-5 on losses and gradient norms. Both runtimes run the same GEMMs on the same
local weight shards from the same initial values; only who sums the partial results differs (gloo's
reduce-scatter / all-reduce under DTensor, our all-to-all + local sum). At TP=2 a sum of two terms
does not depend on its order, so in practice the runs are bit-identical; the tolerance is the one
every layout comparison uses.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from overlap.cli import main
from overlap.config.overrides import apply_overrides
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.recipes.models import RECIPES
from overlap.training.trainer import Trainer
from tests.world import run_world

STEPS = 3
PEER = "model.tensor_parallel_impl=dtensor"


def _train(overrides: list[str]) -> dict:
    """dense_tiny for STEPS iterations: losses, grad norms, and what a rank's model and our tracer
    show."""
    cfg = RECIPES["dense_tiny"].build(dist.get_world_size())
    cfg.train.train_iters = STEPS
    apply_overrides(cfg, overrides)
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    recorder().drain()
    losses, norms, traced = [], [], Counter()
    for it in range(STEPS):
        loss, norm = trainer.train_step(it)
        losses.append(loss)
        norms.append(norm)
        events, _spans = recorder().drain()
        traced.update(e.kind for e in events if e.kind in ("tp_ag", "tp_rs"))
    trainer.finish_param_sync()
    params = [
        (name, isinstance(p, DTensor)) for c in trainer.chunks for name, p in c.named_parameters()
    ]
    return {
        "losses": losses,
        "norms": norms,
        "traced": dict(traced),
        "params": params,
        "micro_batches": trainer.num_micro_batches,
    }


@functools.cache
def _run(world: int, overrides: tuple[str, ...]) -> list[dict]:
    """Every rank's `_train` result, once per configuration for all the tests that read it."""
    return run_world(world, _train, list(overrides))


TP2 = ("model.tensor_model_parallel_size=2",)
# 4 ranks on 2 cores: the recipe's 2 x ranks would double the time
SMALL_BATCH = ("train.global_batch_size=4",)
CASES = [
    # (id, world, overrides)
    ("tp2_sp", 2, TP2 + ("model.sequence_parallel=true",)),
    ("tp2_no_sp", 2, TP2 + ("model.sequence_parallel=false",)),
    (
        "tp2_dp2_sp_distopt_overlaps",
        4,
        TP2
        + SMALL_BATCH
        + (
            "model.sequence_parallel=true",
            "ddp.use_distributed_optimizer=true",
            "optimizer.use_distributed_optimizer=true",
            "ddp.overlap_grad_reduce=true",
            "ddp.overlap_param_gather=true",
            "ddp.bucket_size=200000",
        ),
    ),
    (
        "tp2_pp2_sp",
        4,
        TP2
        + SMALL_BATCH
        + ("model.sequence_parallel=true", "model.pipeline_model_parallel_size=2"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_dtensor_peer_trains_to_our_losses(case):
    _id, world, overrides = case
    ours, peer = _run(world, overrides), _run(world, overrides + (PEER,))
    for o, p in zip(ours, peer):
        assert p["losses"] == pytest.approx(o["losses"], rel=1e-5)
        assert p["norms"] == pytest.approx(o["norms"], rel=1e-5)
        # The same parameters under the same names (so the same initial values and gradient
        # buckets), all plain.
        assert p["params"] == o["params"] and not any(
            is_dtensor for _name, is_dtensor in p["params"]
        )


def test_the_layers_tp_collectives_leave_our_comm():
    """Under SP the peer's layers all-gather and reduce-scatter through DTensor: our tracer sees
    only the embedding's and the output layer's per micro-batch, forward and backward together (the
    embedding's reduce-scatter and all-gather; the output layer's all-gather, its input gathered
    again for the weight gradient and its reduce-scatter), against per layer six all-gathers (the
    QKV and fc1 inputs gathered again in backward) and four reduce-scatters more for ours."""
    overrides = TP2 + ("model.sequence_parallel=true",)  # the tp2_sp case: its runs are reused
    ours, peer = _run(2, overrides)[0], _run(2, overrides + (PEER,))[0]
    n = peer["micro_batches"] * STEPS
    assert peer["traced"] == {"tp_ag": 3 * n, "tp_rs": 2 * n}
    layers = RECIPES["dense_tiny"].build(2).model.num_layers
    assert ours["traced"] == {"tp_ag": (3 + 6 * layers) * n, "tp_rs": (2 + 4 * layers) * n}


DENSE = ["run", "-m", "qwen", "-mr", "dense_tiny", "-g", "cpu", "-ng", "2", "--max_steps", "1"]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (
            DENSE + ["-tp", "1", PEER],
            ["model.tensor_parallel_impl='dtensor'", "compare nothing", "-tp 2"],
        ),
        (
            [
                "run",
                "-m",
                "qwen",
                "-mr",
                "qwen3_moe_tiny",
                "-g",
                "cpu",
                "-ng",
                "2",
                "-tp",
                "2",
                "--max_steps",
                "1",
                PEER,
            ],
            [
                "model.tensor_parallel_impl='dtensor'",
                "MoE models",
                "not built",
                "tensor_parallel_impl=overlap",
            ],
        ),
        (
            DENSE + ["-tp", "2", "comm_overlap.tp_comm_overlap=true", PEER],
            ["model.tp_comm_overlap=True", "not built", "comm_overlap.tp_comm_overlap=false"],
        ),
        (
            DENSE + ["-tp", "2", "model.tensor_parallel_impl=megatron"],
            ["model.tensor_parallel_impl='megatron'", "dtensor"],
        ),
    ],
    ids=["tp1", "moe", "tp_comm_overlap", "unknown"],
)
def test_what_the_peer_cannot_run_is_refused_before_any_rank_starts(argv, needles, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("overlap: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
