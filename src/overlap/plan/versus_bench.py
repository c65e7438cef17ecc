"""The planner against a measured benchmark: re-plan an `overlap bench` result's configurations on
the machine profile its own floor gives, and compare step times.

This is how the model is proven where we can measure (`bench/plan_vs_bench.py` writes the table,
`tests/test_plan_vs_bench.py` holds the bounds). For each result:
- the profile is `overlap.plan.calibrate`'s: the link from the result's `--network` (a loopback link
  from the committed probe, `bench/results/loopback_probe.json`), and the efficiency fitted on the
  result's floor, the run with the modelled collectives faked, exactly what `overlap plan
  --calibrate` measures;
- every configuration of ours (not the PyTorch peers: the planner plans this runtime) is predicted,
  off and on alike: nothing of a switch is fitted.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace
from pathlib import Path

from overlap.harness import resolve_run
from overlap.launch.kinds import FAMILIES
from overlap.launch.network import parse_network
from overlap.perf.bench import (
    BENCH_OPTIONS_WITH_VALUE,
    BENCH_SWITCHES,
    IDEAL_NAME,
    family_floor_name,
)
from overlap.plan.calibrate import cpu_cluster, fit_efficiency
from overlap.plan.hardware import Link, precision_of
from overlap.plan.predict import predict

# The committed results (bench/results/NAME.json) the planner is proven against; each has a floor.
BENCHMARKS = (
    "ep_overlap",
    "ep_overlap_2ranks",
    "ep_overlap_one_rank_per_core",
    "dp_overlap",
    "dp_overlap_modelled",
    "pp_schedules",
    "pp_schedules_2ranks",
    "pp_schedules_modelled",
    "pp_bubble",
    "tp_overlap",
    "tp_overlap_narrow",
    "ep_overlap_pp",
    "ep_overlap_pp_8mb",
    "dp_overlap_2ranks",
    "ep_overlap_balanced",
    "ep_overlap_pp_balanced",
)
_VALUED = BENCH_OPTIONS_WITH_VALUE + ("--network",)
_PEERS = ("ddp.impl=", "model.pipeline_impl=", "model.tensor_parallel_impl=")


@dataclass(frozen=True)
class Row:
    benchmark: str
    config: str
    measured_ms: float
    predicted_ms: float
    measured_ratio: float  # to the first configuration
    predicted_ratio: float

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1

    @property
    def ratio_error(self) -> float:
        return self.predicted_ratio - self.measured_ratio


def _split(command: str) -> tuple[list[str], list[str], str | None, str]:
    """A bench command -> (harness flags and overrides, --config values, --ab value, --network)."""
    words = shlex.split(command)[2:]  # "overlap bench"
    rest, configs, ab, network = [], [], None, "real"
    items = iter(words)
    for item in items:
        if item in _VALUED:
            value = next(items)
            configs += [value] if item == "--config" else []
            ab = value if item == "--ab" else ab
            network = value if item == "--network" else network
        elif item not in BENCH_SWITCHES:
            rest.append(item)
    return rest, configs, ab, network


def _floor(doc: dict, families: tuple[str, ...] | None) -> tuple[float, tuple[str, ...] | None]:
    """(step ms, families faked) of the floor to fit on: the one faking the modelled link's
    families, else the one faking everything, else a single family's (whose link is then the only
    one the plan charges)."""
    floors = doc["floors_step_time_ms"]
    wanted = [(family_floor_name("+".join(families)), families)] if families else []
    wanted += [(IDEAL_NAME, None)]
    wanted += [(family_floor_name(f), (f,)) for f in FAMILIES if not families]
    for name, faked in wanted:
        if name in floors:
            return floors[name], faked
    raise KeyError(
        f"{doc['command']!r} has no floor to fit on (it has {sorted(floors)}): run it with --ideal"
    )


def compare(result: Path, loopback: dict[int, Link]) -> list[Row]:
    """Predicted vs measured step time of every configuration of ours in the bench result `result`;
    `loopback` holds the probe's link per number of ranks (for `real`, `nic:` and `tbf:`
    networks)."""
    from overlap.perf.bench import build_configs, parse_ab, parse_named_config

    doc = json.loads(result.read_text())
    words, config_texts, ab, network_text = _split(doc["command"])
    network = parse_network(network_text)
    configs = (
        build_configs(*parse_ab(ab), False) if ab else [parse_named_config(c) for c in config_texts]
    )
    configs = [c for c in configs if not any(o.startswith(_PEERS) for o in c.overrides)]
    measured = {c["name"]: c["step_time_ms"]["mean"] for c in doc["configs"]}
    jobs = [(c.name, resolve_run(words, c.overrides)) for c in configs]
    first = jobs[0][1]
    ranks = first.resolution.layout.world_size
    link_families = network.families if network.kind == "model" else None
    floor_ms, faked = _floor(doc, link_families)
    cluster = cpu_cluster(
        network, ranks, 1.0, precision_of(first.cfg.resolved.precision), loopback.get(ranks)
    )
    # a single family's floor: only its link is charged
    if faked is not None and link_families is None:
        cluster = replace(cluster, link_families=faked)
    cluster = fit_efficiency(
        first.cfg,
        first.resolution.layout,
        cluster,
        floor_ms,
        f"fitted on the floor of {result.name}",
        faked,
    )
    predicted = {
        name: predict(name, [], job.cfg, job.resolution.layout, cluster).step_ms
        for name, job in jobs
    }
    base_m, base_p = measured[jobs[0][0]], predicted[jobs[0][0]]
    return [
        Row(
            result.stem,
            name,
            measured[name],
            predicted[name],
            measured[name] / base_m,
            predicted[name] / base_p,
        )
        for name, _job_ in jobs
    ]


def load_loopback(path: Path) -> dict[int, Link]:
    """The committed loopback probe: {ranks: Link}."""
    doc = json.loads(path.read_text())
    return {
        int(n): Link(v["bandwidth_GBps"] * 1e9, v["latency_us"] * 1e-6, v["source"])
        for n, v in doc.items()
    }
