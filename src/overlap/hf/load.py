"""A Hugging Face folder straight into this rank's parameter shards (any TP / EP / PP / DP layout).

Every parameter carries its cut of the layout-independent full tensor (`param.shard`,
`layers/init.py`); a rank reads from the safetensors files only the rows / columns / experts of that
cut and applies the transforms of `overlap.hf.names` to them. That is exact because each cut is a
cut of the HF tensors too: TP splits QKV by whole query groups (so the rank's q / k / v rows are
contiguous in q_proj / k_proj / v_proj), fc1 by rows of gate and up alike, o_proj by columns, the
vocabulary by rows, and EP the stacked experts by whole experts.

Before reading, every rank checks config.json against its configured model and that the files hold
every tensor the whole model needs (not only its own): the checks are the same on every rank, so a
bad checkpoint fails everywhere at once instead of leaving the other ranks waiting in the first
collective.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from overlap.config.architecture import TransformerArchitecture
from overlap.errors import CheckpointError
from overlap.hf.config_json import check_model_matches, read_hf_config
from overlap.hf.names import (
    EXPERT_KINDS,
    Mapping,
    fused_name,
    mappings,
    merge_gate_up,
    merge_qkv,
    per_expert_names,
    stack_experts,
)
from overlap.hf.safetensors_io import SafetensorsReader
from overlap.layers.init import Shard

log = logging.getLogger("overlap.hf")


class Source(Protocol):
    """Where HF tensors come from (`SafetensorsReader`, or a dict in tests): whole or a [start,
    stop) cut."""

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor: ...


def _cut(size: int, shard: Shard | None) -> tuple[int, int]:
    """[start, stop) of `shard`'s slice along a dimension of `size` (the whole of it without a
    shard)."""
    if shard is None or shard.count == 1:
        return 0, size
    if size % shard.count:
        raise ValueError(f"a dimension of {size} does not split into {shard.count} equal shards")
    step = size // shard.count
    return shard.index * step, (shard.index + 1) * step


def experts_fused(names: set[str], prefix: str) -> bool:
    """Whether this layer's experts are stored fused (transformers 5) rather than per expert; a mix
    is refused, as Bridge's `moe_experts_stored_packed` does (one of the two would be silently
    ignored)."""
    fused = f"{prefix}.gate_up_proj" in names or f"{prefix}.down_proj" in names
    per = any(
        n.startswith(prefix + ".") and n[len(prefix) + 1 :].split(".")[0].isdigit() for n in names
    )
    if fused and per:
        raise CheckpointError(
            "checkpoint.pretrained_checkpoint",
            prefix,
            "the checkpoint holds both fused (gate_up_proj / down_proj) and per-expert tensors for "
            "these experts.",
            "use a checkpoint with one expert layout.",
        )
    return fused


def required_names(
    maps: list[Mapping], source_names: set[str], cfg: TransformerArchitecture
) -> list[str]:
    """The HF tensors the whole model `maps` is made of, in the layout (fused or per-expert) the
    source uses."""
    out = []
    for m in maps:
        if m.kind in EXPERT_KINDS:
            prefix = m.hf[0]
            if experts_fused(source_names, prefix):
                out.append(fused_name(prefix, m.kind))
            else:
                out += [
                    n
                    for e in range(cfg.num_moe_experts)
                    for n in per_expert_names(prefix, m.kind, e)
                ]
        else:
            out += list(m.hf)
    return out


def read_shard(
    m: Mapping, source: Source, cfg: TransformerArchitecture, shard: Shard | None
) -> torch.Tensor:
    """Our parameter `m.ours` (its `shard` cut, or whole) read from `source` (see the module
    docstring)."""
    count = 1 if shard is None else shard.count
    expect = {"same": None, "qkv": 0, "fc1": 1}.get(m.kind, 0)
    if count > 1 and expect is not None and shard.dim != expect:
        raise ValueError(
            f"{m.ours}: cut along dim {shard.dim}, the HF mapping expects dim {expect}"
        )

    def cut(name: str, dim: int) -> torch.Tensor:
        start, stop = _cut(source.shape(name)[dim], shard)
        return source.read(name, dim, start, stop)

    if m.kind == "same":
        return source.read(m.hf[0]) if count == 1 else cut(m.hf[0], shard.dim)
    if m.kind == "qkv":
        return merge_qkv(*(cut(n, 0) for n in m.hf), groups=cfg.query_groups // count)
    if m.kind == "fc1":
        return merge_gate_up(*(cut(n, 0) for n in m.hf))
    if m.kind not in EXPERT_KINDS:
        raise ValueError(f"unknown mapping kind {m.kind!r}")
    prefix = m.hf[0]
    first, stop = _cut(cfg.num_moe_experts, shard)
    if experts_fused(source.names(), prefix):  # transformers 5's fused layout is ours
        return source.read(fused_name(prefix, m.kind), 0, first, stop)
    return stack_experts(
        [[source.read(n) for n in per_expert_names(prefix, m.kind, e)] for e in range(first, stop)]
    )


def check_source(cfg: TransformerArchitecture, source: Source, folder: str | Path) -> list[Mapping]:
    """The whole model's mappings, after checking that `source` holds every tensor they need and
    nothing else (an unexpected tensor is a model part we would drop: refused, never ignored)."""
    maps = mappings(cfg)
    names = source.names()
    need = required_names(maps, names, cfg)
    missing = [n for n in need if n not in names]
    if missing:
        raise CheckpointError(
            "checkpoint.pretrained_checkpoint",
            str(folder),
            f"{len(missing)} tensor(s) the model needs are not in the checkpoint: "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}.",
            "load a checkpoint of this model.",
        )
    extra = sorted(names - set(need))
    if cfg.share_embeddings_and_output_weights and "lm_head.weight" in extra:
        # a tied checkpoint's copy of the embedding: transformers ties over it too
        extra.remove("lm_head.weight")
    if extra:
        raise CheckpointError(
            "checkpoint.pretrained_checkpoint",
            str(folder),
            f"the checkpoint holds tensor(s) "
            "this model has no place for: "
            f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}.",
            "load a plain Qwen3 / Qwen3-MoE checkpoint of this model.",
        )
    return maps


@torch.no_grad()
def load_hf_weights(
    cfg: TransformerArchitecture, params: dict[str, nn.Parameter], folder: str | Path, rank: int = 0
) -> None:
    """Fill this rank's `params` (our names -> parameters, this rank's chunks) from the HF folder,
    after checking that config.json describes the configured model (`check_model_matches`)."""
    check_model_matches(cfg, read_hf_config(folder), folder)
    source = SafetensorsReader(folder)
    by_name = {m.ours: m for m in check_source(cfg, source, folder)}
    for name, param in params.items():
        # a tied embedding's copy on the last stage: the embedding
        m = by_name.get(getattr(param, "tied_to", name))
        if m is None:
            raise CheckpointError(
                "checkpoint.pretrained_checkpoint",
                str(folder),
                f"parameter {name!r} has no Hugging Face counterpart.",
                "load it from an overlap checkpoint instead.",
            )
        value = read_shard(m, source, cfg, getattr(param, "shard", None))
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(
                "checkpoint.pretrained_checkpoint",
                str(folder),
                f"{name!r} reads as {tuple(value.shape)} but this rank's shard is "
                f"{tuple(param.shape)}.",
                "load a checkpoint of this model configuration.",
            )
        param.copy_(value.to(param.dtype))
    if rank == 0:
        log.info(
            "loaded the Hugging Face checkpoint %s (%d tensors) into this layout's shards; "
            "training starts at iteration 0 with the optimizer's masters from these weights",
            folder,
            len(source.names()),
        )


class DictSource:
    """HF tensors held in memory (a model's `state_dict()`), read like a folder: for tests and the
    round trip."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        t = self.tensors[name]
        return (
            t
            if dim is None
            else t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)
        )
