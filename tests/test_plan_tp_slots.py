"""The planner's TP model, slot by slot (`overlap.plan.tp_slots`): each method's exposure, the
collectives a layer runs under each plan, and the plan read from the same resolution the runtime
uses."""

import pytest

from overlap.kernels import BULK, PIPELINE, RING, SlotPlan
from overlap.kernels.tp_overlap import TPOverlapInputs, effective_tp_plan
from overlap.plan.hardware import Link
from overlap.plan.tp_slots import TPGemms, layer_tp
from overlap.recipes.models import RECIPES

MS = 1e-3
LINK = Link(1e6, 0.0, "1 MB/s, no latency")  # 1000 bytes: 1 ms
NBYTES = 1000.0


def _attention_layer(plans, qkv_s, tp=2):
    """A MoE layer (only the attention's TP linears: four collectives of 1 ms without a plan):
    (exposed, hidden)."""
    layer = layer_tp(plans, TPGemms(qkv_s, 0.0, 0.0, 0.0), LINK, NBYTES, tp, dense=False)
    return layer.exposed_ag_s + layer.exposed_rs_s, layer.hidden_s


def test_a_ring_hides_each_shard_under_one_chunk_of_the_gemm():
    ring = {"qkv_fprop": SlotPlan(RING)}
    # TP 2: one step, one shard (the whole 1 ms) under half the GEMM; the other three collectives
    # alone
    assert _attention_layer(ring, 1.0 * MS) == pytest.approx((3.5 * MS, 0.5 * MS))
    assert _attention_layer(ring, 4.0 * MS) == pytest.approx((3.0 * MS, 1.0 * MS))
    # TP 4: three steps of a third of the bytes each, under a quarter of the GEMM each
    assert _attention_layer(ring, 1.0 * MS, tp=4)[0] == pytest.approx(
        3 * MS + 3 * (MS / 3 - MS / 4)
    )


def test_a_pipelined_reduce_scatter_exposes_its_last_chunk_and_the_queue():
    def exposed(splits, gemm_s, link=LINK):
        plans = {"proj_fprop": SlotPlan(PIPELINE, splits)}
        layer = layer_tp(plans, TPGemms(0.0, gemm_s, 0.0, 0.0), link, NBYTES, 2, dense=False)
        return layer.exposed_rs_s - link.time_s(NBYTES)  # less the (unplanned) dgrad reduce-scatter

    # chunks keep pace with the GEMM: the last one is left
    assert exposed(4, 1.0 * MS) == pytest.approx(0.25 * MS)
    # the link is the bottleneck: 1.1 ms - 0.4
    assert exposed(4, 0.4 * MS) == pytest.approx(1.0 * MS - 0.3 * MS)
    latency = Link(1e6, 0.1 * MS, "with latency")
    # each chunk pays the latency
    assert exposed(4, 1.0 * MS, latency) == pytest.approx(0.35 * MS + 0.3 * MS)


def test_bulk_slots_hide_the_whole_collective_beside_the_whole_gemm():
    dense = TPGemms(0.3 * MS, 0.3 * MS, 2.0 * MS, 2.0 * MS)
    plans = {"fc1_dgrad": SlotPlan(BULK), "fc1_wgrad": SlotPlan(BULK)}
    layer = layer_tp(plans, dense, LINK, NBYTES, 2, dense=True)
    # fc1's input re-gather under its dgrad GEMM, its reduce-scatter under its wgrad GEMM: both
    # hidden; qkv's plain path does the same beside its 0.3 ms GEMMs (0.7 ms of each exposed); the
    # forward's four and the row-parallel linears' two backward all-gathers have no plan
    assert (layer.all_gathers, layer.reduce_scatters) == (6, 4)
    assert layer.exposed_ag_s + layer.exposed_rs_s == pytest.approx(7.4 * MS)
    assert layer.hidden_s == pytest.approx(2.6 * MS)


def test_a_chunked_dgrad_slot_takes_the_reduce_scatter():
    plans = {"qkv_dgrad": SlotPlan(PIPELINE, 2)}
    layer = layer_tp(plans, TPGemms(2.0 * MS, 0.0, 0.0, 0.0), LINK, NBYTES, 2, dense=False)
    assert (layer.all_gathers, layer.reduce_scatters) == (2, 2)  # kept input: no re-gather
    # proj's forward alone, qkv's last chunk
    assert layer.exposed_rs_s == pytest.approx(1 * MS + 0.5 * MS)


