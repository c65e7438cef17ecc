"""safetensors files of a Hugging Face folder: lazy, sliced reads; sharded writes with an index.

A rank of a parallel run needs only its TP / EP slices, so reads go through
`safe_open(...).get_slice`, which maps the file and copies just the requested rows / columns: a rank
never materialises a tensor it holds a fraction of. Both layouts `save_pretrained` writes are read:
one `model.safetensors`, or shards named by `model.safetensors.index.json` (`weight_map`: tensor
name -> file).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from overlap.errors import CheckpointError
from overlap.files import create_exclusive, fresh_name

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """Every tensor of an HF folder by name, read lazily (one file handle per shard file, opened on
    first use)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index, single = self.folder / INDEX, self.folder / SINGLE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(
                    "checkpoint.pretrained_checkpoint",
                    str(index),
                    f"the shard index cannot be read ({type(exc).__name__}: {exc}).",
                    "re-download the checkpoint.",
                ) from None
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif single.exists():
            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise CheckpointError(
                "checkpoint.pretrained_checkpoint",
                str(self.folder),
                f"no {SINGLE} and no {INDEX}: not a Hugging Face safetensors checkpoint.",
                "point it at the folder save_pretrained wrote (config.json + safetensors).",
            )
        missing = sorted({str(p) for p in self.files.values() if not p.exists()})
        if missing:
            raise CheckpointError(
                "checkpoint.pretrained_checkpoint",
                missing[0],
                "a shard file named by the index is missing.",
                "copy the whole checkpoint folder.",
            )
        self._handles: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def _handle(self, name: str):
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(
                "checkpoint.pretrained_checkpoint",
                str(self.folder),
                f"tensor {name!r} is not in the checkpoint.",
                "load a checkpoint of this model configuration.",
            )
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """The tensor `name`, or only [start, stop) along `dim` (read from the file without the
        rest)."""
        view = self._handle(name).get_slice(name)
        if dim is None:
            return view[:]
        return view[(slice(None),) * dim + (slice(start, stop),)]


def write_sharded(
    folder: str | Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int = 2 << 30
) -> list[str]:
    """Write `tensors` (name -> contiguous CPU tensor) as `save_pretrained` does:
    `model.safetensors` if they fit in one shard, else `model-0000i-of-0000n.safetensors` files and
    an index. Returns the files written. Every file is written under a fresh name (nothing planted
    at its name is written through) and renamed only once all are written: a failure (a full disk)
    leaves none of them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    names = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    temps: list[tuple[Path, Path]] = []
    try:
        for file, shard in zip(names, shards):
            temps.append((fresh_name(folder / file), folder / file))
            save_file(shard, str(temps[-1][0]), metadata={"format": "pt"})
        if len(shards) > 1:
            weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            temps.append((fresh_name(folder / INDEX), folder / INDEX))
            with create_exclusive(temps[-1][0]) as f:
                f.write(
                    json.dumps(
                        {"metadata": {"total_size": total}, "weight_map": weight_map},
                        indent=2,
                        sort_keys=True,
                    )
                    + "\n"
                )
        for tmp, final in temps:
            os.replace(tmp, final)
    except BaseException:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        raise
    return [final.name for _, final in temps]
