"""`overlap plan --search` (overlap.plan.search): the fastest layouts that fit, each runnable as
printed, and where the reference's hand-tuned layouts rank among them."""

from __future__ import annotations

import functools
import json
import os
import shlex
from dataclasses import replace

import pytest

from overlap.cli import main
from overlap.harness import resolve_run
from overlap.perf.memory_model import rank_memory, reserve_bytes
from overlap.plan.hardware import builtin_cluster
from overlap.plan.predict import predict
from overlap.plan.report import format_search
from overlap.plan.search import KEEP, _Space, search
from overlap.plan.validate import ROWS

LLAMA8 = "-m llama -mr llama3_8b -g h100 -ng 8 -c bf16 -gb 128 -sl 8192".split()


@pytest.fixture(scope="module")
def llama8():
    return search(LLAMA8)


def test_the_ranking_is_fastest_first_and_every_candidate_fits(llama8):
    assert llama8.ranked and llama8.considered >= len(llama8.ranked)
    steps = [c.prediction.step_ms for c in llama8.ranked]
    assert steps == sorted(steps)
    for c in llama8.ranked[:5]:
        assert c.margin_bytes >= 0
        assert c.prediction.peak_mem_bytes + reserve_bytes(c.prediction.peak_mem_bytes) <= (
            80 * 2**30
        )


def test_each_printed_command_resolves_to_the_layout_and_step_it_was_ranked_by(llama8):
    """The command line is what `overlap run` takes: resolved again (exactly, without the search's
    extrapolated pipeline program) it is the candidate's layout, within 0.1% of its step."""
    cluster = builtin_cluster("h100", "bf16", 8)
    for c in llama8.ranked[:3]:
        words = shlex.split(c.command(llama8.words, llama8.overrides))[2:]
        job = resolve_run(words, [])
        layout = job.resolution.layout
        assert (layout.tp, layout.pp, layout.ep) == (c.layout.tp, c.layout.pp, c.layout.ep)
        assert job.cfg.train.micro_batch_size == c.layout.mb
        exact = predict("again", [], job.cfg, layout, cluster)
        assert exact.step_ms == pytest.approx(c.prediction.step_ms, rel=1e-3)
        assert rank_memory(job.cfg, layout).total == c.prediction.peak_mem_bytes


def test_a_memory_rung_is_taken_only_where_a_layout_needs_it_to_fit(llama8):
    """Recompute and Megatron-FSDP never make a step faster: a layout carries one only when the
    layout without either does not fit."""
    for c in llama8.ranked:
        if c.layout.rung == ((), False):
            continue
        plain = c.layout.plain()
        job = resolve_run(LLAMA8 + plain.words() + plain.overrides(), [])
        peak = rank_memory(job.cfg, job.resolution.layout).total
        assert peak + reserve_bytes(peak) > 80 * 2**30


