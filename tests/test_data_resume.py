"""Resume on real data (issue 16 with the checkpoint issue): a run over a blend of two indexed
datasets that saves at iteration K and a run that loads that checkpoint train iterations K+1.. on
the same samples - the sample index continues from the consumed ones (iteration x global batch) - so
the losses and the final parameters equal the uninterrupted run's exactly (fp32, same layout), as
tests/test_checkpoint.py shows on mock data. A control run that starts afresh at K on the same data
sees other samples and other losses: the test can tell."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from overlap.data.indexed import IndexedDatasetWriter
from tests.configs import tiny_config
from tests.world import run_world

N, K = 4, 2


def _write(prefix, seed: int, docs: int) -> None:
    rng = np.random.default_rng(seed)
    w = IndexedDatasetWriter(prefix, np.uint16)
    for _ in range(docs):
        w.add_document(rng.integers(0, 255, int(rng.integers(5, 40))).tolist())
    w.finalize()


def _train(items: list[str]):
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = tiny_config(False, "fp32", 2, items, N)
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    losses = [(r.iteration, r.lm_loss) for r in trainer.train().records]
    return losses, {n: p.detach().clone() for n, p in trainer._named_params()}


def test_resume_continues_at_the_consumed_sample(tmp_path):
    _write(tmp_path / "a", 0, 300)
    _write(tmp_path / "b", 1, 200)
    data = [
        f"dataset.blend=[[{tmp_path / 'a'}, {tmp_path / 'b'}], [0.7, 0.3]]",
        "dataset.split=98,1,1",
    ]
    straight = run_world(
        2, _train, data + [f"checkpoint.save={tmp_path / 'ck'}", f"checkpoint.save_interval={K}"]
    )
    resumed = run_world(
        2, _train, data + [f"checkpoint.load={tmp_path / 'ck'}", f"checkpoint.ckpt_step={K}"]
    )
    for (s_losses, s_params), (r_losses, r_params) in zip(straight, resumed):
        assert [it for it, _ in r_losses] == list(range(K, N))
        assert r_losses == s_losses[K:]
        for name in s_params:
            assert torch.equal(r_params[name], s_params[name]), name
    # the weights of iteration K on the data's first samples again: other batches, other losses
    fresh = run_world(
        2, _train, data + [f"checkpoint.pretrained_checkpoint={tmp_path / 'ck' / f'iter_{K:07d}'}"]
    )
    assert [loss for _, loss in fresh[0][0][: N - K]] != pytest.approx(
        [loss for _, loss in straight[0][0][K:]]
    )
