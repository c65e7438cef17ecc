"""Tensor-parallel communication of one layer, GEMM slot by GEMM slot, as the runtime runs it.

The runtime (`overlap.layers.tp_overlap`) executes the plan `overlap.config.tp_overlap.effective_tp_plan` resolves:
one method per slot, or none. The planner reads the same plan, so a preset, a Megatron switch or a size rule that
changes what runs changes the prediction too. With sequence parallelism every TP linear moves one collective of the
layer's activation ([s, b, h], (t-1)/t of it per GPU) per pass; per layer and micro-batch:

    forward:  qkv all-gather -> qkv GEMM;  proj GEMM -> reduce-scatter;  fc1 all-gather -> fc1 GEMM;
              fc2 GEMM -> reduce-scatter
    backward: fc2 all-gather of the output gradient -> dgrad GEMM;  fc1 dgrad GEMM -> reduce-scatter;
              proj all-gather -> dgrad GEMM;  qkv dgrad GEMM -> reduce-scatter
              (+ the input's all-gather again for the weight gradient, only where a bulk dgrad slot keeps just the
              input shard: without one the forward's gathered input is kept)

A MoE layer (expert TP 1) has only the attention's, plus its shared expert's (a plain MLP outside every plan: two
forward and two backward collectives, all exposed). Under full recompute the backward re-runs the forward, its
collectives included, with the same slot methods. How each slot's collective meets compute:

- no plan: the collective runs alone, all exposed;
- ring exchange (all-gather -> GEMM or GEMM -> reduce-scatter): TP - 1 steps, each one shard's transfer under one
  1/TP chunk of the GEMM: exposed (TP - 1) x max(0, shard - GEMM / TP);
- pipeline (GEMM -> reduce-scatter in `num_splits` chunks): chunk i's reduce-scatter is in flight while chunk i+1
  computes, the chunks queue on the link, and the last one is exposed whole;
- bulk: the input's re-gather runs whole under the dgrad GEMM (bulk dgrad slot), the dgrad reduce-scatter under the
  wgrad GEMM (bulk wgrad slot): exposed max(0, collective - GEMM).

The backward's dgrad and wgrad GEMMs each take the forward GEMM's time (`MicrobatchCompute`: backward = 2 x forward).
Each chunk and step pays the link's latency again: that is what makes a many-way split of a small GEMM lose. A ring
with `aggregate` (a pair swap, then two shards per step: TP / 2 steps) is counted as the plain ring's TP - 1 steps:
the same bytes under the same GEMM, TP / 2 - 1 latencies apart. The small TP all-reduces (the cross-entropy's sums, the
router's statistics) are not modelled: they are latency-bound and a few per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap.config.tp_overlap import BULK, PIPELINE, RING, SlotPlan
from overlap.plan.hardware import Link


@dataclass(frozen=True)
class TPGemms:
    """Forward seconds of one layer's TP GEMMs on one GPU (fc1 / fc2: 0 on a MoE layer)."""

    qkv: float
    proj: float
    fc1: float
    fc2: float


NO_GEMMS = TPGemms(0.0, 0.0, 0.0, 0.0)  # a layer's collectives counted without their compute


@dataclass
class TPLayer:
    """One layer's TP collectives per micro-batch: seconds exposed by kind, seconds hidden under GEMMs (what the
    overlap slowdown applies to), and how many all-gathers and reduce-scatters run."""

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


def _ring(link: Link, nbytes: float, tp: int, gemm_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of a ring exchange: TP - 1 steps, one shard each, under a 1/TP chunk of the GEMM."""
    step = link.time_s(nbytes / (tp - 1))
    return (tp - 1) * step, (tp - 1) * max(0.0, step - gemm_s / tp)


def _pipeline(link: Link, nbytes: float, splits: int, gemm_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of a reduce-scatter cut into `splits` chunks, chunk i launched as the GEMM's chunk i
    ends and queued behind chunk i-1 on the link; exposed is what runs past the GEMM's end."""
    chunk = link.time_s(nbytes / splits)
    link_free = 0.0
    for i in range(splits):
        link_free = max(link_free, (i + 1) * gemm_s / splits) + chunk
    return splits * chunk, max(0.0, link_free - gemm_s)


def _under(link: Link, nbytes: float, plan: SlotPlan | None, tp: int, gemm_s: float) -> tuple[float, float]:
    """(total, exposed) seconds of one collective next to the GEMM its slot's plan puts it with."""
    whole = link.time_s(nbytes)
    if plan is None:
        return whole, whole
    if plan.method == RING:
        return _ring(link, nbytes, tp, gemm_s)
    if plan.method == PIPELINE:
        return _pipeline(link, nbytes, plan.num_splits, gemm_s)
    return whole, max(0.0, whole - gemm_s)  # bulk: the whole collective beside the whole GEMM


def _linear_backward(out: TPLayer, plans: dict[str, SlotPlan | None], name: str, link: Link, nbytes: float,
                     tp: int, gemm_s: float) -> None:
    """An all-gather -> GEMM linear's backward (qkv, fc1): the dgrad reduce-scatter, chunked with the dgrad GEMM
    (pipeline / ring dgrad slot), or whole under the wgrad GEMM (bulk wgrad slot), or alone; a bulk dgrad slot adds
    the input's re-gather under the dgrad GEMM."""
    dgrad, wgrad = plans.get(f"{name}_dgrad"), plans.get(f"{name}_wgrad")
    if dgrad is not None and dgrad.method == BULK:
        out.add("ag", *_under(link, nbytes, dgrad, tp, gemm_s))
        dgrad = None  # its GEMM is taken by the re-gather; the reduce-scatter is the wgrad slot's
    out.add("rs", *_under(link, nbytes, dgrad if dgrad is not None else wgrad, tp, gemm_s))


def layer_tp(plans: dict[str, SlotPlan | None], gemms: TPGemms, link: Link, nbytes: float, tp: int,
             dense: bool, shared_expert: bool = False, recompute: bool = False) -> TPLayer:
    """One layer's TP collectives per micro-batch (see the module docstring); `plans` is `effective_tp_plan`'s
    (empty: TP overlap off), `nbytes` one collective's bytes per GPU, `dense` whether the layer has a TP MLP,
    `shared_expert` whether its MoE block has a shared expert, `recompute` full recompute."""
    out = TPLayer()
    linears = (("qkv", "proj", gemms.qkv, gemms.proj),) + ((("fc1", "fc2", gemms.fc1, gemms.fc2),) if dense else ())
    for up, down, up_s, down_s in linears:
        for _ in range(2 if recompute else 1):
            out.add("ag", *_under(link, nbytes, plans.get(f"{up}_fprop"), tp, up_s))
            out.add("rs", *_under(link, nbytes, plans.get(f"{down}_fprop"), tp, down_s))
        out.add("ag", *_under(link, nbytes, plans.get(f"{down}_dgrad"), tp, down_s))
        _linear_backward(out, plans, up, link, nbytes, tp, up_s)
    if shared_expert and not dense:
        for kind in ("ag", "rs") * (3 if recompute else 2):
            out.add(kind, *_under(link, nbytes, None, tp, 0.0))
    return out
