"""The planner against published runs (`overlap.plan.validate`): Megatron-Bridge's performance
summary and the MoE comm-overlap skill's on/off pairs, each predicted by a compute efficiency fitted
on the other runs of its GPU group (leave-one-out; an on/off pair left out whole).

What is held here:
- the stored fit (`overlap.plan.fitted`) is what the fit code gives: a few rows' own efficiencies
  re-solved, the group efficiencies re-derived from the stored ones;
- every published on/off pair within 20% of step time and 0.08 of the on/off ratio (the HybridEP
  pair included);
- the share of rows within 20% is what docs/planner.md states (9 of 15 today, short of the 80% goal;
  each miss is explained there), and the table in docs/planner.md is the generated one;
- the flex dispatcher's hierarchy: DeepEP / HybridEP bytes against the reference's own arithmetic.
"""

import logging
from math import comb
from pathlib import Path

import pytest

from overlap.harness import resolve_run
from overlap.plan import validate
from overlap.plan.comm_model import comm_plan, expected_destinations, hit_probability
from overlap.plan.fitted import FITTED, OWN_EFFICIENCY
from overlap.plan.hardware import builtin_cluster

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"


@pytest.fixture(scope="module")
def table():
    logging.getLogger("overlap").setLevel(logging.ERROR)
    results, groups = validate.fit(OWN_EFFICIENCY)
    return results, groups


@pytest.mark.parametrize("name", ["Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap off",
                                  "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on",
                                  "Qwen3-30B-A3B 8xGB200 MXFP8 MBS4 EP8"])
def test_stored_own_efficiencies_are_the_fit_codes(name):
    row = next(r for r in validate.ROWS if r.name == name)
    assert validate.row_efficiency(row) == pytest.approx(OWN_EFFICIENCY[name], rel=1e-3)
    predicted = validate.predicted_s(row, OWN_EFFICIENCY[name])
    assert predicted == pytest.approx(row.published_s, rel=1e-3)


def test_shipped_efficiencies_are_the_group_fits(table):
    _results, groups = table
    for gpu, group in validate.GROUPS.items():
        assert FITTED[gpu] == groups[group]
        assert builtin_cluster(gpu, "bf16", None).efficiency.value == groups[group]["efficiency"]
    assert builtin_cluster("h200", "bf16", None).efficiency.value == FITTED["h100"]["efficiency"]


def test_no_row_predicts_itself(table):
    results, _ = table
    for r in results:
        assert r.row.name not in r.fit_rows
        if r.row.pair:
            assert not any(o.pair == r.row.pair for o in validate.ROWS if o.name in r.fit_rows)
        fit = validate.center([OWN_EFFICIENCY[n] for n in r.fit_rows])
        assert r.loo_efficiency == pytest.approx(fit)


def test_every_on_off_pair_within_20_percent_and_0_08_of_its_ratio(table):
    results, _ = table
    pairs = validate.pairs(results)
    assert {on.row.pair for _off, on, _p, _q in pairs} == {"guide", "hybridep"}
    for off, on, published, predicted in pairs:
        assert abs(off.error) <= validate.WITHIN and abs(on.error) <= validate.WITHIN, on.row.name
        assert abs(predicted - published) <= validate.RATIO_WITHIN, on.row.name


def test_rows_within_20_percent_as_documented(table):
    results, _ = table
    within = sum(abs(r.error) <= validate.WITHIN for r in results)
    assert len(results) == 15
    assert within >= 9  # the goal is 80% (12); docs/planner.md explains each of the misses
    assert f"{within} of {len(results)} expressible runs within 20%" in DOCS.read_text()


def test_docs_carry_the_generated_table(table):
    results, groups = table
    assert validate.markdown(results, groups) in DOCS.read_text()


def test_flex_gpu_dispatch_sends_a_token_once_per_node_and_rank():
    # the reference's arithmetic: top-8 of 128 experts over 2 nodes reaches 1.99 nodes, over EP16
    # 6.6 ranks
    assert expected_destinations(2, 128, 8) == pytest.approx(1.99, abs=0.01)
    assert expected_destinations(16, 128, 8) == pytest.approx(6.6, abs=0.05)
    assert hit_probability(128, 64, 8) == pytest.approx(1 - comb(64, 8) / comb(128, 8))
    base = ("-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 -ep 16 -tp 1 -pp 1 -gb 1024 -mb 1 "
            "-sl 4096 -c bf16")
    cluster = builtin_cluster("h100", "bf16", 8)
    plans = {}
    for name, extra in (("a2a", "model.moe_token_dispatcher_type=alltoall"),
                        ("hybridep", "--moe_flex_dispatcher_backend hybridep")):
        job = resolve_run(f"{base} {extra}".split(), [])
        plans[name] = comm_plan(job.cfg, job.resolution.layout, cluster)
    tokens, h = 4096, 2048
    p_node, p_rank = hit_probability(128, 64, 8), hit_probability(128, 8, 8)
    rdma, nvlink = tokens * p_node * h * 2, tokens * 2 * 7 * p_rank * h * 2
    dispatch = plans["hybridep"].kinds["ep_dispatch"]
    assert dispatch.bytes_each == pytest.approx(rdma + nvlink)
    assert dispatch.seconds_each == pytest.approx(20e-6 + max(rdma / 46e9, nvlink / 370e9))
    # the plain all-to-all sends k copies, half of them off the node: 4x HybridEP's RDMA bytes and
    # more
    a2a = plans["a2a"].kinds["ep_dispatch"]
    assert a2a.bytes_each == pytest.approx(tokens * 8 * h * 2 * 15 / 16)
    assert a2a.seconds_each > 3.5 * dispatch.seconds_each
    assert plans["hybridep"].ep_sm_share == pytest.approx(32 / 132)
    assert plans["a2a"].ep_sm_share == 0


def test_fp8_plans_move_fp8_dispatch_and_run_gemms_at_the_fp8_rate():
    job = resolve_run("-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 -ep 16 -gb 1024 -mb 1 "
                      "-sl 4096 -c bf16 --moe_flex_dispatcher_backend deepep".split(), [])
    bf16, fp8 = (builtin_cluster("h100", p, 8) for p in ("bf16", "fp8"))
    b, f = (comm_plan(job.cfg, job.resolution.layout, c) for c in (bf16, fp8))
    assert f.kinds["ep_dispatch"].bytes_each == pytest.approx(b.kinds["ep_dispatch"].bytes_each / 2)
    assert f.kinds["ep_combine"].bytes_each == pytest.approx(b.kinds["ep_combine"].bytes_each)
    assert f.ep_sm_share == pytest.approx(20 / 132)
    with pytest.raises(Exception, match="mxfp8"):
        builtin_cluster("h100", "mxfp8", 8)
