"""Launch-count budget (issue 35): the operator calls of one optimizer step, and of one transformer
layer's forward and backward, counted by a TorchDispatchMode, may not silently grow.

Every aten call below the mode costs a dispatch and most launch a kernel on a GPU; host reads
(`_local_scalar_dense`) are counted apart. All cases run the tiny model (`tiny_config`,
tests/configs.py) in a one-rank world with bf16 mixed precision.

- The optimizer step is what `Trainer.train_step` runs after the gradient reduction: `grad_norm()`
  (with its one intended host read) and `step()` (clipping scale, AdamW, bf16 copy-back), the third
  step of the run, with `clip_grad` small enough that the clipping scale always applies. Its
  launches (aten calls less host reads) must equal `LAUNCHES` exactly - 27 dense, 30 MoE (with or
  without the distributed optimizer), and 27 for the dense model with 4 layers, whose 35 slots are
  nearly twice the 2-layer model's 19: the multi-tensor (foreach) optimizer's launches do not grow
  with the slot count. Its host reads must be 2 per slot + 1: torch's foreach path reads each
  slot's CPU `step` twice (host reads of CPU scalars, no device sync; the fused CUDA path keeps
  `step` on the GPU and reads nothing), and ours is the one read of the norm (39 / 43 / 43 / 71
  reads for 19 / 21 / 21 / 35 slots).
- One transformer layer's forward and backward (`layer_ops`) are bounded from above by `LAYER_OPS`:
  dense 118 / 188 aten calls, MoE (4 experts, top-2) 219 / 250. On torch 2.13 (CPU) they measure
  113 / 181 and 209 / 226; work that fuses the layers' elementwise chains or the MoE permutation may
  lower them, not raise them.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.configs import tiny_config
from tests.world import run_world

HOST_READ = "aten._local_scalar_dense.default"
CLIP = "optimizer.clip_grad=1e-6"  # always below the norm: the clipping scale is applied every step


class OpCount(TorchDispatchMode):
    """Counts every aten call by its overload name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def optimizer_step_ops(moe: bool, layers: int, items: list[str]) -> tuple[dict[str, int], int]:
    """On a rank: (aten calls by name, slot count) of the third optimizer step (the first two create
    the Adam state and the gradient buffers' steady state)."""
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    cfg = tiny_config(moe, "bf16_mixed", layers, [CLIP, *items], 3)
    res = cfg.finalize(dist.get_world_size())
    trainer = Trainer(cfg, ParallelState(res.layout))
    trainer.train_step(0)
    trainer.train_step(1)
    with OpCount() as count:
        trainer.optimizer.step(1e-3, trainer.optimizer.grad_norm())
    return dict(count.ops), len(trainer.optimizer.adam.slots)


# (moe, layers, overrides) -> launches (aten calls less host reads) per optimizer step
LAUNCHES = {
    (False, 2, ()): 27,
    (True, 2, ()): 30,
    (True, 2, ("ddp.use_distributed_optimizer=true",)): 30,
    (False, 4, ()): 27,  # twice the layers, 35 slots for 19, the same launches
}


@pytest.mark.parametrize(
    "moe,layers,items", list(LAUNCHES), ids=["dense", "moe", "moe_distopt", "dense_4_layers"]
)
def test_optimizer_step_launches_do_not_grow_with_the_slots(moe, layers, items):
    ops, slots = run_world(1, optimizer_step_ops, moe, layers, list(items))[0]
    reads = ops.get(HOST_READ, 0)
    assert sum(ops.values()) - reads == LAUNCHES[moe, layers, items], ops
    # torch's foreach path: 2 CPU `step` reads per slot; ours: the norm
    assert reads == 2 * slots + 1, ops


def layer_ops(moe: bool) -> tuple[int, int]:
    """On a rank: aten calls of one transformer layer's forward, then of its backward (bf16, one
    micro-batch)."""
    from overlap.model.gpt import GPTModel
    from overlap.parallel.state import ParallelState

    cfg = tiny_config(moe, "bf16_mixed", 1, [], 1)
    res = cfg.finalize(dist.get_world_size())
    model = GPTModel(cfg.model, ParallelState(res.layout), res.overlap, res.precision, res.kernels)
    model.init_weights(cfg.train.seed)
    tokens = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.long)
    x = model.embed(tokens).detach().requires_grad_()
    layer = model.layers[0]
    with OpCount() as forward:
        out, aux = layer(x)
    outputs = [out] if aux is None else [out, aux]
    grads = [torch.ones_like(t) for t in outputs]
    with OpCount() as backward:
        torch.autograd.backward(outputs, grads)
    return sum(forward.ops.values()), sum(backward.ops.values())


# moe -> upper bounds on the (forward, backward) aten calls of one layer (the module docstring has
# today's counts)
LAYER_OPS = {False: (118, 188), True: (219, 250)}


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_layer_forward_backward_ops_do_not_grow(moe):
    forward, backward = run_world(1, layer_ops, moe)[0]
    assert forward <= LAYER_OPS[moe][0] and backward <= LAYER_OPS[moe][1], (forward, backward)
