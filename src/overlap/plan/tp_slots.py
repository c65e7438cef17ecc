"""Tensor-parallel communication of one layer, GEMM slot by GEMM slot, as the runtime runs it.

The runtime (`overlap.layers.tp_overlap`) executes the plan
`overlap.kernels.tp_overlap.effective_tp_plan` resolves (kept as the resolved overlap plan's
`tp_slots`): one method per slot, or none. The planner reads the same plan, so a preset, a Megatron
switch or a size rule that changes what runs changes the prediction too. With sequence parallelism
every TP linear moves one collective of the layer's activation ([s, b, h], (t-1)/t of it per GPU)
per pass; per layer and micro-batch:

    forward:  qkv all-gather -> qkv GEMM
              proj GEMM -> reduce-scatter
              fc1 all-gather -> fc1 GEMM
              fc2 GEMM -> reduce-scatter
    backward: fc2 all-gather of the output gradient -> dgrad GEMM
              fc1 dgrad GEMM -> reduce-scatter
              proj all-gather of the output gradient -> dgrad GEMM
              qkv dgrad GEMM -> reduce-scatter
              (+ the input's all-gather again for the weight gradient: the plain path and a bulk
              dgrad slot keep just the input shard; a plan without a bulk dgrad slot keeps the
              forward's gathered input)

A MoE layer (expert TP 1) has only the attention's, plus its shared expert's (a plain MLP outside
every plan: two forward and two backward collectives, all exposed). Under full recompute the
backward re-runs the forward, its collectives included, with the same slot methods. How each slot's
collective meets compute:

- no plan: the collective runs alone, all exposed - except the column-parallel linears' backward,
  which runs as Megatron-Core's sequence-parallel linear does (`overlap.layers.linear_functions`):
  the input's re-gather in flight under the dgrad GEMM, the input gradient's reduce-scatter under
  the wgrad GEMM (as bulk slots);
- ring exchange (all-gather -> GEMM or GEMM -> reduce-scatter): TP - 1 steps, each one shard's
  transfer under one 1/TP chunk of the GEMM: exposed (TP - 1) x max(0, shard - GEMM / TP);
- pipeline (GEMM -> reduce-scatter in `num_splits` chunks): chunk i's reduce-scatter is in flight
  while chunk i+1 computes, the chunks queue on the link, and the last one is exposed whole;
- bulk: the input's re-gather runs whole under the dgrad GEMM (bulk dgrad slot), the dgrad
  reduce-scatter under the wgrad GEMM (bulk wgrad slot): exposed max(0, collective - GEMM).

On a rate-limited link (`--network tbf:RATE`) what a collective costs depends on what ran before it:
the link's token bucket refills while it idles and lets the next bytes pass at the line rate. So the
layer runs as a program, its collectives in the runtime's order with the compute between them (the
GEMMs no transfer runs beside, the attention core, a MoE layer's MoE block), through one
`TokenBucket`; a reduce-scatter after two GEMMs finds it full, the all-gather right after it finds
it empty. On any other link the order changes nothing.

The backward's dgrad and wgrad GEMMs each take the forward GEMM's time (`MicrobatchCompute`:
backward = 2 x forward). Each chunk and step pays the link's latency again: that is what makes a
many-way split of a small GEMM lose. A ring with `aggregate` (a pair swap, then two shards per step:
TP / 2 steps) is counted as the plain ring's TP - 1 steps: the same bytes under the same GEMM, TP /
2 - 1 latencies apart. The small TP all-reduces (the cross-entropy's sums, the router's statistics)
are not modelled: they are latency-bound and a few per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.kernels import BULK, PIPELINE, RING, SlotPlan
from overlap.plan.hardware import Link, TokenBucket


@dataclass(frozen=True)
class TPGemms:
    """Forward seconds of one layer's TP GEMMs on one GPU (fc1 / fc2: 0 on a MoE layer), and of the
    compute between them that no TP collective runs beside: the attention core (between the qkv and
    proj GEMMs) and a MoE layer's MoE block (between its attention and the next layer's; 0 where its
    all-to-alls use the link), where a rate-limited link's bucket refills."""

    qkv: float
    proj: float
    fc1: float
    fc2: float
    core: float = 0.0
    moe: float = 0.0


NO_GEMMS = TPGemms(0.0, 0.0, 0.0, 0.0)  # a layer's collectives counted without their compute


