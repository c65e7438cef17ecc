"""How a checkpoint lies on disk: DCP shards addressed by layout-independent names, and the folders
around them.

    <save>/latest_checkpointed_iteration.txt    the tracker (Megatron's name): the newest
                                                complete iteration, written last
    <save>/iter_0000010/                        one folder per saved iteration (iter_{:07d})
        __<rank>_0.distcp  .metadata            torch.distributed.checkpoint shards, their index
        digests.json                            a SHA-256 per stored tensor and of .metadata
                                                (shard_digests.py)
        train_state.json                        iteration, consumed samples, optimizer steps, the
                                                layout that wrote it (+ fp16: the loss scaler)
        run_config.yaml                         the resolved run configuration
    <save>/iter_0000020.tmp/                    a save in progress (renamed when complete; left
                                                over if the job died)

Every tensor is stored as a chunk of its *global* tensor: the key is the parameter's name (the same
in every layout: `layers.5.` on whichever pipeline rank holds layer 5, stacked experts), the global
shape is the unsharded one and the chunk's offsets say where this rank's TP / EP shard sits. DCP's
metadata then describes whole tensors, and a load at another layout reads just the overlapping
pieces into each rank's own shards. Plain DCP cannot express that for ordinary tensors (it would
store every rank's shard as a whole tensor of the shard's shape), and DTensor would need one device
mesh per pipeline stage and expert group; the two planners below add the offsets to DCP's own plans.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from overlap.errors import CheckpointError
from overlap.files import write_replace
from overlap.training.dcp_index import ForeignGlobal, RestrictedReader
from overlap.training.shard_digests import DIGESTS, read_digests, verify_index, verify_items

TRACKER = "latest_checkpointed_iteration.txt"
TRAIN_STATE = "train_state.json"
RUN_CONFIG = "run_config.yaml"
FORMAT_VERSION = 1
_ITER = re.compile(r"^iter_(\d{7})$")
_NAMED = re.compile(r"^iter_(\d{7})(?:\.old)?$")

log = logging.getLogger("overlap.checkpoint")


def iteration_dir(base: str | os.PathLike, iteration: int) -> Path:
    return Path(base) / f"iter_{iteration:07d}"


def temporary_dir(base: str | os.PathLike, iteration: int) -> Path:
    return Path(base) / f"iter_{iteration:07d}.tmp"


@dataclass(frozen=True)
class Chunk:
    """`tensor` is the piece of the global tensor (`global_shape`) that starts at `offsets`."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Chunk:
        return cls(tensor, tuple(tensor.shape), (0,) * tensor.dim())


def param_chunk(param: torch.Tensor, tensor: torch.Tensor | None = None) -> Chunk:
    """Where `param` (or `tensor`, a state of the same shape) sits in its global tensor, from its
    shard mark (`layers/init.py`: slice `index` of `count` along `dim`)."""
    shard = getattr(param, "shard", None)
    data = param.detach() if tensor is None else tensor
    if shard is None:
        return Chunk.whole(data)
    shape, offsets = list(param.shape), [0] * param.dim()
    offsets[shard.dim] = shard.index * shape[shard.dim]
    shape[shard.dim] *= shard.count
    return Chunk(data, tuple(shape), tuple(offsets))


class ChunkSavePlanner(DefaultSavePlanner):
    """DCP's planner with every tensor written as its chunk of the global tensor (replicas
    deduplicated by DCP)."""

    def __init__(self, chunks: dict[str, Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, chunk in self.chunks.items():
            t = chunk.tensor
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size(chunk.offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(chunk.offsets), t.size()),
                        properties=TensorProperties.create_from_tensor(t),
                        size=torch.Size(chunk.global_shape),
                    ),
                )
            )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn]


class ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads into every chunk the overlapping pieces of whatever chunks the checkpoint holds (any
    layout)."""

    def __init__(self, chunks: dict[str, Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, chunk in self.chunks.items():
            stored = self.metadata.state_dict_metadata[key]
            local = ChunkStorageMetadata(torch.Size(chunk.offsets), chunk.tensor.size())
            items += create_read_items_for_chunk_list(key, stored, [local])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


# --- folders, tracker, validation -----------------------------------------------------------------
def read_tracker(base: str | os.PathLike) -> int | None:
    """The newest complete iteration recorded in `base`, None if the folder holds no checkpoint
    yet."""
    path = Path(base) / TRACKER
    if not path.exists():
        return None
    text = path.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(
            "checkpoint.load",
            str(path),
            f"the tracker file holds {text!r}, not an iteration number.",
            f"write the iteration to load into {path}, or set checkpoint.ckpt_step.",
        )
    return int(text)


def checkpoint_folder(path: str | os.PathLike, field: str) -> Path:
    """What a checkpoint path names (`locate_checkpoint`), or an error saying what it must be;
    `field` names the setting or flag in the error."""
    folder = locate_checkpoint(path, field)
    if folder is None:
        raise CheckpointError(
            field,
            str(path),
            "neither a checkpoint folder (.metadata) nor a base folder with a checkpoint.",
            "point it at <save> or <save>/iter_NNNNNNN of an overlap run.",
        )
    return folder


def locate_checkpoint(path: str | os.PathLike, field: str) -> Path | None:
    """The checkpoint a path names: an iteration folder as given (it holds `.metadata`); a base
    folder's tracker iteration; a base folder without its tracker: its newest complete `iter_*`
    (said in a warning - a lost tracker must not make a run start afresh over its checkpoints). None
    when the path holds no checkpoint at all."""
    path = Path(path)
    if (path / ".metadata").exists():
        return path
    iteration = read_tracker(path)
    if iteration is not None:
        return iteration_dir(path, iteration)
    complete = complete_iterations(path)
    if complete:
        log.warning(
            "%s has no tracker file (%s) but complete checkpoints %s: using the newest, iteration "
            "%d",
            path,
            TRACKER,
            [iteration_dir(path, i).name for i in complete],
            complete[-1],
        )
        return iteration_dir(path, complete[-1])
    partial = saved_iterations(path)
    if partial:
        raise CheckpointError(
            field,
            str(path),
            f"it has no tracker file and none of its checkpoint folders "
            f"{[iteration_dir(path, i).name for i in partial]} is complete (.metadata and "
            f"{TRAIN_STATE}).",
            "restore the missing files, or point it at another checkpoint.",
        )
    return None


def saved_iterations(base: str | os.PathLike) -> list[int]:
    """Checkpoint folders in `base` (temporary folders of unfinished saves excluded), oldest
    first."""
    if not Path(base).is_dir():
        return []
    found = (_ITER.match(p.name) for p in Path(base).iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def is_complete(folder: Path) -> bool:
    return (folder / ".metadata").is_file() and (folder / TRAIN_STATE).is_file()


def complete_iterations(base: str | os.PathLike) -> list[int]:
    """Checkpoints in `base` that hold their index and training state, oldest first."""
    return [i for i in saved_iterations(base) if is_complete(iteration_dir(base, i))]


def named_iteration(folder: Path) -> int | None:
    """The iteration a checkpoint folder's name says (`iter_0000010`, or its `.old` copy), None for
    another name."""
    m = _NAMED.match(folder.name)
    return int(m.group(1)) if m else None


def finalize_save(
    base: Path,
    iteration: int,
    train_state: dict,
    run_config: str,
    keep: int,
    protect: tuple[int, ...] = (),
    suspect: int | None = None,
) -> Path:
    """Rank 0, after every rank's shards are written: the training state and configuration into the
    temporary folder, the folder renamed to its final name, then the tracker - so an interrupted
    save never replaces the previous checkpoint, and the tracker only ever names a complete one.
    Then retention (`prune`). Returns the final folder."""
    tmp, final = temporary_dir(base, iteration), iteration_dir(base, iteration)
    write_replace(tmp / TRAIN_STATE, json.dumps(train_state, indent=1, sort_keys=True) + "\n")
    write_replace(tmp / RUN_CONFIG, run_config)
    old = None
    # the same iteration saved again (a resumed run that stopped at the same step): the old
    if final.exists():
        # folder moves aside, so the tracker never names a missing one
        old = base / f"iter_{iteration:07d}.old"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(base)
    write_replace(base / TRACKER, f"{iteration}\n")
    _fsync_dir(base)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep > 0:
        prune(base, keep, train_state["lineage"], (iteration, *protect), suspect)
    return final


def prune(
    base: Path, keep: int, lineage: str, protect: tuple[int, ...], suspect: int | None = None
) -> list[int]:
    """Retention (`checkpoint.most_recent_k`): of the complete checkpoints in `base` that belong to
    `lineage` (this run and the runs it resumed), keep the `keep` newest by when they were written
    and delete the rest - never one in `protect` (the one just saved, the one this run loaded),
    never another run's. Once the newest has been saved after its run went non-finite, the newest
    one saved before that (its `first_nonfinite_iteration` unset; a checkpoint from before the
    field counts as good) is kept too - except `suspect`, the one this run loaded and went
    non-finite right after: retention never leaves only checkpoints of a diverged model. Returns
    the deleted iterations."""
    ours = []
    for it in complete_iterations(base):
        try:
            state = json.loads((iteration_dir(base, it) / TRAIN_STATE).read_text())
        except (OSError, ValueError):
            continue  # unreadable: not provably ours, so kept
        if isinstance(state, dict) and state.get("lineage") == lineage:
            finite = state.get("first_nonfinite_iteration") is None
            ours.append((float(state.get("written_at", 0.0)), it, finite))
    ours.sort()
    if ours and not ours[-1][2]:
        good = [it for _, it, finite in ours if finite and it != suspect]
        if good:
            protect = (*protect, good[-1])
            log.warning(
                "retention keeps %s: the last checkpoint saved before the run went non-finite",
                iteration_dir(base, good[-1]).name,
            )
    doomed = [it for _, it, _ in ours[:-keep] if it not in protect]
    for it in doomed:
        shutil.rmtree(iteration_dir(base, it), ignore_errors=True)
    return doomed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_train_state(folder: Path) -> dict:
    path = folder / TRAIN_STATE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            "checkpoint.load",
            str(folder),
            f"{path.name} is missing: this is not a complete "
            "overlap checkpoint (an interrupted save is renamed only once complete).",
            "load another iteration (checkpoint.ckpt_step) or the tracker's latest.",
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            "checkpoint.load",
            str(path),
            f"the training state cannot be read ({exc.__class__.__name__}: {exc}).",
            "load another iteration.",
        ) from None
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            "checkpoint.load",
            str(path),
            f"format version {state.get('format_version')!r}; this build reads version "
            f"{FORMAT_VERSION}.",
            "load it with the version that wrote it.",
        )
    return state


def read_metadata(folder: Path, field: str = "checkpoint.load") -> Metadata:
    """DCP's index of the folder, read without running code from it (`dcp_index`), or a clear error
    naming the file (and `field`, the setting that named the folder)."""
    try:
        return RestrictedReader(str(folder)).read_metadata()
    except ForeignGlobal as exc:
        raise CheckpointError(
            field,
            str(folder / ".metadata"),
            f"the DCP index names {exc.qualname}, which is no part of a checkpoint index: "
            "unpickling it would run code, so the folder is refused (nothing of it was run).",
            "load a checkpoint from a source you trust; delete this one if you did not write it.",
        ) from None
    except FileNotFoundError:
        raise CheckpointError(
            field,
            str(folder / ".metadata"),
            "the DCP index is missing.",
            "load another iteration; this folder is not a complete checkpoint.",
        ) from None
    except Exception as exc:  # unpickling a torn or corrupt index raises many kinds
        raise CheckpointError(
            field,
            str(folder / ".metadata"),
            f"the DCP index is truncated or corrupt ({exc.__class__.__name__}).",
            "load another iteration.",
        ) from None


def verify_shards(
    folder: Path, metadata: Metadata, rank: int, world: int, required: bool
) -> tuple[bool, str | None]:
    """(whether the folder has shard checksums, the first problem with this rank's share of them or
    None); `required`: its training state says they were written, so a missing file is a problem,
    not an old checkpoint (`shard_digests`)."""
    try:
        digests = read_digests(folder)
    except (OSError, ValueError) as exc:
        return True, f"{folder / DIGESTS} cannot be read ({exc.__class__.__name__}: {exc})"
    if digests is None:
        return False, (f"{folder / DIGESTS} is missing (the save wrote one)" if required else None)
    return True, verify_index(folder, digests) or verify_items(
        folder, metadata, digests, rank, world
    )


def check_storage(folder: Path, metadata: Metadata) -> None:
    """Every shard file the index points into exists and is long enough (a truncated copy is named
    here, not in a deserialisation error halfway through the load)."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = folder / name
        if not path.exists():
            raise CheckpointError(
                "checkpoint.load",
                str(path),
                "a shard file of the checkpoint is missing.",
                "copy the whole iteration folder, or load another iteration.",
            )
        if path.stat().st_size < size:
            raise CheckpointError(
                "checkpoint.load",
                str(path),
                f"the shard file is truncated ({path.stat().st_size} of {size} bytes).",
                "copy the whole iteration folder, or load another iteration.",
            )