def test_the_cli_prints_the_table_the_commands_and_why_the_first_wins(tmp_path, capsys):
    out = tmp_path / "search.json"
    assert main(["plan", *LLAMA8, "--search", "3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| # | layout | step ms |" in text and "Why the first:" in text
    assert "| hidden comm ms | exposed comm ms |" in text
    assert text.count("`overlap run -m llama -mr llama3_8b") == 3
    doc = json.loads(out.read_text())
    assert len(doc["candidates"]) == 3 and doc["considered"] > 3
    near = doc["near_best"]
    assert near >= 1 and doc["expected_median_error"] > 0
    said = f"{near} layouts (the first included) are predicted within"
    assert (said in text) == (near > 1)
    assert (
        doc["candidates"][0]["step_time_ms"]["mean"] <= doc["candidates"][1]["step_time_ms"]["mean"]
    )
    # what overlap hides and what it exposes add up to the communication, kind by kind
    for c in doc["candidates"]:
        for kind, total in c["total_comm_ms"].items():
            hidden, exposed = c["hidden_comm_ms"][kind], c["exposed_comm_ms"].get(kind, 0.0)
            assert hidden >= 0 and hidden + exposed == pytest.approx(total)
    assert any(c["hidden_comm_ms"]["all"] > 0 for c in doc["candidates"])


def test_the_command_lines_own_layout_is_priced_as_typed_and_placed_among_the_ranked(
    llama8, capsys
):
    """Where the user's run stands: the command line's own layout (here the recipe's: no layout
    flag) is priced as `overlap plan` prices it (within the search's extrapolated pipeline
    program's 0.1%), placed among the ranked by its step, and printed with what the first does
    better; one the rules refuse says the rule, and the search still runs."""
    given = llama8.given
    job = resolve_run(LLAMA8, [])
    parallel = job.resolution.layout
    assert given.layout.key() == (
        parallel.tp,
        parallel.pp,
        None,
        parallel.cp,
        parallel.ep,
        job.cfg.train.micro_batch_size,
    )
    exact = predict("again", [], job.cfg, parallel, builtin_cluster("h100", "bf16", 8))
    assert given.prediction.step_ms == pytest.approx(exact.step_ms, rel=1e-3)
    rank, _exact = given.rank(llama8)
    step = given.prediction.times.total_s
    assert rank == 1 + sum(c.prediction.times.total_s < step for c in llama8.ranked)
    doc = llama8.to_json(3)["given"]
    assert doc["rank"] == rank and doc["layout"] == given.layout.describe()
    assert doc["fits"] == (given.margin_bytes >= 0)

    assert main(["plan", *LLAMA8, "--search", "2"]) == 0
    text = capsys.readouterr().out
    said = f"The command line's own layout, {given.layout.describe()} at its switches as resolved"
    assert said in text and "Against it the first's" in text

    # the library call takes a command line whose own layout the rules refuse (`overlap plan`
    # refuses it up front): the rule is said, and the layouts are searched without it
    refused = search([*LLAMA8, "-tp", "3"], keep=2)
    assert refused.given.startswith("-ng/--num_gpus: the world size must be a multiple of TP")
    assert refused.to_json(2)["given"] == {"refused": refused.given}
    shown = format_search(refused, 2, "overlap plan")
    assert f"The command line's own layout was not priced: {refused.given}." in shown
    assert shown.count("`overlap run -m llama") == 2


def test_without_a_validated_error_no_layout_is_called_a_near_tie(llama8):
    """A cluster whose efficiency is not validated (a --cluster file, -g cpu) has no band: only
    equal steps are near the first, the JSON says the error is unknown, and the reason the first
    wins claims no 'inside the error'. With the validated band the gap is a share of the step."""
    plain = replace(llama8, cluster=replace(llama8.cluster, expected_error=None))
    steps = [c.prediction.times.total_s for c in plain.ranked]
    assert plain.band == 0 and plain.near_best() == 1 and steps[1] > steps[0]
    assert "inside" not in plain.why_best()
    doc = plain.to_json(3)
    assert doc["expected_median_error"] is None and doc["near_best"] == 1
    gap = 100 * (steps[1] - steps[0]) / steps[0]
    assert f"({gap:.1f}%" in llama8.why_best()
    assert ("inside the model's" in llama8.why_best()) == (gap < 100 * llama8.band)


_EP_OVERLAP_ROW = "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap on"
# a MoE row whose layouts need recompute, where re-running the attention product costs more than
# re-running the experts' activation and the norms (the rungs' order is not their cost's)
_RECOMPUTE_ROW = "Qwen3-30B-A3B 8xGB300 MXFP8 MBS8 EP8 (26.08)"


@pytest.mark.parametrize("name", ["llama3_8b", _EP_OVERLAP_ROW, _RECOMPUTE_ROW])
def test_the_bound_never_exceeds_a_priced_step(name):
    """The search stops pricing once the next candidate's bound (its unpipelined step plus the
    pipeline's least extra, less what EP overlap's warm-up may take back) is slower than the kept
    ones: sound only if no priced step is below its bound. Everything priced here (keep
    unbounded): PP, VPP, the uneven split, CP and TP candidates, MoE ones under EP overlap, and
    recompute rungs; the bounded search then returns the same fastest layouts."""
    if name == "llama3_8b":
        words, cluster = LLAMA8, None
    else:
        row = next(r for r in ROWS if r.name == name)
        words, cluster = row.args(), builtin_cluster(row.gpu, row.precision, None)
    full = search(words, cluster=cluster, keep=10**6)
    assert full.bounded == 0 and len(full.ranked) > 100
    bounded = search(words, cluster=cluster)
    shown = [(c.layout, c.switches) for c in bounded.ranked[:KEEP]]
    assert shown == [(c.layout, c.switches) for c in full.ranked[:KEEP]]
    # every layout the model cannot tell from the fastest is priced by the bounded search too
    assert full.band > 0 and bounded.near_best() == full.near_best()
    plain = [w for w in words if "=" not in w]
    space = _Space(plain, [w for w in words if "=" in w], full.cluster, full)
    for c in full.ranked:
        job = space.resolve(c.layout, c.switches)
        step = c.prediction.times.total_s
        assert space.bound(job) <= step * (1 + 1e-12), c.layout.describe()


@pytest.fixture(scope="module")
def qwen30():
    row = next(r for r in ROWS if r.name == "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on")
    return search(row.args(), cluster=builtin_cluster(row.gpu, row.precision, None))


def test_a_layout_takes_its_fastest_recompute_rung_that_fits(monkeypatch):
    """Where a layout does not fit without recompute, each rung that fits is priced and the
    fastest kept, whatever the rungs' order: no other rung of a ranked layout fits at a faster step
    (at the automatic switches, where the rung is chosen). The searched rungs rarely leave two
    that fit (forced load balancing refuses full recompute on the MoE rows), so this search adds a
    slower rung that fits wherever the experts' rung does - all three selective modules - ahead
    of it."""
    import overlap.plan.search as search_module

    searched = search_module.recompute_options

    def with_a_slower_rung_first(cfg):
        none, *rest = searched(cfg)
        return [none, ("core_attn", "layernorm", "moe_act"), *rest]

    monkeypatch.setattr(search_module, "recompute_options", with_a_slower_rung_first)
    row = next(r for r in ROWS if r.name == _EP_OVERLAP_ROW)
    words, cluster = row.args(), builtin_cluster(row.gpu, row.precision, None)
    result = search(words, cluster=cluster)
    space = _Space(
        [w for w in words if "=" not in w], [w for w in words if "=" in w], cluster, result
    )
    rungs = with_a_slower_rung_first(result.ranked[0].cfg)
    checked = 0
    for c in result.ranked:
        if c.layout.rung == ((), False):
            continue
        chosen = space.variant(c.layout, ())
        assert chosen is not None
        # every rung, Megatron-FSDP's included (16 GPUs at TP x PP below 16: DP x CP > 1)
        every = [(r, f) for f in (False, True) for r in rungs if (r, f) != ((), False)]
        for recompute, fsdp in every:
            other = space.variant(replace(c.layout, recompute=recompute, fsdp=fsdp), ())
            if other is not None and (recompute, fsdp) != c.layout.rung:
                checked += 1
                assert other.prediction.times.total_s >= chosen.prediction.times.total_s, (
                    c.layout.describe(),
                    recompute,
                    fsdp,
                )
    assert checked


def test_every_shown_command_is_accepted_by_the_config_and_labelled_if_run_refuses_it(qwen30):
    """Dispatcher, CP, split and recompute choices included: each top command resolves through the
    configuration without a ConfigError, and what `overlap run` would still refuse today (DeepEP /
    HybridEP kernels, CUDA graphs) is the candidate's label, not a surprise."""
    from overlap.training.runtime_refusals import runtime_refusals

    assert qwen30.ranked and qwen30.bounded > 0
    # full recompute is refused under EP overlap: a rung of layouts that need one, not a layout
    full = "model.recompute_granularity: disable full recomputation"
    assert any(k.startswith(full) for k in qwen30.rungs_refused)
    assert not any(k.startswith(full) for k in qwen30.refused)
    for c in qwen30.ranked[:5]:
        words = shlex.split(c.command(qwen30.words, qwen30.overrides))[2:]
        job = resolve_run(words, [])
        layout = job.resolution.layout
        assert (layout.tp, layout.pp, layout.cp, layout.ep) == (
            c.layout.tp,
            c.layout.pp,
            c.layout.cp,
            c.layout.ep,
        )
        refusals = runtime_refusals(job.cfg, gpu=True)
        assert c.not_runnable == "; ".join(f"{e.field}={e.value}" for e in refusals)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--search", "0"], "--search"),
        (["--search", "3", "--ab", "comm_overlap.tp_comm_overlap=false,true"], "--search"),
    ],
)
def test_bad_search_input_is_a_config_error(capsys, argv, field):
    assert main(["plan", *LLAMA8, *argv]) == 2
    err = capsys.readouterr().err
    assert f"overlap: error: {field}" in err and "Traceback" not in err


