"""What `overlap plan` prints and writes: a table per configuration, one verdict line per overlap
switch, and a JSON document shaped like `overlap bench`'s (`configs[].name / overrides /
step_time_ms.mean / exposed_comm_ms / total_comm_ms`) so one script reads a plan and a measurement
alike."""

from __future__ import annotations

from overlap.launch.activations import SAVED_INPUT_BYTES
from overlap.plan.hardware import Cluster
from overlap.plan.predict import Prediction

PAYS = 0.01  # a switch whose predicted change is within 1% of the step "does not matter" either way


def config_json(p: Prediction) -> dict:
    t = p.times
    total = {k: c.seconds_per_step * 1e3 for k, c in sorted(p.comm.kinds.items())}
    exposed = {k: v * 1e3 for k, v in sorted(t.exposed_s.items())}
    nbytes = {k: c.bytes_per_step for k, c in sorted(p.comm.kinds.items())}
    hidden = {k: max(0.0, v - exposed.get(k, 0.0)) for k, v in total.items()}
    for by_kind in (total, exposed, hidden, nbytes):
        # bench's `all` key (there: the union of kinds; here: their sum)
        by_kind["all"] = sum(by_kind.values())
    lay = p.layout
    return {
        "name": p.name,
        "overrides": list(p.overrides),
        "step_time_ms": {"mean": p.step_ms},
        "tflops_per_gpu": p.tflops_per_gpu,
        "compute_ms": t.compute_s * 1e3,
        "bubble_ms": t.bubble_s * 1e3,
        "overlap_slowdown_ms": t.slowdown_s * 1e3,
        "exposed_comm_ms": exposed,
        "total_comm_ms": total,
        # what runs under compute (overlap switches and the schedule's slack): total - exposed
        "hidden_comm_ms": hidden,
        "bytes_per_iter": nbytes,
        "peak_mem_gb": p.peak_mem_bytes / 1e9,
        "memory_fit": p.fit,
        "microbatches": p.microbatches,
        "layout": {
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "ep": lay.ep,
            "edp": lay.edp,
            "vpp": p.switches.vpp,
        },
    }


def expected_error(cluster: Cluster, fp8_note: str = "") -> dict:
    """What error to expect of the plan's step times: the GPU type's leave-one-out validation on
    published runs (`overlap.plan.validate`), or why there is none."""
    if cluster.expected_error is None:
        if cluster.gpu == "cpu":
            why = (
                "not validated: the compute efficiency is this machine's calibration (the CPU "
                "proof is bench/results/plan_vs_bench.md)"
            )
        else:
            why = "not validated: the compute efficiency comes from the cluster file"
        return {"median": None, "worst": None, "short": "n/a", "text": why + fp8_note}
    median, worst = cluster.expected_error
    where = (
        f"leave-one-out over published Megatron-Bridge runs on {cluster.gpu}'s GPU group, "
        "docs/planner.md 'Validation'"
    )
    return {
        "median": median,
        "worst": worst,
        "short": f"±{100 * median:.0f}% (worst ±{100 * worst:.0f}%)",
        "text": f"±{100 * median:.0f}% median, ±{100 * worst:.0f}% worst ({where})" + fp8_note,
    }


def plan_json(
    cluster: Cluster,
    predictions: list[Prediction],
    verdicts: list[str],
    command: str,
    fp8_note: str = "",
) -> dict:
    base = predictions[0].step_ms
    error = expected_error(cluster, fp8_note)
    per_config = {"median": error["median"], "worst": error["worst"]}
    configs = [
        config_json(p)
        | {"step_time_ratio_to_first": p.step_ms / base, "expected_error": per_config}
        for p in predictions
    ]
    return {
        "cluster": cluster.to_json(),
        "configs": configs,
        "verdicts": verdicts,
        "command": command,
        "predicted": True,
        "expected_error": error,
    }


