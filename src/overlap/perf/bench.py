"""`overlap bench --ab KEY=V1,V2[,V3]`: is an overlap switch worth it, measured side by side in one
invocation.

Each configuration is the same `overlap run` command line (harness flags, overrides, `--network`)
plus `KEY=V`, run as a subprocess with `--metrics`, so every run is a fresh world with identical
steps. Configurations run alternately (A B [ideal] A B [ideal] ...) for `--repeats` rounds, which
spreads slow drift of the machine (thermal, other load) over all of them instead of biasing the one
that happened to run last. Per configuration the harness reports the steady-state mean step time
(the window of `train.eval_time_start_step` / `skip_first_percent_time`, as the run itself reports
it) with min/max across repeats, rank 0's exposed and total communication per kind (mean per
iteration over the same window), peak memory, and the ratio of its step time to the first
configuration's.

`--ideal` adds the first configuration with communication made free (`overlap run --comm-mode none`:
no transfers, shapes kept, losses meaningless): its time `T_ideal` is the compute-only floor, and
each later configuration gets the overlap efficiency `(T_off - T_on) / (T_off - T_ideal)` with the
first configuration as "off": the share of the first configuration's communication cost that the
switch removed (1.0: all of it hidden; 0: none).

`--ideal-family ep` adds a floor where only that family's communication is free (`--comm-mode
none:ep`) and the rest (say, the data-parallel gradient reduction every configuration pays alike)
runs for real. An overlap of one dimension can at best remove that dimension's cost, so this floor
is the denominator that measures it: with it, the efficiency is the share of the exposed EP
communication time that the switch hid. Every floor gets its own efficiency column;
`overlap_efficiency` in the JSON is against the full floor when there is one.

`--ideal-link` adds a floor where nothing is faked: the baseline runs on the plain loopback
(`--network real`), so every transfer still happens and every dependency between the ranks is kept,
only the modelled or emulated link's time is gone. Faking a pipeline's point-to-point transfers
(`--ideal-family pp`) also removes the stages' waits for each other (the bubble; each stage runs
alone), so that floor is below anything a pipeline can reach; the link floor is the same schedule
with free transfers, the denominator for "the share of the link time the overlap hid".
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from overlap.errors import ConfigError
from overlap.files import write_replace
from overlap.launch.kinds import parse_families
from overlap.perf.machine import describe_machine, machine_line

IDEAL_NAME = "ideal (no communication)"
LINK_FLOOR_NAME = "ideal (no link time)"

BENCH_FLAGS: list[tuple[tuple[str, ...], dict]] = [
    (
        ("--ab",),
        dict(
            default=None,
            metavar="KEY=V1,V2[,V3]",
            help="the override key to compare and its values; the first value is the baseline "
            "('off')",
        ),
    ),
    (
        ("--config",),
        dict(
            action="append",
            default=None,
            metavar="NAME:OVERRIDE[;OVERRIDE...]",
            dest="configs",
            help="instead of --ab: a named configuration of several overrides (repeat; the first "
            "is the baseline), e.g. "
            "'dist-opt:ddp.use_distributed_optimizer=true;optimizer.use_distributed_optimizer=true'",
        ),
    ),
    (
        ("--ideal",),
        dict(
            action="store_true",
            help="also run the baseline without communication (T_ideal) and report overlap "
            "efficiency",
        ),
    ),
    (
        ("--ideal-family",),
        dict(
            action="append",
            default=[],
            metavar="FAMILY",
            dest="ideal_families",
            help="also run the baseline with only FAMILY's communication free (e.g. ep: the "
            "all-to-alls), the floor for that dimension's overlap efficiency (repeatable)",
        ),
    ),
    (
        ("--ideal-link",),
        dict(
            action="store_true",
            help="also run the baseline on the plain loopback (--network real): every transfer and "
            "wait between the ranks kept, only the link's time removed (the floor for a pipeline, "
            "whose faked p2p would also remove the bubble)",
        ),
    ),
    (("--repeats",), dict(type=int, default=3, help="alternating rounds (default 3)")),
    (
        ("--json",),
        dict(default=None, metavar="FILE", dest="json_out", help="write the results as JSON"),
    ),
    (
        ("--markdown",),
        dict(default=None, metavar="FILE", help="also write the Markdown table to FILE"),
    ),
]
BENCH_OPTIONS_WITH_VALUE = (
    "--ab",
    "--config",
    "--ideal-family",
    "--repeats",
    "--json",
    "--markdown",
)
BENCH_SWITCHES = ("--ideal", "--ideal-link")


def parse_ab(text: str) -> tuple[str, list[str]]:
    """`ddp.overlap_grad_reduce=false,true` -> ("ddp.overlap_grad_reduce", ["false", "true"])."""
    key, sep, rest = text.partition("=")
    key = key.strip()
    values = [v.strip() for v in rest.split(",")]
    fix = (
        "pass --ab section.field=V1,V2[,V3], e.g. --ab ddp.overlap_grad_reduce=false,true (first = "
        "baseline)."
    )
    if not sep or not key or "." not in key or key.startswith("-"):
        raise ConfigError(
            "--ab", text, "expected an override key (section.field), '=' and values.", fix
        )
    if len(values) < 2 or any(not v for v in values):
        raise ConfigError(
            "--ab", text, "an A/B comparison needs at least two non-empty values.", fix
        )
    if len(set(values)) != len(values):
        raise ConfigError("--ab", text, "a value is repeated.", fix)
    return key, values


def overlap_efficiency(t_off: float, t_on: float, t_ideal: float) -> float | None:
    """(T_off - T_on) / (T_off - T_ideal); None when the baseline has no communication cost to
    hide."""
    exposed_cost = t_off - t_ideal
    if not exposed_cost > 0:
        return None
    return (t_off - t_on) / exposed_cost


@dataclass
class BenchConfig:
    name: str
    overrides: list[str]  # appended to the common overrides
    # extra `overlap run` flags (the ideal run's --comm-mode)
    run_flags: list[str] = field(default_factory=list)
    floor: bool = False  # a no-communication floor (ideal), not a configuration under test


def parse_named_config(text: str) -> BenchConfig:
    """`NAME:k1=v1;k2=v2` -> BenchConfig(NAME, [k1=v1, k2=v2]); `NAME:` alone means the common
    settings."""
    name, sep, rest = text.partition(":")
    overrides = [o.strip() for o in rest.split(";") if o.strip()]
    if not sep or not name.strip() or any("=" not in o for o in overrides):
        raise ConfigError(
            "--config",
            text,
            "expected NAME:OVERRIDE[;OVERRIDE...].",
            "e.g. --config 'overlap:ddp.overlap_grad_reduce=true;ddp.bucket_size=100000'.",
        )
    return BenchConfig(name.strip(), overrides)


def build_configs(
    key: str, values: list[str], ideal: bool, families: list[str] = (), link: bool = False
) -> list[BenchConfig]:
    return with_ideal(
        [BenchConfig(f"{key}={v}", [f"{key}={v}"]) for v in values], ideal, families, link
    )


def family_floor_name(family: str) -> str:
    return f"ideal (no {family} communication)"


def with_ideal(
    configs: list[BenchConfig], ideal: bool, families: list[str] = (), link: bool = False
) -> list[BenchConfig]:
    """Append the floors: the baseline configuration with all communication (`ideal`) or one
    family's made free, and (`link`) on the plain loopback with every transfer kept."""
    if ideal:
        configs.append(
            BenchConfig(IDEAL_NAME, list(configs[0].overrides), ["--comm-mode", "none"], floor=True)
        )
    if len(set(families)) != len(families):
        raise ConfigError(
            "--ideal-family", list(families), "a family is repeated.", "give each family once."
        )
    for family in families:
        label = "+".join(parse_families("--ideal-family", family, family))
        configs.append(
            BenchConfig(
                family_floor_name(label),
                list(configs[0].overrides),
                ["--comm-mode", f"none:{label}"],
                floor=True,
            )
        )
    if link:
        configs.append(
            BenchConfig(
                LINK_FLOOR_NAME, list(configs[0].overrides), ["--network", "real"], floor=True
            )
        )
    return configs


