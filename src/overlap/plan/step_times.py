"""Where one step's time goes: how compute and communication line up, and what each overlap
switch hides behind what.

- Pipeline (`overlap.plan.pipeline_sim`): the rank programs of 1F1B / interleaved 1F1B run as a
  simulation with the micro-batch's time per chunk, once with free and once with real transfers.
  With free transfers the idle time is the bubble, (p - 1) / m of the compute for 1F1B and (p - 1) /
  (m v) interleaved (Narayanan et al. 2021, arXiv 2104.04473; the simulation reproduces both); what
  real transfers add is the exposed p2p. Overlapped p2p (`model.overlap_p2p_comm`: receives posted
  early, sends never waited; in plain 1F1B each input gradient sent before its weight gradients)
  hides the transfers its schedule's slack covers (the simulation's notes).
- EP overlap (`model.overlap_moe_expert_parallel_comm`): micro-batches run as Megatron-Core's
  combined 1F1B (ours: `overlap.pipeline.combined_1f1b`), F(0) alone, F(i) merged with B(i-1),
  B(last) alone. Per merged MoE layer each transfer is hidden by the pieces of the other micro-batch
  between its launch and its wait (each backward counted as half input gradient, half weight
  gradient), in the runtime's order:

      F attention + B previous layer's experts weight gradients   hide B's combine backward
      B previous layer's experts weight gradients                 hide F's split sizes (`ep_counts`)
      B experts input gradient                                    hides F's dispatch
      F experts                                                   hide B's dispatch backward
      B attention backward                                        hides F's combine

  `delay_wgrad_compute` takes the weight gradients out of their fixed places: they fill whatever the
  other pieces leave exposed. F(0) and B(last) expose their all-to-alls and split-size exchanges;
  under an interleaved pipeline the merged program's warm-up forwards and cool-down backwards do
  (`pipeline_steps(merged=True)`, pipeline rank 0). Without EP overlap the split-size exchange is a
  rendezvous with nothing to hide it.
- Shared-expert overlap (`model.moe_shared_expert_overlap`, without EP overlap): the shared expert's
  forward runs in two halves, one under the dispatch and one under the combine.
- DP overlap: bucket by bucket (`bucket_exposure`), the gradient reduce-scatter (or all-reduce)
  hides behind the last micro-batch's backward (`ddp.overlap_grad_reduce`; the last bucket, ready as
  the backward ends, never hides), the parameter all-gather behind the first micro-batch's forward
  (`ddp.overlap_param_gather`; the first bucket is waited for before the forward starts).
  Megatron-FSDP's layer-by-layer collectives do the same in every micro-batch, the parameters'
  gather behind its backward as well as its forward.
- CP (`model.cp_comm_type`): with `p2p` and `model.cp_comm_overlap` each ring step's transfer hides
  behind one block's attention (1 / CP of the layer's attention core; backward twice that): forward
  the next KV block; backward the next KV block and the previous block's dKV sum together on the
  link, the last dKV sum under the rank's own block (`cp_ring_exposure`; a2a+p2p's ring runs
  across its all-to-all groups). Serialised, and the all_gather / a2a collectives, expose
  everything.
- TP overlap (`model.tp_comm_overlap`): slot by slot (`overlap.plan.tp_slots`), with the plan the
  runtime runs (`effective_tp_plan`): a ring exchange hides each shard under a 1/TP chunk of its
  GEMM, a pipelined reduce-scatter exposes its last chunk and what queues behind it, a bulk
  collective hides under the whole neighbouring GEMM; a slot without a plan exposes its collective,
  as do the embedding's and the output layer's.

While a piece overlaps communication its compute runs slower: x (1 + slowdown) for the overlapped
part (`Cluster.overlap_slowdown`, source in `overlap.plan.hardware`). That cost is reported apart
from the exposed communication (`overlap_slowdown_ms`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from overlap.pipeline.schedules import pipeline_steps
from overlap.plan.comm_model import CommPlan
from overlap.plan.compute import MicrobatchCompute
from overlap.plan.pipeline_sim import simulate
from overlap.plan.tp_slots import layer_tp


@dataclass
class StepTimes:
    """Seconds of one step, by where they go."""

    # every micro-batch's forward + backward at the calibrated rate, no slowdown (average stage)
    compute_s: float = 0.0
    # the same on pipeline rank 0 (what a run with faked communication measures)
    first_rank_compute_s: float = 0.0
    slowest_rank_compute_s: float = 0.0  # the same on the busiest pipeline rank
    bubble_s: float = 0.0
    # communication no compute hides, by kind
    exposed_s: dict[str, float] = field(default_factory=dict)
    slowdown_s: float = 0.0  # compute stretched while it overlapped communication

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + sum(self.exposed_s.values()) + self.slowdown_s

    def expose(self, kind: str, seconds: float) -> None:
        if seconds > 0:
            self.exposed_s[kind] = self.exposed_s.get(kind, 0.0) + seconds


@dataclass(frozen=True)
class Switches:
    """The resolved overlap switches the schedule honours."""

    overlap_moe_expert_parallel_comm: bool
    delay_wgrad_compute: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    overlap_p2p_comm: bool
    pp: int
    vpp: int
    vp_group: int | None = None  # microbatch_group_size_per_vp_stage (None: PP)
    moe_shared_expert_overlap: bool = False
    cp_comm_overlap: bool = False  # model.cp_comm_overlap: the KV ring's steps under the blocks
    p2p_warmup_depth: int = 1  # comm_overlap.p2p_warmup_depth: plain 1F1B's warm-up multiple


def bucket_exposure(buckets: list[float], window: float, gather: bool) -> float:
    """Seconds of the buckets' collectives (one link, one after the other) that `window` of compute
    does not hide. Reduce (gather False): bucket i's gradients are ready at (i + 1) / n of the
    backward window, so the last bucket is launched as the window ends. Gather: the forward reaches
    bucket i at i / n of the window and waits for it; bucket 0 is launched as the window starts and
    each next one when the forward reaches its predecessor (one bucket of look-ahead,
    `overlap.data_parallel.param_gather`)."""
    n = len(buckets)
    link = delay = 0.0
    for i, seconds in enumerate(buckets):
        if gather:
            launch = 0.0 if i == 0 else (i - 1) * window / n + delay
            link = max(link, launch) + seconds
            delay = max(delay, link - i * window / n)
        else:
            link = max(link, (i + 1) * window / n) + seconds
    return delay if gather else max(0.0, link - window)


def cp_ring_exposure(
    kv: float, dkv: float, cp: int, block_fwd: float, overlap: bool, forwards: int = 1
) -> tuple[float, float, float]:
    """(exposed cp_kv seconds, exposed cp_dkv seconds, hidden seconds) of one layer's KV ring for
    one micro-batch (`overlap.layers.cp_attention.RingAttention`): forward CP - 1 KV steps
    (`forwards` times: 2 under full recompute), each under a block's forward; backward CP blocks
    (each twice a forward block), starting from the block the forward kept: under block s the next
    KV block travels (s < CP - 2) beside the previous block's dKV sum (s >= 1), the last one under
    the rank's own block. Serialised: all of it exposed, nothing hidden."""
    if not overlap:
        return (cp - 1) * kv * forwards + (cp - 2) * kv, (cp - 1) * dkv, 0.0
    block_bwd = 2 * block_fwd
    fwd = forwards * (cp - 1) * max(0.0, kv - block_fwd)
    hidden = forwards * (cp - 1) * min(kv, block_fwd)
    # in flight under each backward block
    loads = [(kv if s < cp - 2 else 0.0) + (dkv if s >= 1 else 0.0) for s in range(cp)]
    bwd = sum(max(0.0, load - block_bwd) for load in loads)
    hidden += sum(min(load, block_bwd) for load in loads)
    kv_share = (cp - 2) * kv / ((cp - 2) * kv + (cp - 1) * dkv)  # the backward's exposure, split
    return fwd + bwd * kv_share, bwd * (1 - kv_share), hidden


