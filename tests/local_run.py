"""One `overlap run` on this host, read back from its `--metrics` file: the reference the multi-host
tests (two nodes, Slurm) compare their losses with."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def metrics_losses(path: Path) -> dict[int, float]:
    """{iteration: loss} of a `--metrics` JSONL file."""
    return {r["iteration"]: r["lm_loss"] for r in map(json.loads, path.read_text().splitlines())}


def run_locally(args: list[str], metrics: Path) -> dict[int, float]:
    """`overlap run ARGS --metrics METRICS` here; its losses by iteration."""
    done = subprocess.run(
        [sys.executable, "-m", "overlap.cli", "run", *args, "--metrics", str(metrics)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return metrics_losses(metrics)
