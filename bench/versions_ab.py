"""Two versions of the runtime, side by side on the same machine: the same `overlap run` commands
under each version's interpreter, alternated (A B, then B A, ...), every run a fresh process.

Why: a change to the layers (what they keep for backward, how they compute it) or to a collective's
path must not make the steps slower; `overlap bench` compares configurations of one version, this
compares two versions of one configuration. Each round runs every case under A and under B back to
back; the table gives each version's mean steady-state step time (the run's own window,
`FILE.summary.json`) and peak memory, and the median over rounds of B / A (a drift between rounds
cancels in it).

    python bench/versions_ab.py --a /path/to/base/.venv/bin/python --b .venv/bin/python \
        --case "EP2:-m qwen -mr qwen3_moe_tiny -g cpu -ng 2 ..." --repeats 3 \
        --json bench/results/X.json --markdown bench/results/X.md

Each interpreter runs `-m overlap.cli run` from its own installed tree; what each tree is (its git
commit) goes in the result. `--hf-compute ARGS` adds a comparison of single-rank compute: each
tree's own `bench/hf_compute_bench.py ARGS`, alternated the same way; it times our step against
transformers' on the same weights pair by pair, so each version's `ours / transformers` (the median
of its per-pair ratios) is measured against the same reference in the same process, and B's over A's
is the change.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from overlap.files import write_replace
from overlap.perf.machine import describe_machine, machine_line


def _tree(python: str) -> Path:
    """The source tree `python` imports overlap from (its editable install: <tree>/src/overlap)."""
    where = subprocess.run(
        [python, "-c", "import overlap, pathlib; print(pathlib.Path(overlap.__file__).parent)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(where).parent.parent


def _commit(python: str) -> str:
    out = subprocess.run(
        ["git", "-C", str(_tree(python)), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "unknown"


def _hf_compute(python: str, words: list[str], timeout: float) -> dict[str, float]:
    """One run of the tree's own hf_compute_bench: (model, dtype, attention) -> ours / transformers,
    the median of its per-pair ratios."""
    tree = _tree(python)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "hf.json"
        out = subprocess.run(
            [python, str(tree / "bench/hf_compute_bench.py"), *words, "--json", str(report)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tree,
        )
        if out.returncode:
            raise SystemExit(f"hf_compute_bench failed ({python}):\n{out.stderr[-2000:]}")
        rows = json.loads(report.read_text())["rows"]
    return {
        f"{r['model']} {r['dtype']} {r['attention_backend']}": r["pair_ratio_median"] for r in rows
    }


def _run(python: str, words: list[str], timeout: float) -> dict:
    """One `overlap run` of `words` under `python`: its summary (steady step ms, peak MB)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        out = subprocess.run(
            [python, "-m", "overlap.cli", "run", *words, "--metrics", str(metrics)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode:
            raise SystemExit(f"run failed ({python} {' '.join(words)}):\n{out.stderr[-2000:]}")
        summary = json.loads(Path(f"{metrics}.summary.json").read_text())
    return {"step_ms": summary["steady_step_ms"], "peak_mem_mb": summary["peak_mem_mb"]}


def table(doc: dict) -> list[str]:
    """The result's Markdown: what A and B are, the cases' table and the compute table (also
    docs/results.md's, through bench/results_page.py)."""
    lines = [
        f"A = {doc['a']['commit']}, B = {doc['b']['commit']}; {doc['repeats']} rounds, A and B "
        "alternated; step time: each run's steady-state window mean; B / A: the median over rounds "
        "of each round's ratio.",
        "",
        "| case | A step ms | B step ms | B / A (median) | B / A per round | A peak MB | "
        "B peak MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        per_round = ", ".join(f"{x:.3f}" for x in row["b_over_a_rounds"])
        lines.append(
            f"| {row['case']} | {row['a_step_ms']:.1f} | {row['b_step_ms']:.1f} | "
            f"{row['b_over_a_median']:.3f} | {per_round} | {row['a_peak_mem_mb']:.0f} | "
            f"{row['b_peak_mem_mb']:.0f} |"
        )
    if doc["hf_compute"]:
        lines += [
            "",
            "Single-rank compute (bench/hf_compute_bench.py of each tree, "
            f"`{doc['hf_compute_args']}`): ours / transformers on the same weights, the median of "
            "the rounds' per-pair medians.",
            "",
            "| model dtype attention | A: ours / transformers | B: ours / transformers | B / A |",
            "|---|---|---|---|",
        ]
        for c in doc["hf_compute"]:
            a, b = c["a_ours_over_transformers"], c["b_ours_over_transformers"]
            lines.append(f"| {c['row']} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="interpreter of version A (the baseline)")
    p.add_argument("--b", required=True, help="interpreter of version B")
    p.add_argument(
        "--case",
        action="append",
        default=[],
        help="NAME:ARGS, the `overlap run` arguments of one case (repeatable)",
    )
    p.add_argument(
        "--hf-compute",
        default=None,
        metavar="ARGS",
        help="also compare single-rank compute: bench/hf_compute_bench.py ARGS in each tree",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    cases = [(c.split(":", 1)[0], shlex.split(c.split(":", 1)[1])) for c in args.case]
    versions = {"A": args.a, "B": args.b}
    runs: dict[str, dict[str, list[dict]]] = {name: {"A": [], "B": []} for name, _w in cases}
    hf: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for r in range(args.repeats):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        for name, words in cases:
            for v in order:
                runs[name][v].append(_run(versions[v], words, args.timeout))
                print(f"round {r + 1} {name} {v}: {runs[name][v][-1]}", file=sys.stderr)
        if args.hf_compute is not None:
            for v in order:
                hf[v].append(_hf_compute(versions[v], shlex.split(args.hf_compute), args.timeout))
                print(f"round {r + 1} hf_compute {v}: {hf[v][-1]}", file=sys.stderr)
    rows = []
    for name, words in cases:
        a, b = runs[name]["A"], runs[name]["B"]
        ratios = [y["step_ms"] / x["step_ms"] for x, y in zip(a, b)]
        rows.append(
            {
                "case": name,
                "args": words,
                "a_step_ms": statistics.mean(x["step_ms"] for x in a),
                "b_step_ms": statistics.mean(y["step_ms"] for y in b),
                "b_over_a_median": statistics.median(ratios),
                "b_over_a_rounds": ratios,
                "a_peak_mem_mb": max(x["peak_mem_mb"] for x in a),
                "b_peak_mem_mb": max(y["peak_mem_mb"] for y in b),
            }
        )
    compute = [
        {
            "row": key,
            "a_ours_over_transformers": statistics.median(h[key] for h in hf["A"]),
            "b_ours_over_transformers": statistics.median(h[key] for h in hf["B"]),
        }
        for key in (hf["A"][0] if hf["A"] else {})
    ]
    doc = {
        "command": "python " + shlex.join(["bench/versions_ab.py", *(argv or sys.argv[1:])]),
        "machine": describe_machine(),
        "a": {"python": args.a, "commit": _commit(args.a)},
        "b": {"python": args.b, "commit": _commit(args.b)},
        "repeats": args.repeats,
        "rows": rows,
        "hf_compute": compute,
        "hf_compute_args": args.hf_compute,
    }
    lines = [
        f"Command: `{doc['command']}`  ",
        f"{machine_line(doc['machine'])}  ",
        *table(doc),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        write_replace(args.json, json.dumps(doc, indent=1) + "\n")
    if args.markdown:
        write_replace(args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