def _merged_moe_layer(
    c: MicrobatchCompute,
    a2a: dict[str, float],
    counts_s: float,
    sigma: float,
    delay_wgrad_compute: bool,
    t: StepTimes,
    weight: float,
    sm_share: float = 0.0,
) -> None:
    """Adds to `t` the exposed transfers and the slowdown of `weight` merged MoE layer pairs (F of
    one micro-batch, B of the other), in the runtime's order (`overlap.pipeline.combined_1f1b`).
    Each backward is half input gradient, half weight gradient; without delay_wgrad the weight
    halves run at fixed slots, with it they fill the waits (a pool that absorbs what the fixed
    pieces leave exposed).

    A transfer slows the compute beside it only while it runs: the compute loses a share u of its
    rate for the transfer's time (DeepEP / HybridEP: `sm_share`, the SMs their kernels hold;
    NCCL's all-to-alls, `sm_share` 0: sigma, as every other overlap in the model charges sigma per
    second of hidden transfer). A window of W seconds beside a t-second transfer then takes W + u t
    when it outlasts the transfer, and the transfer exposes t - W / (1 - u) past it otherwise, less
    what the delayed weight gradients (at the same 1 - u) fill. The compute after the transfer has
    ended, and the window's launch gaps, are not slowed."""
    u = sm_share or sigma
    e_wgrad, a_wgrad = c.moe_fwd_s, c.attention_fwd_s
    e_dgrad = c.bwd_factor * c.moe_fwd_s + c.moe_recompute_s - e_wgrad
    a_dgrad = c.bwd_factor * c.attention_fwd_s + c.attention_recompute_s - a_wgrad
    fixed_e, fixed_a = (0.0, 0.0) if delay_wgrad_compute else (e_wgrad, a_wgrad)
    # The pieces in order (B's combine backward launched before the first): F's attention, B's
    # previous layer's experts weight gradients, B's experts input gradient, F's experts, B's
    # attention backward. Each transfer is covered by the pieces between its launch and its wait.
    pieces = (c.attention_fwd_s, fixed_e, e_dgrad, c.moe_fwd_s, a_dgrad + fixed_a)
    covers = (
        ("ep_combine_bwd", a2a.get("ep_combine_bwd", 0.0), (0, 1)),
        ("ep_counts", counts_s, (1,)),
        ("ep_dispatch", a2a.get("ep_dispatch", 0.0), (2,)),
        ("ep_dispatch_bwd", a2a.get("ep_dispatch_bwd", 0.0), (3,)),
        ("ep_combine", a2a.get("ep_combine", 0.0), (4,)),
    )
    # delayed: the weight gradients run beside whatever transfer the fixed pieces leave exposed
    pool = e_wgrad + a_wgrad if delay_wgrad_compute else 0.0
    for kind, seconds, window in covers:
        if seconds <= 0:
            continue
        room = sum(pieces[i] for i in window) / (1 - u)
        exposed = max(0.0, seconds - room)
        filled = min(exposed, pool / (1 - u))
        pool -= filled * (1 - u)
        t.slowdown_s += u * (min(seconds, room) + filled) * weight
        t.expose(kind, (exposed - filled) * weight)


