"""The schedule: how compute and communication of one step line up, and what each overlap switch hides behind what.

- Pipeline bubble (Narayanan et al. 2021, arXiv 2104.04473): 1F1B idles (p - 1) micro-batch times per step,
  interleaved (p - 1) / v; as a fraction of the m micro-batches, (p - 1) / m and (p - 1) / (m v).
- EP overlap (`model.overlap_moe_expert_parallel_comm`): micro-batches run as Megatron-Core's combined 1F1B (ours:
  `overlap.pipeline.combined_1f1b`), F(0) alone, F(i) merged with B(i-1), B(last) alone. Per merged MoE layer
  the four all-to-alls are hidden by a piece of the other micro-batch, in this order (phases run back to back,
  each as long as the longer of its compute and its transfer):
      F attention            hides B's combine backward
      B experts backward     hides F's dispatch
      F experts              hides B's dispatch backward
      B attention backward   hides F's combine
  `delay_wgrad_compute` moves the experts' weight gradient (half the experts' backward) from the second phase to
  the third, beside F's experts. F(0) and B(last) expose their all-to-alls.
- DP overlap: the gradient reduce-scatter (or all-reduce) hides behind the last micro-batch's backward
  (`ddp.overlap_grad_reduce`), the parameter all-gather behind the first micro-batch's forward
  (`ddp.overlap_param_gather`); what does not fit is exposed.
- TP overlap (`model.tp_comm_overlap`): each layer's collectives are split into chunks pipelined with the
  neighbouring GEMMs; one chunk of four stays exposed (Bridge performance guide: num_splits = 4), and what the
  layer's compute cannot cover.
- PP overlap (`model.overlap_p2p_comm`): the micro-batch's sends run under its own compute; without it they block.

While a piece overlaps communication its compute runs slower: x (1 + slowdown) for the overlapped part
(`Cluster.overlap_slowdown`, source in `overlap.plan.hardware`). That cost is reported apart from the exposed
communication (`overlap_slowdown_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap.plan.comm_model import CommPlan
from overlap.plan.compute import MicrobatchCompute

TP_SPLITS = 4  # Megatron-Bridge performance guide: num_splits = 4 is best; one chunk stays exposed


@dataclass
class StepTimes:
    """Seconds of one step, by where they go."""

    compute_s: float = 0.0  # every micro-batch's forward + backward at the calibrated rate, no slowdown
    bubble_s: float = 0.0
    exposed_s: dict[str, float] = field(default_factory=dict)  # communication no compute hides, by kind
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

    ep_overlap: bool
    delay_wgrad: bool
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    tp_overlap: bool
    overlap_p2p: bool
    pp: int
    vpp: int


def bubble_fraction(pp: int, microbatches: int, vpp: int = 1) -> float:
    """(p - 1) / (m v): 1F1B at v = 1, interleaved otherwise."""
    return (pp - 1) / (microbatches * max(1, vpp)) if pp > 1 else 0.0


def _merged_moe_layer(c: MicrobatchCompute, a2a: dict[str, float], sigma: float, delay_wgrad: bool,
                      t: StepTimes, weight: int) -> float:
    """Seconds of one merged MoE layer pair (F of one micro-batch, B of the other); adds the exposed transfers and
    the slowdown of `weight` such pairs to `t`."""
    experts_bwd = c.bwd_factor * c.moe_fwd_s
    wgrad = c.moe_fwd_s if delay_wgrad else 0.0  # the experts' weight gradient: half the backward
    phases = ((c.attention_fwd_s, "ep_combine_bwd"), (experts_bwd - wgrad, "ep_dispatch"),
              (c.moe_fwd_s + wgrad, "ep_dispatch_bwd"), (c.bwd_factor * c.attention_fwd_s, "ep_combine"))
    total = 0.0
    for compute, kind in phases:
        transfer = a2a.get(kind, 0.0)
        stretched = compute * (1 + sigma) if transfer > 0 else compute
        phase = max(stretched, transfer)
        exposed = max(0.0, transfer - stretched)
        t.expose(kind, exposed * weight)
        t.slowdown_s += (phase - compute - exposed) * weight
        total += phase
    return total


def step_times(c: MicrobatchCompute, comm: CommPlan, sw: Switches, microbatches: int,
               slowdown: dict[str, float]) -> StepTimes:
    """Where one step's time goes for these switches (see the module docstring)."""
    t = StepTimes()
    m = microbatches
    sigma_ep = slowdown.get("ep", slowdown.get("other", 0.0))
    sigma = slowdown.get("other", 0.0)
    t.compute_s = m * c.fwd_bwd_s
    a2a = comm.ep_a2a_s
    if a2a and sw.ep_overlap and m > 1:
        for _ in range(c.moe_layers):
            _merged_moe_layer(c, a2a, sigma_ep, sw.delay_wgrad, t, m - 1)
        for kind, seconds in a2a.items():  # F(0) and B(last) run alone: their two transfers each are exposed
            t.expose(kind, seconds * c.moe_layers)
    else:
        for kind, seconds in a2a.items():
            t.expose(kind, seconds * c.moe_layers * m)

    if comm.tp_layer_s:
        per_mb = comm.tp_layer_s * c.layers
        if sw.tp_overlap:
            window = c.fwd_bwd_s - c.logits_fwd_s * (1 + c.bwd_factor)
            exposed = max(per_mb / TP_SPLITS, per_mb - window)
            hidden = per_mb - exposed
            t.slowdown_s += m * min(hidden, window) * sigma
        else:
            exposed = per_mb
        for kind in ("tp_ag", "tp_rs"):
            if kind in comm.kinds:
                t.expose(kind, m * exposed * comm.kinds[kind].count / sum(
                    comm.kinds[k].count for k in ("tp_ag", "tp_rs") if k in comm.kinds))

    per_mb_exposed_pp = 0.0
    if comm.pp_mb_s:
        if sw.overlap_p2p:
            per_mb_exposed_pp = max(0.0, comm.pp_mb_s - c.fwd_bwd_s)
            t.slowdown_s += m * min(comm.pp_mb_s, c.fwd_bwd_s) * sigma
        else:
            per_mb_exposed_pp = comm.pp_mb_s
        t.expose("pp_send", m * per_mb_exposed_pp)

    per_mb_s = (t.compute_s + t.slowdown_s + sum(t.exposed_s.values())) / m
    t.bubble_s = bubble_fraction(sw.pp, m, sw.vpp) * m * per_mb_s

    bwd_last, fwd_first = c.fwd_s * c.bwd_factor, c.fwd_s
    for kinds, seconds, overlapped, window in (
            (("dp_rs", "edp_rs", "dp_ar", "edp_ar"), comm.dp_rs_s, sw.overlap_grad_reduce, bwd_last),
            (("dp_ag", "edp_ag"), comm.dp_ag_s, sw.overlap_param_gather, fwd_first)):
        if not seconds:
            continue
        exposed = max(0.0, seconds - window) if overlapped else seconds
        if overlapped:
            t.slowdown_s += min(seconds, window) * sigma
        present = [k for k in kinds if k in comm.kinds]
        total = sum(comm.kinds[k].seconds_per_step for k in present)
        for k in present:
            t.expose(k, exposed * comm.kinds[k].seconds_per_step / total)
    return t
