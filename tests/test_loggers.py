"""Experiment logging: TensorBoard and W&B get the `--metrics` scalars, read back from what they
wrote; W&B's mode; a missing extra and the logger section's mistakes are one clear error before
training."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from overlap.config import ConfigContainer
from overlap.config.logger import wandb_save_dir
from overlap.config.overrides import apply_overrides
from overlap.errors import ConfigError
from overlap.profiling.sinks import record_sinks, wandb_mode


def _flat(record: dict, prefix: str = "") -> dict[str, float]:
    """The test's own reading of a JSON line: every number, nested keys joined by "/", not the
    iteration."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and key != "iteration":
            out[prefix + key] = float(value)
    return out


def _expected(metrics: Path) -> dict[int, dict[str, float]]:
    """Per iteration, the numbers of both JSON-lines files (FILE and FILE.comm.jsonl)."""
    steps: dict[int, dict[str, float]] = {}
    for path in (metrics, Path(f"{metrics}.comm.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps.setdefault(row["iteration"], {}).update(_flat(row))
    return steps


def _tensorboard(log_dir: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    steps: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    return steps


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (.wandb): a 7-byte header (":W&B", magic, version), then
    32 KiB blocks of chunks, each with a 7-byte header (CRC, length, type: 1 full, 2 first, 3
    middle, 4 last); a block's tail too short for a header is padding."""
    data, block, pos = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def _wandb_history(save_dir: Path) -> dict[int, dict[str, float]]:
    """The logged rows of the one offline run under `save_dir`, read with W&B's own record
    definitions."""
    from wandb.proto import wandb_internal_pb2

    (path,) = save_dir.glob("wandb/offline-run-*/run-*.wandb")
    steps: dict[int, dict[str, float]] = {}
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        steps.setdefault(row["_step"], {}).update(
            {k: float(v) for k, v in row.items() if not k.startswith("_")}
        )
    return steps


def _offline_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), NETRC=str(home / "no-netrc"))
    return env


def test_tensorboard_and_wandb_get_the_metrics_scalars(tmp_path):
    metrics, tb, wb = tmp_path / "m.jsonl", tmp_path / "tb", tmp_path / "wb"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "overlap.cli",
            "run",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-g",
            "cpu",
            "-ng",
            "2",
            "-ms",
            "3",
            "--metrics",
            str(metrics),
            f"logger.tensorboard_dir={tb}",
            "logger.tensorboard_log_interval=2",
            "logger.wandb_project=overlap-test",
            "logger.wandb_exp_name=tiny",
            f"logger.wandb_save_dir={wb}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=_offline_env(tmp_path),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mode offline" in out.stderr and "W&B run 'tiny' (offline" in out.stderr
    expected = _expected(metrics)
    assert sorted(expected) == [1, 2, 3]
    for name in (
        "lm_loss",
        "grad_norm",
        "lr",
        "step_time_ms",
        "tokens_per_s",
        "peak_mem_mb",
        "comm_ms/dp_ar",
        "comm_bytes/dp_ar",
        "exposed_comm_ms/dp_ar",
        "total_comm_ms/dp_ar",
    ):
        assert name in expected[2], name
    due = {2: expected[2], 3: expected[3]}  # every 2nd iteration, and the last
    board = _tensorboard(tb)
    assert sorted(board) == [2, 3] and all(set(board[s]) == set(due[s]) for s in due)
    for step, row in due.items():  # event files hold float32: relative 1e-6
        assert board[step] == {k: pytest.approx(v, rel=1e-6, abs=1e-30) for k, v in row.items()}
    history = _wandb_history(wb)
    assert history == due  # JSON numbers both ways: exact
    # W&B's cache and staging folders are the run's, not the home folder's (HOME is tmp_path)
    assert not (tmp_path / ".cache" / "wandb").exists() and (wb / "wandb" / "cache").is_dir()


def test_a_missing_extra_is_one_error_naming_the_field_and_the_install(monkeypatch):
    for field, module in (("tensorboard_dir", "tensorboard"), ("wandb_project", "wandb")):
        cfg = ConfigContainer()
        apply_overrides(
            cfg,
            [f"logger.{field}=x", "logger.wandb_exp_name=e"]
            if module == "wandb"
            else [f"logger.{field}=x"],
        )
        with monkeypatch.context() as m:
            m.setitem(sys.modules, module, None)  # as if not installed
            res = cfg.finalize(1, require_libraries=True)
            with pytest.raises(
                ConfigError, match=rf"logger\.{field}='x': it needs the {module} package"
            ) as err:
                record_sinks(cfg.logger, res.decisions, require_libraries=True)
            assert f"pip install 'overlap[{module}]'" in str(err.value)
            # explain: said, not raised
            described = ConfigContainer(logger=cfg.logger)
            res = described.finalize(1, require_libraries=False)
            record_sinks(described.logger, res.decisions, require_libraries=False)
            assert any(
                f"needs overlap[{module}]" in d.reason for d in res.decisions.sections["logger"]
            )


def test_run_without_the_extra_exits_2_before_any_rank_starts(tmp_path):
    code = (
        "import sys; sys.modules['wandb'] = None; from overlap.cli import main; "
        "sys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "run",
            "-m",
            "qwen",
            "-mr",
            "dense_tiny",
            "-g",
            "cpu",
            "-ng",
            "2",
            "logger.wandb_project=p",
            "logger.wandb_exp_name=e",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "logger.wandb_project='p'" in out.stderr and "pip install 'overlap[wandb]'" in out.stderr
    assert "Traceback" not in out.stderr and "Launch environment" not in out.stdout


def test_wandb_mode_offline_without_a_key(tmp_path):
    none = str(tmp_path / "absent")
    assert wandb_mode({"NETRC": none})[0] == "offline"
    assert wandb_mode({"NETRC": none, "WANDB_API_KEY": "k"})[0] == "online"
    assert (
        wandb_mode({"NETRC": none, "WANDB_API_KEY": "k", "WANDB_MODE": "offline"})[0] == "offline"
    )
    assert wandb_mode({"NETRC": none, "WANDB_MODE": "dryrun"})[0] == "offline"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    netrc.chmod(0o600)
    assert wandb_mode({"NETRC": str(netrc)})[0] == "online"
    with pytest.raises(ConfigError, match="WANDB_MODE='sometimes'"):
        wandb_mode({"WANDB_MODE": "sometimes"})


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["logger.wandb_project=p"], "logger.wandb_exp_name"),  # Bridge refuses a nameless run too
        (["logger.tensorboard_dir=''"], "logger.tensorboard_dir"),
        (["logger.log_interval=0"], "logger.log_interval"),
        (["logger.tensorboard_log_interval=0"], "logger.tensorboard_log_interval"),
    ],
)
def test_logger_mistakes_name_the_field(overrides, field):
    cfg = ConfigContainer()
    apply_overrides(cfg, overrides)
    with pytest.raises(ConfigError) as err:
        cfg.finalize(1, require_libraries=False)
    assert err.value.field == field


