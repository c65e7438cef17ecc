"""Layout-independent parameter initialisation.

Every parameter is initialised as if the model were not parallel at all: the full tensor is drawn from a generator
seeded by (seed, parameter name), and each rank keeps its own slice. So a TP=2 x EP=2 model starts from exactly the
weights of the single-process reference, which is what makes "parallel layout vs reference" tests exact.
Full tensors are materialised one parameter at a time, which is fine for the small models we train on CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Shard:
    """This rank holds slice `index` of `count` equal slices of the full tensor along `dim`."""

    dim: int
    index: int
    count: int


def mark_shard(param: nn.Parameter, dim: int, index: int, count: int) -> nn.Parameter:
    """Record how `param` is cut out of its full (unsharded) tensor."""
    param.shard = Shard(dim, index, count)
    return param


def mark_ones(param: nn.Parameter) -> nn.Parameter:
    """Norm weights and similar start at 1, not at a random draw."""
    param.init_ones = True
    return param


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_shape(param: nn.Parameter) -> tuple[int, ...]:
    shape = list(param.shape)
    shard: Shard | None = getattr(param, "shard", None)
    if shard is not None:
        shape[shard.dim] *= shard.count
    return tuple(shape)


@torch.no_grad()
def init_model_params(model: nn.Module, seed: int, std: float) -> None:
    """Initialise every parameter of `model` from its full-tensor draw (normal(0, std), biases 0, norms 1)."""
    for name, param in model.named_parameters():
        if getattr(param, "init_ones", False):
            param.fill_(1.0)
            continue
        if name.endswith("bias"):
            param.zero_()
            continue
        # a tied copy (the output layer's on the last pipeline stage) draws the tensor it is a copy of
        gen = torch.Generator().manual_seed(_seed_for(seed, getattr(param, "tied_to", name)))
        full = torch.empty(full_shape(param), dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)
        shard: Shard | None = getattr(param, "shard", None)
        if shard is not None:
            full = full.chunk(shard.count, dim=shard.dim)[shard.index]
        param.copy_(full.to(param.dtype))
