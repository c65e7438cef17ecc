"""DCP's index (`.metadata`) read without running code from the file.

torch's `FileSystemReader.read_metadata` reads `.metadata` with plain `pickle.load`, and a pickle
can name any importable callable: a planted `.metadata` runs its payload in every process that reads
the folder (a resume, a pretrained start, a save folder's model check, `overlap convert export`).
Teams share checkpoint folders, so the index is read here by an unpickler that admits only the
classes DCP's own index is made of (the same in torch 2.11 to 2.13: `torch.distributed.checkpoint`'s
metadata dataclasses and `_StorageInfo`, `torch.Size`, dtypes and layouts, `pathlib` paths) and
refuses any other global before it is looked up. `RestrictedReader` is DCP's file-system reader with
that one method replaced; every read of a checkpoint in this package goes through it. The shards
themselves are read by DCP with `torch.load(weights_only=True)`, and our load plans hold tensors
only, so no other pickle of a checkpoint is ever loaded.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: dict[str, frozenset[str]] = {
    _DCP_METADATA: frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    # a layout is pickled as _get_layout("torch.strided"): a lookup in torch's table of layouts
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    "torch": frozenset(
        {"Size"} | {name for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    ),
}


class ForeignGlobal(pickle.UnpicklingError):
    """The index names something that is not part of a DCP index: it would run code."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.qualname = f"{module}.{name}"


class IndexUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of a DCP index (`_ALLOWED`)."""

    def find_class(self, module: str, name: str) -> Any:
        if name not in _ALLOWED.get(module, ()):
            raise ForeignGlobal(module, name)
        return super().find_class(module, name)


def load_index(stream: BinaryIO) -> Metadata:
    """The `Metadata` pickled in `stream`, read with `IndexUnpickler`."""
    metadata = IndexUnpickler(stream).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class RestrictedReader(FileSystemReader):
    """DCP's file-system reader, its index read by `load_index` instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with open(path, "rb") as f:
            metadata = load_index(f)
        # what torch's reader does after loading (it stamps the load's id on the index)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
