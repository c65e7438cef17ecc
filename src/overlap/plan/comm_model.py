"""Bytes per communication kind and their time on the cluster's links.

Bytes (per GPU, the busbw convention of `NVIDIA/nccl-tests:doc/PERFORMANCE.md`; planner reference
section 4.2):

- EP, per micro-batch and MoE layer, four all-to-alls (`ep_dispatch`, `ep_combine`, and their
  backward mirrors `ep_dispatch_bwd`, `ep_combine_bwd`). Alltoall dispatcher: T x k x h x beta bytes
  each, T = b s / TP tokens (after SP); flex (token-deduplicating) dispatch sends a token once per
  distinct destination rank instead of once per routed expert, R (1 - C(E - E/R, k) / C(E, k)) ranks
  on average under uniform routing. Before each dispatch (`ep_counts`) one int64 per expert tells
  the ranks how many rows follow: latency-bound and a rendezvous, hidden only by the EP-overlap
  schedule (`overlap.plan.step_times`); the static-shape mode (`moe_pad_expert_input_to_capacity`)
  has none. The sync-free dispatch (`moe_expert_rank_capacity_factor`) sends EP blocks of C =
  ceil(T k / EP x factor) rows whatever the routing, (EP - 1) C h beta bytes leaving, and has no
  counts exchange either (each row carries its local expert; the host reads it saves are not
  priced).
- EP with DeepEP or HybridEP (flex dispatcher, `flex_gpu_a2a`): hierarchical. A token crosses the
  network once per destination node (to the GPU of the same index there) and NVLink once per
  destination rank within a node, the receiving GPU fanning it out to the other ranks of its node:
  per token, (nodes - 1) x P(node) RDMA copies and nodes x (g - 1) x P(rank) NVLink copies, P(node)
  / P(rank) the chance that top-k of E experts hit a given node / rank, 1 - C(E - E_there, k) / C(E,
  k). The RDMA and NVLink parts run at once (time: the slower). Under an FP8 recipe the forward
  dispatch moves FP8 (1 byte per element), its combine and the backward BF16 (DeepEP's setting). The
  kernels hold a fixed number of SMs (`Cluster.ep_backend_sms`: per backend and version,
  `overlap.plan.hardware.DISPATCHER_SMS`), `ep_sm_share` of the GPU.
- TP with SP, per micro-batch and layer: 4 forward + 4 backward collectives of (t-1)/t x b s h beta,
  plus the input's re-gather for the weight gradient where a bulk dgrad slot keeps only the shard (a
  MoE layer with ETP 1 keeps only its attention's: 2 + 2 (+ 1), and its shared expert's 2 + 2; full
  recompute repeats the forward's); `overlap.plan.tp_slots` says which GEMM hides each. Per
  micro-batch, the vocabulary-parallel embedding adds a reduce-scatter (backward: an all-gather) on
  the first stage and the output layer an all-gather (backward: a reduce-scatter) on the last, never
  overlapped.
- PP, per micro-batch: one activation (b s h beta, / TP under SP) sent forward and one gradient back
  per stage boundary; VPP v sends v times as often.
- CP, per micro-batch and layer, on a CP rank's b s / CP tokens (every other kind above counts those
  too): `p2p` sends its keys and values (2 b s / CP x groups / TP x d x beta) to the next CP rank CP
  - 1 times forward and CP - 2 times backward (`cp_kv`; the backward starts from the block the
  forward kept), and the key/value gradient sums (fp32, as the runtime sends them) CP - 1 times
  (`cp_dkv`), each step over the CP ring's link; `all_gather` gathers them
  ((CP - 1) x the rank's keys and values, `cp_ag`) forward and again backward, and reduce-scatters
  the gradients (`cp_dkv`); `a2a` trades q, k, v and the output ((CP - 1) / CP of them, `cp_a2a`)
  forward and their gradients backward; `a2a+p2p` ([A, P]) runs `a2a`'s all-to-alls inside groups
  of A consecutive CP ranks and `p2p`'s ring across the P groups (each step the same bytes as one
  rank's keys and values). Full recompute repeats the forward's.
- DP, per step: the distributed optimizer's reduce-scatter of gradients ((d-1)/d x P x beta_grad)
  and all-gather of parameters ((d-1)/d x P x beta_param), or one all-reduce (2 (d-1)/d x P x
  beta_grad); dense parameters over DP, experts over expert-DP. P is this rank's parameter count
  (`overlap.launch.resources.estimate_memory`), cut into ceil(P / bucket size) equal buckets (the
  resolved plan's `bucket_size`; one without a bucket size), one collective each. Megatron-FSDP
  moves the same bytes a layer at a time (each layer's share of P; the embedding, output layer and
  final norm, outside its units, as one more) and more often: the gradients' reduce-scatter every
  micro-batch (`optim_grads` and up), the parameters' all-gather every micro-batch's forward and
  the layers' again in its backward (`optim_grads_params`).

Time: latency + bytes / bandwidth, where the link depends on how many of the group's members share a
node (`g`, from the rank order tp-cp-dp-pp, tensor parallel fastest; experts pp-edp-ep-etp): the
whole group on one node runs at NVLink speed; a ring spanning nodes is NIC-bound at min(g x NIC,
NVLink) (rings run rail-parallel, one NIC per member on the node); an all-to-all sends its off-node
share (n - g) / n through this GPU's own NIC while the on-node share (g - 1) / n crosses NVLink at
the same time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil, comb

from overlap.config.comm_overlap import FSDP_SHARDING
from overlap.config.container import ConfigContainer
from overlap.config.model import expert_rank_capacity
from overlap.kernels import SlotPlan
from overlap.launch.activations import capacity_rows_per_token
from overlap.launch.resources import estimate_memory
from overlap.layout import ParallelLayout
from overlap.plan.hardware import Cluster, Link, Transfer
from overlap.plan.tp_slots import NO_GEMMS, layer_tp

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def members_per_node(size: int, stride: int, gpus_per_node: int) -> int:
    """How many of a group's `size` members (ranks `stride` apart) share one node of
    `gpus_per_node`."""
    if size <= 1:
        return 1
    return max(1, min(size, gpus_per_node // max(1, stride)))


def ring_link(size: int, per_node: int, cluster: Cluster) -> Link:
    """The link a ring collective (all-gather / reduce-scatter / all-reduce) of the group runs
    at."""
    if per_node >= size:
        return cluster.nvlink
    bandwidth = min(per_node * cluster.nic.bandwidth_Bps, cluster.nvlink.bandwidth_Bps)
    return Link(
        bandwidth, cluster.nic.latency_s, f"{per_node} of {size} members per node: the NICs"
    )


def ring_time_s(nbytes: float, size: int, per_node: int, cluster: Cluster) -> float:
    """A ring collective moving `nbytes` per GPU over the group."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    return ring_link(size, per_node, cluster).time_s(nbytes)


