"""The planner against the committed benchmarks (bench/results/*.json): each configuration of ours
re-planned on the profile fitted on that benchmark's own floor (`overlap.plan.versus_bench`, the fit
`overlap plan --calibrate` makes), step time within 20% of the measured one and the ratio to the
first configuration within 0.08.

Rows the model does not reach yet are listed with the reason, as strict expected failures: a model
change that brings one inside the bounds fails here until it is moved to the passing rows.
bench/plan_vs_bench.py writes the same comparison as a table (bench/results/plan_vs_bench.md)."""

import json
import logging
from pathlib import Path

import pytest

from overlap.plan.versus_bench import BENCHMARKS, compare, load_loopback

RESULTS = Path(__file__).parent.parent / "bench" / "results"
STEP_BOUND, RATIO_BOUND = 0.20, 0.08

TIME_SLICED = (
    "4 ranks on 2 cores: gloo's transfers take CPU from a compute thread sharing the core; the "
    "floor has none"
)
RANK0_FLOOR = (
    "4 ranks on 2 cores, and the floor faked every collective, so it shows rank 0's compute only; "
    "the FLOP-proportional stage weights make the last stage (the output layer) slower than it is "
    "on this CPU"
)
IMBALANCE = (
    "4 ranks on 2 cores, and the routing imbalance the planner does not model (its ranks are "
    "balanced): the model's delayed weight gradients fill waits for the link, the runtime's waits "
    "are mostly for a late peer"
)
BALANCED_PP_BASE = (
    "4 ranks on 2 cores; the off row is predicted 12% slower than measured and the overlap rows "
    "within 3%, so the ratios miss through the base row (not diagnosed further)"
)
KNOWN_MISSES = {
    ("ep_overlap", "EP overlap"): TIME_SLICED,
    ("ep_overlap", "EP overlap + delay_wgrad"): TIME_SLICED,
    ("ep_overlap", "shared-expert overlap"): TIME_SLICED,
    ("dp_overlap", "dist-opt, overlap grad reduce + param gather"): TIME_SLICED,
    ("dp_overlap", "all-reduce, overlap grad reduce"): TIME_SLICED,
    ("ep_overlap_pp", "EP overlap + delay_wgrad"): IMBALANCE,
    ("ep_overlap_pp_balanced", "EP overlap"): BALANCED_PP_BASE,
    ("ep_overlap_pp_balanced", "EP overlap + delay_wgrad"): BALANCED_PP_BASE,
    ("pp_schedules", "1F1B, batched p2p"): RANK0_FLOOR,
    ("pp_schedules", "1F1B, overlapped p2p"): RANK0_FLOOR,
    ("pp_schedules", "interleaved VPP2, overlapped p2p"): RANK0_FLOOR,
}


@pytest.fixture(scope="module")
def rows():
    logging.disable(logging.WARNING)
    try:
        loopback = load_loopback(RESULTS / "loopback_probe.json")
        return {
            (r.benchmark, r.config): r
            for name in BENCHMARKS
            for r in compare(RESULTS / f"{name}.json", loopback)
        }
    finally:
        logging.disable(logging.NOTSET)


def test_every_known_miss_names_a_real_row(rows):
    assert set(KNOWN_MISSES) <= set(rows)


def _cases():
    for name in BENCHMARKS:
        doc = json.loads((RESULTS / f"{name}.json").read_text())
        for c in doc["configs"]:
            if c["name"].startswith("ideal") or not c.get("comm_traced", True):
                continue
            reason = KNOWN_MISSES.get((name, c["name"]))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            yield pytest.param(name, c["name"], marks=marks, id=f"{name}:{c['name']}")


@pytest.mark.parametrize("benchmark, config", list(_cases()))
def test_predicted_step_and_ratio_within_bounds(rows, benchmark, config):
    r = rows[(benchmark, config)]
    assert abs(r.error) <= STEP_BOUND, (
        f"predicted {r.predicted_ms:.0f} ms vs measured {r.measured_ms:.0f} ms"
    )
    # the first configuration is its benchmark's base: both ratios are 1 by definition
    if r.measured_ratio != 1.0:
        assert abs(r.ratio_error) <= RATIO_BOUND, (
            f"ratio {r.predicted_ratio:.3f} vs measured {r.measured_ratio:.3f}"
        )