@pytest.mark.parametrize(
    "overrides, gathers",
    [
        # TP overlap off: the plain path re-gathers qkv's and fc1's input for the weight gradient
        # (Megatron's sequence-parallel linear)
        ({}, 6),
        (
            {"tp_comm_overlap": True},
            6,
        ),  # Transformer Engine's defaults: bulk dgrad re-gathers qkv's and fc1's input
        ({"tp_comm_overlap": True, "tp_comm_bulk_dgrad": False}, 4),
    ],
)
def test_a_layers_collectives_follow_the_resolved_plan(overrides, gathers):
    """Per layer: the forward's two all-gathers, the row-parallel linears' two in backward, and the
    column-parallel linears' inputs gathered again for their weight gradients (the plain path and a
    bulk dgrad slot: they keep only the shard); a plan without a bulk dgrad slot keeps the gathered
    input and gathers nothing again."""
    m = RECIPES["dense_tiny"].build(1).model
    m.tensor_model_parallel_size, m.sequence_parallel = 2, True
    for key, value in overrides.items():
        setattr(m, key, value)
    # the slots the resolution puts in the plan (none with TP overlap off)
    plans = (
        effective_tp_plan(TPOverlapInputs.of(m), None, delay_wgrad_compute=False)[0]
        if m.tp_comm_overlap
        else {}
    )
    layer = layer_tp(plans, TPGemms(1 * MS, 1 * MS, 1 * MS, 1 * MS), LINK, NBYTES, 2, dense=True)
    assert (layer.all_gathers, layer.reduce_scatters) == (gathers, 4)
    if not overrides:  # the re-gathers and the backward's reduce-scatters under the 1 ms GEMMs
        assert layer.hidden_s == pytest.approx(4 * MS)
        assert layer.exposed_ag_s + layer.exposed_rs_s == pytest.approx(6 * MS)
    else:
        assert layer.hidden_s > 0


@pytest.mark.parametrize("recompute, gathers, scatters", [(False, 6, 4), (True, 8, 6)])
def test_a_shared_expert_and_full_recompute_add_their_collectives(recompute, gathers, scatters):
    """A MoE layer's shared expert is a plain TP MLP (two collectives each way, none in a plan, and
    fc1's input gathered again in backward); full recompute runs the forward's collectives again in
    the backward. The attention's plain qkv hides its re-gather and reduce-scatter under its 1 ms
    GEMMs; everything else is exposed."""
    layer = layer_tp(
        {},
        TPGemms(1 * MS, 1 * MS, 0.0, 0.0),
        LINK,
        NBYTES,
        2,
        dense=False,
        shared_expert=True,
        recompute=recompute,
    )
    assert (layer.all_gathers, layer.reduce_scatters) == (gathers, scatters)
    assert layer.exposed_ag_s + layer.exposed_rs_s == pytest.approx((gathers + scatters - 2) * MS)
    assert layer.hidden_s == pytest.approx(2 * MS)
    ring = layer_tp(
        {"qkv_fprop": SlotPlan(RING)},
        TPGemms(1 * MS, 0.0, 0.0, 0.0),
        LINK,
        NBYTES,
        2,
        dense=False,
        recompute=True,
    )
    # the recomputed forward hides its ring again
    assert ring.hidden_s == pytest.approx(2 * 0.5 * MS)


def test_a_token_bucket_refills_under_the_compute_between_collectives():
    """A rate-limited link's bucket (`--network tbf:RATE`) fills while the link idles, up to its
    depth, and the next transfer spends it at the line rate. Plain attention layer (TP overlap off),
    1 ms GEMMs, one collective's worth of bucket. On a plain link the forward's all-gather and
    reduce-scatter and the backward's proj all-gather are exposed (3 ms) and qkv's re-gather and
    reduce-scatter hide under its dgrad and wgrad GEMMs (2 ms). With the bucket: the forward's
    reduce-scatter follows the qkv and proj GEMMs (a full bucket), the backward's proj all-gather
    right after it pays the rate, and the GEMMs after each refill it for the next: 1 ms exposed."""
    gemms = TPGemms(1 * MS, 1 * MS, 0.0, 0.0)
    bursty = Link(1e6, 0.0, "1 MB/s, 1000-byte bucket", burst_bytes=NBYTES)
    plain = layer_tp({}, gemms, LINK, NBYTES, 2, dense=False)
    layer = layer_tp({}, gemms, bursty, NBYTES, 2, dense=False)
    assert (plain.exposed_ag_s, plain.exposed_rs_s) == pytest.approx((2 * MS, 1 * MS))
    assert plain.hidden_s == pytest.approx(2 * MS)
    assert (layer.exposed_ag_s, layer.exposed_rs_s) == pytest.approx((1 * MS, 0.0))
    # GEMMs of a quarter of the refill time refill a quarter of the bucket each: half a millisecond
    # less of each kind than the plain link's
    quarter = TPGemms(0.25 * MS, 0.25 * MS, 0.0, 0.0)
    plain = layer_tp({}, quarter, LINK, NBYTES, 2, dense=False)
    layer = layer_tp({}, quarter, bursty, NBYTES, 2, dense=False)
    assert (plain.exposed_ag_s, plain.exposed_rs_s) == pytest.approx((2.75 * MS, 1.75 * MS))
    assert (layer.exposed_ag_s, layer.exposed_rs_s) == pytest.approx((2.25 * MS, 1.25 * MS))
