"""What machine a benchmark ran on, recorded beside its results.

This project's CPU machines have changed under the same name three times (an older CPU where bf16
was ~15x slower than fp32, an AMD EPYC with native bf16, an Intel Xeon with AMX), and each change
moved every compute-bound number and the regime of every modelled-link benchmark. A result that does
not say which CPU made it cannot be compared with a later run, so `overlap bench` and
`bench/hf_compute_bench.py` write this description into their JSON and markdown.
"""

from __future__ import annotations

import os
import platform
from importlib.metadata import version
from pathlib import Path

# The CPU flags that decide how fast bf16 compute is on this machine's CPUs.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def describe_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """{"cpu": model name, "cores": usable cores, "bf16_flags": [...], "torch": version} (the CPU
    fields are "unknown" / [] where /proc/cpuinfo cannot be read, e.g. off Linux)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": model,
        "cores": cores,
        "bf16_flags": [f for f in BF16_FLAGS if f in flags],
        "torch": version("torch"),
    }  # no torch import: the bench driver does not need one


def machine_line(machine: dict) -> str:
    """One markdown line naming the machine."""
    flags = ", ".join(machine["bf16_flags"]) or "none"
    return (
        f"Machine: {machine['cpu']}, {machine['cores']} cores (bf16 flags: {flags}), torch "
        f"{machine['torch']}"
    )
