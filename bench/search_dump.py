"""The layout search's ranking, for checking that a speed change changes no result.

For Llama3-8B on 8 H100s, every published row `tests/test_plan_search.py` searches, and the
256-GPU Qwen3-235B-A22B H100 and GB200 (26.08) rows, it writes each search's ranked candidates
(layout, switches, step ms to 1e-6, peak bytes), what it left out (considered, not fitting,
bounded, refused by reason, recompute rungs refused by reason), how many layouts it counts near
the best (and whether that count is exact) and its CPU seconds as JSON. Run it before and after a
change and diff (the CPU seconds aside):

    PYTHONPATH=src python bench/search_dump.py /tmp/before.json [NAME_PART ...]

NAME_PART: only the searches whose name contains one of them (e.g. "235B-A22B 256xH100").
"""

from __future__ import annotations

import json
import sys
import time

from overlap.plan.hardware import builtin_cluster
from overlap.plan.search import search
from overlap.plan.validate import ROWS

LLAMA8 = "-m llama -mr llama3_8b -g h100 -ng 8 -c bf16 -gb 128 -sl 8192".split()
LARGE = (
    "Qwen3-235B-A22B 256xH100 FP8 TP2 PP8 VP4 EP32",
    "Qwen3-235B-A22B 256xGB200 MXFP8 MBS1 PP8 VP3 EP32 (26.08)",
)


def searches() -> list[tuple[str, list[str], object]]:
    """(name, harness words, cluster) of each search: the suite's and the 256-GPU rows."""
    rows = [
        r
        for r in ROWS
        if not r.not_expressible and not r.name.endswith(" off") and "-ng 256" not in r.flags
    ]
    rows += [r for r in ROWS if r.name in LARGE]
    return [("llama3_8b", LLAMA8, None)] + [
        (r.name, r.args(), builtin_cluster(r.gpu, r.precision, None)) for r in rows
    ]


def main(path: str, only: list[str]) -> None:
    out = {}
    for name, words, cluster in searches():
        if only and not any(part in name for part in only):
            continue
        start = time.process_time()
        res = search(words, cluster=cluster)
        cpu = time.process_time() - start
        out[name] = {
            "ranked": [
                (
                    c.layout.describe(),
                    list(c.switches),
                    round(c.prediction.step_ms, 6),
                    c.prediction.peak_mem_bytes,
                )
                for c in res.ranked
            ],
            "left_out": [
                res.considered,
                res.not_fitting,
                res.bounded,
                res.refused,
                res.rungs_refused,
            ],
            "near_best": [res.near_best(), res.near_best_is_exact()],
            "cpu_s": round(cpu, 2),
        }
        print(f"{cpu:7.1f} CPU s  {name}", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
