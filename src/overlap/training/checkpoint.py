"""Checkpoints: what a run saves and loads, when, and how a save stays atomic (and, optionally,
asynchronous).

What is saved (every tensor under its layout-independent name, as a chunk of its global tensor - see
`checkpoint_format.py`):
- `model.<param>`: the weights (this rank's TP / EP shard, the pipeline stage's layers, replicas
  deduplicated);
- `optimizer.{master,exp_avg,exp_avg_sq}.<param>`: Adam's state in parameter space (the distributed
  optimizer gathers its DP shards first), so it loads at another DP size or with the distributed
  optimizer on or off; the master only where the parameter is not fp32 itself;
- `rng.torch.rank<r>` (and `rng.cuda.rank<r>`): every rank's generator states, restored only at the
  same layout (Bridge ignores RNG state after a TP/PP change too);
- `train_state.json`: iteration, consumed samples, optimizer steps, the layout, the loss
  scaler's state and the count of steps skipped for an overflow (fp16); `run_config.yaml`.
The data position needs nothing more: sample i of iteration k is the data's sample k x global batch
+ i (mock data: a function of (seed, k, i); real data: of the files, split, seed and sequence
  length, not of the run's length), so a
run resumed at iteration K reads exactly the samples the uninterrupted run reads at K. A resume with
another global batch size would skip or repeat samples and is refused; another dataset configuration
is allowed and warned about.

Saves go to `iter_N.tmp/`, renamed once every rank's shards and rank 0's metadata are written, then
the tracker is updated: a job killed mid-save leaves the previous checkpoint as the latest. Every
stored tensor's SHA-256 goes into `digests.json` (`shard_digests.py`), and a load checks them, and
reads DCP's index without running code (`dcp_index.py`), before it reads any tensor. With
`async_save` the state is copied to host memory at the step boundary (DCP's stager) and written by a
background thread; its rank coordination runs on a dedicated gloo group (`groups.cpu_group`), apart
from the training's collectives, and rank 0 renames the folder once the write has completed - polled
at every step boundary, waited for by the next save and at the end. DCP's own control messages (plan
exchange) go through that group; they are the library's, not ours to trace.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from overlap.config.container import ConfigContainer
from overlap.errors import CheckpointError, NoSpaceError, agreed
from overlap.files import is_no_space, no_space
from overlap.optim.adam import STATE_KEYS, ParamStates, keeps_master
from overlap.parallel import comm, groups
from overlap.parallel.state import ParallelState
from overlap.training.checkpoint_format import (
    FORMAT_VERSION,
    TRAIN_STATE,
    Chunk,
    ChunkLoadPlanner,
    ChunkSavePlanner,
    check_chunks,
    check_storage,
    checkpoint_folder,
    complete_iterations,
    finalize_save,
    find_corrupt_shard,
    iteration_dir,
    locate_checkpoint,
    named_iteration,
    param_chunk,
    read_metadata,
    read_train_state,
    saved_iterations,
    temporary_dir,
    verify_shards,
)
from overlap.training.dcp_index import RestrictedReader
from overlap.training.save_lock import SaveFolderLock
from overlap.training.shard_digests import DIGESTS, DigestingWriter

log = logging.getLogger("overlap.checkpoint")


def _cause(exc: BaseException) -> str:
    """One line per failing rank: DCP's CheckpointException carries {rank: (exception,
    traceback)}."""
    failures = getattr(exc, "failures", None)
    if failures:
        return "; ".join(
            f"rank {r}: {_cause(e[0] if isinstance(e, tuple) else e)}"
            for r, e in sorted(failures.items())
        )
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _no_space(exc: BaseException) -> bool:
    """A full disk anywhere in a (DCP) failure: ENOSPC, or the torch writer's short-write enforce
    that it becomes."""
    failures = getattr(exc, "failures", None)
    if failures:
        return any(_no_space(e[0] if isinstance(e, tuple) else e) for e in failures.values())
    if is_no_space(exc):
        return True
    while exc is not None:
        if "unexpected pos" in str(exc) or "file write failed" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _remove_stale(path: Path) -> None:
    """Remove what an unfinished save left at `path`: its folder, or a link planted at its name
    (the link alone: what it points to is not ours)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def run_config_yaml(cfg: ConfigContainer) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