def common_run_options(
    bench_argv: list[str],
    overrides: list[str],
    with_value: tuple[str, ...] = (),
    switches: tuple[str, ...] = (),
) -> list[str]:
    """The bench command line (without the word `bench`) minus bench-only flags (and the caller's
    own: `with_value` options and `switches`) and minus the positional overrides, which the run
    command line puts last (argparse reads positionals only as one group)."""
    valued, flags = BENCH_OPTIONS_WITH_VALUE + with_value, BENCH_SWITCHES + switches
    out: list[str] = []
    pending = list(overrides)
    items = iter(bench_argv)
    for item in items:
        if item in flags:
            continue
        if item in valued:
            next(items, None)
            continue
        if item.split("=", 1)[0] in valued and "=" in item:
            continue
        if item in pending:
            pending.remove(item)
            continue
        out.append(item)
    return out


@dataclass
class RunResult:
    step_ms: float
    exposed_comm_ms: dict[str, float]
    total_comm_ms: dict[str, float]
    peak_mem_mb: float
    # The steady-state window as FILE.summary.json's `window_iterations`: [first, last], 1-based,
    # both included.
    steps_window: list[int]
    network: str
    comm_mb: dict[str, float] = field(default_factory=dict)
    # Of exposed_comm_ms, the peer wait per kind (profiling/exposed.py); only kinds whose link knew
    # it (modelled).
    exposed_peer_wait_ms: dict[str, float] = field(default_factory=dict)
    # iterations (1-based) the sync-free MoE dispatch re-ran dropless after an overflow
    moe_rerun_iterations: list[int] = field(default_factory=list)

    def window_reruns(self) -> int:
        """The re-runs inside the steady-state window: steps that did two forward-backwards."""
        first, last = self.steps_window
        return sum(first <= i <= last for i in self.moe_rerun_iterations)


