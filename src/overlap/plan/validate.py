"""The planner against published runs: one compute efficiency per GPU type, fitted on stated rows,
and every row predicted by a fit that did not see it.

`python -m overlap.plan.validate` prints the table docs/planner.md carries, from the rows' own
efficiencies stored in `overlap.plan.fitted`; `--write` first solves them again (a few minutes) and
regenerates that module (the fits `overlap plan` uses, with their expected error).

Rows (`ROWS`): Megatron-Bridge's performance summary (step time = GBS x seq / (tokens/s/GPU x GPUs))
and the MoE comm-overlap skill's measured on/off pairs. Each row says what we assumed where the
source does not say it (dispatcher, EP overlap) and how it is expressed; a row the configuration
cannot express (yet) is listed with the reason and not predicted.

Fitted: one compute efficiency per group (`overlap.plan.compute`). For each row, the efficiency at
which its predicted step equals the published one (`row_efficiency`, a secant solve: the step is
close to a + b / efficiency); a group's fit is their median (least absolute deviation in log
efficiency: robust to a run from an older software release). Groups: `h100` (H100 rows) and
`blackwell` (B200 and GB200 rows: one die, their peaks already differ). Validation: leave-one-out
within the group, the efficiency re-fitted without the row (the runs of an on/off pair are left out
together, so a pair's ratio is predicted by rows that include none of it); the shipped fit uses all
the group's rows.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from pprint import pformat

from overlap.plan.hardware import builtin_cluster, with_efficiency
from overlap.plan.predict import predict

WITHIN = 0.20  # a row is "within" when |predicted / published - 1| <= 20%
RATIO_WITHIN = 0.08  # an on/off pair's ratio within 0.08 of the published one
GROUPS = {"h100": "h100", "b200": "blackwell", "gb200": "blackwell"}
_QWEN30 = "-m qwen -mr qwen3_30b_a3b"
_QWEN235 = "-m qwen -mr qwen3_235b_a22b"
# GPT-OSS-120B (openai/gpt-oss-120b config.json) on the Qwen3-MoE recipe's structure: 36 layers,
# hidden 2880, 64 query / 8 KV heads of 64, 128 experts of 2880 top-4, vocabulary 201088, no QK
# norm. Its sliding-window layers and attention sinks are not expressed (Megatron's FLOPs count,
# which the published TFLOP/s use, ignores them too).
_GPT_OSS = ("model.num_layers=36 model.hidden_size=2880 model.num_attention_heads=64 "
            "model.num_query_groups=8 model.kv_channels=64 model.ffn_hidden_size=2880 "
            "model.moe_ffn_hidden_size=2880 model.moe_router_topk=4 model.vocab_size=201088 "
            "model.qk_layernorm=false")


@dataclass(frozen=True)
class Row:
    """One published run and how the plan expresses it."""

    name: str
    gpu: str
    precision: str  # the plan's: bf16 | fp8 | mxfp8
    published_s: float
    flags: str  # harness flags (the config is resolved at -c bf16; `precision` is the plan's)
    overrides: str = ""
    source: str = "Bridge performance summary"
    # what the source does not say and we chose, or how an inexpressible part is approximated
    assumed: str = ""
    pair: str = ""  # on/off pairs: the pair's name; "off" rows end in " off"
    not_expressible: str = ""  # why it is not predicted

    def args(self) -> list[str]:
        return f"{self.flags} -c bf16 {self.overrides}".split()


def _row(name, gpu, prec, n, gbs, mbs, seq, tp, pp, vp, ep, step, model, extra="", **kw) -> Row:
    gpn = 72 if gpu == "gb200" and n % 72 == 0 else 8
    flags = (f"{model} -g {gpu} -ng {n} -gn {gpn} -tp {tp} -pp {pp} -vp {vp or 'None'} -ep {ep} "
             f"-gb {gbs} -mb {mbs} -sl {seq}")
    return Row(name, gpu, prec, step, flags, extra, **kw)


_EP_OFF = "comm_overlap.overlap_moe_expert_parallel_comm=false"
_EP_ON = "comm_overlap.overlap_moe_expert_parallel_comm=true"
_A2A = "model.moe_token_dispatcher_type=alltoall"
_HYBRID = "--moe_flex_dispatcher_backend hybridep"
_DEEPEP = "--moe_flex_dispatcher_backend deepep"
_GUIDE = "Bridge MoE comm-overlap skill (alltoall pair)"
_SKILL = "Bridge MoE comm-overlap skill (HybridEP pair)"
_NOT_SAID = "dispatcher and EP overlap not published: the recipe's"
_H100_30B = ("not published: the 16-GPU H100 perf recipe's HybridEP and EP overlap (on in its "
             "perf variant, which sets CUDA_DEVICE_MAX_CONNECTIONS=32 for it)")
# the recipe counts the embedding and the loss as layers: 94 + 2 split evenly over the virtual stages
_SELECTIVE_235 = ("model.recompute_granularity=selective "
                  "model.recompute_modules=[layernorm,moe_act]")
_UNEVEN_235 = ("the recipe's uneven layout (embedding and loss accounted as layers); selective "
               "recompute's extra backward compute not priced")

ROWS: tuple[Row, ...] = (
    _row("Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap off", "h100", "bf16", 16, 1024, 1, 4096,
         1, 1, None, 16, 41.25, _QWEN30, f"{_A2A} {_EP_OFF}", source=_GUIDE, pair="guide"),
    _row("Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap on", "h100", "bf16", 16, 1024, 1, 4096, 1,
         1, None, 16, 31.31, _QWEN30, f"{_A2A} {_EP_ON}", source=_GUIDE, pair="guide"),
    _row("Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap + delay_wgrad", "h100", "bf16", 16, 1024,
         1, 4096, 1, 1, None, 16, 31.20, _QWEN30,
         f"{_A2A} {_EP_ON} comm_overlap.delay_wgrad_compute=true", source=_GUIDE, pair="guide"),
    _row("Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap off", "h100", "bf16", 16, 1024, 1, 4096,
         1, 1, None, 16, 24.714, _QWEN30, f"{_HYBRID} {_EP_OFF}", source=_SKILL, pair="hybridep"),
    _row("Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on", "h100", "bf16", 16, 1024, 1, 4096, 1,
         1, None, 16, 20.992, _QWEN30, f"{_HYBRID} {_EP_ON}", source=_SKILL, pair="hybridep"),
    _row("Qwen3-30B-A3B 16xH100 FP8 EP16", "h100", "fp8", 16, 1024, 1, 4096, 1, 1, None, 16, 29.26,
         _QWEN30, f"{_HYBRID} {_EP_ON}", assumed=_H100_30B),
    _row("Qwen3-30B-A3B 16xH100 FP8 PP2 VP12 EP8", "h100", "fp8", 16, 1024, 1, 4096, 1, 2, 12, 8,
         28.94, _QWEN30, f"{_HYBRID} {_EP_ON}", assumed=_H100_30B),
    _row("Qwen3-30B-A3B 16xH100 FP8-CS MBS2 PP2 VP24 EP8", "h100", "fp8", 16, 512, 2, 4096, 1, 2,
         24, 8, 24.85, _QWEN30, f"{_HYBRID} {_EP_ON}", assumed=_H100_30B),
    _row("Qwen3-235B-A22B 256xH100 FP8 TP2 PP8 VP4 EP32", "h100", "fp8", 256, 8192, 1, 4096, 2, 8,
         4, 32, 76.56, _QWEN235, f"{_DEEPEP} {_EP_ON} {_SELECTIVE_235}",
         assumed="DeepEP; EP overlap on (its perf recipe sets CUDA_DEVICE_MAX_CONNECTIONS=8 for "
                 f"it); {_UNEVEN_235}"),
    _row("GPT-OSS-120B 64xH100 BF16 PP4 EP8", "h100", "bf16", 64, 1280, 1, 4096, 1, 4, None, 8,
         14.07, _QWEN30, f"{_A2A} {_EP_OFF} {_GPT_OSS}",
         assumed="alltoall, EP overlap off; sliding windows not expressed"),
    _row("Llama3-8B 8xH100 FP8-CS FSDP", "h100", "fp8", 8, 128, 1, 8192, 1, 1, None, 1, 9.07,
         "-m llama -mr llama3_8b", assumed="FSDP expressed as the distributed optimizer over DP8"),
    _row("Llama3-70B 64xH100 FP8 TP4 PP8 VP5", "h100", "fp8", 64, 256, 1, 8192, 4, 8, 5, 1, 19.69,
         "-m llama -mr llama3_70b", "comm_overlap.tp_comm_overlap=true",
         assumed="TP overlap on (Bridge's Llama3-70B perf recipe)"),
    _row("Llama3.1-405B 1024xH100 FP8 TP8 PP8 CP2 VP8", "h100", "fp8", 1024, 1536, 1, 8192, 8, 8, 8,
         1, 37.46, "-m llama -mr llama3_70b",
         not_expressible="context parallelism (CP2) is neither built nor planned, and there is no "
                         "405B recipe"),
    _row("DeepSeek-V3 1024xH100 FP8 TP2 PP8 VP4 EP64", "h100", "fp8", 1024, 8192, 1, 4096, 2, 8, 4,
         64, 25.26, _QWEN30,
         not_expressible="multi-latent attention and MTP are not in the model config"),
    _row("Qwen3-30B-A3B 8xB200 MXFP8 MBS4 EP8", "b200", "mxfp8", 8, 512, 4, 4096, 1, 1, None, 8,
         9.66, _QWEN30, f"{_HYBRID} {_EP_OFF}",
         assumed=f"{_NOT_SAID}: HybridEP (Bridge's perf harness), EP overlap off"),
    _row("Qwen3-30B-A3B 8xGB200 MXFP8 MBS4 EP8", "gb200", "mxfp8", 8, 512, 4, 4096, 1, 1, None, 8,
         6.44, _QWEN30, f"{_HYBRID} {_EP_OFF}",
         assumed=f"{_NOT_SAID}: HybridEP (NVL72), EP overlap off"),
    _row("Qwen3-235B-A22B 256xGB200 MXFP8 PP8 VP3 EP32", "gb200", "mxfp8", 256, 8192, 1, 4096, 1, 8,
         3, 32, 18.00, _QWEN235, f"{_HYBRID} {_EP_OFF}",
         assumed=f"HybridEP (NVL72), EP overlap off; {_UNEVEN_235}; 64 GPUs per NVLink domain"),
    _row("DeepSeek-V3 256xGB200 MXFP8 PP4 VP4 EP64", "gb200", "mxfp8", 256, 4096, 1, 4096, 1, 4, 4,
         64, 13.34, _QWEN30,
         not_expressible="multi-latent attention and MTP are not in the model config"),
)


def _config(row: Row):
    from overlap.harness import resolve_run

    job = resolve_run(row.args(), [])
    return job.cfg, job.resolution.layout


def _cluster(row: Row, efficiency: float):
    return with_efficiency(builtin_cluster(row.gpu, row.precision, None), efficiency, "validation")


def predicted_s(row: Row, efficiency: float, config=None) -> float:
    cfg, layout = config or _config(row)
    return predict(row.name, [], cfg, layout, _cluster(row, efficiency)).step_ms / 1e3


def row_efficiency(row: Row, config=None, tol: float = 1e-4) -> float:
    """The efficiency at which the row's predicted step equals the published one:
    a secant solve on the model step = a + b / efficiency (exact when no overlap window changes; a
    few rounds
    otherwise). A row whose published step is shorter than the part no efficiency shrinks raises
    ValueError."""
    config = config or _config(row)
    e0, e1 = 0.3, 0.6
    s0, s1 = (predicted_s(row, e, config) for e in (e0, e1))
    for _ in range(20):
        b = (s0 - s1) / (1 / e0 - 1 / e1)
        a = s1 - b / e1
        if b <= 0 or row.published_s <= a:
            raise ValueError(f"{row.name}: the part no efficiency shrinks exceeds the published "
                             "step")
        e2 = b / (row.published_s - a)
        s2 = predicted_s(row, e2, config)
        if abs(s2 / row.published_s - 1) < tol:
            return e2
        e0, s0, e1, s1 = e1, s1, e2, s2
    raise ValueError(f"{row.name}: the efficiency solve did not converge")


@dataclass
class Result:
    row: Row
    own_efficiency: float  # the row alone, fitted
    loo_efficiency: float  # fitted on the group's other rows (pair partners left out too)
    predicted_s: float  # at loo_efficiency
    fit_rows: tuple[str, ...]

    @property
    def error(self) -> float:
        return self.predicted_s / self.row.published_s - 1


def center(values: list[float]) -> float:
    """The fit of a group's efficiencies: their median in log (least absolute deviation: one run
    from another software release cannot drag the fit, as it would a mean)."""
    logs = sorted(math.log(v) for v in values)
    mid = len(logs) // 2
    return math.exp(logs[mid] if len(logs) % 2 else (logs[mid - 1] + logs[mid]) / 2)


def solve_own(rows: tuple[Row, ...] = ROWS) -> dict[str, float]:
    """Every expressible row's own efficiency."""
    return {r.name: row_efficiency(r) for r in rows if not r.not_expressible}


