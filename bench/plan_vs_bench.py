"""The planner against the committed benchmarks: prove the model where we can measure.

    python bench/plan_vs_bench.py --probe    # command 38: writes bench/results/loopback_probe.json
    python bench/plan_vs_bench.py            # command 39: writes bench/results/plan_vs_bench.md

--probe measures the loopback link with 2 and 4 local ranks
(`overlap.plan.calibrate.probe_loopback`) into bench/results/loopback_probe.json and stops; run it
alone on the machine, like every benchmark. Without it, for every committed result with a floor,
each configuration of ours is re-planned on the profile that floor gives
(`overlap.plan.versus_bench`) and bench/results/plan_vs_bench.md gets the table: predicted vs
measured step time and on/off ratio, against the bounds (20% and 0.08) that
tests/test_plan_vs_bench.py holds.
"""

import json
import logging
import sys
from pathlib import Path

from overlap.plan.versus_bench import BENCHMARKS, compare, load_loopback

RESULTS = Path(__file__).parent / "results"


def probe() -> None:
    from overlap.plan.calibrate import probe_loopback

    doc = {}
    for ranks in (2, 4):
        link = probe_loopback(ranks)
        doc[str(ranks)] = {
            "bandwidth_GBps": link.bandwidth_Bps / 1e9,
            "latency_us": link.latency_s * 1e6,
            "source": link.source,
        }
    (RESULTS / "loopback_probe.json").write_text(json.dumps(doc, indent=1) + "\n")


def main() -> None:
    logging.disable(logging.WARNING)  # the resolution's notes on each re-planned configuration
    if "--probe" in sys.argv[1:]:
        probe()
        return
    loopback = load_loopback(RESULTS / "loopback_probe.json")
    lines = [
        "Planner vs measured: each committed benchmark's configurations of ours re-planned on the "
        "profile fitted on that benchmark's own floor (`overlap.plan.versus_bench`); nothing of a "
        "switch is fitted.  ",
        "Command: `python bench/plan_vs_bench.py` (loopback link: "
        "bench/results/loopback_probe.json).  ",
        "Bounds (tests/test_plan_vs_bench.py): step time within 20%, ratio to the first "
        "configuration within 0.08.",
        "",
        "| benchmark | config | measured ms | predicted ms | error | measured ratio | predicted "
        "ratio | ratio error | within bounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in BENCHMARKS:
        for r in compare(RESULTS / f"{name}.json", loopback):
            ok = abs(r.error) <= 0.20 and abs(r.ratio_error) <= 0.08
            lines.append(
                f"| {r.benchmark} | {r.config} | {r.measured_ms:.0f} | {r.predicted_ms:.0f} | "
                f"{r.error:+.1%} | {r.measured_ratio:.3f} | {r.predicted_ratio:.3f} | "
                f"{r.ratio_error:+.3f} | {'yes' if ok else '**no**'} |"
            )
    (RESULTS / "plan_vs_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