class RunFailed(RuntimeError):
    """One `overlap run` of the benchmark exited non-zero: its exit code and the line that says
    why."""

    def __init__(self, config: str, code: int, command: list[str], output: str) -> None:
        super().__init__(
            f"bench run {config!r} failed (exit {code}): {shlex.join(command)}\n{output[-4000:]}"
        )
        self.code = code
        lines = [line for line in output.splitlines() if line.strip()]
        # The run's own verdict ("overlap: error: ...") when it printed one, else its last line.
        self.error = next(
            (line for line in reversed(lines) if line.startswith("overlap: error:")),
            lines[-1] if lines else "(no output)",
        )


def run_command(
    options: list[str], overrides: list[str], config: BenchConfig, metrics: Path
) -> list[str]:
    """The `overlap run` command line of one run of `config`. CPU ranks start through our local
    launcher; GPU ranks one per GPU of this machine through torchrun (`overlap run` joins that
    world), as every GPU run does."""
    # A configuration's own run flag (the link floor's --network) replaces the common one: `overlap
    # run` refuses a flag given twice with different values.
    own = tuple(f for f in config.run_flags if f.startswith("--"))
    run = [
        "run",
        *common_run_options(options, [], with_value=own),
        "--metrics",
        str(metrics),
        *config.run_flags,
        *overrides,
        *config.overrides,
    ]
    from overlap.harness import add_harness_flags

    parser = argparse.ArgumentParser(add_help=False)
    add_harness_flags(parser)
    known, _rest = parser.parse_known_args(options)
    if known.gpu == "cpu":
        return [sys.executable, "-m", "overlap.cli", *run]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={known.num_gpus or 1}",
        "-m",
        "overlap.cli",
        *run,
    ]


def run_once(
    options: list[str], overrides: list[str], config: BenchConfig, metrics: Path
) -> RunResult:
    command = run_command(options, overrides, config, metrics)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RunFailed(config.name, done.returncode, command, done.stdout + done.stderr)
    s = json.loads(Path(f"{metrics}.summary.json").read_text())
    return RunResult(
        s["steady_step_ms"],
        s["exposed_comm_ms"],
        s["total_comm_ms"],
        s["peak_mem_mb"],
        s["window_iterations"],
        s["network"],
        s.get("comm_mb", {}),
        s.get("exposed_peer_wait_ms", {}),
        s.get("moe_rerun_iterations", []),
    )


def _mean_by_kind(runs: list[RunResult], attr: str) -> dict[str, float]:
    kinds = sorted({k for r in runs for k in getattr(r, attr)})
    return {k: statistics.fmean(getattr(r, attr).get(k, 0.0) for r in runs) for k in kinds}


