"""Layout-independent parameter initialisation, drawn one local shard at a time.

Every parameter is initialised as if the model were not parallel at all, so a TP=2 x EP=2 model
starts from exactly the weights of the single-process reference, which is what makes "parallel
layout vs reference" tests exact. The full tensor is never made: it is defined as independent slices
along the dim the parameter is cut on (its `Shard.dim`, which every layout gives the same parameter
- the TP=1 and EP=1 layers mark it too - and dim 0 without a shard), slice i drawn from a generator
  seeded by (seed, parameter name, i), and each rank draws only the slices it holds. The
draw is fp32 on the CPU, so every device type starts from the same weights, and at most
`_HOST_ELEMENTS` of it are held on the host before they are copied (and cast) into the parameter
wherever it lives.

What drawing the whole tensor cost at start-up, per rank (one CPU thread, /tmp bench, bf16
parameters): a Qwen3-30B-A3B expert tensor [128, 3072, 2048] at EP 1 of 16 took 20.3 s and 3.4 GiB
of host memory, now 0.43 s and 0.36 GiB (the process's peak); the vocabulary [151936, 2048] at TP 1
of 8 took 3.2 s and 1.5 GiB, now 0.47 s and 0.34 GiB.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

_U64 = (1 << 64) - 1
_SEED_MASK = (1 << 63) - 1  # torch.Generator.manual_seed takes a non-negative int64
# fp32 elements drawn on the host before they are copied into the parameter (64 MiB): bounds host
# memory at any shape
_HOST_ELEMENTS = 1 << 24


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
    """The parameter's base seed: a hash of (seed, name), once per parameter (so names, not order,
    decide)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _SEED_MASK


def _slice_seed(base: int, i: int) -> int:
    """Seed of slice `i` of a parameter: splitmix64 of the base seed stepped i + 1 times. A
    vocabulary has 150k slices, and this costs 0.7 us a slice where a sha256 of (seed, name, i)
    costs 1.6 us."""
    z = (base + (i + 1) * 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) & _SEED_MASK


@torch.no_grad()
def init_model_params(model: nn.Module, seed: int, std: float) -> None:
    """Initialise every parameter of `model` with this rank's slices of its full-tensor draw
    (normal(0, std), biases 0, norms 1): slice i along the parameter's shard dim (dim 0 when it has
    no shard) comes from a generator seeded by (seed, name, i), and a rank draws only the slices it
    holds."""
    gen = torch.Generator()
    for name, param in model.named_parameters():
        if param.is_meta or is_fake(param):
            # the dry run's parameters hold no values, and a fake draw per slice would cost it
            # seconds
            continue
        if getattr(param, "init_ones", False):
            param.fill_(1.0)
            continue
        if name.endswith("bias"):
            param.zero_()
            continue
        shard: Shard = getattr(param, "shard", None) or Shard(0, 0, 1)
        # a tied copy (the output layer's on the last pipeline stage) draws the tensor it is a copy
        # of
        base = _seed_for(seed, getattr(param, "tied_to", name))
        dim, local = shard.dim, param.shape[shard.dim]
        first = shard.index * local
        slice_shape = param.shape[:dim] + param.shape[dim + 1 :]
        per_group = max(1, _HOST_ELEMENTS // max(1, slice_shape.numel()))
        for start in range(0, local, per_group):
            n = min(per_group, local - start)
            host = torch.empty((n, *slice_shape), dtype=torch.float32, device="cpu")
            for j in range(n):
                gen.manual_seed(_slice_seed(base, first + start + j))
                host[j].normal_(0.0, std, generator=gen)
            param.narrow(dim, start, n).copy_(host.movedim(0, dim))
