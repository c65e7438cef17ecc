"""Every file or folder a command will write, checked before anything starts (no rank, no benchmark
run).

Rules (one per kind of output):
- a FILE flag (`--metrics FILE` and its `FILE.comm.jsonl` / `FILE.summary.json` siblings,
  `--emit-slurm FILE`, `overlap bench --json FILE` / `--markdown FILE`): its folder must already
  exist and be writable, and the path must not be a folder or an unwritable file. A missing folder
  is an error, not created: a typo in a path should not leave new folders behind, and the fix
  (`mkdir -p`) is one command, named in the message;
- a DIR flag (`--trace DIR`): the folder is made (with its parents) when missing, as `mkdir -p`
  would, because writing a set of files into a new folder is what it asks for; an existing file
  there is an error;
- the logging folders (`logger.tensorboard_dir`, `logger.wandb_save_dir`) are DIRs;
- a checkpoint folder (`checkpoint.save`) is a DIR: made when missing; the folders read
  (`checkpoint.load`, `checkpoint.pretrained_checkpoint`) must be folders - a missing `load` folder
  is a fresh start only when it is the `save` folder (a restartable job's first start) or a
  pretrained checkpoint is set, and never under `checkpoint.exit_on_missing_checkpoint`; a missing
  pretrained one is an error;
- an empty value (`--metrics=`) is an error, never "no output";
- two flags may not name the same file;
- paths arrive expanded (`~`, `$VAR`, absolute: `overlap.launch.path_fields`), so this check and the
  ranks read the same path;
- a FILE that is a symbolic link is an error: outputs are written under a fresh name and renamed
  (`overlap.files`), never through a link.

Writability is probed by creating (and removing) a temporary file in the folder, so read-only mounts
and permissions are judged by the system itself (root may write where the mode bits say no). Each
problem is a ConfigError naming the flag, the path and the fix: exit 2, no traceback.

With `--emit-slurm` only the script is checked here: `--metrics` and `--trace` then name paths on
the cluster, which the ranks check when they start there.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from overlap.config.logger import wandb_save_dir
from overlap.errors import ConfigError

_EXAMPLE_NAMES = {
    "--metrics": "metrics.jsonl",
    "--emit-slurm": "job.sbatch",
    "--json": "bench.json",
    "--markdown": "bench.md",
}


def _error(flag: str, path: str, why: str, fix: str) -> ConfigError:
    return ConfigError(flag, path, why, fix)


def _probe_folder(flag: str, path: str, folder: Path) -> None:
    """The folder exists, is a folder, and a file can be created in it."""
    shown = str(folder) or "."
    if not folder.exists():
        raise _error(
            flag,
            path,
            f"the folder {shown} does not exist.",
            f"create it first (mkdir -p {shown}), or point {flag} at an existing folder.",
        )
    if not folder.is_dir():
        raise _error(
            flag, path, f"{shown} is a file, not a folder.", f"point {flag} into a folder."
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".overlap-write-check-", dir=folder)
    except OSError as exc:
        raise _error(
            flag,
            path,
            f"cannot write into the folder {shown} ({exc.strerror or exc}).",
            f"point {flag} at a writable folder, or fix its permissions.",
        ) from None
    os.close(fd)
    os.unlink(probe)


def _given(flag: str, path: str | None, what: str, example: str) -> Path | None:
    """The path of a flag that writes: None when the flag was not given; an empty value is an
    error."""
    if path is None:
        return None
    if not str(path).strip():
        raise _error(
            flag,
            path,
            "the path is empty, so nothing would be written.",
            f"give {what} (e.g. {flag} {example}), or omit {flag}.",
        )
    return Path(path)


def check_output_file(flag: str, path: str | None) -> Path | None:
    """A file the command will create or overwrite (None: the flag was not given)."""
    target = _given(flag, path, "a file name", "run.jsonl")
    if target is None:
        return None
    if target.is_symlink():
        raise _error(
            flag,
            path,
            f"it is a symbolic link (to {os.readlink(target)}); a run never writes through a link "
            "(one planted in a shared folder would make it overwrite any file it can write).",
            "give the real file's path, or remove the link.",
        )
    if target.is_dir():
        example = _EXAMPLE_NAMES.get(flag.split(" ")[0], "out")
        raise _error(
            flag,
            path,
            "this is a folder; the flag writes a file.",
            f"give a file name, e.g. {flag} {target / example}.",
        )
    _probe_folder(flag, path, target.parent)
    if target.exists() and not os.access(target, os.W_OK):
        raise _error(
            flag,
            path,
            "the file exists and cannot be overwritten (no write permission).",
            f"remove it, fix its permissions, or choose another {flag} path.",
        )
    return target


def check_output_dir(flag: str, path: str | None, files: tuple[str, ...] = ()) -> Path | None:
    """A folder the command writes `files` into; made (with its parents) when missing."""
    target = _given(flag, path, "a folder", "trace/")
    if target is None:
        return None
    if target.exists() and not target.is_dir():
        raise _error(
            flag,
            path,
            "this is a file; the flag writes a folder of files.",
            f"give a folder path (it is created when missing), e.g. {flag} {target}.d.",
        )
    if not target.exists():
        existing = next((p for p in target.parents if p.exists()), Path("."))
        if not existing.is_dir():
            raise _error(
                flag,
                path,
                f"{existing} is a file, so the folder cannot be made.",
                f"point {flag} somewhere else.",
            )
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _error(
                flag,
                path,
                f"the folder cannot be created ({exc.strerror or exc}).",
                f"point {flag} at a writable place, or create the folder first.",
            ) from None
    _probe_folder(flag, path, target)
    for name in files:
        if (target / name).is_dir():
            raise _error(
                flag,
                path,
                f"{target / name} is a folder, and the command writes a file there.",
                f"remove it, or choose another {flag} folder.",
            )
    return target


def _no_two_alike(outputs: dict[str, Path | None]) -> None:
    seen: dict[Path, str] = {}
    for flag, target in outputs.items():
        if target is None:
            continue
        key = target.resolve()
        if key in seen:
            raise _error(
                flag,
                str(target),
                f"{seen[key]} writes the same file.",
                f"give {flag} and {seen[key]} different paths.",
            )
        seen[key] = flag


TRACE_FILES = ("trace.json", "timeline.png")


def check_run_outputs(args) -> None:
    """`overlap run`: --metrics (and siblings), --trace, --emit-slurm; see the module docstring."""
    metrics = getattr(args, "metrics", None)
    trace = getattr(args, "trace", None)
    slurm = getattr(args, "emit_slurm", None)
    outputs: dict[str, Path | None] = {"--emit-slurm": check_output_file("--emit-slurm", slurm)}
    if slurm is not None:
        # The ranks will write these on the cluster: only an empty value is surely wrong here.
        for flag, value in (("--metrics", metrics), ("--trace", trace)):
            if value is not None and not str(value).strip():
                raise _error(
                    flag,
                    value,
                    "the path is empty, so nothing would be written.",
                    f"give a path, or omit {flag}.",
                )
        return
    outputs["--metrics"] = check_output_file("--metrics", metrics)
    if metrics is not None:
        for suffix in (".comm.jsonl", ".summary.json"):
            outputs[f"--metrics (its {suffix} file)"] = check_output_file(
                f"--metrics (its {suffix} file)", f"{metrics}{suffix}"
            )
    check_output_dir("--trace", trace, TRACE_FILES)
    _no_two_alike(outputs)


def check_checkpoint_paths(ck) -> None:
    """`overlap run` with a `checkpoint` section (config.checkpoint.CheckpointConfig); see the
    module docstring."""
    check_output_dir("checkpoint.save", ck.save)
    own = (
        ck.load is not None
        and ck.save is not None
        and Path(ck.load).resolve() == Path(ck.save).resolve()
    )
    load_required = ck.exit_on_missing_checkpoint or not (own or ck.pretrained_checkpoint)
    for field, path, required in (
        ("checkpoint.load", ck.load, load_required),
        ("checkpoint.pretrained_checkpoint", ck.pretrained_checkpoint, True),
    ):
        if path is None:
            continue
        target = Path(path)
        if target.exists() and not target.is_dir():
            raise _error(
                field,
                path,
                "this is a file; a checkpoint is a folder.",
                f"point {field} at the folder given as checkpoint.save, or at one of its iter_* "
                "folders.",
            )
        if required and not target.exists():
            raise _error(
                field,
                path,
                "the folder does not exist.",
                f"point {field} at an existing checkpoint"
                + (
                    ", or set it to the checkpoint.save folder (a restartable job)."
                    if field == "checkpoint.load"
                    else "."
                ),
            )


def check_logger_paths(lg, checkpoint_save: str | None) -> None:
    """`overlap run` with TensorBoard or W&B on (config.logger.LoggerConfig): their folders are
    DIRs (W&B's as its rule decides it: `config.logger.wandb_save_dir`)."""
    check_output_dir("logger.tensorboard_dir", lg.tensorboard_dir)
    if lg.wandb_project is not None:
        check_output_dir("logger.wandb_save_dir", wandb_save_dir(lg, checkpoint_save)[0])


def check_bench_outputs(args) -> None:
    """`overlap bench`: --json and --markdown, before the first run."""
    _no_two_alike(
        {
            "--json": check_output_file("--json", getattr(args, "json_out", None)),
            "--markdown": check_output_file("--markdown", getattr(args, "markdown", None)),
        }
    )