def verdict(label: str, off: Prediction, on: Prediction) -> str:
    """ "EP overlap: -24% step time: pays" / "delay_wgrad: within 1%" / "...: costs"."""
    change = on.step_ms / off.step_ms - 1
    if abs(change) <= PAYS:
        return f"{label}: within 1% ({change:+.1%})"
    return f"{label}: {change:+.0%} step time: {'pays' if change < 0 else 'costs'}"


def _kinds(by_kind: dict[str, float]) -> str:
    parts = [f"{k} {v:.1f}" for k, v in by_kind.items() if k != "all" and v >= 0.05]
    return f"{by_kind.get('all', 0.0):.1f}" + (f" ({', '.join(parts)})" if parts else "")


def overhead(us: float) -> str:
    """The per-kernel overhead beside the efficiency (nothing where none is modelled): a floor
    under each kernel's time, not an addition (`overlap.plan.compute`)."""
    return f", each kernel outside CUDA graphs at least {us:.1f} us (its launch)" if us else ""


def format_markdown(doc: dict) -> str:
    c = doc["cluster"]
    error = doc["expected_error"]
    lines = [
        f"Predicted (nothing was run) for {c['gpus_per_node']} x {c['gpu']} per node, "
        f"{c['precision']} peak {c['peak_tflops']:g} TFLOP/s; NVLink "
        f"{c['nvlink']['bandwidth_GBps']:g} GB/s, NIC {c['nic']['bandwidth_GBps']:g} GB/s.  ",
        f"Expected error of every step time below: {error['text']}.  ",
        f"Compute efficiency {c['compute_efficiency']:.4f} of "
        f"peak{overhead(c['kernel_overhead_us'])} ({c['compute_efficiency_source']}); overlap "
        f"slowdown {c['overlap_slowdown']} ({c['overlap_slowdown_source']}).  ",
        f"Command: `{doc['command']}`",
        "",
        "| config | step ms | expected error | vs first | TFLOP/s/GPU | compute ms | bubble ms | "
        "slowdown ms | exposed comm ms | total comm ms | GB/iter | peak GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["configs"]:
        lines.append(
            f"| {r['name']} | {r['step_time_ms']['mean']:.1f} | {error['short']} | "
            f"{r['step_time_ratio_to_first']:.3f} | {r['tflops_per_gpu']:.1f} | "
            f"{r['compute_ms']:.1f} | {r['bubble_ms']:.1f} | {r['overlap_slowdown_ms']:.1f} | "
            f"{_kinds(r['exposed_comm_ms'])} | {_kinds(r['total_comm_ms'])} | "
            f"{r['bytes_per_iter']['all'] / 1e9:.2f} | {r['peak_mem_gb']:.1f} |"
        )
    fits = [f"- {r['name']}: {r['memory_fit']}" for r in doc["configs"] if r.get("memory_fit")]
    if fits:
        fp8 = (
            f"; at {c['precision']} the linears keep FP8 copies of their inputs"
            if c["precision"] in SAVED_INPUT_BYTES
            else ""
        )
        lines += [
            "",
            f"Memory (the peak of the rank that needs the most, overlap.perf.memory_model{fp8}):",
        ]
        lines += fits
    lines += ["", "Verdicts:"] + [f"- {v}" for v in doc["verdicts"]]
    return "\n".join(lines)


def _given_line(result, first_ms: float) -> str:
    """Where the command line's own layout stands: its step against the first, its place among the
    priced, whether it fits; or why it could not be priced."""
    from overlap.perf.memory_model import gib
    from overlap.plan.search import Given, differences

    given = result.given
    if given is None:  # a result built by hand
        return ""
    if not isinstance(given, Given):
        return f"The command line's own layout was not priced: {given}."
    p, (rank, exact) = given.prediction, given.rank(result)
    place = (
        f"it would rank {rank} of the {len(result.ranked)} priced"
        if exact
        else f"{rank - 1} of the {len(result.ranked)} priced are faster, and layouts left "
        "unpriced may be too"
    )
    memory = (
        f"peak {gib(p.peak_mem_bytes)}, margin {gib(given.margin_bytes)}"
        if given.margin_bytes >= 0
        else f"it does not fit: peak {gib(p.peak_mem_bytes)}, "
        f"{gib(-given.margin_bytes)} over the GPU's memory less its reserve"
    )
    against = (
        f" Against it the first's {differences(result.ranked[0].prediction.times, p.times)}."
        if result.ranked and p.step_ms > first_ms
        else ""
    )
    return (
        f"The command line's own layout, {given.layout.describe()} at its switches as resolved: "
        f"{p.step_ms:.0f} ms, {p.step_ms / first_ms:.3f} x the first; {place}; {memory}.{against}"
    )


def format_search(result, top: int, command: str) -> str:
    """`overlap plan --search N`'s table: the N fastest layouts that fit, what each hides under
    compute and what it exposes, its memory margin and command; then why the first beats the second
    and what was left out."""
    from overlap.perf.memory_model import gib
    from overlap.plan.search import REFINE

    error = expected_error(result.cluster)
    lines = [
        f"The {min(top, len(result.ranked))} fastest of {len(result.ranked)} layouts priced "
        f"({result.considered} considered: {result.not_fitting} do not fit even with full "
        f"recompute and Megatron-FSDP, {result.bounded} fit or may but are left unpriced as "
        f"their compute and pipeline ramp alone are slower than the ones kept, "
        f"{sum(result.refused.values())} "
        f"refused by the configuration rules) on "
        f"{result.cluster.gpus_per_node} x {result.cluster.gpu} per node; predicted, nothing was "
        f"run. Expected error of each step time: {error['text']}.  ",
        f"Command: `{command}`",
        "",
        "| # | layout | step ms | vs first | TFLOP/s/GPU | bubble ms | hidden comm ms | "
        "exposed comm ms | peak | margin | switches flipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = result.ranked[0].prediction.step_ms if result.ranked else 0.0
    for i, c in enumerate(result.ranked[:top], 1):
        p, by_kind = c.prediction, config_json(c.prediction)
        lines.append(
            f"| {i} | {c.layout.describe()} | {p.step_ms:.0f} | {p.step_ms / first:.3f} | "
            f"{p.tflops_per_gpu:.0f} | {p.times.bubble_s * 1e3:.0f} | "
            f"{_kinds(by_kind['hidden_comm_ms'])} | {_kinds(by_kind['exposed_comm_ms'])} | "
            f"{gib(p.peak_mem_bytes)} | {gib(c.margin_bytes)} | "
            f"{' '.join(c.switches) or '-'} |"
        )
    lines += ["", f"Why the first: {result.why_best()}."]
    near = result.near_best()
    if near > 1:
        exact = result.near_best_is_exact()
        lines.append(
            f"{'' if exact else 'At least '}{near} layouts (the first included) are predicted "
            f"within ±{100 * result.band:.1f}% of the first, the model's median error on this GPU "
            "group: their order is the model's, not a measurement, so measure the first few "
            "before settling on one"
            + (f" (`--search {near}` lists them)" if near > top else "")
            + (
                ""
                if exact
                else f"; past the first {REFINE} they are priced at the automatic switches"
            )
            + "."
        )
    given = _given_line(result, first)
    if given:
        lines.append(given)
    lines += ["", "Commands:"]
    lines += [
        f"{i}. `{c.command(result.words, result.overrides)}`"
        + (f" (`overlap run` refuses it today: {c.not_runnable})" if c.not_runnable else "")
        for i, c in enumerate(result.ranked[:top], 1)
    ]
    for title, tally in (
        ("Refused by the configuration rules (count: field: why):", result.refused),
        (
            "Recompute rungs refused by the configuration rules, the layout taking another rung "
            "(count: field: why):",
            result.rungs_refused,
        ),
    ):
        if tally:
            lines += ["", title]
            lines += [f"- {n}: {why}" for why, n in sorted(tally.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines)
