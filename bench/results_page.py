"""Write docs/results.md from the committed results, so the page cannot drift from the data.

    python bench/results_page.py            # rewrites docs/results.md
    python bench/results_page.py --check    # exit 1 if docs/results.md is not what it would write

Inputs: every file in bench/results/ (the JSON of `overlap bench`, `hf_compute_bench.py` and
`checkpoint_bench.py`, and the text / Markdown outputs of the other commands), bench/commands.sh
(which numbered command writes which file: its `# N. -> FILE` headers) and bench/results_notes.md
(the analysis: one `## KEY` section per page section or result, KEY being a section key below or a
result's file stem). The page has one part per result: a table, the command that made it, its
number in bench/commands.sh, and its note.
"""

import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

from overlap.perf.bench import window_of

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COMMANDS = ROOT / "bench" / "commands.sh"
NOTES = ROOT / "bench" / "results_notes.md"
PAGE = ROOT / "docs" / "results.md"

# (section key, title, result stems in page order). A result file in bench/results/ that no section
# names is an error (see `missing_results`), so a new result cannot be committed without a place on
# the page.
SECTIONS = (
    ("summary", "Summary", ()),
    (
        "ep",
        "EP overlap",
        (
            "ep_overlap",
            "ep_overlap_2ranks",
            "ep_overlap_one_rank_per_core",
            "ep_overlap_balanced",
            "ep_overlap_capacity",
            "flex_vs_alltoall",
        ),
    ),
    (
        "ep_cpus",
        "EP overlap on CPUs with fast bf16",
        (
            "ep_overlap_epyc_20MBs",
            "ep_overlap_epyc_60MBs",
            "ep_overlap_epyc_30MBs_linkfloor",
            "ep_overlap_epyc_30MBs",
            "ep_overlap_xeon_20MBs",
            "ep_overlap_xeon_30MBs",
            "ep_overlap_xeon_nolink",
        ),
    ),
    (
        "ep_pp",
        "EP overlap under the interleaved pipeline",
        (
            "ep_overlap_pp",
            "ep_overlap_pp_8mb",
            "ep_overlap_pp_balanced",
            "ep_overlap_pp_xeon_2MBs",
            "ep_overlap_pp_xeon_8MBs",
        ),
    ),
    ("dp", "DP overlap", ("dp_overlap", "dp_overlap_modelled", "dp_overlap_2ranks")),
    (
        "pp",
        "Pipeline schedules and p2p overlap",
        (
            "pp_schedules",
            "pp_1f1b_overlap",
            "pp_1f1b_overlap_20MBs",
            "pp_1f1b_overlap_20MBs_pp4",
            "pp_1f1b_overlap_20MBs_pp4_deep",
            "pp_1f1b_overlap_10MBs_pp4_deep",
            "pp_1f1b_deep_warmup_20MBs_pp4",
            "pp_1f1b_deep_warmup_10MBs_pp4_deep",
            "pp_1f1b_deep_warmup_20MBs_pp2_unbalanced",
            "pp_1f1b_deep_warmup_20MBs_pp2",
            "pp_1f1b_overlap_nic",
            "pp_1f1b_overlap_nic_pp4",
            "pp_1f1b_overlap_nic_20MBs",
            "pp_schedules_2ranks",
            "pp_schedules_modelled",
            "pp_bubble",
            "pp_p2p_overlap_vpp",
            "pp_vs_torch_2ranks",
            "pp_vs_torch_2ranks_vpp2",
            "pp_vs_torch_cpu_time",
        ),
    ),
    ("tp", "TP overlap", ("tp_overlap", "tp_overlap_narrow")),
    ("cp", "CP overlap", ("cp_overlap",)),
    ("moe", "Sync-free dropless MoE", ("moe_sync_free",)),
    ("checkpoints", "Checkpoints", ("checkpoint",)),
    (
        "compute",
        "Compute next to transformers",
        ("hf_compute", "hf_compute_fp32", "hf_compute_bf16", "hf_compute_moe_40"),
    ),
    ("memory", "The memory work against the version before it", ("memory_versions_ab",)),
    ("costs", "What gloo costs on this machine", ("gloo_costs",)),
    ("planner", "The planner against these results", ("loopback_probe", "plan_vs_bench")),
)

_HEADER = re.compile(r"^# (\d+)\. -> (\S+?)(?:\.json/\.md|\.json|\.md|\.txt)?\. (.*)$")


def commands(text: str) -> dict[str, tuple[int, str]]:
    """Result stem -> (number, description) of the bench/commands.sh command that writes it: the
    `# N. -> FILE.` header and the comment lines that continue it."""
    out: dict[str, tuple[int, str]] = {}
    stem = None
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            stem = m.group(2)
            if stem in out:
                raise ValueError(f"bench/commands.sh: two commands write {stem}")
            out[stem] = (int(m.group(1)), m.group(3).strip())
        elif stem is not None and line.startswith("#  "):
            number, text_so_far = out[stem]
            out[stem] = (number, f"{text_so_far} {line[1:].strip()}")
        else:
            stem = None
    return out