def test_bridge_logger_names_we_do_not_carry_are_refused():
    with pytest.raises(ConfigError, match="not carried") as err:
        apply_overrides(ConfigContainer(), ["logger.log_memory_to_tensorboard=true"])
    assert err.value.field == "logger.log_memory_to_tensorboard"
    with pytest.raises(ConfigError, match="logger.log_interval"):
        apply_overrides(ConfigContainer(), ["train.log_interval=5"])


def test_wandb_folder_follows_bridge_and_settings_without_a_sink_are_noops():
    cfg = ConfigContainer()
    apply_overrides(
        cfg, ["logger.wandb_project=p", "logger.wandb_exp_name=e", "checkpoint.save=/ck"]
    )
    res = cfg.finalize(1, require_libraries=False)
    (folder,) = [d for d in res.decisions.sections["logger"] if d.field == "logger.wandb_save_dir"]
    assert folder.effective == "/ck/wandb" and folder.decided_by == "rule"
    assert cfg.logger.wandb_save_dir is None  # the input stays as typed; the sink reads the rule
    assert wandb_save_dir(cfg.logger, cfg.checkpoint.save) == (folder.effective, folder.reason)
    cfg = ConfigContainer()
    apply_overrides(cfg, ["logger.wandb_entity=team", "logger.tensorboard_queue_size=10"])
    noops = {n.field for n in cfg.finalize(1, require_libraries=False).decisions.noops}
    assert {"logger.wandb_entity", "logger.tensorboard_queue_size"} <= noops


def test_tensorboard_alone_takes_both_streams_without_metrics_files(tmp_path):
    from overlap.profiling.sinks import open_sinks

    cfg = ConfigContainer()
    apply_overrides(cfg, [f"logger.tensorboard_dir={tmp_path / 'tb'}", "train.train_iters=3"])
    cfg.finalize(1)
    sinks = open_sinks(cfg, None)
    assert len(sinks.owned) == 1 and sinks.describe().startswith("TensorBoard")
    for it in (1, 2, 3):
        sinks.comm.write({"iteration": it, "network": "real", "total_comm_ms": {"dp_ar": it / 8}})
        sinks.metrics.write({"iteration": it, "lm_loss": 2.5 - it, "comm_bytes": {"dp_ar": 1024}})
    sinks.close()
    assert list(tmp_path.iterdir()) == [tmp_path / "tb"]  # no JSON lines without --metrics
    board = _tensorboard(tmp_path / "tb")
    expected = {
        it: {"lm_loss": 2.5 - it, "comm_bytes/dp_ar": 1024.0, "total_comm_ms/dp_ar": it / 8}
        for it in (1, 2, 3)
    }
    assert board == expected  # exact in float32; the network label stays out
