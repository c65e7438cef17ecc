"""The planner against published runs (`overlap.plan.validate`): Megatron-Bridge's performance
summary and the MoE comm-overlap skill's on/off pairs, each predicted by the compute efficiency and
per-kernel overhead fitted on the other runs of its GPU group (leave-one-out; an on/off pair left
out whole).

What is held here:
- the stored fit (`overlap.plan.fitted`) is what the fit code gives: a few rows' linear models
  taken again, the group fits re-derived from the stored ones, and each linear model within 2% of
  the full model at the shipped fit;
- every published on/off pair within 20% of step time and 0.03 of the on/off ratio (the HybridEP
  pair included);
- the share of rows within 20% is what docs/planner.md states (21 of 24; the misses are explained
  there), the median leave-one-out error at most 10%, and the table in docs/planner.md is the
  generated one;
- the flex dispatcher's SMs per backend and version (a cluster file picks DeepEP V2's), and the
  sync-free MoE buffers' elementwise work over every row of their blocks;
- the flex dispatcher's hierarchy: DeepEP / HybridEP bytes against the reference's own arithmetic.
"""

from math import comb
from pathlib import Path

import pytest

from overlap.harness import resolve_run, start_up_quiet
from overlap.plan import validate
from overlap.plan.comm_model import comm_plan, expected_destinations, hit_probability
from overlap.plan.fitted import FITTED, LINEARIZED_AT
from overlap.plan.hardware import builtin_cluster

DOCS = Path(__file__).resolve().parents[1] / "docs" / "planner.md"
ROWS = {r.name: r for r in validate.ROWS}


@pytest.fixture(scope="module")
def table():
    # the rows' resolution notes are not the point here (held back for the fit alone: a later test
    # reading the start-up lines with caplog sees its own)
    with start_up_quiet():
        lins = validate.stored_linear()
        results, groups = validate.fit(lins)
    return lins, results, groups


@pytest.mark.parametrize(
    "name",
    [
        "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap off",
        "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on",
        "Qwen3-30B-A3B 8xGB200 MXFP8 MBS4 EP8 (26.08)",
    ],
)
def test_stored_linear_models_are_the_fit_codes(table, name):
    lins, _results, _groups = table
    row = ROWS[name]
    fresh = validate.linearize(row, *LINEARIZED_AT[validate.GROUPS[row.gpu]])
    stored = lins[name]
    for got, want in ((fresh.a, stored.a), (fresh.b, stored.b), (fresh.c, stored.c)):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def test_the_linear_models_hold_at_the_shipped_fit(table):
    lins, _results, groups = table
    for name in (
        "Qwen3-30B-A3B 16xH100 BF16 alltoall, EP overlap on",
        "Llama3-70B 64xH100 FP8 TP4 PP8 VP5",
    ):
        row = ROWS[name]
        g = groups[validate.GROUPS[row.gpu]]
        eff, tau = g["efficiency"], g["kernel_overhead_us"] * 1e-6
        full = validate.predicted_s(row, eff, tau)
        assert lins[name].step_s(eff, tau) == pytest.approx(full, rel=0.02)


def test_shipped_fits_are_the_group_fits(table):
    _lins, _results, groups = table
    for gpu, group in validate.GROUPS.items():
        assert FITTED[gpu] == groups[group]
        efficiency = builtin_cluster(gpu, "bf16", None).efficiency
        assert efficiency.value == groups[group]["efficiency"]
        assert efficiency.kernel_overhead_s * 1e6 == pytest.approx(
            groups[group]["kernel_overhead_us"]
        )
    assert builtin_cluster("h200", "bf16", None).efficiency.value == FITTED["h100"]["efficiency"]
    # Blackwell's overhead is the H100 fit's, on H100 rows only
    assert FITTED["gb200"]["kernel_overhead_from"] == "h100"
    assert FITTED["gb200"]["kernel_overhead_us"] == FITTED["h100"]["kernel_overhead_us"]


