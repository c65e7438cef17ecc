"""What we read from and write to a checkpoint folder cannot run code, follow a planted link, or
pass corruption off as training (issue 48).

- A `.metadata` carrying a pickle payload is refused, with nothing run, on every path that reads a
  folder: a resume, a pretrained start, a save folder's model check, `convert export`, and the
  index reader itself.
- Links planted at the lock's, the tracker's and its old temporary file's names are refused or
  replaced, never written through.
- Flipped shard bytes are named (file, tensor, byte range) before any tensor is read; a checkpoint
  written before checksums existed still resumes, said to be unverified; a deleted `digests.json`
  of a checkpoint that had one is refused.
- A run that goes non-finite keeps its last good checkpoint under `most_recent_k=1`, and one that
  goes non-finite on its first iteration after a load calls that checkpoint suspect.

Real files, real 1-rank worlds of the tiny dense model.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from overlap.errors import CheckpointError, NonFiniteError
from tests.configs import tiny_config
from tests.world import run_world

CONSTANT = ["scheduler.lr_decay_style=constant"]  # resumes may train longer on the same schedule


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(items: list[str], iters: int, poison_at: int | None = None):
    """Train the tiny dense model; (first iteration, losses, log lines) or the error's text.
    `poison_at`: a weight filled with NaN before that (0-based) iteration."""
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    lines = _Lines()
    logging.getLogger("overlap").addHandler(lines)
    try:
        cfg = tiny_config(False, "fp32", 2, items + CONSTANT, iters)
        trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
        if poison_at is not None:
            step, weight = trainer.train_step, next(iter(trainer.model.parameters()))

            def poisoned(it: int):
                if it == poison_at:
                    with torch.no_grad():
                        weight.fill_(float("nan"))
                return step(it)

            trainer.train_step = poisoned
        summary = trainer.train()
    except (CheckpointError, NonFiniteError) as exc:
        return str(exc)
    finally:
        logging.getLogger("overlap").removeHandler(lines)
    return summary.first_iteration, [r.lm_loss for r in summary.records], lines.lines


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A base folder with iter_0000001 and iter_0000002 of the tiny dense model."""
    folder = tmp_path_factory.mktemp("saved")
    run_world(1, _run, [f"checkpoint.save={folder}", "checkpoint.save_interval=1"], 2)
    return folder


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- no code from data ----------------------------------------------------------------------------
class _Payload:
    """Unpickled, it writes `marker`: proof that the index ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def _plant(folder: Path, marker: Path) -> None:
    """Every `.metadata` under `folder` becomes its own index plus a payload (plain pickle would run
    it and go on: the index is otherwise intact)."""
    for meta in folder.rglob(".metadata"):
        with open(meta, "rb") as f:
            index = pickle.load(f)
        index.planner_data = _Payload(marker)
        with open(meta, "wb") as f:
            pickle.dump(index, f)


def _export(load: str, out: str) -> str:
    from overlap.convert import export_hf

    try:
        export_hf(load, out)
    except CheckpointError as exc:
        return str(exc)
    return "exported"


def test_a_planted_pickle_payload_runs_on_no_path_that_reads_a_folder(saved, tmp_path):
    marker = tmp_path / "payload-ran"
    evil = _copy(saved, tmp_path / "evil")
    _plant(evil, marker)
    from overlap.training.checkpoint_format import read_metadata

    with pytest.raises(CheckpointError, match="builtins.exec") as err:
        read_metadata(evil / "iter_0000002")
    assert err.value.field == "checkpoint.load"
    # a resume; a pretrained start; a save folder whose newest checkpoint is checked for the model
    # (this run resumes iteration 2 from elsewhere into it); convert export
    save_into = _copy(evil, tmp_path / "save-into")
    shutil.rmtree(save_into / "iter_0000002")
    (save_into / "latest_checkpointed_iteration.txt").write_text("1\n")
    cases = {
        "resume": [f"checkpoint.load={evil}"],
        "pretrained": [f"checkpoint.pretrained_checkpoint={evil}"],
        "save folder": [f"checkpoint.load={saved}", f"checkpoint.save={save_into}"],
    }
    fields = {"resume": "checkpoint.load=", "pretrained": "checkpoint.pretrained_checkpoint="}
    for name, items in cases.items():
        (msg,) = run_world(1, _run, items, 3)
        assert isinstance(msg, str) and "builtins.exec" in msg and ".metadata" in msg, (name, msg)
        assert msg.startswith(fields.get(name, "checkpoint.save=")), (name, msg)
    (msg,) = run_world(1, _export, str(evil), str(tmp_path / "hf"))
    assert msg.startswith("--load=") and "builtins.exec" in msg
    assert not marker.exists()


def test_the_index_reader_admits_what_dcp_indexes_are_made_of_in_this_torch():
    """Every admitted global exists in this torch (the GPU machines' 2.11 has the same names), and
    a real index loads through it (the fixture's resumes above and below)."""
    from overlap.training.dcp_index import _ALLOWED

    for module, names in _ALLOWED.items():
        for name in names:
            assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


# --- no writes through links ----------------------------------------------------------------------
def test_links_planted_at_the_lock_and_tracker_names_are_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / ".overlap_save.lock").symlink_to(victim)
    (msg,) = run_world(1, _run, [f"checkpoint.save={locked}"], 1)
    assert "symbolic link" in msg and ".overlap_save.lock" in msg
    tracked = tmp_path / "tracked"
    tracked.mkdir()
    (tracked / "latest_checkpointed_iteration.txt").symlink_to(victim)
    (tracked / "latest_checkpointed_iteration.txt.tmp").symlink_to(victim)
    (tracked / "iter_0000001.tmp").symlink_to(
        tmp_path
    )  # a "stale save" link: removed, not followed
    first, _, _ = run_world(1, _run, [f"checkpoint.save={tracked}"], 1)[0]
    assert first == 0 and victim.read_text() == "precious\n"
    tracker = tracked / "latest_checkpointed_iteration.txt"
    assert not tracker.is_symlink() and tracker.read_text() == "1\n"
    assert (tmp_path / "locked").is_dir() and (tmp_path / "victim.txt").exists()


def test_the_file_writers_replace_a_link_and_never_open_an_existing_name(tmp_path):
    from overlap.data.indexed import IndexedDatasetWriter
    from overlap.files import create_replacing, write_replace

    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name, write in (
        ("summary.json", lambda p: write_replace(p, "{}")),
        ("metrics.jsonl", lambda p: create_replacing(p).close()),
    ):
        (tmp_path / name).symlink_to(victim)
        write(tmp_path / name)
        assert not (tmp_path / name).is_symlink() and victim.read_text() == "precious"
    (tmp_path / "data.bin").symlink_to(victim)
    with pytest.raises(FileExistsError):
        IndexedDatasetWriter(tmp_path / "data", "uint16")
    assert victim.read_text() == "precious"


# --- integrity ------------------------------------------------------------------------------------
def test_flipped_shard_bytes_are_named_before_anything_is_loaded(saved, tmp_path):
    base = _copy(saved, tmp_path / "flipped")
    shard = base / "iter_0000002" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    (msg,) = run_world(1, _run, [f"checkpoint.load={base}"], 3)
    assert "__0_0.distcp (tensor '" in msg and "bytes " in msg
    assert "do not match the sha256 checksum" in msg
    (msg,) = run_world(1, _export, str(base), str(tmp_path / "hf"))
    assert "__0_0.distcp (tensor '" in msg and "checksum" in msg
    # a deleted digests.json does not turn a checked checkpoint into an unchecked one
    (base / "iter_0000002" / "digests.json").unlink()
    (msg,) = run_world(1, _run, [f"checkpoint.load={base}"], 3)
    assert "digests.json is missing" in msg


def test_a_checkpoint_from_before_checksums_resumes_and_is_said_unverified(saved, tmp_path):
    """Today's main wrote no digests.json and no `shard_digests` in its training state (its
    `.metadata` is DCP's, as ours): such a checkpoint resumes, said to be unverified."""
    old = _copy(saved, tmp_path / "old")
    for it in ("iter_0000001", "iter_0000002"):
        (old / it / "digests.json").unlink(missing_ok=True)
        state_file = old / it / "train_state.json"
        state = json.loads(state_file.read_text())
        state.pop("shard_digests", None), state.pop("first_nonfinite_iteration", None)
        state_file.write_text(json.dumps(state))
    first, losses, lines = run_world(1, _run, [f"checkpoint.load={old}"], 3)[0]
    assert first == 2 and len(losses) == 1
    assert any("no shard checksums" in ln and "unverified" in ln for ln in lines), lines
    _, straight, _ = run_world(1, _run, [f"checkpoint.load={saved}"], 3)[0]
    assert losses == straight


def test_a_diverging_run_keeps_its_last_good_checkpoint_and_names_a_suspect_one(saved, tmp_path):
    base = _copy(saved, tmp_path / "diverging")
    keep1 = [
        f"checkpoint.load={base}",
        f"checkpoint.save={base}",
        "checkpoint.save_interval=1",
        "checkpoint.most_recent_k=1",
        "ddp.check_for_nan_in_grad=false",
    ]
    # resumes at 2; iterations 3 and 4 finite (saved), NaN from iteration 5 on (saved 5, 6)
    first, losses, lines = run_world(1, _run, keep1, 6, poison_at=4)[0]
    assert first == 2 and [math.isnan(x) for x in losses] == [False, False, True, True]
    names = sorted(p.name for p in base.iterdir() if p.name.startswith("iter_"))
    # the loaded 2, the last finite 4, the newest 6
    assert names == ["iter_0000002", "iter_0000004", "iter_0000006"], names
    state = json.loads((base / "iter_0000006" / "train_state.json").read_text())
    assert state["first_nonfinite_iteration"] == 5
    assert any("retention keeps iter_0000004" in ln for ln in lines)
    # non-finite on the first iteration after a load: that checkpoint is suspect
    nan_ok = "ddp.check_for_nan_in_grad=false"
    _, _, lines = run_world(1, _run, [f"checkpoint.load={saved}", nan_ok], 3, poison_at=2)[0]
    warning = next(ln for ln in lines if "training goes on" in ln)
    assert "first iteration after loading" in warning and "suspect" in warning
    assert "iter_0000002" in warning and "parameters may now be NaN" in warning
    checked = "ddp.check_for_nan_in_grad=true"
    (msg,) = run_world(1, _run, [f"checkpoint.load={saved}", checked], 3, poison_at=2)
    assert msg.startswith("ddp.check_for_nan_in_grad") and "suspect" in msg


@pytest.mark.parametrize("unset", ["OVERLAP_TEST_UNSET_48"])
def test_an_unset_variable_in_a_path_is_an_error_naming_it(unset):
    from overlap.errors import ConfigError
    from overlap.launch.path_fields import expand_path

    assert unset not in os.environ
    with pytest.raises(ConfigError, match=f"\\${unset}, which is not set"):
        expand_path("checkpoint.save", f"${unset}/ck")
    assert expand_path("checkpoint.save", "~/ck") == os.path.expanduser("~/ck")
    assert expand_path("checkpoint.save", "ck") == os.path.join(os.getcwd(), "ck")