def notes(text: str) -> dict[str, str]:
    """`## KEY` sections of bench/results_notes.md -> their text (stripped)."""
    out: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("## "):
            key = line[3:].strip()
            if key in out:
                raise ValueError(f"bench/results_notes.md: section '## {key}' appears twice")
            out[key] = ""
        elif key is not None:
            out[key] += line + "\n"
        elif line.strip() and not line.startswith("# "):
            raise ValueError(
                f"bench/results_notes.md: text before the first '## KEY' section: {line!r}"
            )
    return {k: v.strip() for k, v in out.items()}


def result_stems() -> set[str]:
    """Every result in bench/results/, by stem (a benchmark's .json and .md are one result)."""
    return {p.stem for p in RESULTS.iterdir() if p.suffix in (".json", ".md", ".txt")}


def missing_results() -> set[str]:
    placed = {stem for _, _, stems in SECTIONS for stem in stems}
    return result_stems() - placed


def _f(x: float | None, digits: int = 0) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _bench_table(doc: dict) -> list[str]:
    """An `overlap bench` result: one row per configuration, floors included."""
    floors = list(doc.get("floors_step_time_ms", {}))
    by_floor = doc.get("overlap_efficiency_by_floor", {})
    per_round = any("step_time_ratio_to_first_per_round" in c for c in doc["configs"])
    hidden = any("exposed_hidden_share_vs_first" in c for c in doc["configs"])
    head = ["config", "step ms (mean)", "min-max", "vs first"]
    head += ["vs first, per-round median"] if per_round else []
    head += ["exposed comm ms", "total comm ms", "MB/iter"]
    head += [f"eff. vs {f.removeprefix('ideal ').strip('()')}" for f in floors]
    head += ["exposed hidden vs first"] if hidden else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in doc["configs"]:
        st = c["step_time_ms"]
        name = c["name"] + (" (**NOISY**)" if _noisy(st) else "")
        traced = c.get("comm_traced", True)
        row = [
            name,
            _f(st["mean"]),
            f"{st['min']:.0f}-{st['max']:.0f}",
            _f(c["step_time_ratio_to_first"], 3),
        ]
        if per_round:
            pr = c.get("step_time_ratio_to_first_per_round")
            row.append(_f(pr["median"], 3) if pr else "")
        row += [
            _f(c["exposed_comm_ms"]["all"]) if traced else "n/a",
            _f(c["total_comm_ms"]["all"]) if traced else "n/a",
            _f(c["comm_mb_per_iter"]["all"], 2) if traced else "n/a",
        ]
        row += [_f(by_floor.get(f, {}).get(c["name"]), 2) for f in floors]
        if hidden:
            share = c.get("exposed_hidden_share_vs_first", {})
            row.append(", ".join(f"{k} {v:.2f}" for k, v in sorted(share.items())))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _noisy(step: dict) -> bool:
    """`overlap bench`'s rule, applied to every result alike (some predate the flag in the JSON):
    repeats that spread by more than 10% of their mean make the mean unreliable."""
    return step["max"] - step["min"] > 0.10 * step["mean"]


def _bench_header(doc: dict) -> list[str]:
    first, last = window_of(doc)
    facts = [
        f"Network: {doc['network'].split(' (')[0]}",
        f"{doc['repeats']} {doc['order']} repeats",
        f"steady-state window: iterations {first}-{last}",
    ]
    lines = ["; ".join(facts) + ". Communication columns are rank 0's mean per iteration."]
    if any(_noisy(c["step_time_ms"]) for c in doc["configs"]):
        lines += [
            "",
            "**NOISY**: that configuration's repeats spread by more than 10% of their mean; the "
            "machine drifted, so read its per-round ratios where they are given, not its mean.",
        ]
    return lines