def find_corrupt_shard(folder: Path, metadata: Metadata) -> str | None:
    """After a load failed: the first stored tensor whose bytes do not deserialise, as "<file>
    (tensor <key>)", so the error names the file; None if every one reads (the failure was
    elsewhere). Only on the failure path: it reads the whole checkpoint."""
    for index, info in (metadata.storage_data or {}).items():
        if getattr(info, "transform_descriptors", None):
            continue  # stored through a transform (compression): not ours to decode by hand
        path = folder / info.relative_path
        try:
            with open(path, "rb") as f:
                f.seek(info.offset)
                torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        except Exception:  # any failure to read it back is the corruption we look for
            return f"{path} (tensor {index.fqn!r})"
    return None


def check_chunks(folder: Path, metadata: Metadata, chunks: dict[str, Chunk]) -> str | None:
    """The first reason these chunks cannot be read from the checkpoint (a missing tensor, another
    global shape or dtype), None if they can."""
    stored = metadata.state_dict_metadata
    for key, chunk in chunks.items():
        md = stored.get(key)
        if md is None:
            return f"tensor {key!r} is not in the checkpoint {folder}"
        if not isinstance(md, TensorStorageMetadata):
            return f"{key!r} in the checkpoint {folder} is not a tensor"
        if tuple(md.size) != chunk.global_shape:
            return (
                f"tensor {key!r} has shape {tuple(md.size)} in the checkpoint {folder} but "
                f"{chunk.global_shape} "
                "in this model (a different model configuration)"
            )
    return None