# --- the reference's hand-tuned layouts -----------------------------------------------------------
# Published runs whose layout the search can reach (the inexpressible ones aside: docs/planner.md
# 'Layout search' has every row), with what the search finds. The 256-GPU Qwen3-235B-A22B rows take
# 15-30 CPU seconds each, so they run with OVERLAP_SLOW_TESTS=1 only. Llama3.1-405B on 1024 GPUs is
# in: its CP2 layout with the embedding and loss accounted is the search's third, 1.9% behind. A
# miss is recorded with its gap, and passes the day the model ranks the reference's choice where it
# belongs.
_MISS = {
    "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap on": "not among the 19 priced: the pick, "
    "TP2 x EP8 at micro-batch 4 with recompute of the norms and the experts' activation under "
    "Megatron-FSDP, keeps its all-to-alls inside a node and lengthens the MoE layer's short "
    "kernels past the fitted per-kernel overhead's floor",
    "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap + delay_wgrad": "as the EP overlap row",
    "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on": "third, 25% behind TP2 x EP16 at "
    "micro-batch 4 with recompute under Megatron-FSDP (DeepEP): at micro-batch 1 the launch floor "
    "is 31% of the published layout's compute, from micro-batch 4 on none",
    "Qwen3-30B-A3B 16xH100 FP8 EP16": "not among the 17 priced: TP1 x EP16 at micro-batch 2, 41% "
    "faster (the launch floor, as the BF16 rows; FP8 halves the GEMMs under it)",
    "Qwen3-30B-A3B 16xH100 FP8 PP2 VP12 EP8": "not among the 17 priced (as the FP8 EP16 row)",
    "Qwen3-30B-A3B 16xH100 FP8-CS MBS2 PP2 VP24 EP8": "12th, 24% behind (as the FP8 EP16 row)",
    "Qwen3-30B-A3B 16xH100 FP8 MBS2 PP2 VP24 EP8 token drop (25.09)": "tenth, 2.3% behind: within "
    "5% but nine near-ties ahead, EP8 at micro-batch 2 under Megatron-FSDP and PP2 x EP8 with "
    "other interleaves and splits",
    "GPT-OSS-120B 64xH100 BF16 PP4 EP8": "not among the 29 priced: the pick, PP4 x VP9 at "
    "micro-batch 2 with recompute, has a smaller bubble and fits by the memory model (sliding "
    "windows are not expressed)",
    "GPT-OSS-120B 64xH100 BF16 MBS4 PP4 EP8 (25.11)": "not among the 31 priced: the same pick "
    "(its 8 micro-batches a step leave plain PP4 a large bubble)",
    "Llama3-70B 64xH100 FP8 TP4 PP8 VP5": "18th, 9.5% behind TP4 x PP4 x VP5, whose modelled "
    "bubble is smaller",
    "Qwen3-30B-A3B 8xGB300 MXFP8 MBS8 EP8 (26.08)": "eighth, 3.3% behind EP2 at micro-batch 4: "
    "within 5% but seven near-ties ahead (all-to-alls inside NVLink priced nearly free)",
    "GPT-OSS-120B 64xGB200 MXFP8 MBS4 EP64 (26.08)": "ninth, 1.3% behind EP8 at micro-batch 2: "
    "within 5% but eight near-ties ahead",
    "GPT-OSS-120B 64xGB300 MXFP8 MBS4 EP16 (26.08)": "eighth, 0.9% behind EP4 at micro-batch 2: "
    "within 5% but seven near-ties ahead",
    "Qwen3-235B-A22B 256xH100 FP8 TP2 PP8 VP4 EP32": "96th, 10.8% behind TP2 x PP2 x VP4 x EP32 "
    "(embedding and loss accounted): PP8's bubble outweighs the shallower pipeline's interleave "
    "sends",
    "Qwen3-235B-A22B 256xGB200 MXFP8 MBS1 PP8 VP3 EP32 (26.04.01)": "not among the 109 priced: "
    "the pick drops the pipeline (TP1 x EP64 at micro-batch 1), which fits by the memory model",
    "Qwen3-235B-A22B 256xGB300 MXFP8 MBS2 PP4 VP12 EP32 (26.04.01)": "54th, 12.3% behind: the "
    "pick drops the pipeline (TP1 x EP32 at micro-batch 2)",
    "Qwen3-235B-A22B 256xGB200 MXFP8 MBS1 PP8 VP3 EP32 (26.08)": "not among the 163 priced: the "
    "pick drops the pipeline (TP1 x EP32 at micro-batch 1), 19% faster",
    "Qwen3-235B-A22B 256xGB300 MXFP8 MBS2 PP4 VP12 EP32 (26.08)": "275th, 17.5% behind TP1 x "
    "EP8 at micro-batch 1 (no pipeline)",
}


