"""A checksum for every stored tensor, written at save and verified at load.

Without one, a checkpoint whose shard bytes were flipped (a bad disk, a torn copy) loads without a
word and the run trains on garbage. Each rank hashes what it has just written: `DigestingWriter` is
DCP's file-system writer that, after writing its shards, reads each stored item back (from the page
cache, streaming, SHA-256) and hands the digest to DCP's coordinator with the item's write result;
the coordinator writes them beside the shards as `digests.json` (ours, plain JSON: item key, file,
byte range, digest) together with the digest of DCP's `.metadata`, then strips them from what DCP
pickles, so `.metadata` stays DCP's own. No collective of our own: the digests travel in DCP's
gather of write results, in the synchronous and the asynchronous save alike.

At load every rank verifies its share of the items (file `i` of the sorted shard files is rank
`i mod world`'s), streaming each byte range once, before any tensor is read; a mismatch names the
file, the tensor and the range. The digests guard against corruption, not against someone who can
rewrite the folder: they can rewrite `digests.json` too (docs/checkpoints.md says what is trusted).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from overlap.files import write_replace

DIGESTS = "digests.json"
ALGORITHM = "sha256"
_BLOCK = 1 << 20


def _digest(path: Path, offset: int, length: int) -> str:
    """SHA-256 of `length` bytes of `path` from `offset`, read in blocks."""
    h = hashlib.new(ALGORITHM)
    with open(path, "rb") as f:
        f.seek(offset)
        left = length
        while left > 0:
            block = f.read(min(_BLOCK, left))
            if not block:
                break  # a short file: the digest then differs from a whole one
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, ALGORITHM).hexdigest()


def item_key(index: Any) -> str:
    """A stored item's name in `digests.json`: its tensor's key and chunk offsets."""
    return f"{index.fqn}@{','.join(map(str, index.offset or ()))}"


@dataclasses.dataclass(frozen=True)
class _Digested:
    """A write result's storage info with the digest of the bytes it names (coordinator only)."""

    info: Any
    digest: str


class DigestingWriter(dcp.FileSystemWriter):
    """DCP's writer plus a digest of every stored item in `digests.json` (see the module)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        results = super().write_data(plan, planner).wait()  # the file system writes synchronously
        root = Path(self.path)
        out = [
            dataclasses.replace(
                r,
                storage_data=_Digested(
                    r.storage_data,
                    _digest(
                        root / r.storage_data.relative_path,
                        r.storage_data.offset,
                        r.storage_data.length,
                    ),
                ),
            )
            for r in results
        ]
        done: Future = Future()
        done.set_result(out)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        items = {}
        plain = []
        for rank_results in results:
            plain.append(
                [dataclasses.replace(r, storage_data=r.storage_data.info) for r in rank_results]
            )
            for r in rank_results:
                info = r.storage_data.info
                items[item_key(r.index)] = {
                    "file": info.relative_path,
                    "offset": info.offset,
                    "length": info.length,
                    ALGORITHM: r.storage_data.digest,
                }
        super().finish(metadata, plain)
        root = Path(self.path)
        doc = {
            "algorithm": ALGORITHM,
            "index": _file_digest(root / ".metadata"),
            "items": dict(sorted(items.items())),
        }
        write_replace(root / DIGESTS, json.dumps(doc, indent=0) + "\n")


def read_digests(folder: Path) -> dict | None:
    """The folder's `digests.json`, None when it has none (a checkpoint written before digests were
    kept); ValueError / OSError when it cannot be read."""
    path = folder / DIGESTS
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or doc.get("algorithm") != ALGORITHM:
        raise ValueError(f"not a {DIGESTS} of this format")
    return doc


def verify_index(folder: Path, digests: dict) -> str | None:
    """Whether `.metadata` is the index the digests were written with (None) or what is wrong."""
    if _file_digest(folder / ".metadata") != digests["index"]:
        return f"{folder / '.metadata'} (the DCP index) differs from the one written at the save"
    return None


def verify_items(
    folder: Path, metadata: Metadata, digests: dict, rank: int, world: int
) -> str | None:
    """Verify this rank's share of the stored items against the digests; the first problem as
    "<file> (tensor '<key>', bytes a-b): ...", None if all match."""
    stored = digests["items"]
    files = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    mine = set(files[rank::world])
    for index, info in (metadata.storage_data or {}).items():
        if info.relative_path not in mine:
            continue
        key = item_key(index)
        where = (
            f"{folder / info.relative_path} (tensor {index.fqn!r}, bytes "
            f"{info.offset}-{info.offset + info.length})"
        )
        want = stored.get(key)
        if want is None:
            return f"{where}: it has no checksum in {DIGESTS}"
        if (want["file"], want["offset"], want["length"]) != (
            info.relative_path,
            info.offset,
            info.length,
        ):
            return f"{where}: the index places it elsewhere than {DIGESTS} does"
        if _digest(folder / info.relative_path, info.offset, info.length) != want[ALGORITHM]:
            return f"{where}: its bytes do not match the {ALGORITHM} checksum written at the save"
    return None