def test_no_row_predicts_itself(table):
    lins, results, _groups = table
    for r in results:
        assert r.row.name not in r.fit_rows
        if r.row.pair:
            assert not any(o.pair == r.row.pair for o in validate.ROWS if o.name in r.fit_rows)
        points = [(lins[n], ROWS[n].published_s) for n in r.fit_rows]
        if validate.GROUPS[r.row.gpu] == "h100":
            fit = validate.fit_group(points)
        else:  # the overhead from all H100 rows, the efficiency from the other Blackwell rows
            h100 = [
                (lins[n], o.published_s)
                for n, o in ROWS.items()
                if o.gpu == "h100" and not o.not_expressible
            ]
            fit = validate.fit_group(points, validate.fit_group(h100)[1])
        assert (r.loo_efficiency, r.loo_overhead_s) == pytest.approx(fit)
        assert r.predicted_s == pytest.approx(validate.predicted_s(r.row, *fit))


def test_the_fit_meets_two_rows_exactly_and_minimizes_the_deviation():
    # three rows made from a known (efficiency, overhead), one of them off by 30%: the fit finds the
    # two that agree and ignores the third
    truth = (0.5, 20e-6)
    rows = [
        validate.Linear(1.0, 10.0, 1e5),
        validate.Linear(2.0, 5.0, 3e5),
        validate.Linear(0.5, 8.0, 2e5),
    ]
    points = [(lin, lin.step_s(*truth) * (1.3 if i == 2 else 1.0)) for i, lin in enumerate(rows)]
    assert validate.fit_group(points) == pytest.approx(truth)
    # the overhead given: the efficiency is the median of the rows' own
    eff, tau = validate.fit_group(points[:2] + [(rows[2], rows[2].step_s(0.25, 20e-6))], 20e-6)
    assert (eff, tau) == pytest.approx((0.5, 20e-6))


def test_every_on_off_pair_within_20_percent_and_0_03_of_its_ratio(table):
    _lins, results, _groups = table
    pairs = validate.pairs(results)
    assert {on.row.pair for _off, on, _p, _q in pairs} == {"guide", "hybridep"}
    for off, on, published, predicted in pairs:
        assert abs(off.error) <= validate.WITHIN and abs(on.error) <= validate.WITHIN, on.row.name
        assert abs(predicted - published) <= validate.RATIO_WITHIN, on.row.name


def test_rows_within_20_percent_as_documented(table):
    _lins, results, _groups = table
    within = sum(abs(r.error) <= validate.WITHIN for r in results)
    assert len(results) == 26
    assert within >= 22  # docs/planner.md explains the misses
    assert validate.median_error(results) <= 0.10  # issue 53's goal, leave-one-out
    assert f"{within} of {len(results)} expressible runs within 20%" in DOCS.read_text()


def test_docs_carry_the_generated_table(table):
    _lins, results, groups = table
    text = DOCS.read_text()
    assert validate.markdown(results, groups) in text
    assert text.count("| group | efficiency (all its rows)") == 1  # no stale copy beside it


def test_flex_gpu_dispatch_sends_a_token_once_per_node_and_rank():
    # the reference's arithmetic: top-8 of 128 experts over 2 nodes reaches 1.99 nodes, over EP16
    # 6.6 ranks
    assert expected_destinations(2, 128, 8) == pytest.approx(1.99, abs=0.01)
    assert expected_destinations(16, 128, 8) == pytest.approx(6.6, abs=0.05)
    assert hit_probability(128, 64, 8) == pytest.approx(1 - comb(64, 8) / comb(128, 8))
    base = (
        "-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 -ep 16 -tp 1 -pp 1 -gb 1024 -mb 1 -sl 4096 "
        "-c bf16"
    )
    cluster = builtin_cluster("h100", "bf16", 8)
    plans = {}
    for name, extra in (
        ("a2a", "model.moe_token_dispatcher_type=alltoall"),
        ("hybridep", "--moe_flex_dispatcher_backend hybridep"),
    ):
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
    job = resolve_run(
        "-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 -ep 16 -gb 1024 -mb 1 "
        "-sl 4096 -c bf16 --moe_flex_dispatcher_backend deepep".split(),
        [],
    )
    bf16, fp8 = (builtin_cluster("h100", p, 8) for p in ("bf16", "fp8"))
    b, f = (comm_plan(job.cfg, job.resolution.layout, c) for c in (bf16, fp8))
    assert f.kinds["ep_dispatch"].bytes_each == pytest.approx(b.kinds["ep_dispatch"].bytes_each / 2)
    assert f.kinds["ep_combine"].bytes_each == pytest.approx(b.kinds["ep_combine"].bytes_each)
    assert f.ep_sm_share == pytest.approx(20 / 132)
    with pytest.raises(Exception, match="mxfp8"):
        builtin_cluster("h100", "mxfp8", 8)