@functools.cache
def _searched(row) -> tuple:
    """A published row's search (once per session: two tests read it) and its published layout."""
    words = row.args()

    def flag(name: str) -> str:
        return words[words.index(name) + 1]

    published = (
        int(flag("-tp")),
        int(flag("-pp")),
        None if flag("-vp") == "None" else int(flag("-vp")),
        int(flag("-cp")) if "-cp" in words else 1,
        int(flag("-ep")),
        int(flag("-mb")),
    )
    return search(words, cluster=builtin_cluster(row.gpu, row.precision, None)), published


_SLOW = pytest.mark.skipif(
    os.environ.get("OVERLAP_SLOW_TESTS") != "1",
    reason="a 256-GPU search (15-30 CPU s); OVERLAP_SLOW_TESTS=1 runs it",
)
_REACHABLE = [r for r in ROWS if not r.not_expressible and not r.name.endswith(" off")]


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            r,
            marks=(
                [pytest.mark.xfail(reason=_MISS[r.name], strict=True)] if r.name in _MISS else []
            )
            + ([_SLOW] if "-ng 256" in r.flags else []),
            id=r.name,
        )
        for r in _REACHABLE
    ],
)
def test_the_published_layout_is_in_the_top_five_within_five_percent(row):
    result, published = _searched(row)
    ranks = [i for i, c in enumerate(result.ranked[:5]) if c.layout.key() == published]
    assert ranks, f"not in the top 5: {[c.layout.describe() for c in result.ranked[:5]]}"
    best = result.ranked[0].prediction.step_ms
    assert result.ranked[ranks[0]].prediction.step_ms <= 1.05 * best