@dataclass
class TPLayer:
    """One layer's TP collectives per micro-batch: seconds exposed by kind, seconds hidden under
    GEMMs (what the overlap slowdown applies to), and how many all-gathers and reduce-scatters
    run."""

    exposed_ag_s: float = 0.0
    exposed_rs_s: float = 0.0
    hidden_s: float = 0.0
    all_gathers: int = 0
    reduce_scatters: int = 0

    def add(self, kind: str, total_s: float, exposed_s: float) -> None:
        if kind == "ag":
            self.exposed_ag_s += exposed_s
            self.all_gathers += 1
        else:
            self.exposed_rs_s += exposed_s
            self.reduce_scatters += 1
        self.hidden_s += total_s - exposed_s


def _ring(
    bucket: TokenBucket, nbytes: float, tp: int, gemm_s: float, gathers: bool
) -> tuple[float, float]:
    """(total, exposed) seconds of a ring exchange: TP - 1 steps, one shard each, under a 1/TP chunk
    of the GEMM. The chunk without a transfer (the local shard's) runs last for an all-gather and
    first for a reduce-scatter, the link idle meanwhile; so does it after a step shorter than its
    chunk."""
    chunk = gemm_s / tp
    if not gathers:
        bucket.idle(chunk)
    total = exposed = 0.0
    for _ in range(tp - 1):
        step = bucket.send_s(nbytes / (tp - 1))
        total, exposed = total + step, exposed + max(0.0, step - chunk)
        bucket.idle(chunk - step)
    if gathers:
        bucket.idle(chunk)
    return total, exposed


def _pipeline(
    bucket: TokenBucket, nbytes: float, splits: int, gemm_s: float
) -> tuple[float, float]:
    """(total, exposed) seconds of a reduce-scatter cut into `splits` chunks, chunk i launched as
    the GEMM's chunk i ends and queued behind chunk i-1 on the link; exposed is what runs past the
    GEMM's end."""
    link_free = total = 0.0
    for i in range(splits):
        launch = (i + 1) * gemm_s / splits
        bucket.idle(launch - link_free)
        chunk = bucket.send_s(nbytes / splits)
        link_free, total = max(link_free, launch) + chunk, total + chunk
    return total, max(0.0, link_free - gemm_s)


def _under(
    bucket: TokenBucket, nbytes: float, plan: SlotPlan | None, tp: int, gemm_s: float, gathers: bool
) -> tuple[float, float]:
    """(total, exposed) seconds of one collective next to the GEMM its slot's plan puts it with: an
    all-gather (`gathers`) before its GEMM, a reduce-scatter after it. The link is idle during the
    slot GEMM's compute that no transfer runs beside (`bucket` refills meanwhile)."""
    if plan is not None and plan.method == RING:
        return _ring(bucket, nbytes, tp, gemm_s, gathers)
    if plan is not None and plan.method == PIPELINE:
        return _pipeline(bucket, nbytes, plan.num_splits, gemm_s)
    if plan is None:  # alone, before its GEMM (all-gather) or after it (reduce-scatter)
        if not gathers:
            bucket.idle(gemm_s)
        whole = bucket.send_s(nbytes)
        if gathers:
            bucket.idle(gemm_s)
        return whole, whole
    whole = bucket.send_s(nbytes)  # bulk: the whole collective beside the whole GEMM
    bucket.idle(gemm_s - whole)
    return whole, max(0.0, whole - gemm_s)


_PLAIN = SlotPlan(BULK)  # the plain sequence-parallel linear's backward (`_linear_backward`)


def _linear_backward(
    out: TPLayer,
    plans: dict[str, SlotPlan | None],
    name: str,
    bucket: TokenBucket,
    nbytes: float,
    tp: int,
    gemm_s: float,
) -> None:
    """An all-gather -> GEMM linear's backward (qkv, fc1), its dgrad GEMM then its wgrad GEMM: the
    dgrad reduce-scatter chunked with the dgrad GEMM (pipeline / ring dgrad slot), or whole under
    the wgrad GEMM (bulk wgrad slot), or alone between the two GEMMs; a bulk dgrad slot adds the
    input's re-gather under the dgrad GEMM. A linear without any planned slot runs the plain path
    (`linear_functions.Linear` with `gather`): the re-gather under the dgrad GEMM, the
    reduce-scatter under the wgrad GEMM, as two bulk slots."""
    dgrad, wgrad = plans.get(f"{name}_dgrad"), plans.get(f"{name}_wgrad")
    if dgrad is None and wgrad is None and plans.get(f"{name}_fprop") is None:
        dgrad = wgrad = _PLAIN
    if dgrad is not None and dgrad.method == BULK:
        out.add("ag", *_under(bucket, nbytes, dgrad, tp, gemm_s, True))  # beside the dgrad GEMM
        if wgrad is not None:
            # beside the wgrad GEMM
            out.add("rs", *_under(bucket, nbytes, wgrad, tp, gemm_s, False))
        else:  # alone, then the wgrad GEMM
            out.add("rs", *_under(bucket, nbytes, None, tp, gemm_s, True))
        return
    # bulk wgrad: after the dgrad GEMM, beside the wgrad GEMM
    if dgrad is None and wgrad is not None:
        bucket.idle(gemm_s)
        out.add("rs", *_under(bucket, nbytes, wgrad, tp, gemm_s, False))
        return
    if dgrad is None:  # alone between the dgrad GEMM and the wgrad GEMM
        bucket.idle(gemm_s)
        out.add("rs", *_under(bucket, nbytes, None, tp, gemm_s, True))
        return
    out.add("rs", *_under(bucket, nbytes, dgrad, tp, gemm_s, False))  # chunked with the dgrad GEMM
    bucket.idle(gemm_s)  # the wgrad GEMM