def summarize(
    configs: list[BenchConfig], results: dict[str, list[RunResult]], network: str, command: str
) -> dict:
    """The JSON document: per configuration, ideal time and overlap efficiency (see the module
    docstring). A configuration without any run (the benchmark stopped at a failure first) is left
    out and named in `not_run`."""
    rows = []
    for c in configs:
        runs = results[c.name]
        if not runs:
            continue
        times = [r.step_ms for r in runs]
        rows.append(
            {
                "name": c.name,
                "overrides": c.overrides + c.run_flags,
                "step_time_ms": {
                    "mean": statistics.fmean(times),
                    "min": min(times),
                    "max": max(times),
                    "repeats": times,
                },
                "exposed_comm_ms": _mean_by_kind(runs, "exposed_comm_ms"),
                "total_comm_ms": _mean_by_kind(runs, "total_comm_ms"),
                "comm_mb_per_iter": _mean_by_kind(runs, "comm_mb"),
                "exposed_peer_wait_ms": _mean_by_kind(runs, "exposed_peer_wait_ms"),
                "peak_mem_mb": max(r.peak_mem_mb for r in runs),
                # per repeat: the window's steps re-run dropless (sync-free MoE dispatch)
                "moe_reruns_in_window": [r.window_reruns() for r in runs],
            }
        )
    floor_names = {c.name for c in configs if c.floor}
    floors = [r for r in rows if r["name"] in floor_names]
    measured = [r for r in rows if r["name"] not in floor_names]
    not_run = [c.name for c in configs if not results[c.name]]
    if not measured:  # the very first run failed: no baseline, nothing to compare
        return {
            "network": network,
            "window_iterations": None,
            "repeats": 0,
            "order": "alternating",
            "configs": [],
            "ideal_step_time_ms": None,
            "overlap_efficiency": {},
            "floors_step_time_ms": {},
            "overlap_efficiency_by_floor": {},
            "not_run": not_run,
            "command": command,
            "machine": describe_machine(),
        }
    base = measured[0]["step_time_ms"]["mean"]
    first_times = measured[0]["step_time_ms"]["repeats"]
    for r in rows:
        r["step_time_ratio_to_first"] = r["step_time_ms"]["mean"] / base
        r["step_time_ratio_to_first_per_round"] = per_round_ratios(
            r["step_time_ms"]["repeats"], first_times
        )
    by_floor = {
        f["name"]: {
            r["name"]: overlap_efficiency(
                base, r["step_time_ms"]["mean"], f["step_time_ms"]["mean"]
            )
            for r in measured[1:]
        }
        for f in floors
    }
    # The same per round (each round's off, config and floor ran back to back), median: see
    # per_round_ratios.
    by_floor_per_round = {
        f["name"]: {
            r["name"]: per_round_efficiency(
                first_times, r["step_time_ms"]["repeats"], f["step_time_ms"]["repeats"]
            )
            for r in measured[1:]
        }
        for f in floors
    }
    main_floor = next((f for f in floors if f["name"] == IDEAL_NAME), floors[0] if floors else None)
    t_ideal = main_floor["step_time_ms"]["mean"] if main_floor else None
    efficiency = (
        by_floor[main_floor["name"]] if main_floor else {r["name"]: None for r in measured[1:]}
    )
    for r in rows:
        # A PyTorch peer (ddp.impl=torch_ddp|fsdp2, model.pipeline_impl=torch_pipelining,
        # model.tensor_parallel_impl=dtensor) communicates with torch's own collectives, which our
        # tracer does not see: its communication columns would read as "no (or less) communication".
        # Say so instead.
        r["comm_traced"] = not any(
            o.startswith(("ddp.impl=", "model.pipeline_impl=", "model.tensor_parallel_impl="))
            and o
            not in (
                "ddp.impl=overlap",
                "model.pipeline_impl=overlap",
                "model.tensor_parallel_impl=overlap",
            )
            for o in r["overrides"]
        )
    for r in measured[1:]:
        if r["comm_traced"]:
            r["exposed_hidden_share_vs_first"] = hidden_share_by_family(
                measured[0]["exposed_comm_ms"], r["exposed_comm_ms"]
            )
            if measured[0]["exposed_peer_wait_ms"] and r["exposed_peer_wait_ms"]:
                r["link_exposed_hidden_share_vs_first"] = hidden_share_by_family(
                    _link_exposed(measured[0]), _link_exposed(r)
                )
    first_runs = results[measured[0]["name"]]
    return {
        "network": network,
        "window_iterations": first_runs[0].steps_window,
        "repeats": len(first_runs),
        "order": "alternating",
        "configs": rows,
        "noisy": noisy_configs(rows),
        "ideal_step_time_ms": t_ideal,
        "overlap_efficiency": efficiency,
        "floors_step_time_ms": {f["name"]: f["step_time_ms"]["mean"] for f in floors},
        "overlap_efficiency_by_floor": by_floor,
        "overlap_efficiency_by_floor_per_round": by_floor_per_round,
        "not_run": not_run,
        "command": command,
        "machine": describe_machine(),
    }