# Published runs whose own layout, as the row expresses it (no recompute), the memory model puts
# over 80 GB less its reserve, though the reference ran it: the search then prices that layout only
# with a recompute rung. Each is a disagreement between the memory model and a published run, kept
# here by how far over it is (GiB) so that a change either way is seen.
_OVER_MEMORY = {
    # 102 GiB peak, 61 of it activations: 4 micro-batches of 4 sequences in flight on the first of
    # PP4's stages, at full attention (sliding windows not expressed), under the selective
    # recompute (norms, the experts' activation) of Bridge's H100 config of that release
    "GPT-OSS-120B 64xH100 BF16 MBS4 PP4 EP8 (25.11)": 29.6,
}


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=[_SLOW] if "-ng 256" in r.flags else [], id=r.name) for r in _REACHABLE],
)
def test_each_published_row_prices_its_own_layout_as_the_command_lines(row):
    """The search prices the command line's own layout (here the published one) as typed, and
    places it among the ranked by its step: the row's published layout is where it stands, not
    only whether it made the top five (the same search as the top-five test's)."""
    result, published = _searched(row)
    given = result.given
    assert given.layout.key() == published
    rank, _exact = given.rank(result)
    step = given.prediction.times.total_s
    assert rank == 1 + sum(c.prediction.times.total_s < step for c in result.ranked)
    # the reference ran it: the memory model says it fits, or the row is a known disagreement
    over = max(0.0, -given.margin_bytes / 2**30)
    assert over == pytest.approx(_OVER_MEMORY.get(row.name, 0.0), abs=0.05)