def _versions_table(doc: dict) -> list[str]:
    """bench/versions_ab.py's result, in its own words (one renderer for both)."""
    spec = importlib.util.spec_from_file_location("versions_ab", ROOT / "bench" / "versions_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.table(doc)


def _hf_table(doc: dict) -> list[str]:
    lines = [
        "| model | dtype | attention (ours) | ours ms | transformers ms | ours / transformers | "
        "per pair | loss ours | loss transformers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['attention_backend']} | {r['ours_ms']:.1f} | "
            f"{r['transformers_ms']:.1f} | {r['ratio']:.3f} | {r['pair_ratio_median']:.3f} | "
            f"{r['loss_ours']:.4f} | {r['loss_transformers']:.4f} |"
        )
    return lines


def _checkpoint_table(doc: dict) -> list[str]:
    cols = (
        "size_mb",
        "blocked_ms",
        "complete_ms",
        "step_no_save_ms",
        "step_after_save_ms",
        "load_ms",
    )
    lines = [
        "| workload | mode | size MB | save blocks training ms | save complete ms | step, no save "
        "ms | step during an async write ms | load ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workload, modes in doc["results"].items():
        for mode, runs in modes.items():
            means = [statistics.fmean(r[c] for r in runs) for c in cols]
            lines.append(
                f"| {workload} | {mode} | {means[0]:.1f} | "
                + " | ".join(f"{m:.0f}" for m in means[1:])
                + " |"
            )
    return [
        f"{doc['iters']} iterations, a save every {doc['interval']}, then a load + 1 iteration; "
        "means over "
        f"the saves and {doc['repeats']} alternated repeats.",
        "",
    ] + lines


def _probe_table(doc: dict) -> list[str]:
    lines = ["| ranks | latency us | bandwidth GB/s |", "|---|---|---|"]
    for ranks, link in doc.items():
        lines.append(f"| {ranks} | {link['latency_us']:.0f} | {link['bandwidth_GBps']:.2f} |")
    return lines


def _machine(doc: dict) -> str:
    m = doc.get("machine")
    if not m:
        return ""
    flags = ", ".join(m.get("bf16_flags") or []) or "none"
    return f"Machine: {m['cpu']}, {m['cores']} cores (bf16 flags: {flags}), torch {m['torch']}."


def _result(stem: str, command: tuple[int, str] | None, note: str) -> list[str]:
    if command is None:
        raise ValueError(
            f"bench/commands.sh has no '# N. -> {stem}...' command for bench/results/{stem}"
        )
    number, description = command
    out = [f"### {stem}", "", description, ""]
    cmd_line = f"Command {number} in [bench/commands.sh](../bench/commands.sh)"
    js = RESULTS / f"{stem}.json"
    if js.exists():
        doc = json.loads(js.read_text())
        if "configs" in doc:
            body = _bench_header(doc) + [""] + _bench_table(doc)
        elif "a" in doc and "b" in doc:
            body = _versions_table(doc)
        elif "rows" in doc:
            body = _hf_table(doc)
        elif "workloads" in doc:
            body = _checkpoint_table(doc)
        else:
            body = _probe_table(doc)
        machine = _machine(doc)
        if machine:
            body = [machine, ""] + body
        out += body + [""]
        if "command" in doc:
            out += [f"{cmd_line}:", "", "```", doc["command"], "```", ""]
        else:
            out += [f"{cmd_line}.", ""]
        if (RESULTS / f"{stem}.md").exists():
            out += [f"Full table: [bench/results/{stem}.md](../bench/results/{stem}.md).", ""]
    else:
        path = next(RESULTS.glob(f"{stem}.*"))
        text = path.read_text().rstrip("\n")
        if path.suffix == ".md":
            out += [text, "", f"{cmd_line}.", ""]
        else:
            out += [
                "```",
                text,
                "```",
                "",
                f"{cmd_line} ([bench/results/{path.name}](../bench/results/{path.name})).",
                "",
            ]
    if note:
        out += [note, ""]
    return out


def render() -> str:
    missing = missing_results()
    if missing:
        raise ValueError(
            f"bench/results_page.py: no section places {sorted(missing)}; add them to SECTIONS"
        )
    made_by = commands(COMMANDS.read_text())
    texts = notes(NOTES.read_text())
    known = {k for k, _, _ in SECTIONS} | {s for _, _, stems in SECTIONS for s in stems}
    stray = set(texts) - known
    if stray:
        raise ValueError(
            f"bench/results_notes.md: sections {sorted(stray)} name no result or page section"
        )
    out = [
        "# Measured results",
        "",
        "Generated by `python bench/results_page.py` from bench/results/ (the data), "
        "bench/commands.sh (the commands) and bench/results_notes.md (the analysis); "
        "`tests/test_results_page.py` fails if this page and its generator's output differ. Step "
        "times are steady-state means in ms; efficiency is `(T_off - T_on) / (T_off - T_floor)` "
        "with the first configuration as off; columns are explained in "
        "[bench/README.md](../bench/README.md).",
        "",
    ]
    for key, title, stems in SECTIONS:
        out += [f"## {title}", ""]
        if texts.get(key):
            out += [texts[key], ""]
        for stem in stems:
            out += _result(stem, made_by.get(stem), texts.get(stem, ""))
    return "\n".join(out).rstrip("\n") + "\n"


def main() -> None:
    page = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text() != page:
            print("docs/results.md is stale: run python bench/results_page.py", file=sys.stderr)
            sys.exit(1)
        return
    PAGE.write_text(page)


if __name__ == "__main__":
    main()