def per_round_ratios(times: list[float], first_times: list[float]) -> dict:
    """Each round's step time over the first configuration's in the same round, and their median.
    The rounds alternate the configurations, so a pair ran minutes apart at most: a drift of the
    machine between rounds (a slow round moves every configuration in it) cancels in the pair where
    it moves a mean. The median of the pairs is the statistic to read on a noisy machine; the ratio
    of means is what a steady one gives."""
    ratios = [t / f for t, f in zip(times, first_times) if f > 0]
    return {"median": statistics.median(ratios) if ratios else None, "rounds": ratios}


def per_round_efficiency(off: list[float], on: list[float], floor: list[float]) -> float | None:
    """The median over rounds of each round's (T_off - T_on) / (T_off - T_floor); None without a
    round that had a communication cost to hide."""
    effs = [
        e for e in (overlap_efficiency(a, b, c) for a, b, c in zip(off, on, floor)) if e is not None
    ]
    return statistics.median(effs) if effs else None


# (max - min) / mean of a configuration's repeats above which its mean is called unreliable
NOISY_SPREAD = 0.10


def noisy_configs(rows: list[dict]) -> dict[str, float]:
    """The configurations whose repeats spread by more than NOISY_SPREAD of their mean, with that
    spread: one slow round (the machine drifting, another load) moves such a mean, and every ratio
    and efficiency built on it, by more than most overlaps are worth. Said in the table, so that
    nobody reads a drift as a result."""
    out = {}
    for r in rows:
        st = r["step_time_ms"]
        spread = (st["max"] - st["min"]) / st["mean"] if st["mean"] > 0 else 0.0
        if len(st["repeats"]) > 1 and spread > NOISY_SPREAD:
            out[r["name"]] = spread
    return out


def _link_exposed(row: dict) -> dict[str, float]:
    """A row's exposed time per kind less its peer wait: what the link itself exposed (kinds whose
    link knew it)."""
    peer = row["exposed_peer_wait_ms"]
    return {
        k: row["exposed_comm_ms"][k] - ms for k, ms in peer.items() if k in row["exposed_comm_ms"]
    }


