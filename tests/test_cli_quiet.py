"""A clean run is quiet and honest: no warnings on stderr, no claimed file that is missing, a table
that stays aligned, no GPU number on CPU ranks, and one iteration numbering (1-based, window [first,
last]) in the log, the summary file and the bench table."""

import json
import logging
import re
import subprocess
import sys

import pytest

from overlap.config.training import TrainConfig
from overlap.parallel.trace import Span
from overlap.perf import bench
from overlap.profiling.collector import Collector
from overlap.profiling.exposed import ALL, KindExposure, format_table
from overlap.training.metrics import StepRecord, format_iteration, window_iterations

# The smallest real job: one rank, one layer, short sequences, three iterations (window: iterations
# 2-3).
TINY = (
    "-m",
    "qwen",
    "-mr",
    "dense_tiny",
    "-g",
    "cpu",
    "-ng",
    "1",
    "-ms",
    "3",
    "-gb",
    "1",
    "-mb",
    "1",
    "-sl",
    "32",
    "model.num_layers=1",
)
WARNING_MARKS = ("Warning", "WARNING", "warn(")


def _overlap(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "overlap.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(mark in line for mark in WARNING_MARKS)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny `overlap run` with --metrics and --trace, shared by the tests below."""
    tmp = tmp_path_factory.mktemp("tiny")
    metrics, trace = tmp / "m.jsonl", tmp / "trace"
    out = _overlap("run", *TINY, "--metrics", str(metrics), "--trace", str(trace))
    assert out.returncode == 0, out.stderr[-3000:]
    return out, metrics, trace


def test_tiny_run_prints_no_warnings(tiny_run):
    out, _, _ = tiny_run
    assert _warning_lines(out.stderr) == [], out.stderr[-3000:]
    assert "Traceback" not in out.stderr


def test_explain_prints_no_warnings():
    out = _overlap("explain", *TINY)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _warning_lines(out.stderr) == [] and _warning_lines(out.stdout) == [], out.stderr[-3000:]


# The MoE guide's harness command, verbatim: its override beats its own --moe_a2a_overlap false on
# purpose.
MOE_GUIDE = (
    "-m",
    "qwen",
    "-mr",
    "qwen3_30b_a3b",
    "--task",
    "pretrain",
    "-g",
    "h100",
    "-c",
    "bf16",
    "-ng",
    "16",
    "-gn",
    "8",
    "--max_steps",
    "8",
    "--config_variant",
    "v1",
    "--cuda_graph_impl",
    "none",
    "--moe_flex_dispatcher_backend",
    "None",
    "--moe_a2a_overlap",
    "false",
    "--tokenizer_type",
    "NullTokenizer",
    "comm_overlap.overlap_moe_expert_parallel_comm=true",
    "comm_overlap.delay_wgrad_compute=false",
    "model.moe_shared_expert_overlap=false",
)


def test_the_moe_guides_command_is_quiet_and_names_the_beaten_flag():
    out = _overlap("explain", *MOE_GUIDE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert _warning_lines(out.stderr) == [] and _warning_lines(out.stdout) == [], out.stderr[-3000:]
    assert "beats --moe_a2a_overlap false" in out.stdout


def test_every_trace_file_the_log_names_exists(tiny_run):
    out, _, trace = tiny_run
    lines = [
        line.split("trace: ", 1)[1] for line in out.stderr.splitlines() if "INFO trace: " in line
    ]
    assert len(lines) == 1, out.stderr[-3000:]
    claimed = re.findall(r"(\S+\.(?:json|png))\b", lines[0])
    # matplotlib is installed
    assert str(trace / "trace.json") in claimed and str(trace / "timeline.png") in claimed
    assert all((trace / p.rsplit("/", 1)[-1]).exists() for p in claimed)
    assert (trace / "timeline.png").stat().st_size > 1000


def test_trace_log_does_not_claim_a_timeline_it_could_not_draw(tmp_path, monkeypatch, caplog):
    from overlap.commands import _write_traces
    from overlap.parallel import comm
    from overlap.profiling import timeline

    def no_matplotlib(*_args, **_kwargs):
        raise timeline.MissingPlotting("the timeline PNG needs matplotlib (test)")

    monkeypatch.setattr(comm, "barrier", lambda group=None: None)
    monkeypatch.setattr(timeline, "plot_timeline", no_matplotlib)
    (tmp_path / "timeline.png").write_bytes(b"stale picture of an earlier run")
    collector = Collector(0, "real", keep_events=True)
    collector([], [])  # the reset drain
    collector([], [Span("forward", 0.0, 0.01)])
    with caplog.at_level(logging.INFO, logger="overlap"):
        _write_traces(collector, tmp_path, rank=0, world=1)
    claim = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trace: ")]
    assert len(claim) == 1 and "trace.json" in claim[0] and "timeline.png" not in claim[0]
    assert any("timeline.png not drawn" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "trace.json").exists() and not (tmp_path / "timeline.png").exists()


def test_exposure_table_columns_stay_aligned_for_long_kind_names():
    rows = {
        "dp_loss": KindExposure(0.1, 0.1, 1, 4),
        "ep_dispatch_bwd": KindExposure(12.5, 4.25, 10, 123_456_789),
        "ep_combine_bwd": KindExposure(1.0, 0.0, 3, 1000),
        "some_future_kind_with_a_long_name": KindExposure(12345.678, 12.0, 12345, 9_876_543_210),
        ALL: KindExposure(12359.0, 16.0, 12359, 9_999_999_999),
    }
    lines = format_table(rows, "title").splitlines()
    assert lines[0] == "title"
    header, body = lines[1], lines[2:]
    assert len({len(line) for line in lines[1:]}) == 1  # every row as wide as the header
    assert [line.split()[0] for line in body] == [
        "dp_loss",
        "ep_combine_bwd",
        "ep_dispatch_bwd",
        "some_future_kind_with_a_long_name",
        ALL,
    ]
    for name in (
        "ops",
        "MB",
        "total ms",
        "exposed ms",
        "hidden %",
    ):  # numbers end where their header ends
        end = header.index(name) + len(name)
        assert all(
            line[end - 1] != " " and (end == len(line) or line[end] == " ") for line in body
        ), name
    # the kind column: left-aligned, as wide as the longest name
    width = len("some_future_kind_with_a_long_name")
    assert all(
        line[width] == " " and line[:width] == line.split()[0].ljust(width)
        for line in [header, *body]
    )


def test_cpu_iteration_lines_quote_no_gpu_number(tiny_run):
    record, cfg = (
        StepRecord(0, 6.9, 1.0, 12.0, 1e-4),
        TrainConfig(global_batch_size=2, train_iters=3),
    )
    cpu = format_iteration(record, cfg, 1000.0, 0.001, on_gpu=False)
    assert "TFLOP/s" not in cpu and "per GPU" not in cpu and "tokens/s per rank: 1000" in cpu
    assert cpu.startswith("iteration      1/3")
    gpu = format_iteration(record, cfg, 1000.0, 0.001, on_gpu=True)
    assert "throughput per GPU (TFLOP/s/GPU): 0.0010" in gpu and "tokens/s per GPU: 1000" in gpu
    out, _, _ = tiny_run
    iteration_lines = [
        line for line in out.stderr.splitlines() if "elapsed time per iteration" in line
    ]
    assert len(iteration_lines) == 3 and not any("TFLOP/s/GPU" in line for line in iteration_lines)


def test_one_iteration_numbering_in_log_summary_and_bench(tiny_run, monkeypatch):
    out, metrics, _ = tiny_run
    assert [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()] == [1, 2, 3]
    summary = json.loads(metrics.with_name("m.jsonl.summary.json").read_text())
    assert summary["window_iterations"] == [2, 3] and "steps_window" not in summary
    assert window_iterations((1, 3)) == (2, 3)
    assert "steady-state step time over iterations 2-3:" in out.stderr
    assert "mean per iteration over iterations 2-3 |" in out.stderr
    # `overlap bench` reads the same file (its subprocess replaced by the run above) and prints the
    # same numbers
    monkeypatch.setattr(
        bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", "")
    )
    config = bench.BenchConfig("only", [])
    result = bench.run_once([], [], config, metrics)
    doc = bench.summarize([config], {"only": [result]}, summary["network"], "overlap bench ...")
    assert doc["window_iterations"] == [2, 3]
    assert "Steady-state window: iterations 2-3 (1-based, inclusive)" in bench.format_markdown(doc)
    # result files written before window_iterations (0-based [start, end)) print the same way
    old = dict(doc, steps_window=[1, 3])
    del old["window_iterations"]
    assert bench.window_of(old) == (2, 3)
