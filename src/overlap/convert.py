"""What `overlap convert import | export | roundtrip` does (the command itself: `overlap.commands`,
which imports this module only when it runs): Hugging Face folder <-> our checkpoint (the DCP
format).

- import: config.json -> ModelConfig, the model built once in one process (a gloo world of 1),
  filled by the same loader `checkpoint.pretrained_checkpoint=<HF folder>` uses, saved by the run's
  own `Checkpointer` (weights only, iteration 0). The source config.json is kept beside it as
  `hf_config.json`, so that export can write back the fields we do not model (token ids,
  max_position_embeddings, the dtype).
- export: reads our checkpoint's full tensors straight from DCP (no model is built; any layout wrote
  it), writes config.json and sharded safetensors with the on-disk per-expert HF names, in the
  source's dtype.
- roundtrip: import, export, compare every tensor (names, dtypes, shapes, bits); exit 0 only if all
  are identical. A fused (transformers-5) source is compared in the per-expert naming export writes.

The loaders shared with `overlap run` name that command's settings in their errors
(checkpoint.pretrained_checkpoint, checkpoint.load, checkpoint.save); here the user typed --hf /
--load / --out / --work, so `flag_errors` renames them.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml

from overlap.config.model import ModelConfig
from overlap.errors import CheckpointError
from overlap.files import is_no_space, no_space, write_replace
from overlap.hf.config_json import hf_config_from_model, model_config_from_hf, read_hf_config
from overlap.hf.names import mappings, to_hf, unfuse_experts
from overlap.hf.safetensors_io import SafetensorsReader, write_sharded
from overlap.parallel import groups
from overlap.training.checkpoint_format import (
    RUN_CONFIG,
    TRAIN_STATE,
    Chunk,
    ChunkLoadPlanner,
    check_storage,
    checkpoint_folder,
    iteration_dir,
    read_metadata,
    saved_iterations,
    verify_shards,
)
from overlap.training.dcp_index import RestrictedReader

log = logging.getLogger("overlap.hf")
HF_CONFIG = "hf_config.json"


@contextmanager
def single_process() -> Iterator[None]:
    """A gloo world of one process for the Checkpointer's collectives (nothing if a world exists
    already)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        groups.forget_groups()
        dist.destroy_process_group()


@contextmanager
def flag_errors(flag: str, *fields: str) -> Iterator[None]:
    """A CheckpointError naming one of `fields` (a setting of `overlap run`) is re-raised naming
    `flag`, the flag the user gave this command, so that the message points at something on their
    command line."""
    try:
        yield
    except CheckpointError as exc:
        if exc.field not in fields:
            raise
        raise CheckpointError(flag, exc.value, exc.why, exc.fix) from exc


