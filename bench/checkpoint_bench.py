"""Checkpoint save / load time and size, synchronous vs asynchronous saves, alternated.

For each workload, each repeat runs `overlap run` twice per mode (sync, then async, then sync ...
alternated):
1. train `ITERS` iterations saving every `INTERVAL`: the run summary (`--metrics F` ->
   `F.summary.json`) has, per save, the time the training thread was blocked (`blocked_ms`: the
   whole write when synchronous; the host copy when asynchronous) and the time until the checkpoint
   was complete and renamed (`complete_ms`), and its size; the per-iteration step times (`F`) give
   the step after each save (where an asynchronous writer competes for the CPU) against the steps
   with no save in flight;
2. load the last checkpoint and train one more iteration: `load_ms`.

Usage: python bench/checkpoint_bench.py OUT.json OUT.md [REPEATS]
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ITERS, INTERVAL = 8, 2
WORKLOADS = {
    "qwen3_moe_tiny EP4": [
        "-mr",
        "qwen3_moe_tiny",
        "-ng",
        "4",
        "-ep",
        "4",
        "-gb",
        "16",
        "-mb",
        "1",
    ],
    "dense_tiny DP4 (dist-opt)": [
        "-mr",
        "dense_tiny",
        "-ng",
        "4",
        "-gb",
        "16",
        "-mb",
        "1",
        "ddp.use_distributed_optimizer=true",
    ],
}
MODES = {"sync": "checkpoint.async_save=false", "async": "checkpoint.async_save=true"}


def _run(args: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "run", "-m", "qwen", "-g", "cpu", *args],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise SystemExit(f"overlap run failed ({out.returncode}):\n{out.stderr[-3000:]}")


def measure(flags: list[str], mode: str, work: Path) -> dict:
    save = work / "ckpt"
    shutil.rmtree(save, ignore_errors=True)
    metrics = work / "train.jsonl"
    _run(
        [
            *flags,
            "-ms",
            str(ITERS),
            "--metrics",
            str(metrics),
            f"checkpoint.save={save}",
            f"checkpoint.save_interval={INTERVAL}",
            MODES[mode],
        ]
    )
    summary = json.loads(Path(f"{metrics}.summary.json").read_text())["checkpoint"]
    steps = {
        r["iteration"]: r["step_time_ms"] for r in map(json.loads, metrics.read_text().splitlines())
    }
    # the last one is the end-of-run save
    saves = [s for s in summary["saves"] if s["iteration"] < ITERS]
    after = [steps[s["iteration"] + 1] for s in saves if s["iteration"] + 1 in steps]
    # no save just before
    plain = [t for it, t in steps.items() if it > 1 and (it - 1) % INTERVAL != 0]
    load_metrics = work / "load.jsonl"
    _run([*flags, "-ms", str(ITERS + 1), "--metrics", str(load_metrics), f"checkpoint.load={save}"])
    load = json.loads(Path(f"{load_metrics}.summary.json").read_text())["checkpoint"]
    return {
        "blocked_ms": statistics.fmean(s["blocked_ms"] for s in saves),
        "complete_ms": statistics.fmean(s["complete_ms"] for s in saves),
        "size_mb": saves[-1]["size_mb"],
        "step_after_save_ms": statistics.fmean(after),
        "step_no_save_ms": statistics.fmean(plain),
        "load_ms": load["load_ms"],
    }


def main() -> None:
    out_json, out_md = Path(sys.argv[1]), Path(sys.argv[2])
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    results: dict[str, dict[str, list[dict]]] = {w: {m: [] for m in MODES} for w in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        for _ in range(repeats):
            for workload, flags in WORKLOADS.items():
                for mode in MODES:  # alternated: sync, async, sync, async ...
                    results[workload][mode].append(measure(flags, mode, Path(tmp)))
    out_json.write_text(
        json.dumps(
            {
                "iters": ITERS,
                "interval": INTERVAL,
                "repeats": repeats,
                "workloads": WORKLOADS,
                "results": results,
            },
            indent=1,
        )
    )
    keys = [
        "size_mb",
        "blocked_ms",
        "complete_ms",
        "step_no_save_ms",
        "step_after_save_ms",
        "load_ms",
    ]
    lines = [
        f"Command: `python bench/checkpoint_bench.py {out_json} {out_md} {repeats}` ({ITERS} "
        "iterations, a save "
        f"every {INTERVAL}, then a load + 1 iteration; modes alternated, {repeats} repeats; means "
        "over saves and repeats; -g cpu, real loopback)",
        "",
        "| workload | mode | " + " | ".join(keys) + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for workload, modes in results.items():
        for mode, runs in modes.items():
            cells = [f"{statistics.fmean(r[k] for r in runs):.1f}" for k in keys]
            lines.append(f"| {workload} | {mode} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "blocked_ms: the training thread's time in the save (the step-time cost of a save step); "
        "complete_ms: until the folder is renamed and the tracker updated; step_after_save_ms: the "
        "step that runs while an asynchronous save writes; load_ms: reading the checkpoint into "
        "the model and optimizer.",
    ]
    out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