def _layer_program(
    out: TPLayer,
    plans: dict[str, SlotPlan | None],
    gemms: TPGemms,
    bucket: TokenBucket,
    nbytes: float,
    tp: int,
    dense: bool,
    shared_expert: bool,
    recompute: bool,
) -> None:
    """One layer's collectives in the order the runtime runs them, with the compute between them
    (the link's idle time): the forward's linear pairs, then their backward in reverse order."""
    pairs = [("qkv", "proj", gemms.qkv, gemms.proj, gemms.core)]
    if dense:
        pairs.append(("fc1", "fc2", gemms.fc1, gemms.fc2, 0.0))

    def forward() -> None:
        for up, down, up_s, down_s, between_s in pairs:
            out.add("ag", *_under(bucket, nbytes, plans.get(f"{up}_fprop"), tp, up_s, True))
            bucket.idle(between_s)
            out.add("rs", *_under(bucket, nbytes, plans.get(f"{down}_fprop"), tp, down_s, False))
        if not dense:
            _shared_expert(out, bucket, nbytes, tp, gemms.moe, shared_expert)

    forward()
    if recompute:
        forward()
    if not dense:
        _shared_expert(out, bucket, nbytes, tp, 2 * gemms.moe, shared_expert, backward=True)
    for up, down, up_s, down_s, between_s in reversed(pairs):
        out.add("ag", *_under(bucket, nbytes, plans.get(f"{down}_dgrad"), tp, down_s, True))
        bucket.idle(down_s + 2 * between_s)  # the down linear's wgrad GEMM, the core's backward
        _linear_backward(out, plans, up, bucket, nbytes, tp, up_s)


def _shared_expert(
    out: TPLayer,
    bucket: TokenBucket,
    nbytes: float,
    tp: int,
    block_s: float,
    shared_expert: bool,
    backward: bool = False,
) -> None:
    """The MoE block between a layer's attention and the next layer's (`block_s` of compute), with
    its shared expert's plain collectives (a TP MLP outside every plan) where it has one: an
    all-gather and a reduce-scatter each way, and in backward fc1's input gathered again. Its GEMMs
    are counted in the block, so nothing is taken as hidden beside them."""
    if shared_expert:
        out.add("ag", *_under(bucket, nbytes, None, tp, 0.0, True))
        if backward:
            out.add("ag", *_under(bucket, nbytes, None, tp, 0.0, True))
    bucket.idle(block_s)
    if shared_expert:
        out.add("rs", *_under(bucket, nbytes, None, tp, 0.0, False))


def layer_tp(
    plans: dict[str, SlotPlan | None],
    gemms: TPGemms,
    link: Link,
    nbytes: float,
    tp: int,
    dense: bool,
    shared_expert: bool = False,
    recompute: bool = False,
) -> TPLayer:
    """One layer's TP collectives per micro-batch (see the module docstring); `plans` is the
    resolved overlap plan's `tp_slots` (empty: TP overlap off), `nbytes` one collective's bytes per
    GPU, `dense` whether the layer has a TP MLP, `shared_expert` whether its MoE block has a shared
    expert, `recompute` full recompute. On a link with a token bucket the layer runs twice and the
    second is counted: the steady state, with the bucket as the layer before left it."""
    bucket = TokenBucket(link)
    if link.burst_bytes:
        _layer_program(TPLayer(), plans, gemms, bucket, nbytes, tp, dense, shared_expert, recompute)
    out = TPLayer()
    _layer_program(out, plans, gemms, bucket, nbytes, tp, dense, shared_expert, recompute)
    return out