def test_dispatcher_sms_per_backend_and_version(tmp_path):
    from overlap.errors import ConfigError
    from overlap.plan.hardware import DISPATCHER_SMS, load_cluster

    assert builtin_cluster("gb300", "mxfp8", None).ep_backend_sms == {"deepep": 20, "hybridep": 32}
    f = tmp_path / "c.json"
    f.write_text('{"gpu": "h100", "ep_backend_sms": {"deepep": "v2", "hybridep": 24}}')
    cluster = load_cluster(str(f), "h100", "bf16", 8)
    assert cluster.ep_backend_sms == {"deepep": DISPATCHER_SMS["deepep"]["v2"], "hybridep": 24}
    f.write_text('{"gpu": "h100", "ep_backend_sms": {"deepep": "v9"}}')
    with pytest.raises(ConfigError, match="v1, v2"):
        load_cluster(str(f), "h100", "bf16", 8)


def test_sync_free_buffers_run_the_expert_glue_over_every_row():
    from overlap.plan.compute import microbatch_compute

    job = resolve_run(
        "-m qwen -mr qwen3_30b_a3b -g h100 -ng 16 -gn 8 -ep 16 -gb 1024 -mb 1 -sl 4096 "
        "-c bf16".split(),
        [],
    )
    cluster = builtin_cluster("h100", "bf16", 8)
    plain = microbatch_compute(job.cfg, job.resolution.layout, cluster).moe_fwd_s
    job.resolution.model.moe_expert_rank_capacity_factor = 1.5
    padded = microbatch_compute(job.cfg, job.resolution.layout, cluster).moe_fwd_s
    assert padded > plain  # the activation and casts over 1.5x the rows; the GEMMs unchanged


def _merged(sigma: float, sm_share: float, delay_wgrad: bool, a2a_s: float):
    from overlap.plan.compute import MicrobatchCompute
    from overlap.plan.step_times import StepTimes, _merged_moe_layer

    c = MicrobatchCompute(
        attention_fwd_s=1.0,
        moe_fwd_s=1.0,
        shared_expert_fwd_s=0.0,
        dense_mlp_fwd_s=0.0,
        logits_fwd_s=0.0,
        moe_layers=1.0,
        dense_layers=0.0,
        recompute=False,
    )
    kinds = ("ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd")
    t = StepTimes()
    _merged_moe_layer(c, dict.fromkeys(kinds, a2a_s), 0.0, sigma, delay_wgrad, t, 1.0, sm_share)
    return t


def test_a_transfer_slows_the_compute_beside_it_only_while_it_runs():
    # NCCL (no SM share): 0.40 of the compute's rate for the transfer's time, not the whole window
    short = _merged(0.4, 0.0, False, 0.1)
    assert short.slowdown_s == pytest.approx(4 * 0.4 * 0.1)
    assert not short.exposed_s
    # the same rule as HybridEP's SM share
    assert _merged(0.0, 0.4, False, 0.1).slowdown_s == pytest.approx(short.slowdown_s)
    # a transfer longer than its window: the window runs at 0.6 of its rate throughout, the rest
    # is exposed (F's dispatch, under B's 1 s of expert input gradients: 3 - 1 / 0.6)
    long = _merged(0.4, 0.0, False, 3.0)
    assert long.exposed_s["ep_dispatch"] == pytest.approx(3.0 - 1.0 / 0.6)


def test_delayed_weight_gradients_fill_a_dispatchers_exposure():
    # with delay_wgrad the weight gradients leave their windows and run beside what stays exposed,
    # for DeepEP / HybridEP (an SM share) as for NCCL
    for sigma, share in ((0.4, 0.0), (0.0, 32 / 148)):
        u = share or sigma
        plain, delayed = (_merged(sigma, share, d, 3.0) for d in (False, True))
        exposed = sum(delayed.exposed_s.values())
        assert exposed <= sum(plain.exposed_s.values()) + 1e-9
        # each of the four 1 s windows exposes 3 - 1 / (1 - u); the 2 s of weight gradients,
        # slowed as well, cover 2 / (1 - u) of it
        assert exposed == pytest.approx(4 * (3.0 - 1 / (1 - u)) - 2 / (1 - u))