def fit(own: dict[str, float],
        rows: tuple[Row, ...] = ROWS) -> tuple[list[Result], dict[str, dict]]:
    """Leave-one-out results for every expressible row and each group's fit on all its rows, from
    the rows' own efficiencies (`solve_own`)."""
    usable = [r for r in rows if not r.not_expressible]
    results = []
    for r in usable:
        others = [o.name for o in usable
                  if GROUPS[o.gpu] == GROUPS[r.gpu] and o is not r
                  and not (r.pair and o.pair == r.pair)]
        eff = center([own[n] for n in others])
        results.append(Result(r, own[r.name], eff, predicted_s(r, eff), tuple(others)))
    groups = {}
    for group in sorted(set(GROUPS.values())):
        members = [r for r in results if GROUPS[r.row.gpu] == group]
        errors = sorted(abs(r.error) for r in members)
        within = sum(e <= WITHIN for e in errors)
        groups[group] = {
            "efficiency": round(center([r.own_efficiency for r in members]), 4),
            "median_error": round(errors[len(errors) // 2], 3), "worst_error": round(errors[-1], 3),
            "group": group, "fit_rows": [r.row.name for r in members],
            "expected_error": (f"median {100 * errors[len(errors) // 2]:.0f}%, worst "
                               f"{100 * errors[-1]:.0f}%, {within} of {len(errors)} runs within "
                               f"{100 * WITHIN:.0f}% (leave-one-out over published runs, "
                               "docs/planner.md)"),
        }
    return results, groups


def pairs(results: list[Result]) -> list[tuple[Result, Result, float, float]]:
    """(off, on, published ratio, predicted ratio) of every on/off pair."""
    out = []
    for name in sorted({r.row.pair for r in results if r.row.pair}):
        members = [r for r in results if r.row.pair == name]
        off = next(r for r in members if r.row.name.endswith(" off"))
        for on in (r for r in members if r is not off):
            published = on.row.published_s / off.row.published_s
            out.append((off, on, published, on.predicted_s / off.predicted_s))
    return out


def markdown(results: list[Result], groups: dict[str, dict], rows: tuple[Row, ...] = ROWS) -> str:
    """The table docs/planner.md carries (generated: `python -m overlap.plan.validate`)."""
    lines = ["| run | GPU | precision | published s | predicted s | error | own eff. | fit eff. | "
             "assumed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.row.name} | {r.row.gpu} | {r.row.precision} | "
                     f"{r.row.published_s:.2f} | "
                     f"{r.predicted_s:.2f} | {100 * r.error:+.0f}% | {r.own_efficiency:.3f} | "
                     f"{r.loo_efficiency:.3f} | {r.row.assumed or '-'} |")
    for row in rows:
        if row.not_expressible:
            lines.append(f"| {row.name} | {row.gpu} | {row.precision} | {row.published_s:.2f} | "
                         "- | not "
                         f"expressed | - | - | {row.not_expressible} |")
    within = sum(abs(r.error) <= WITHIN for r in results)
    lines += ["", f"{within} of {len(results)} expressible runs within {100 * WITHIN:.0f}% "
                  f"(leave-one-out; {len(rows) - len(results)} not expressible).", "",
              "| pair | published on/off | predicted on/off | on step error |", "|---|---|---|---|"]
    for off, on, pub, pred in pairs(results):
        lines.append(f"| {on.row.name} | {pub:.3f} | {pred:.3f} | {100 * on.error:+.0f}% |")
    lines += ["", "| group | efficiency (all its rows) | expected error |", "|---|---|---|"]
    for name, g in groups.items():
        lines.append(f"| {name} | {g['efficiency']:.4f} | {g['expected_error']} |")
    return "\n".join(lines)


def write_fitted(groups: dict[str, dict], own: dict[str, float], path: Path) -> None:
    """`overlap.plan.fitted`: each GPU type's group fit and the rows' own efficiencies (so a test
    re-derives the fit from them and re-solves a few rows to check them)."""
    by_gpu = {gpu: groups[group] for gpu, group in GROUPS.items()}
    header = ('"""Generated by `python -m overlap.plan.validate --write` (do not edit): '
              "the compute\nefficiency of each GPU type, fitted on the published runs named here\n"
              "(`overlap.plan.validate`), its leave-one-out step-time error, and each run's own\n"
              'efficiency."""')
    own_rounded = {n: round(v, 6) for n, v in own.items()}
    lines = [header, "", f"FITTED = {pformat(by_gpu, width=100, sort_dicts=False)}", "",
             f"OWN_EFFICIENCY = {pformat(own_rounded, width=100, sort_dicts=False)}", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m overlap.plan.validate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="re-solve every row and regenerate src/overlap/plan/fitted.py")
    args = parser.parse_args(argv)
    # the rows' resolution notes (e.g. a single DP bucket) are not the point here
    logging.getLogger("overlap").setLevel(logging.ERROR)
    logging.getLogger("overlap.config").setLevel(logging.ERROR)
    if args.write:
        own = solve_own()
    else:
        from overlap.plan.fitted import OWN_EFFICIENCY as own
    results, groups = fit(own)
    if args.write:
        write_fitted(groups, own, Path(__file__).with_name("fitted.py"))
    print(markdown(results, groups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