def alltoall_time_s(nbytes: float, size: int, per_node: int, cluster: Cluster) -> float:
    """An all-to-all where `nbytes` leave this GPU for the other members, spread evenly over
    them."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    off_node = nbytes * (size - per_node) / (size - 1)
    on_node = nbytes - off_node
    if off_node <= 0:
        return cluster.nvlink.time_s(on_node)
    return cluster.nic.latency_s + max(
        off_node / cluster.nic.bandwidth_Bps, on_node / cluster.nvlink.bandwidth_Bps
    )


def hit_probability(experts: int, there: int, topk: int) -> float:
    """The chance that a token routed uniformly to top-k of `experts` picks at least one of the
    `there` experts."""
    if there >= experts:
        return 1.0
    return 1 - comb(experts - there, topk) / comb(experts, topk)


def flex_gpu_a2a(
    tokens: float,
    hidden_bytes: float,
    ep: int,
    per_node: int,
    experts: int,
    topk: int,
    cluster: Cluster,
) -> tuple[float, float]:
    """(bytes leaving this GPU, seconds) of one DeepEP / HybridEP dispatch or combine (module
    docstring)."""
    nodes = -(-ep // per_node)
    p_node = hit_probability(experts, experts * per_node // ep, topk)
    p_rank = hit_probability(experts, experts // ep, topk)
    rdma = tokens * (nodes - 1) * p_node * hidden_bytes
    nvlink = tokens * nodes * (per_node - 1) * p_rank * hidden_bytes
    if rdma > 0:
        slower = max(rdma / cluster.nic.bandwidth_Bps, nvlink / cluster.nvlink.bandwidth_Bps)
        seconds = cluster.nic.latency_s + slower
    else:
        seconds = cluster.nvlink.time_s(nvlink)
    return rdma + nvlink, seconds


def expected_destinations(groups: int, experts: int, topk: int) -> float:
    """Distinct destination groups (ranks or nodes) of one token routed uniformly to top-k of
    `experts` spread over `groups` groups: R (1 - C(E - E/R, k) / C(E, k)) (planner reference
    section 4.2)."""
    if groups <= 1:
        return 1.0
    per = experts // groups
    return groups * (1 - comb(experts - per, topk) / comb(experts, topk))


@dataclass
class Collective:
    """One kind: bytes and seconds per occurrence, and how many occur per step."""

    kind: str
    bytes_each: float
    seconds_each: float
    count: int  # per step

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_each * self.count

    @property
    def seconds_per_step(self) -> float:
        return self.seconds_each * self.count


@dataclass
class CommPlan:
    """All collectives of a step, by kind, plus the pieces the schedule needs per micro-batch and
    per layer."""

    kinds: dict[str, Collective] = field(default_factory=dict)
    # per MoE layer and micro-batch, per EP kind
    ep_a2a_s: dict[str, float] = field(default_factory=dict)
    # per MoE layer and micro-batch: the split-size exchange before the dispatch
    ep_counts_s: float = 0.0
    # DeepEP / HybridEP: the share of the GPU's SMs their kernels hold (0: NCCL's all-to-all)
    ep_sm_share: float = 0.0
    # TP with SP: one collective's bytes per GPU, its link, and the slot plan the runtime runs
    # (`overlap.plan.tp_slots`)
    tp_bytes: float = 0.0
    tp_link: Link | None = None
    tp_size: int = 1
    tp_plans: dict[str, SlotPlan | None] = field(default_factory=dict)
    # The embedding's reduce-scatter (its backward: an all-gather) and the output layer's all-gather
    # (backward: a reduce-scatter), outside any overlap plan: per micro-batch, of each kind, on the
    # average pipeline stage.
    tp_edges_per_mb: float = 0.0
    pp_send: Transfer | None = None  # one activation (or its gradient) between neighbouring stages
    # Per step, per gradient buffer ("dp" dense, "edp" experts: their own groups, so their own
    # links), per bucket:
    # gradient reduce-scatter / all-reduce
    dp_rs_s: dict[str, list[float]] = field(default_factory=dict)
    # parameter all-gather (distributed optimizer)
    dp_ag_s: dict[str, list[float]] = field(default_factory=dict)
    # Megatron-FSDP: the kinds ("rs", "ag") that run layer by layer in every micro-batch (their
    # lists above: one micro-batch's, a collective a layer, the parameters outside the layers one
    # more: gathered first, reduce-scattered last), and the backward's gathers (the layers again)
    dp_every_microbatch: frozenset[str] = frozenset()
    dp_ag_bwd_s: dict[str, list[float]] = field(default_factory=dict)
    # CP p2p: one ring step's seconds per kind ("cp_kv", "cp_dkv") and the ring's size
    cp_ring_s: dict[str, float] = field(default_factory=dict)
    cp_size: int = 1

    def add(self, kind: str, bytes_each: float, seconds_each: float, count: int) -> None:
        if count and bytes_each > 0:
            self.kinds[kind] = Collective(kind, bytes_each, seconds_each, count)


def microbatches(cfg: ConfigContainer, layout: ParallelLayout) -> int:
    """Micro-batches per DP replica per step: GBS / (DP x MBS)."""
    return max(1, cfg.train.global_batch_size // (max(1, layout.dp) * cfg.train.micro_batch_size))


def comm_plan(cfg: ConfigContainer, layout: ParallelLayout, cluster: Cluster) -> CommPlan:
    """Every collective of one step of `cfg` on `layout`, with its bytes and time on `cluster`
    (the overlap switches: the resolved plan's)."""
    m, o, prec = cfg.resolved.model, cfg.resolved.overlap, cfg.resolved.precision
    plan = CommPlan()
    tp, pp, ep, dp, edp = (
        max(1, x) for x in (layout.tp, layout.pp, layout.ep, layout.dp, layout.edp)
    )
    gpn = cluster.gpus_per_node
    mb = microbatches(cfg, layout)
    act = 2 if prec.bf16 or prec.fp16 else 4  # activation bytes (beta)
    cp = max(1, layout.cp)
    # a CP rank's share of the sequence
    b, s, h = cfg.train.micro_batch_size, m.seq_length // cp, m.hidden_size
    # the layers of the pipeline rank holding the most (the real per-stage layout)
    held = cfg.resolved.pipeline.busiest_rank_layers()
    moe_here = sum(1 for layer in held if m.is_moe_layer(layer))
    dense_here = len(held) - moe_here

    if m.is_moe and ep > 1 and moe_here and cluster.carries("ep"):
        tokens = b * s / (tp if layout.sequence_parallel else 1)
        g = members_per_node(ep, max(1, layout.etp), gpn)
        backend = cfg.resolved.kernels.moe_flex_dispatcher_backend  # None unless flex runs
        for kind in ("ep_dispatch", "ep_combine", "ep_dispatch_bwd", "ep_combine_bwd"):
            if backend in cluster.ep_backend_sms:
                fp8 = kind == "ep_dispatch" and cluster.precision in ("fp8", "mxfp8")
                leaving, seconds = flex_gpu_a2a(
                    tokens,
                    h * (1 if fp8 else act),
                    ep,
                    g,
                    m.num_moe_experts,
                    m.moe_router_topk,
                    cluster,
                )
                if cluster.sms:
                    plan.ep_sm_share = cluster.ep_backend_sms[backend] / cluster.sms
            elif m.moe_expert_rank_capacity_factor is not None:
                # the sync-free dispatch's blocks: EP x C rows a rank, full whatever the routing
                block = expert_rank_capacity(
                    round(tokens), m.moe_router_topk, ep, m.moe_expert_rank_capacity_factor
                )
                leaving = ep * block * h * act * (ep - 1) / ep
                seconds = alltoall_time_s(leaving, ep, g, cluster)
            else:
                # the alltoall dispatcher sends each kept row (the expert capacity pads or drops)
                copies = (
                    expected_destinations(ep, m.num_moe_experts, m.moe_router_topk)
                    if backend
                    else capacity_rows_per_token(m, tokens)
                )
                leaving = tokens * copies * h * act * (ep - 1) / ep
                seconds = alltoall_time_s(leaving, ep, g, cluster)
            plan.add(kind, leaving, seconds, moe_here * mb)
            plan.ep_a2a_s[kind] = seconds
        # static shapes (capacity + padding, or the sync-free blocks) exchange no counts
        if not (m.moe_pad_expert_input_to_capacity or m.moe_expert_rank_capacity_factor):
            counts = m.num_moe_experts * 8 * (ep - 1) / ep  # one int64 per expert
            plan.ep_counts_s = alltoall_time_s(counts, ep, g, cluster)
            plan.add("ep_counts", counts, plan.ep_counts_s, moe_here * mb)

    if layout.sequence_parallel and cluster.carries("tp"):  # (the layout has it at TP > 1 only)
        plan.tp_bytes = (tp - 1) / tp * b * s * h * act
        plan.tp_link, plan.tp_size = ring_link(tp, members_per_node(tp, 1, gpn), cluster), tp
        plan.tp_plans = dict(o.tp_slots)
        plan.tp_edges_per_mb = 2.0 / pp
        dense, moe = (
            layer_tp(
                plan.tp_plans,
                NO_GEMMS,
                plan.tp_link,
                plan.tp_bytes,
                tp,
                is_dense,
                bool(m.moe_shared_expert_intermediate_size),
                m.recompute_granularity == "full",
            )
            for is_dense in (True, False)
        )
        t_each = plan.tp_link.time_s(plan.tp_bytes)
        edges = ceil(plan.tp_edges_per_mb * mb)
        plan.add(
            "tp_ag",
            plan.tp_bytes,
            t_each,
            (dense.all_gathers * dense_here + moe.all_gathers * moe_here) * mb + edges,
        )
        plan.add(
            "tp_rs",
            plan.tp_bytes,
            t_each,
            (dense.reduce_scatters * dense_here + moe.reduce_scatters * moe_here) * mb + edges,
        )

    if pp > 1 and cluster.carries("pp"):
        vpp = layout.vpp
        nbytes = b * s * h * act / (tp if layout.sequence_parallel else 1)
        link = ring_link(2, members_per_node(2, tp * layout.cp * dp, gpn), cluster)
        sends = 2 * vpp  # an activation forward and a gradient back, per model chunk
        plan.add("pp_send", nbytes, link.time_s(nbytes), sends * mb)
        plan.pp_send = Transfer(link, nbytes)
        # the tied embedding's gradient summed with its last-stage copy's
        if m.share_embeddings_and_output_weights:
            grad = 4 if prec.grad_reduce_in_fp32 else _BYTES.get(prec.params_dtype, 4)
            shards = dp * cp if o.use_distributed_optimizer else 1
            tied = m.vocab_size // tp * h * grad / shards
            ends = members_per_node(2, tp * layout.cp * dp * (pp - 1), gpn)
            plan.add("pp_tied_grad", tied, ring_time_s(tied, 2, ends, cluster), 1)

    if cp > 1 and cluster.carries("cp"):
        _cp_plan(cfg, plan, layout, b * s / tp, len(held), mb, cluster)

    est = estimate_memory(cfg, layout, cpu=False)
    grad = 4 if prec.grad_reduce_in_fp32 else _BYTES.get(prec.params_dtype, 4)
    param = 1 if prec.fp8_param_gather else _BYTES.get(prec.params_dtype, 4)
    # Megatron-FSDP reduce-scatters each micro-batch's gradients (optim_grads and up) and gathers
    # the parameters for every forward and backward (optim_grads_params), one layer at a time
    level = FSDP_SHARDING.index(o.data_parallel_sharding_strategy) if o.use_megatron_fsdp else 0
    plan.dp_every_microbatch = frozenset(("rs", "ag")[: max(0, level - 1)])
    for prefix, size, stride, count, layers, root in (
        # dense gradients over DP x CP (ranks TP apart), experts over expert-DP
        ("dp", dp * cp, tp, est.params - est.expert_params, len(held), est.root_params),
        ("edp", edp, ep * layout.etp, est.expert_params, moe_here, 0),
    ):
        if size <= 1 or count <= 0 or not cluster.carries(prefix):
            continue
        g = members_per_node(size, stride, gpn)
        buckets = max(1, -(-count // o.bucket_size)) if o.bucket_size else 1
        per_bucket = count / buckets
        if o.use_distributed_optimizer:
            for kind, nbytes, times in (("rs", grad, plan.dp_rs_s), ("ag", param, plan.dp_ag_s)):
                if kind not in plan.dp_every_microbatch:
                    each = (size - 1) / size * per_bucket * nbytes
                    plan.add(f"{prefix}_{kind}", each, ring_time_s(each, size, g, cluster), buckets)
                    times[prefix] = [ring_time_s(each, size, g, cluster)] * buckets
                    continue
                # Megatron-FSDP: a layer's share at a time, the rest (root) once: gathered
                # before the first layer, reduce-scattered after the last
                layers = max(1, layers)
                layer = (size - 1) / size * (count - root) / layers * nbytes
                ends = [(size - 1) / size * root * nbytes] if root else []
                passes = ends + [layer] * layers if kind == "ag" else [layer] * layers + ends
                times[prefix] = [ring_time_s(b, size, g, cluster) for b in passes]
                sent, seconds, calls = sum(passes), sum(times[prefix]), len(passes)
                if kind == "ag":  # the layers again for the backward
                    plan.dp_ag_bwd_s[prefix] = [ring_time_s(layer, size, g, cluster)] * layers
                    sent += layers * layer
                    seconds += sum(plan.dp_ag_bwd_s[prefix])
                    calls += layers
                plan.add(f"{prefix}_{kind}", sent / calls, seconds / calls, calls * mb)
        else:
            ar = 2 * (size - 1) / size * per_bucket * grad
            plan.add(f"{prefix}_ar", ar, ring_time_s(ar, size, g, cluster), buckets)
            plan.dp_rs_s[prefix] = [ring_time_s(ar, size, g, cluster)] * buckets
    return plan


def _cp_plan(
    cfg: ConfigContainer,
    plan: CommPlan,
    layout: ParallelLayout,
    rows: float,
    layers: int,
    mb: int,
    cluster: Cluster,
) -> None:
    """CP's kinds (module docstring) for `layers` layers x `mb` micro-batches; `rows` = a CP rank's
    tokens / TP (the heads of one TP rank see all of them). The CP ranks are TP apart; a2a+p2p's
    all-to-all groups are A consecutive CP ranks (`layout.cp_a2a`), its ring's members A x TP
    apart."""
    m, kind = cfg.resolved.model, cfg.resolved.overlap.cp_comm_type
    cp, tp = layout.cp, layout.tp
    gpn = cluster.gpus_per_node
    prec = cfg.resolved.precision
    act = 2 if prec.bf16 or prec.fp16 else 4
    forwards = 2 if m.recompute_granularity == "full" else 1
    kv = rows * 2 * m.query_groups * m.head_dim * act
    dkv = kv * 4 / act  # the gradients travel in fp32
    a2a_size = layout.cp_a2a if kind == "a2a+p2p" else cp
    if kind in ("a2a", "a2a+p2p") and a2a_size > 1:
        heads = 2 * m.num_attention_heads + 2 * m.query_groups  # q, k, v in and the output back
        a2a = (a2a_size - 1) / a2a_size * rows * heads * m.head_dim * act
        seconds = alltoall_time_s(a2a, a2a_size, members_per_node(a2a_size, tp, gpn), cluster)
        plan.add("cp_a2a", a2a, seconds, (forwards + 1) * layers * mb)
    if kind in ("p2p", "a2a+p2p"):
        # a2a+p2p: a ring of CP / A members, each step a block of A ranks' tokens for 1 / A of the
        # heads: the same bytes as one rank's keys and values
        hierarchical = kind == "a2a+p2p"
        size = cp // a2a_size if hierarchical else cp
        stride = tp * a2a_size if hierarchical else tp
        if size > 1:
            link = ring_link(size, members_per_node(size, stride, gpn), cluster)
            plan.cp_ring_s = {"cp_kv": link.time_s(kv), "cp_dkv": link.time_s(dkv)}
            plan.cp_size = size
            kv_steps = (size - 1) * forwards + size - 2  # the backward starts from the kept block
            plan.add("cp_kv", kv, link.time_s(kv), kv_steps * layers * mb)
            plan.add("cp_dkv", dkv, link.time_s(dkv), (size - 1) * layers * mb)
    elif kind == "all_gather":
        per_node = members_per_node(cp, tp, gpn)
        ag, rs = (cp - 1) * kv, (cp - 1) * dkv
        plan.add("cp_ag", ag, ring_time_s(ag, cp, per_node, cluster), (forwards + 1) * layers * mb)
        plan.add("cp_dkv", rs, ring_time_s(rs, cp, per_node, cluster), layers * mb)