def hidden_share_by_family(first: dict[str, float], other: dict[str, float]) -> dict[str, float]:
    """Per communication family (the kind's prefix: ep, dp, tp, ...), the share of the first
    configuration's exposed time that this configuration no longer exposes: 1 - exposed_other /
    exposed_first. This isolates, say, the EP all-to-all from a data-parallel reduction that every
    configuration pays alike."""
    from overlap.profiling.exposed import ALL

    def families(by_kind: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind, ms in by_kind.items():
            if kind != ALL:
                fam = kind.split("_", 1)[0]
                out[fam] = out.get(fam, 0.0) + ms
        return out

    a, b = families(first), families(other)
    return {fam: 1.0 - b.get(fam, 0.0) / ms for fam, ms in sorted(a.items()) if ms > 0}


def _kinds(by_kind: dict[str, float]) -> str:
    from overlap.profiling.exposed import ALL

    parts = [f"{k} {v:.1f}" for k, v in sorted(by_kind.items()) if k != ALL and v >= 0.05]
    head = f"{by_kind.get(ALL, 0.0):.1f}"
    return f"{head} ({', '.join(parts)})" if parts else head


def _shares(shares: dict[str, float] | None) -> str:
    return "-" if not shares else ", ".join(f"{fam} {v:.2f}" for fam, v in shares.items())


def window_of(doc: dict) -> tuple[int, int]:
    """A bench or summary document's steady-state window as 1-based (first, last), both included.
    Documents written before `window_iterations` carry `steps_window`, 0-based [start, end)."""
    if "window_iterations" in doc:
        first, last = doc["window_iterations"]
        return first, last
    start, end = doc["steps_window"]
    return start + 1, end


def format_markdown(doc: dict) -> str:
    if doc.get("window_iterations", doc.get("steps_window")) is None:
        window = "none (no run finished)"
    else:
        first, last = window_of(doc)
        window = f"iterations {first}-{last} (1-based, inclusive)"
    by_floor = doc.get("overlap_efficiency_by_floor", {})
    lines = [
        f"Network: {doc['network']}  ",
        f"Steady-state window: {window}, {doc['repeats']} alternating "
        "repeats; comm columns are rank 0's mean per iteration in ms, `all` first (union of "
        "kinds).  ",
        f"Command: `{doc['command']}`  ",
        # Results committed before the machine was recorded have no "machine".
        machine_line(doc["machine"]) if "machine" in doc else "Machine: not recorded",
        "",
        "| config | step ms (mean) | min | max | vs first | vs first, per round | exposed comm ms "
        "| total comm ms | MB/iter | peak MB | "
        + "".join(f"eff. vs {name} | " for name in by_floor)
        + "exposed hidden vs first |",
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(by_floor) + "---|",
    ]
    for r in doc["configs"]:
        st = r["step_time_ms"]
        per_round = (
            doc.get("overlap_efficiency_by_floor_per_round", {}) if doc["repeats"] > 1 else {}
        )
        effs = "".join(
            f"{_eff(doc_effs.get(r['name']), per_round.get(floor, {}).get(r['name']))} | "
            for floor, doc_effs in by_floor.items()
        )
        traced = r.get("comm_traced", True)
        untraced = "n/a (peer: torch's collectives are not traced)"
        lines.append(
            f"| {r['name']} | {st['mean']:.1f} | {st['min']:.1f} | {st['max']:.1f} | "
            f"{r['step_time_ratio_to_first']:.3f} | {_per_round(r)} | "
            f"{_kinds(r['exposed_comm_ms']) if traced else untraced} | "
            f"{_kinds(r['total_comm_ms']) if traced else untraced} | "
            f"{format(r['comm_mb_per_iter'].get('all', 0.0), '.2f') if traced else 'n/a'} | "
            f"{r['peak_mem_mb']:.0f} | {effs}{_shares(r.get('exposed_hidden_share_vs_first'))} |"
        )
    if not by_floor:
        lines.append(
            "\n(no floor run (--ideal / --ideal-family): overlap efficiency needs a floor T_ideal)"
        )
    else:
        lines.append(
            "\neff. vs FLOOR = (T_first - T_config) / (T_first - T_FLOOR), the first config being "
            "'off'; per round: the median of that ratio within each round."
        )
    return "\n".join(
        lines + _noisy_lines(doc) + _rerun_lines(doc) + _peer_wait_lines(doc) + _failure_lines(doc)
    )


def _per_round(row: dict) -> str:
    """The per-round ratios' median and range, e.g. "0.978 (0.93-1.12)"; results written before
    them: "-"."""
    per_round = row.get("step_time_ratio_to_first_per_round") or {}
    ratios, median = per_round.get("rounds") or [], per_round.get("median")
    if median is None:
        return "-"
    return (
        f"{median:.3f}"
        if len(ratios) == 1
        else f"{median:.3f} ({min(ratios):.2f}-{max(ratios):.2f})"
    )


def _rerun_lines(doc: dict) -> list[str]:
    """The configurations whose steps the sync-free MoE dispatch re-ran dropless inside the window
    (each such step did two forward-backwards: its time is in the mean), per repeat."""
    rows = [r for r in doc["configs"] if any(r.get("moe_reruns_in_window", ()))]
    if not rows:
        return []
    named = "; ".join(
        f"`{r['name']}` {', '.join(map(str, r['moe_reruns_in_window']))}" for r in rows
    )
    return [
        "\nSteps re-run dropless after a sync-free MoE block overflowed "
        f"(model.moe_expert_rank_capacity_factor), in the window, per repeat: {named}."
    ]


def _noisy_lines(doc: dict) -> list[str]:
    noisy = doc.get("noisy") or {}
    if not noisy:
        return []
    rows = {r["name"]: r["step_time_ms"] for r in doc["configs"]}
    named = "; ".join(
        f"`{name}` {rows[name]['min']:.0f}-{rows[name]['max']:.0f} ms ({spread:.0%} of its mean)"
        for name, spread in noisy.items()
    )
    return [
        f"\n**NOISY**: repeats spread by more than {NOISY_SPREAD:.0%} of their mean: {named}. The "
        "machine drifted during the benchmark, so the means, ratios of means and efficiencies "
        "above are unreliable: read the per-round ratios (each round's pair ran back to back), "
        "rerun it alone, or with more --repeats."
    ]


def _peer_wait_lines(doc: dict) -> list[str]:
    """Where the modelled link knew when every member had posted: each row's exposed time on that
    link split into peer wait (a member was late: load imbalance, which no overlap hides) and the
    link's own exposed time, and the share of the first row's link exposure that each row hides."""
    rows = [
        r for r in doc["configs"] if r.get("exposed_peer_wait_ms") and r.get("comm_traced", True)
    ]
    if not rows:
        return []
    lines = [
        "",
        "Exposed time of the kinds whose ready time the modelled link knew (collectives and "
        "receives, summed over kinds), split: *peer wait* is time waiting for a member to post (a "
        "late peer: load imbalance), *link* the rest.",
        "",
        "| config | exposed ms | of it peer wait | link | link exposed hidden vs first |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        peer = sum(ms for k, ms in r["exposed_peer_wait_ms"].items() if k != "all")
        exposed = sum(
            r["exposed_comm_ms"].get(k, 0.0) for k in r["exposed_peer_wait_ms"] if k != "all"
        )
        lines.append(
            f"| {r['name']} | {exposed:.1f} | {peer:.1f} | {exposed - peer:.1f} | "
            f"{_shares(r.get('link_exposed_hidden_share_vs_first'))} |"
        )
    return lines


def _failure_lines(doc: dict) -> list[str]:
    """Say which run failed and which configurations therefore have no row (a partial result must
    not pass for a whole one)."""
    lines = []
    failed = doc.get("failed")
    if failed:
        lines.append(
            f"\n**FAILED**: round {failed['round']}, config `{failed['config']}` exited "
            f"{failed['exit']}: {failed['error']}. The benchmark stopped there; the rows above are "
            "the runs that finished."
        )
    if doc.get("not_run"):
        lines.append(f"\nNot run (no row): {', '.join(f'`{name}`' for name in doc['not_run'])}.")
    return lines


def _eff(value: float | None, per_round: float | None = None) -> str:
    """The efficiency of the means, and the per-round median where there is one, e.g. "0.59 (per
    round 0.56)"."""
    if value is None:
        return "-"
    return f"{value:.2f}" if per_round is None else f"{value:.2f} (per round {per_round:.2f})"


def _validate(args: argparse.Namespace, configs: list[BenchConfig]) -> None:
    """Resolve every configuration here first: a bad one fails before any run starts, with the usual
    message."""
    from overlap.harness import prepare
    from overlap.launch.network import (
        EMULATED,
        check_netns_support,
        check_network_for,
        parse_network,
    )

    network = parse_network(args.network)
    check_network_for(network, args.gpu)
    if network.kind in EMULATED:
        check_netns_support(network.text)
    from overlap.launch.paths import check_bench_outputs
    from overlap.launch.resources import check_run_resources
    from overlap.perf.memory_model import rank_memory
    from overlap.training.runtime_refusals import check_runtime_support

    if args.repeats < 1:
        raise ConfigError(
            "--repeats", args.repeats, "at least one round is needed.", "pass --repeats 1 or more."
        )
    check_bench_outputs(args)  # --json / --markdown: before the first run, not after the last
    common = {o.split("=", 1)[0].strip(): o for o in args.overrides}
    for c in configs:
        for o in c.overrides if not c.floor else ():
            key = o.split("=", 1)[0].strip()
            if key in common:
                raise ConfigError(
                    "--config",
                    c.name,
                    f"it sets {key}, which the common overrides set too ({common[key]}).",
                    f"set {key} in one place: each --config, or the common overrides.",
                )
        ns = copy.copy(args)
        ns.overrides = list(args.overrides) + c.overrides
        job = prepare(ns)
        # What `overlap run` would refuse, for every configuration, before the first one trains.
        check_runtime_support(job.cfg, gpu=args.gpu != "cpu")
        check_run_resources(
            job.cfg,
            job.resolution.layout,
            ns,
            estimate=lambda cpu, job=job: rank_memory(job.cfg, job.resolution.layout, cpu=cpu),
        )


def run_bench_command(args: argparse.Namespace) -> int:
    from overlap.launch.network import parse_network

    if (args.ab is None) == (args.configs is None):
        raise ConfigError(
            "--ab/--config",
            args.ab or args.configs,
            "give either --ab KEY=V1,V2 or two or more --config NAME:OVERRIDES.",
            "pass exactly one of the two forms.",
        )
    if args.ab is not None:
        key, values = parse_ab(args.ab)
        if any(o.split("=", 1)[0] == key for o in args.overrides):
            raise ConfigError(
                "--ab", args.ab, f"{key} is also given as an override.", "remove that override."
            )
        configs = build_configs(key, values, args.ideal, args.ideal_families, args.ideal_link)
    else:
        configs = with_ideal(
            [parse_named_config(c) for c in args.configs],
            args.ideal,
            args.ideal_families,
            args.ideal_link,
        )
        if sum(not c.floor for c in configs) < 2 or len({c.name for c in configs}) != len(configs):
            raise ConfigError(
                "--config",
                args.configs,
                "a comparison needs two or more distinctly named configs.",
                "repeat --config NAME:OVERRIDES with different names.",
            )
    if args.ideal_link and parse_network(args.network).kind == "real":
        raise ConfigError(
            "--ideal-link",
            True,
            "the run is on the plain loopback already (--network real), so the link floor would be "
            "the baseline itself.",
            "pass --network model:... or tbf:..., or drop --ideal-link.",
        )
    _validate(args, configs)
    network = parse_network(args.network).describe()
    options = common_run_options(args.argv[1:], args.overrides)
    command = shlex.join(["overlap", *args.argv])
    results: dict[str, list[RunResult]] = {c.name: [] for c in configs}
    failed = _run_rounds(args, configs, options, results)
    windows = {tuple(r.steps_window) for runs in results.values() for r in runs}
    if len(windows) > 1:
        raise RuntimeError(f"the runs used different steady-state windows {sorted(windows)}")
    doc = summarize(configs, results, network, command)
    if failed is not None:
        doc["failed"] = failed
    table = format_markdown(doc)
    print(table)
    if args.markdown:
        write_replace(args.markdown, table + "\n")
    if args.json_out:
        write_replace(args.json_out, json.dumps(doc, indent=1) + "\n")
    return 0 if failed is None else 1


def _run_rounds(
    args: argparse.Namespace,
    configs: list[BenchConfig],
    options: list[str],
    results: dict[str, list[RunResult]],
) -> dict | None:
    """Run the configurations alternately for `args.repeats` rounds into `results`. The first failed
    run stops the benchmark (no retry: a run that fails is a finding, not noise) and is returned as
    {config, round (1-based), exit, error}, so that the caller still writes what finished, with the
    failure named; None if all finished."""
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as tmp:
        for rnd in range(args.repeats):
            for i, c in enumerate(configs):
                try:
                    res = run_once(
                        options, list(args.overrides), c, Path(tmp) / f"r{rnd}c{i}.jsonl"
                    )
                except RunFailed as exc:
                    print(f"overlap bench: {exc}", file=sys.stderr)
                    return {
                        "config": c.name,
                        "round": rnd + 1,
                        "exit": exc.code,
                        "error": exc.error,
                    }
                results[c.name].append(res)
                print(
                    f"[bench] round {rnd + 1}/{args.repeats} {c.name}: {res.step_ms:.1f} ms/step, "
                    "exposed comm "
                    f"{res.exposed_comm_ms.get('all', 0.0):.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return None
