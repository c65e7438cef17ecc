"""The PyTorch peers (torch DDP, FSDP2) train the same model with the same arithmetic as our
Trainer, so a benchmark against them compares runtimes, not different maths. fp32; rel 1e-5
(averaging vs summing over DP reorders sums)."""

import pytest
import torch.distributed as dist

from overlap.config import ConfigContainer, ModelConfig, OptimizerConfig, TrainConfig
from overlap.parallel.state import ParallelState
from overlap.perf.peers import PeerTrainer
from overlap.training.trainer import Trainer
from tests.world import run_world


def _losses(impl: str) -> list[float]:
    cfg = ConfigContainer(
        model=ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=128,
            vocab_size=256,
            seq_length=16,
        ),
        train=TrainConfig(global_batch_size=8, micro_batch_size=2, train_iters=3),
        optimizer=OptimizerConfig(lr=1e-3, clip_grad=0.5),
    )
    cfg.ddp.impl = impl
    res = cfg.finalize(dist.get_world_size())
    trainer = (Trainer if impl == "overlap" else PeerTrainer)(cfg, ParallelState(res.layout))
    return [(r.lm_loss, r.grad_norm) for r in trainer.train().records]


@pytest.mark.parametrize("impl", ["torch_ddp", "fsdp2"])
def test_peer_trains_like_our_trainer(impl):
    ours = run_world(2, _losses, "overlap")[0]
    peer = run_world(2, _losses, impl)[0]
    for (l_ours, n_ours), (l_peer, n_peer) in zip(ours, peer):
        assert l_peer == pytest.approx(l_ours, rel=1e-5)
        assert n_peer == pytest.approx(n_ours, rel=1e-4)


def test_every_implementation_name_the_config_accepts_has_a_runtime_entry():
    """The config validates `model.pipeline_impl` / `model.tensor_parallel_impl` against its own
    name lists (config sits below the runtime); the runtime's tables must hold exactly those."""
    from overlap.config.model import PIPELINE_IMPLS, TENSOR_PARALLEL_IMPLS
    from overlap.model import tensor_parallel_impl
    from overlap.pipeline import runner

    assert set(runner.IMPLEMENTATIONS) == set(PIPELINE_IMPLS)
    assert set(tensor_parallel_impl.IMPLEMENTATIONS) == set(TENSOR_PARALLEL_IMPLS)