@functools.lru_cache(maxsize=4096)
def unmerged_forwards(pp: int, vpp: int, microbatches: int, group: int | None) -> int:
    """Pipeline rank 0's forwards that run alone (not merged with a backward) in the EP-overlap
    program; cached, since the same few programs recur across thousands of priced and bounded
    candidates in the layout search."""
    steps = pipeline_steps(pp, 0, vpp, microbatches, group, merged=True)
    return sum(1 for s in steps if s.backward is None)


def step_times(
    c: MicrobatchCompute,
    comm: CommPlan,
    sw: Switches,
    microbatches: int,
    slowdown: dict[str, float],
    exact: bool = True,
) -> StepTimes:
    """Where one step's time goes for these switches (see the module docstring); `exact=False`
    extrapolates a long pipeline program from short ones (`pipeline_sim.simulate`)."""
    t = StepTimes()
    m = microbatches
    sigma_ep = slowdown.get("ep", slowdown.get("other", 0.0))
    sigma = slowdown.get("other", 0.0)
    t.compute_s = m * c.fwd_bwd_s
    per_rank = (
        [
            sum(w for v, w in enumerate(c.stage_weights) if v % sw.pp == r) / sw.vpp
            for r in range(sw.pp)
        ]
        if sw.pp > 1
        else [1.0]
    )
    t.first_rank_compute_s = t.compute_s * per_rank[0]
    t.slowest_rank_compute_s = t.compute_s * max(per_rank)
    a2a = comm.ep_a2a_s
    if a2a and sw.overlap_moe_expert_parallel_comm and m > 1:
        # The merged program's warm-up forwards (as many cool-down backwards) run alone, their
        # all-to-alls exposed: F(0) and B(last) without PP; under an interleaved pipeline, pipeline
        # rank 0's (the most of any rank).
        alone = unmerged_forwards(sw.pp, sw.vpp, m, sw.vp_group)
        _merged_moe_layer(
            c,
            a2a,
            comm.ep_counts_s,
            sigma_ep,
            sw.delay_wgrad_compute,
            t,
            c.moe_layers * (m * sw.vpp - alone) / sw.vpp,
            comm.ep_sm_share,
        )
        for kind, seconds in a2a.items():
            t.expose(kind, seconds * c.moe_layers * alone / sw.vpp)
        t.expose("ep_counts", comm.ep_counts_s * c.moe_layers * alone / sw.vpp)
    # with the shared-expert overlap, its two halves run under the dispatch and under the combine
    # (forward)
    else:
        cover = c.shared_expert_fwd_s / 2 if sw.moe_shared_expert_overlap else 0.0
        for kind, seconds in a2a.items():
            hidden = min(seconds, cover) if kind in ("ep_dispatch", "ep_combine") else 0.0
            t.expose(kind, (seconds - hidden) * c.moe_layers * m)
            t.slowdown_s += hidden * sigma_ep * c.moe_layers * m
        t.expose("ep_counts", comm.ep_counts_s * c.moe_layers * m)

    # the KV ring step by step, under the blocks' attention; CP's collectives exposed whole
    if comm.cp_ring_s:
        kv_exposed, dkv_exposed, hidden = cp_ring_exposure(
            comm.cp_ring_s["cp_kv"],
            comm.cp_ring_s["cp_dkv"],
            comm.cp_size,
            c.attention_core_fwd_s / comm.cp_size,
            sw.cp_comm_overlap,
            2 if c.recompute else 1,
        )
        t.expose("cp_kv", kv_exposed * c.layers * m)
        t.expose("cp_dkv", dkv_exposed * c.layers * m)
        t.slowdown_s += hidden * sigma * c.layers * m
    for kind in ("cp_ag", "cp_a2a") if comm.cp_ring_s else ("cp_ag", "cp_dkv", "cp_a2a"):
        if kind in comm.kinds:
            t.expose(kind, comm.kinds[kind].seconds_per_step)

    # slot by slot, as the runtime's plan puts each collective next to a GEMM
    if comm.tp_link is not None:
        for dense, layers in ((True, c.dense_layers), (False, c.moe_layers)):
            if layers:
                tp = layer_tp(
                    comm.tp_plans,
                    c.tp_gemms,
                    comm.tp_link,
                    comm.tp_bytes,
                    comm.tp_size,
                    dense,
                    c.shared_expert_fwd_s > 0,
                    c.recompute,
                )
                t.expose("tp_ag", m * layers * tp.exposed_ag_s)
                t.expose("tp_rs", m * layers * tp.exposed_rs_s)
                t.slowdown_s += m * layers * tp.hidden_s * sigma
        edges = m * comm.tp_edges_per_mb * comm.tp_link.time_s(comm.tp_bytes)
        t.expose("tp_ag", edges)
        t.expose("tp_rs", edges)

    # the pipeline program itself, simulated: its bubble, and the p2p its schedule cannot hide
    if sw.pp > 1:
        per_mb_s = (t.compute_s + t.slowdown_s + sum(t.exposed_s.values())) / m
        fwd_share = c.fwd_s / c.fwd_bwd_s
        f, b = per_mb_s * fwd_share / sw.vpp, per_mb_s * (1 - fwd_share) / sw.vpp
        merged = sw.overlap_moe_expert_parallel_comm and bool(comm.ep_a2a_s)
        free = simulate(
            sw.pp,
            sw.vpp,
            m,
            f,
            b,
            0.0,
            sw.overlap_p2p_comm,
            sw.vp_group,
            c.stage_weights,
            merged,
            exact=exact,
            warmup_depth=sw.p2p_warmup_depth,
        )
        t.bubble_s = free.step_s - free.compute_s  # idle time, unequal stages' included
        if comm.pp_send is not None:
            exposed = (
                simulate(
                    sw.pp,
                    sw.vpp,
                    m,
                    f,
                    b,
                    comm.pp_send,
                    sw.overlap_p2p_comm,
                    sw.vp_group,
                    c.stage_weights,
                    merged,
                    exact=exact,
                    warmup_depth=sw.p2p_warmup_depth,
                ).step_s
                - free.step_s
            )
            t.expose("pp_send", exposed)
            if sw.overlap_p2p_comm:
                hidden = max(0.0, comm.kinds["pp_send"].seconds_per_step - exposed)
                t.slowdown_s += min(hidden, t.compute_s) * sigma

    # after the DP reduction, before the optimizer: nothing runs beside it
    if "pp_tied_grad" in comm.kinds:
        t.expose("pp_tied_grad", comm.kinds["pp_tied_grad"].seconds_per_step)

    # Per step, or (Megatron-FSDP) per micro-batch, where the layers' parameters are gathered for
    # the backward too; there its gather and reduce-scatter are priced apart, as if each had the
    # link to itself
    every, bwd, fwd = comm.dp_every_microbatch, c.bwd_s, c.fwd_s
    for kinds, passes, overlapped in (
        (("rs", "ar"), ((comm.dp_rs_s, bwd, False),), sw.overlap_grad_reduce),
        (
            ("ag",),
            ((comm.dp_ag_s, fwd, True), (comm.dp_ag_bwd_s, bwd, True)),
            sw.overlap_param_gather,
        ),
    ):
        # Each buffer (dense over DP, experts over expert-DP) has its own group: they run side by
        # side, and the step waits for the slower one.
        exposed: dict[str, float] = {}
        hidden = 0.0
        for buffers, window, gather in passes:
            if not buffers:
                continue
            left = {
                p: bucket_exposure(b, window, gather) if overlapped else sum(b)
                for p, b in buffers.items()
            }
            for p, seconds in left.items():
                exposed[p] = exposed.get(p, 0.0) + seconds
            if overlapped:
                hidden += min(max(sum(b) - left[p] for p, b in buffers.items()), window)
        if not exposed:
            continue
        times = m if kinds[0] in every else 1
        t.slowdown_s += times * sigma * hidden
        scale = max(exposed.values()) / sum(exposed.values()) if sum(exposed.values()) > 0 else 0.0
        for prefix, seconds in exposed.items():
            kind = next(f"{prefix}_{k}" for k in kinds if f"{prefix}_{k}" in comm.kinds)
            t.expose(kind, times * seconds * scale)
    return t