@dataclasses.dataclass
class _PendingSave:
    future: Future
    iteration: int
    train_state: dict
    started: float
    record: dict[str, float]


class Checkpointer:
    """Saves and loads this rank's part of the training state; one per run (collective: every rank
    builds it)."""

    def __init__(
        self, cfg: ConfigContainer, ps: ParallelState, chunks: Sequence[nn.Module], optimizer
    ) -> None:
        self.cfg, self.ps, self.optimizer = cfg, ps, optimizer
        self.ck = cfg.checkpoint
        # By checkpoint name: a tied embedding's copy on the last pipeline stage is saved and loaded
        # as the embedding (`tied_to`; both are the same tensor), so the checkpoint is the same at
        # every pipeline size
        self.params: dict[str, nn.Parameter] = {
            getattr(p, "tied_to", n): p for c in chunks for n, p in c.named_parameters()
        }
        self.group = groups.cpu_group()
        self.pending: _PendingSave | None = None
        self.last_saved: int | None = None  # the newest complete checkpoint
        # the newest save started (an asynchronous one may be in flight)
        self.last_requested: int | None = None
        # What saving and loading cost (the run summary and `bench/checkpoint.py` report it): per
        # save the time the training thread was blocked and the time until the checkpoint was
        # complete, and its size on disk.
        self.saves: list[dict[str, float]] = []
        self.load_ms: float | None = None
        # Retention deletes only this lineage's checkpoints (a fresh run starts one; a resume
        # continues the loaded checkpoint's), and never the one this run loaded (`protect`).
        self.lineage = uuid.uuid4().hex
        self.protect: tuple[int, ...] = ()
        # the checkpoint (or Hugging Face folder) this run started from, None for a fresh start
        self.loaded_from: Path | None = None
        self.lock = SaveFolderLock(self.ck.save) if self.ck.save and ps.rank == 0 else None

    # --- what is saved ----------------------------------------------------------------------------
    def _state_bytes(self) -> int:
        """What this rank writes per checkpoint (weights and optimizer state), in bytes."""

        def states(p) -> int:
            return (len(STATE_KEYS) - (0 if keeps_master(p) else 1)) if self.ck.save_optim else 0

        return sum(p.numel() * (p.element_size() + 4 * states(p)) for p in self.params.values())

    def _model_chunks(self) -> dict[str, Chunk]:
        return {f"model.{name}": param_chunk(p) for name, p in self.params.items()}

    def _optimizer_chunks(self, states: ParamStates) -> dict[str, Chunk]:
        out = {}
        for name, p in self.params.items():
            for key, value in states[p].items():
                out[f"optimizer.{key}.{name}"] = param_chunk(p, value)
        return out

    def _rng_chunks(self) -> dict[str, Chunk]:
        r = self.ps.rank
        out = {f"rng.torch.rank{r}": Chunk.whole(torch.get_rng_state())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out[f"rng.cuda.rank{r}"] = Chunk.whole(torch.cuda.get_rng_state())
        return out

    def _layout(self) -> dict:
        """The layout a checkpoint records (its RNG state is restored only on the same one), its
        virtual pipeline under the name checkpoints have always used."""
        out = dataclasses.asdict(self.ps.layout)
        out["vp"] = out.pop("vpp")
        return out

    # --- saving -----------------------------------------------------------------------------------
    def due(self, iteration: int) -> bool:
        """Save after `iteration` completed iterations (the interval; the end of training is the
        trainer's call)."""
        return bool(
            self.ck.save and self.ck.save_interval and iteration % self.ck.save_interval == 0
        )

    def save(self, iteration: int, first_nonfinite: int | None = None) -> None:
        """Write the state after `iteration` completed iterations (parameters must be in sync: no
        gather pending). `first_nonfinite`: this run's first iteration with a non-finite loss or
        gradient norm (1-based; `stopping.NonFiniteCount`), recorded so that retention keeps the
        last checkpoint saved before it."""
        if not self.ck.save:
            return
        start = time.perf_counter()
        # one save at a time: the previous asynchronous one completes (and is renamed) first
        self.wait()
        base = Path(self.ck.save)
        tmp = temporary_dir(base, iteration)
        if self.ps.rank == 0:
            _remove_stale(tmp)
            tmp.mkdir(parents=True)  # a fresh folder: fails if anything is still at its name
        # the folder exists (and holds nothing stale) before any rank writes
        comm.barrier(self.group)
        chunks = self._model_chunks()
        if self.ck.save_optim:
            chunks.update(self._optimizer_chunks(self.optimizer.param_states()))
        if self.ck.save_rng:
            chunks.update(self._rng_chunks())
        state = {k: c.tensor for k, c in chunks.items()}
        self.last_requested = iteration
        record: dict[str, float] = {"iteration": iteration}
        self.saves.append(record)
        t = self.cfg.train
        train_state = {
            "format_version": FORMAT_VERSION,
            "iteration": iteration,
            "lineage": self.lineage,
            "written_at": time.time(),
            "schedule": self._schedule(),
            "consumed_train_samples": iteration * t.global_batch_size,
            "optimizer_steps": self.optimizer.steps_taken(),
            "layout": self._layout(),
            "has_optimizer": self.ck.save_optim,
            "has_rng": self.ck.save_rng,
            "seed": t.seed,
            "global_batch_size": t.global_batch_size,
            "torch": torch.__version__,
            "dataset": dataclasses.asdict(self.cfg.dataset),
            "shard_digests": DIGESTS,  # written by the writer (shard_digests.py)
            "first_nonfinite_iteration": first_nonfinite,
            **self.optimizer.scaling_state(),
        }
        writer = DigestingWriter(str(tmp), sync_files=True)
        planner = ChunkSavePlanner(chunks)
        if self.ck.async_save:
            future = dcp.async_save(
                state, storage_writer=writer, planner=planner, process_group=self.group
            )
            self.pending = _PendingSave(future, iteration, train_state, start, record)
            record["blocked_ms"] = (time.perf_counter() - start) * 1e3
        else:
            try:
                dcp.save(state, storage_writer=writer, planner=planner, process_group=self.group)
            # DCP's collective failure is a BaseException
            except (Exception, CheckpointException) as exc:
                raise self._save_failed(iteration, exc) from exc
            self._finish(iteration, train_state, start, record)
            record["blocked_ms"] = record["complete_ms"]

    def _finish(
        self, iteration: int, train_state: dict, start: float, record: dict[str, float]
    ) -> None:
        """Every rank's shards are on disk: rank 0 completes the folder, renames it and moves the
        tracker."""
        if self.ps.rank == 0:
            try:
                final = finalize_save(
                    Path(self.ck.save),
                    iteration,
                    train_state,
                    run_config_yaml(self.cfg),
                    self.ck.most_recent_k,
                    self.protect,
                    self._suspect(train_state),
                )
            except OSError as exc:
                raise self._save_failed(iteration, exc) from exc
            record["size_mb"] = sum(f.stat().st_size for f in final.iterdir()) / 1e6
        record["complete_ms"] = (time.perf_counter() - start) * 1e3
        if self.ps.rank == 0:
            log.info(
                "saved checkpoint %s (iteration %d%s): %.1f MB in %.0f ms",
                final,
                iteration,
                ", asynchronously" if self.ck.async_save else "",
                record["size_mb"],
                record["complete_ms"],
            )
        self.last_saved = iteration

    def poll(self) -> None:
        """Step boundary: complete an asynchronous save whose write has finished (rank 0 renames
        it)."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is written and renamed."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as exc:
            raise self._save_failed(pending.iteration, exc) from exc
        self._finish(pending.iteration, pending.train_state, pending.started, pending.record)

    def _suspect(self, train_state: dict) -> int | None:
        """The checkpoint this run loaded from the save folder when the run went non-finite on its
        first iteration after it: not a good one to fall back to."""
        first = train_state["first_nonfinite_iteration"]
        loaded = self.protect[0] if self.protect else None
        return loaded if loaded is not None and first == loaded + 1 else None

    def _save_failed(self, iteration: int, exc: BaseException) -> CheckpointError | NoSpaceError:
        if _no_space(exc):
            sizes = [r["size_mb"] * 1e6 for r in self.saves if "size_mb" in r]
            need = (
                f"a checkpoint of this run takes {int(sizes[-1])} bytes"
                if sizes
                else f"this rank holds {self._state_bytes()} bytes of it"
            )
            return no_space(
                self.ck.save,
                f"checkpoint.save={self.ck.save}: the save of iteration {iteration} failed "
                f"({need})",
                "the previous checkpoint stays the latest; free space there or save to a larger "
                "folder, then resume.",
            )
        return CheckpointError(
            "checkpoint.save",
            self.ck.save,
            f"the save of iteration {iteration} failed ({_cause(exc)}); its temporary folder is "
            "left incomplete and the previous checkpoint stays the latest.",
            "check that the folder is writable and has space, then resume.",
        )

    # --- loading ----------------------------------------------------------------------------------
    def _source(self) -> tuple[Path, bool, str] | None:
        """(iteration folder, weights only, the setting that named it) to start from, or None
        (fresh start).

        `checkpoint.load` is a base folder (its tracker's iteration, or `ckpt_step`; without a
        tracker its newest complete checkpoint) or a checkpoint folder itself. One that holds no
        checkpoint is a fresh start only when it is this run's save folder (a restartable job's
        first start) or `pretrained_checkpoint` is set; else an error, so a wrong path never
        silently trains from scratch."""
        ck = self.ck
        if ck.load is not None:
            load = Path(ck.load)
            if ck.ckpt_step is None:
                folder = locate_checkpoint(load, "checkpoint.load")
            elif (load / ".metadata").exists():
                if named_iteration(load) != ck.ckpt_step:
                    raise CheckpointError(
                        "checkpoint.ckpt_step",
                        ck.ckpt_step,
                        f"checkpoint.load={load} is itself "
                        "a checkpoint folder; ckpt_step picks iter_<ckpt_step> inside a base "
                        "folder.",
                        f"set checkpoint.load={load.parent} to use ckpt_step, or drop ckpt_step.",
                    )
                folder = load
            else:
                folder = iteration_dir(load, ck.ckpt_step)
            if folder is not None:
                aside = folder.with_name(folder.name + ".old")
                # stopped while re-saving the same iteration
                if not folder.is_dir() and aside.is_dir():
                    folder = aside
                if not folder.is_dir():
                    found = saved_iterations(folder.parent)
                    raise CheckpointError(
                        "checkpoint.load",
                        str(folder),
                        "this iteration's folder does not exist "
                        f"(saved iterations there: {found or 'none'}).",
                        "set checkpoint.ckpt_step to one of them, or fix the tracker file.",
                    )
                return folder, ck.finetune, "checkpoint.load"
            if ck.exit_on_missing_checkpoint:
                raise CheckpointError(
                    "checkpoint.load",
                    ck.load,
                    "no checkpoint there (no tracker file) and "
                    "checkpoint.exit_on_missing_checkpoint is set.",
                    "point checkpoint.load at a folder with a checkpoint, or unset the flag.",
                )
            own = ck.save is not None and Path(ck.save).resolve() == load.resolve()
            if not own and ck.pretrained_checkpoint is None:
                raise CheckpointError(
                    "checkpoint.load",
                    ck.load,
                    "it holds no checkpoint (no .metadata, tracker file or iter_* folder) and is "
                    "not this run's checkpoint.save, so nothing would be resumed.",
                    "point it at <save> or <save>/iter_NNNNNNN of a run, set it to the "
                    "checkpoint.save folder (a restartable job), or unset it to start from "
                    "scratch.",
                )
        if ck.pretrained_checkpoint is not None:
            pretrained = "checkpoint.pretrained_checkpoint"
            return self._pretrained(Path(ck.pretrained_checkpoint)), True, pretrained
        if ck.load is not None and self.ps.rank == 0:
            log.info(
                "checkpoint.load=%s holds no checkpoint yet: training starts at iteration 0",
                ck.load,
            )
        return None

    def _pretrained(self, path: Path) -> Path:
        """A base folder (its tracker's latest), an iteration folder, or a Hugging Face folder
        (config.json)."""
        if (path / "config.json").exists():
            return path
        return checkpoint_folder(path, "checkpoint.pretrained_checkpoint")

    def load(self) -> int:
        """Claim the save folder and load the configured checkpoint into this rank's parameters and
        optimizer; return the iteration to continue from (0 for a fresh start or a weights-only
        load). On any failure the save folder's lock is given back."""
        try:
            return self._load()
        except BaseException:
            self.release()
            raise

    def _load(self) -> int:
        source = self._source()
        folder, weights_only, field = source if source is not None else (None, True, "")
        hf = folder is not None and (folder / "config.json").exists()
        train_state = read_train_state(folder) if folder is not None and not hf else None
        if train_state is not None:
            named = named_iteration(folder)
            if named is not None and named != int(train_state["iteration"]):
                raise CheckpointError(
                    "checkpoint.load",
                    str(folder),
                    f"its {TRAIN_STATE} says iteration {train_state['iteration']} but the folder's "
                    f"name says {named} (a renamed "
                    "or mixed-up folder).",
                    "restore the folder's own files, or load another iteration.",
                )
        resume = train_state is not None and not weights_only
        # Refusals that the training state alone decides come first, before any shard is read
        if resume:
            if self.ck.load_optim and not train_state.get("has_optimizer"):
                raise CheckpointError(
                    "checkpoint.load_optim",
                    True,
                    f"{folder} was saved without optimizer state (checkpoint.save_optim=false).",
                    "set checkpoint.load_optim=false to load the weights and start the optimizer "
                    "afresh.",
                )
            self._check_data_position(train_state, folder)
            self._check_schedule(train_state, folder)
            self.lineage = str(train_state.get("lineage") or self.lineage)
            if self.ck.save and folder.parent.resolve() == Path(self.ck.save).resolve():
                self.protect = (int(train_state["iteration"]),)
        self._claim_save_folder(int(train_state["iteration"]) if resume else 0)
        if folder is None:
            return 0
        self.loaded_from = folder
        start = time.perf_counter()
        if hf:  # Hugging Face weights (overlap.hf): weights only, iteration 0
            from overlap.hf.load import load_hf_weights

            load_hf_weights(self.cfg.resolved.model, self.params, folder, self.ps.rank)
            self.optimizer.load_param_states({}, 0)  # the masters from the loaded weights
            self.load_ms = (time.perf_counter() - start) * 1e3
            return 0
        want_optim = self.ck.load_optim and not weights_only
        metadata = read_metadata(folder, field)
        check_storage(folder, metadata)
        self._verify_shards(folder, metadata, train_state, field)
        chunks = self._model_chunks()
        states: ParamStates = {}
        if want_optim:
            # read into host memory, as the save gathers into it: three fp32 copies of every
            # local parameter on the device would be the save's spike again (37.5 GiB per rank at
            # Qwen3-30B-A3B EP16), at resume, beside the model; the optimizer copies its own
            # slots' pieces to the device
            for name, p in self.params.items():
                keys = STATE_KEYS if keeps_master(p) else STATE_KEYS[1:]
                states[p] = {k: torch.empty(p.shape, dtype=torch.float32) for k in keys}
                if (
                    keeps_master(p)
                    and f"optimizer.master.{name}" not in metadata.state_dict_metadata
                ):
                    # saved from fp32 parameters: the weights are the masters
                    del states[p]["master"]
            chunks.update(self._optimizer_chunks(states))
        same_layout = train_state.get("layout") == self._layout()
        load_rng = (
            self.ck.load_rng and not weights_only and train_state.get("has_rng") and same_layout
        )
        if load_rng:
            chunks.update(self._rng_chunks())
        self._agree(check_chunks(folder, metadata, chunks), folder)
        self._check_no_extra(metadata, folder)
        state = {k: c.tensor for k, c in chunks.items()}
        try:
            dcp.load(
                state,
                storage_reader=RestrictedReader(str(folder)),
                planner=ChunkLoadPlanner(chunks),
                process_group=self.group,
            )
        except (Exception, CheckpointException) as exc:
            bad = find_corrupt_shard(folder, metadata)
            raise CheckpointError(
                "checkpoint.load",
                bad or str(folder),
                f"reading the shards failed ({_cause(exc)}); the "
                "files are corrupt or were written by another build.",
                "load another iteration.",
            ) from exc
        step = int(train_state.get("optimizer_steps", 0)) if want_optim else 0
        # without optimizer state: masters from the loaded weights
        self.optimizer.load_param_states(states, step)
        if not weights_only:
            self.optimizer.load_scaling_state(train_state, with_scaler=want_optim)
            self._say_scaler_restart(train_state, want_optim)
        if load_rng:
            torch.set_rng_state(state[f"rng.torch.rank{self.ps.rank}"])
            if f"rng.cuda.rank{self.ps.rank}" in state:
                torch.cuda.set_rng_state(state[f"rng.cuda.rank{self.ps.rank}"])
        iteration = 0 if weights_only else int(train_state["iteration"])
        self.load_ms = (time.perf_counter() - start) * 1e3
        if self.ps.rank == 0:
            parts = (
                ["weights"] + (["optimizer"] if want_optim else []) + (["RNG"] if load_rng else [])
            )
            why = (
                ""
                if load_rng or not self.ck.load_rng or weights_only
                else f"; RNG state not restored: saved at layout {train_state.get('layout')}, "
                "this run is "
                f"{self._layout()}"
            )
            log.info(
                "loaded checkpoint %s (%s) in %.0f ms; training %s at iteration %d%s",
                folder,
                " + ".join(parts),
                self.load_ms,
                "starts" if weights_only else "resumes",
                iteration,
                why,
            )
        return iteration

    # --- the save folder --------------------------------------------------------------------------
    def _claim_save_folder(self, start: int) -> None:
        """Collective. Rank 0 takes the save folder's lock, checks that saving there from iteration
        `start` loses nothing (`_check_save_folder`) and removes the temporary folders of saves that
        never completed; any rank's refusal is raised on every rank."""
        if not self.ck.save:
            return
        shapes = {k: c.global_shape for k, c in self._model_chunks().items()}
        gathered = comm.all_gather_object(shapes, self.group)
        error: CheckpointError | None = None
        if self.ps.rank == 0:
            try:
                self.lock.acquire()
                self._check_save_folder(start, {k: v for d in gathered for k, v in d.items()})
                for p in Path(self.ck.save).glob("iter_*.tmp"):
                    log.warning(
                        "removing %s: a save that never completed (the job stopped while writing "
                        "it)",
                        p,
                    )
                    _remove_stale(p)
            except CheckpointError as exc:
                error = exc
        reports = comm.all_gather_object(
            None if error is None else (error.field, error.value, error.why, error.fix), self.group
        )
        first = next((r for r in reports if r is not None), None)
        if first is not None:
            raise agreed(CheckpointError(*first))

    def _check_save_folder(self, start: int, shapes: dict[str, tuple[int, ...]]) -> None:
        """Saving into `checkpoint.save` from iteration `start` deletes or overwrites nothing a user
        saved: no checkpoint folder there is newer than `start` (this run would overwrite it and
        move the tracker back), and the newest checkpoint there is of this model (unless
        `checkpoint.allow_other_model_in_save`)."""
        base = Path(self.ck.save)
        newer = [iteration_dir(base, i).name for i in saved_iterations(base) if i > start]
        if newer:
            fix = (
                "set checkpoint.load to this folder to resume them, or save into another (empty) "
                "folder"
                if start == 0
                else "save this run into another checkpoint.save folder, or move them away if "
                "they are unwanted"
            )
            raise CheckpointError(
                "checkpoint.save",
                str(base),
                f"it holds checkpoints newer than iteration {start}, where this run starts: "
                f"{', '.join(newer)}; saving here would overwrite them and "
                "move the tracker back.",
                f"{fix}.",
            )
        existing = complete_iterations(base)
        if not existing:
            return
        folder = iteration_dir(base, existing[-1])
        theirs = {
            k: tuple(md.size)
            for k, md in read_metadata(folder, "checkpoint.save").state_dict_metadata.items()
            if k.startswith("model.") and hasattr(md, "size")
        }
        differ = sorted(set(theirs) ^ set(shapes)) or sorted(
            k for k in shapes if tuple(shapes[k]) != theirs[k]
        )
        if not differ:
            return
        key = differ[0]
        what = (
            f"tensor {key!r} is {theirs[key] if key in theirs else 'absent'} there and "
            f"{tuple(shapes[key]) if key in shapes else 'absent'} in this model"
        )
        if self.ck.allow_other_model_in_save:
            log.warning(
                "checkpoint.save=%s holds another model's checkpoints (%s: %s); saving beside them "
                "(checkpoint.allow_other_model_in_save; retention never deletes them)",
                base,
                folder.name,
                what,
            )
            return
        raise CheckpointError(
            "checkpoint.save",
            str(base),
            f"it holds checkpoints of another model ({folder.name}: {what}); saving here would put "
            "two models in one folder and move its tracker.",
            "use another checkpoint.save folder, or set checkpoint.allow_other_model_in_save=true "
            "to save beside them.",
        )

    # --- the learning-rate schedule ---------------------------------------------------------------
    def _schedule(self) -> dict[str, Any]:
        """What the learning rate of every iteration is computed from (optim.adam.learning_rate)."""
        o, sc = self.cfg.optimizer, self.cfg.scheduler
        out = {
            "lr": o.lr,
            "lr_warmup_iters": sc.lr_warmup_iters,
            "lr_decay_style": sc.lr_decay_style,
        }
        if sc.lr_decay_style != "constant":
            out.update(
                min_lr=o.min_lr, lr_decay_iters=sc.lr_decay_iters or self.cfg.train.train_iters
            )
        return out

    def _check_schedule(self, train_state: dict, folder: Path) -> None:
        """A resume keeps the checkpoint's learning-rate schedule unless told otherwise (Megatron's
        rule and names): a mismatch is refused; `override_opt_param_scheduler` takes this run's
        values, `use_checkpoint_opt_param_scheduler` the checkpoint's."""
        saved, now = train_state.get("schedule"), self._schedule()
        if saved is None or saved == now:
            return
        diff = ", ".join(
            f"{k} {saved.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)
        )
        sc = self.cfg.scheduler
        if sc.override_opt_param_scheduler:
            if self.ps.rank == 0:
                log.warning(
                    "the learning-rate schedule differs from the checkpoint's (%s): this run's is "
                    "used (scheduler.override_opt_param_scheduler)",
                    diff,
                )
            return
        if sc.use_checkpoint_opt_param_scheduler:
            o = self.cfg.optimizer
            o.lr, sc.lr_warmup_iters, sc.lr_decay_style = (
                saved["lr"],
                saved["lr_warmup_iters"],
                saved["lr_decay_style"],
            )
            o.min_lr = saved.get("min_lr", o.min_lr)
            sc.lr_decay_iters = saved.get("lr_decay_iters", sc.lr_decay_iters)
            if self.ps.rank == 0:
                log.warning(
                    "the learning-rate schedule differs from the checkpoint's (%s): the "
                    "checkpoint's is used (scheduler.use_checkpoint_opt_param_scheduler)",
                    diff,
                )
            return
        keep = (
            " (to train longer on the same schedule keep its decay length: "
            "scheduler.lr_decay_iters="
            f"{saved['lr_decay_iters']})"
            if "lr_decay_iters" in saved
            else ""
        )
        key = (
            next(k for k in sorted(now) if saved.get(k) != now[k])
            if set(now) <= set(saved)
            else "lr_decay_style"
        )
        field = {"lr": "optimizer.lr", "min_lr": "optimizer.min_lr"}.get(key, f"scheduler.{key}")
        if key == "lr_decay_iters" and sc.lr_decay_iters is None:
            field = "train.train_iters"  # the decay length follows it
        raise CheckpointError(
            field,
            now[key],
            f"{folder} was trained with another learning-rate schedule ({diff}); resuming would "
            "change it mid-run.",
            f"resume with the checkpoint's values{keep}, or set "
            "scheduler.override_opt_param_scheduler=true (this run's schedule from here on) or "
            "scheduler.use_checkpoint_opt_param_scheduler=true (the checkpoint's).",
        )

    def _check_data_position(self, train_state: dict, folder: Path) -> None:
        """A resume continues at sample iteration x global batch: only right if the global batch is
        the same."""
        saved, now = train_state.get("global_batch_size"), self.cfg.train.global_batch_size
        if saved is not None and saved != now:
            raise CheckpointError(
                "train.global_batch_size",
                now,
                f"{folder} was trained with global batch {saved}: resuming at iteration "
                f"{train_state['iteration']} with {now} would skip or repeat "
                "samples (batch-size changes are not built).",
                f"resume with -gb {saved}, or start from its weights with "
                "checkpoint.finetune=true.",
            )
        data = dataclasses.asdict(self.cfg.dataset)
        if train_state.get("dataset", data) != data and self.ps.rank == 0:
            log.warning(
                "the dataset configuration differs from the checkpoint's (%s, now %s): training "
                "continues at sample %d of the new data",
                train_state.get("dataset"),
                data,
                int(train_state["iteration"]) * now,
            )

    def _verify_shards(self, folder: Path, metadata, train_state: dict, field: str) -> None:
        """Every rank checks its share of the shard checksums (`shard_digests`) before any tensor
        is read, and learns of any rank's mismatch; a checkpoint written before checksums were kept
        loads unverified, said once."""
        has, problem = verify_shards(
            folder,
            metadata,
            self.ps.rank,
            self.ps.layout.world_size,
            required=bool(train_state.get("shard_digests")),
        )
        problems = [p for p in comm.all_gather_object(problem, self.group) if p]
        if problems:
            raise agreed(
                CheckpointError(
                    field,
                    str(folder),
                    f"{problems[0]}: the checkpoint was corrupted or altered after it was "
                    "saved (nothing of it was loaded).",
                    "load another iteration (checkpoint.ckpt_step), or restore the folder from a "
                    "good copy.",
                )
            )
        if not has and self.ps.rank == 0:
            log.warning(
                "%s has no shard checksums (it was saved before they were written): its shards "
                "are loaded unverified",
                folder,
            )

    def _say_scaler_restart(self, train_state: dict, with_scaler: bool) -> None:
        """fp16 resumed from a checkpoint without the loss scaler's state (another precision, or
        without optimizer state): the scaler starts afresh, which changes the steps that follow,
        so it is said."""
        if self.optimizer.scaler is None or self.ps.rank != 0:
            return
        if train_state.get("loss_scaler") is None or not with_scaler:
            why = (
                "the checkpoint has no loss-scaler state (it was saved without loss scaling, e.g. "
                "bf16 or fp32)"
                if train_state.get("loss_scaler") is None
                else "its optimizer state is not loaded (checkpoint.load_optim=false)"
            )
            log.warning(
                "%s: the fp16 loss scaler restarts at scale %g, as in a fresh run; steps may be "
                "skipped for overflows while it settles",
                why,
                self.optimizer.loss_scale,
            )

    def _agree(self, problem: str | None, folder: Path) -> None:
        """Every rank learns of any rank's problem before anyone enters the load's collectives."""
        problems = [p for p in comm.all_gather_object(problem, self.group) if p]
        if problems:
            raise agreed(
                CheckpointError(
                    "checkpoint.load",
                    str(folder),
                    problems[0] + ".",
                    "load a checkpoint of this model (same sizes), or change the model "
                    "configuration to the one in its run_config.yaml.",
                )
            )

    def _check_no_extra(self, metadata, folder: Path) -> None:
        """The checkpoint holds no model tensor that this model lacks (e.g. more layers or experts
        by name)."""
        ours = set().union(
            *comm.all_gather_object(sorted(f"model.{n}" for n in self.params), self.group)
        )
        extra = sorted(
            k for k in metadata.state_dict_metadata if k.startswith("model.") and k not in ours
        )
        if extra:
            raise agreed(
                CheckpointError(
                    "checkpoint.load",
                    str(folder),
                    "the checkpoint holds tensors this model does not have: "
                    f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}.",
                    "load it with the model configuration in its run_config.yaml.",
                )
            )

    def close(self) -> None:
        """The end of the run: an asynchronous save in flight completes before the process group
        goes."""
        self.wait()

    def release(self) -> None:
        """Give the save folder's lock back (every exit path of the run; idempotent)."""
        if self.lock is not None:
            self.lock.release()

    def report(self) -> dict[str, Any]:
        """The run summary's `checkpoint` entry."""
        return {"async_save": self.ck.async_save, "saves": self.saves, "load_ms": self.load_ms}