def output_folder(path: str | Path, flag: str, create: bool = True) -> Path:
    """`path` as a folder to write, created if missing (with `create=False` only checked, so that a
    command failing on its input leaves nothing behind): a file in its place or above it, or an
    unwritable parent, is the user's to fix, said before any work is done rather than as an OSError
    traceback halfway through."""
    folder = Path(path)
    existing = next((p for p in (folder, *folder.absolute().parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CheckpointError(
            flag,
            str(path),
            f"{existing} is a file, not a folder.",
            "give a folder path (new or existing), not a file.",
        )
    if not create:
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            flag,
            str(path),
            f"the folder cannot be created ({type(exc).__name__}: {exc.strerror}).",
            "give a folder path you can write.",
        ) from None
    return folder


@dataclass
class _NoOptimizer:
    """What `Checkpointer.save` asks of an optimizer when no optimizer state is saved: the step
    count (0) and the loss-scaling state (none: an import has taken no step)."""

    def steps_taken(self) -> int:
        return 0

    def scaling_state(self) -> dict:
        return {"skipped_iterations": 0, "loss_scaler": None}


def import_hf(
    hf_dir: str | Path, out: str | Path, seq_length: int | None = None, out_flag: str = "--out"
) -> Path:
    """HF folder -> our checkpoint in `out` (iteration 0, weights only); returns the iteration
    folder. `out` may hold an earlier import (iteration 0 is saved again) but no other iteration:
    the tracker would then point at the import and a run resuming from that folder would silently
    restart from these weights."""
    from overlap.config import ConfigContainer
    from overlap.config.checkpoint import CheckpointConfig
    from overlap.hf.load import load_hf_weights
    from overlap.model.gpt import model_chunks
    from overlap.parallel.state import ParallelState
    from overlap.training.checkpoint import Checkpointer

    with flag_errors("--hf", "checkpoint.pretrained_checkpoint"):
        hf = read_hf_config(hf_dir)
    existing = saved_iterations(out) if output_folder(out, out_flag, create=False).is_dir() else []
    others = [i for i in existing if i != 0]
    if others:
        raise CheckpointError(
            out_flag,
            str(out),
            f"the folder holds checkpoints of iterations {others}; importing "
            "there would make iteration 0 the latest.",
            "import into a new or empty folder.",
        )
    cfg = ConfigContainer(
        model=model_config_from_hf(hf, seq_length),
        checkpoint=CheckpointConfig(save=str(out), save_optim=False, save_rng=False),
    )
    with single_process():
        res = cfg.finalize(1, on_cuda=False)  # built and saved on the CPU, never run here
        ps = ParallelState(res.layout)
        chunks = model_chunks(res.model, ps, res.pipeline, res.overlap, res.precision, res.kernels)
        with flag_errors("--hf", "checkpoint.pretrained_checkpoint"):
            load_hf_weights(
                res.model, {n: p for c in chunks for n, p in c.named_parameters()}, hf_dir
            )
        output_folder(out, out_flag)
        with flag_errors(out_flag, "checkpoint.save"):
            checkpointer = Checkpointer(cfg, ps, chunks, _NoOptimizer())
            checkpointer.save(0)
            checkpointer.close()
    folder = iteration_dir(out, 0)
    write_replace(folder / HF_CONFIG, json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return folder


def saved_model_config(folder: Path, flag: str = "--load") -> ModelConfig:
    """The model section of the checkpoint's run_config.yaml (its architecture; the layout no longer
    matters)."""
    try:
        section = yaml.safe_load((folder / RUN_CONFIG).read_text())["model"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
        raise CheckpointError(
            flag,
            str(folder / RUN_CONFIG),
            f"the run configuration cannot be read ({type(exc).__name__}).",
            "export a complete overlap checkpoint.",
        ) from None
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in section.items() if k in known})


def read_full_model(folder: Path) -> dict[str, torch.Tensor]:
    """Every `model.*` tensor of the checkpoint, whole (DCP reads the chunks any layout wrote)."""
    metadata = read_metadata(folder)
    check_storage(folder, metadata)
    has, problem = verify_shards(folder, metadata, 0, 1, required=_digests_written(folder))
    if problem is not None:
        raise CheckpointError(
            "checkpoint.load",
            str(folder),
            f"{problem}: the checkpoint was corrupted or altered after it was saved.",
            "export another iteration, or restore the folder from a good copy.",
        )
    if not has:
        log.warning(
            "%s has no shard checksums (it was saved before they were written): exported "
            "unverified",
            folder,
        )
    chunks = {
        key: Chunk.whole(torch.empty(tuple(md.size), dtype=md.properties.dtype))
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    state = {k: c.tensor for k, c in chunks.items()}
    dcp.load(state, storage_reader=RestrictedReader(str(folder)), planner=ChunkLoadPlanner(chunks))
    return {k[len("model.") :]: t for k, t in state.items()}


def _digests_written(folder: Path) -> bool:
    """Whether the checkpoint's training state says its save wrote shard checksums."""
    try:
        return bool(json.loads((folder / TRAIN_STATE).read_text()).get("shard_digests"))
    except (OSError, ValueError, AttributeError):
        return False


def _source_hf_config(folder: Path, flag: str) -> dict | None:
    """The `hf_config.json` import kept beside the checkpoint (None for a checkpoint a training run
    wrote)."""
    path = folder / HF_CONFIG
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            flag,
            str(path),
            f"the imported config.json copy cannot be read ({type(exc).__name__}).",
            f"delete {path} (export then writes a config.json from "
            "the model alone) or import again.",
        ) from None


def check_no_weights(hf_dir: str | Path, flag: str) -> None:
    """Refuse an export folder that already holds weights: a stale index or shard beside the new
    files would be what a loader reads (transformers prefers model.safetensors, our reader the
    index), silently other weights."""
    folder = output_folder(hf_dir, flag, create=False)
    weights = (".safetensors", ".safetensors.index.json")
    old = (
        sorted(p.name for p in folder.iterdir() if p.name.endswith(weights))
        if folder.is_dir()
        else []
    )
    if old:
        raise CheckpointError(
            flag,
            str(hf_dir),
            f"the folder already holds weights ({', '.join(old[:3])}"
            f"{' ...' if len(old) > 3 else ''}), which would mix with the export.",
            "export into a new or empty folder, or delete those files first.",
        )


def export_hf(
    load: str | Path,
    hf_dir: str | Path,
    dtype: str | None = None,
    load_flag: str = "--load",
    hf_flag: str = "--hf",
) -> list[str]:
    """Our checkpoint -> HF folder (config.json + safetensors, per-expert names); returns the files
    written."""
    folder = checkpoint_folder(load, load_flag)
    cfg = saved_model_config(folder, load_flag)
    base = _source_hf_config(folder, load_flag)
    dtype = dtype or (base or {}).get("dtype") or (base or {}).get("torch_dtype") or "float32"
    target = getattr(torch, dtype)
    check_no_weights(hf_dir, hf_flag)
    with single_process(), flag_errors(load_flag, "checkpoint.load"):
        ours = read_full_model(folder)
    out: dict[str, torch.Tensor] = {}
    for m in mappings(cfg):
        full = ours.pop(m.ours, None)
        if full is None:
            raise CheckpointError(
                load_flag,
                str(folder),
                f"tensor model.{m.ours} is missing.",
                "export a complete checkpoint of a Qwen3 / Qwen3-MoE model.",
            )
        out.update({k: v.to(target).contiguous() for k, v in to_hf(m, full, cfg).items()})
    if ours:
        raise CheckpointError(
            load_flag,
            str(folder),
            f"tensors without a Hugging Face name: {sorted(ours)[:4]}.",
            "export a Qwen3 / Qwen3-MoE model.",
        )
    config = hf_config_from_model(cfg, dtype, base)
    folder_out = output_folder(hf_dir, hf_flag)
    files: list[str] = []
    try:
        files = write_sharded(folder_out, out)
        write_replace(
            folder_out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n"
        )
    except Exception as exc:  # safetensors' own error type carries a full disk too
        for name in files:
            (folder_out / name).unlink(missing_ok=True)
        if is_no_space(exc):
            raise no_space(
                hf_dir,
                f"{hf_flag} {hf_dir}: writing the export of {folder} failed",
                "no file of the export is left there.",
            ) from None
        raise
    return files + ["config.json"]


def per_expert_tensors(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder, fused experts expanded to the per-expert naming (bits
    unchanged)."""
    reader = SafetensorsReader(hf_dir)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(reader.names()):
        out.update(unfuse_experts(name, reader.read(name)))
    return out


def compare_folders(a: str | Path, b: str | Path) -> list[str]:
    """What differs between two HF folders' tensors (and the models their config.json files
    describe)."""
    left, right = per_expert_tensors(a), per_expert_tensors(b)
    diffs = []
    for folder, tensors in ((a, left), (b, right)):
        # A tied model's stray lm_head copy (what import reads over, as transformers does) is not a
        # tensor of its own: it must be the embedding, bit for bit, and is then left out, as export
        # leaves it out.
        stray = tensors.get("lm_head.weight")
        if stray is not None and read_hf_config(folder).get("tie_word_embeddings", False):
            embedding = tensors.get("model.embed_tokens.weight")
            if (
                embedding is None
                or stray.dtype != embedding.dtype
                or not torch.equal(stray, embedding)
            ):
                diffs.append(
                    f"{folder}: lm_head.weight is not the tied embedding model.embed_tokens.weight"
                )
            del tensors["lm_head.weight"]
    diffs += [f"only in {a}: {n}" for n in sorted(left.keys() - right.keys())]
    diffs += [f"only in {b}: {n}" for n in sorted(right.keys() - left.keys())]
    for name in sorted(left.keys() & right.keys()):
        x, y = left[name], right[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            diffs.append(f"{name}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
        elif not torch.equal(
            x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y
        ):
            diffs.append(
                f"{name}: values differ (max abs "
                f"{(x.double() - y.double()).abs().max().item():.3g})"
            )
    ca, cb = (model_config_from_hf(read_hf_config(f)).architecture for f in (a, b))
    if ca != cb:
        diffs.append(f"config.json describes another model: {ca} vs {cb}")
    return diffs


def roundtrip(hf_dir: str | Path, work: str | Path | None = None) -> tuple[int, list[str]]:
    """Import, export, compare: (tensors compared, differences; empty if bit-exact)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = output_folder(work or tmp, "--work")
        import_hf(hf_dir, base / "ckpt", out_flag="--work")
        export_hf(base / "ckpt", base / "hf", load_flag="--work", hf_flag="--work")
        with flag_errors("--hf", "checkpoint.pretrained_checkpoint"):
            return len(per_expert_tensors(hf_dir)), compare_folders(hf_dir, base / "hf")
