"""What a run will need, per rank, before anything is allocated or started: memory and the local
rank count.

The estimate is analytic (plain Python integers, so an absurd size cannot overflow) and mirrors the
shapes the model builds (`overlap.model.gpt`; `tests/test_resources.py` checks it against the
meta-device model):

- parameters of the largest pipeline stage this rank holds, TP-sharded where the layers shard them,
  routed experts divided over EP;
- their gradients (`main_grad`: fp32 with `grad_reduce_in_fp32`, else the parameter dtype);
- the optimizer state: Adam's two fp32 moments, plus an fp32 master copy for 16-bit parameters; the
  distributed optimizer shards both over data parallel (dense) / expert-data parallel (experts);
- under Megatron-FSDP (planned, not run) the gradients (`optim_grads`) and the parameters too
  (`optim_grads_params`) in the same shards, plus what is whole at the peak: the parameters outside
  its units (the transformer layers: the embedding, output layer and final norm, gathered at the
  forward's start and kept to the backward's end) and their gradients, the layer computing and the
  layers prefetched (up to `FSDP_PREFETCH` elements), and two layers' gradients (the one computing,
  the previous one's on its way to the reduce-scatter);
- the activations, block by block as our layers keep them (`overlap.launch.activations`, held to
  real tensors by tests/test_activation_memory.py), followed through a pipeline rank's program: each
  forward adds its chunk's, each backward frees them and needs its layers' (or its loss's) working
  set; EP overlap's merged steps, overlapped 1F1B's late weight gradients and the deferred
  output-layer weight gradients (alive until the flush) as the runtime runs them (`_walk`). The
  program is `overlap.perf.memory_model`'s (the planner, `overlap explain`, the dry run); without
  one, one micro-batch through every chunk (a lower bound, what the run checks need);
- on CPU ranks, the Python + torch runtime itself (~0.25 GiB per process, measured ~0.33 GiB for a
  tiny rank).

`prepare` refuses, for every command, a configuration whose sizes cannot even be represented (a
tensor or the total past 2^63 bytes: torch would overflow). `overlap run -g cpu` compares the
estimate x the local ranks (they all share this host) with this host's memory (the smaller of
physical memory and the cgroup limit), and caps the local ranks at `MAX_RANKS_PER_CORE` x the cores;
a GPU rank compares it with its device's memory. `OVERLAP_FORCE_RESOURCES=1` skips the host, device
and rank-count refusals (the estimate is only an estimate); the representability check stays.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from overlap.config.comm_overlap import FSDP_SHARDING
from overlap.config.container import ConfigContainer
from overlap.config.recompute import layer_chunks, selective_modules
from overlap.errors import ConfigError
from overlap.kernels import BULK
from overlap.kernels.attention import attention_kernel
from overlap.launch.activations import (
    INDEX_BYTES,
    LOSS_CHUNK_BYTES,
    SAVED_INPUT_BYTES,
    Block,
    LayerShape,
    backward_working_bytes,
    layer_blocks,
    layer_bytes,
)
from overlap.layout import ParallelLayout

FORCE_ENV = "OVERLAP_FORCE_RESOURCES"
MAX_RANKS_PER_CORE = 8
# Python + torch + gloo per CPU rank (a tiny rank peaks at ~340 MB RSS)
CPU_RUNTIME_BYTES = 256 * 2**20
_LIMIT = 2**63  # bytes / elements torch can address (int64 sizes)
_GIB = 2**30

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Megatron-FSDP's parameter prefetch, in elements: half its communication unit, at least 1e9
# (megatron_fsdp.py `suggested_AG_prefetch_size`)
FSDP_PREFETCH = 500_000_000


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes by part at its peak (module docstring)."""

    params: int  # parameter count on this rank
    expert_params: int  # of which routed experts
    largest_tensor: int  # elements of the largest single parameter
    param_bytes: int
    grad_bytes: int  # the gradient buffer (`main_grad`)
    master_bytes: int  # fp32 master weights (16-bit parameters), sharded by the dist. optimizer
    moment_bytes: int  # Adam's two fp32 moments, the same shards
    buffer_bytes: int  # non-parameter buffers (the RoPE tables)
    activation_bytes: int  # kept for backward at the peak, `in_flight` model chunks' worth
    transient_bytes: int  # the working set of the backward running at the peak
    runtime_bytes: int  # CPU ranks: the Python + torch runtime
    pp_rank: int = 0  # the pipeline rank estimated
    in_flight: int = 1  # (micro-batch, model chunk) forwards alive at the peak
    peak_at: str = ""  # which backward runs at the peak
    tokens: int = 0  # tokens of one micro-batch
    blocks: tuple[Block, ...] = ()  # one layer's activation bytes per token, by block (MoE if any)
    # of `params`, those outside the transformer layers (embedding, output layer, final norm)
    root_params: int = 0

    @property
    def optimizer_bytes(self) -> int:
        return self.master_bytes + self.moment_bytes

    @property
    def total(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.buffer_bytes
            + self.activation_bytes
            + self.transient_bytes
            + self.runtime_bytes
        )

    def parts(self) -> list[tuple[str, int]]:
        """(component, bytes), in the order the table prints them."""
        parts = [
            ("parameters", self.param_bytes),
            ("gradients", self.grad_bytes),
            ("master weights", self.master_bytes),
            ("Adam moments", self.moment_bytes),
            ("buffers (RoPE tables)", self.buffer_bytes),
            (f"activations ({self.in_flight} chunk forward(s) in flight)", self.activation_bytes),
            (
                f"backward working set ({self.peak_at})"
                if self.peak_at
                else "backward working set",
                self.transient_bytes,
            ),
        ]
        if self.runtime_bytes:
            parts.append(("runtime (Python + torch)", self.runtime_bytes))
        return parts

    def describe(self) -> str:
        parts = [
            ("parameters", gib(self.param_bytes)),
            ("gradients", gib(self.grad_bytes)),
            ("optimizer state", gib(self.optimizer_bytes)),
            ("activations", gib(self.activation_bytes + self.transient_bytes)),
        ]
        if self.runtime_bytes:
            parts.append(("runtime", gib(self.runtime_bytes)))
        return (
            f"{gib(self.total)} per rank ({_count(self.params)} parameters; "
            + ", ".join(f"{name} {size}" for name, size in parts)
            + ")"
        )

    def table(self) -> list[str]:
        """The per-component table, then one layer's activation bytes per token by block, ours and
        Megatron-Core's accounting (`overlap.launch.activations`)."""
        lines = [f"  {name:<52} {n / _GIB:>8.2f} GiB" for name, n in self.parts()]
        total = f"total (pipeline rank {self.pp_rank})"
        lines.append(f"  {total:<52} {self.total / _GIB:>8.2f} GiB")
        if self.blocks:
            lines.append(
                f"  one layer's activations per token ({self.tokens} tokens a micro-batch), "
                "bytes: ours / Megatron-Core's accounting"
            )
            for b in self.blocks:
                lines.append(f"    {b.name:<18} {b.ours:>10,.0f} {b.megatron:>10,.0f}  {b.kept}")
            ours = sum(b.ours for b in self.blocks)
            megatron = sum(b.megatron for b in self.blocks)
            lines.append(f"    {'layer':<18} {ours:>10,.0f} {megatron:>10,.0f}")
        return lines


def gib(nbytes: int | float) -> str:
    """A byte count for people: MiB below 1 GiB, GiB above (scientific past a million GiB)."""
    if nbytes < _GIB:
        return f"{nbytes / 2**20:.0f} MiB"
    if nbytes >= 1e6 * _GIB:
        return f"{nbytes / _GIB:.2e} GiB"
    return f"{nbytes / _GIB:.2f} GiB" if nbytes < 10 * _GIB else f"{nbytes / _GIB:,.0f} GiB"


def _count(n: int) -> str:
    return f"{n:.2e}" if n >= 10**15 else f"{n:,}"


@dataclass(frozen=True)
class _RankParams:
    params: int
    expert: int
    largest: int
    attention_layers: int
    layer: int  # the largest transformer layer's parameters (a Megatron-FSDP unit)
    root: int  # the parameters outside the transformer layers (embedding, output layer, final norm)


def _rank_params(
    cfg: ConfigContainer, layout: ParallelLayout, stages, moe: tuple[bool, ...]
) -> _RankParams:
    """Parameters of the model chunks `stages` (one pipeline rank's), as the model builds them:
    TP-sharded where the layers shard them, routed experts divided over EP; `moe`: which layers
    are MoE (`_LayerCosts.moe`)."""
    m = cfg.resolved.model
    tp, ep = max(1, layout.tp), max(1, layout.ep)
    h, hd, heads, groups = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups
    ffn, fused = m.ffn_size, 2 if m.gated_linear_unit else 1
    vocab = m.vocab_size

    def linear(out: int, inp: int) -> int:
        return out * inp // tp

    qkv = linear(groups * (heads // max(1, groups) + 2) * hd, h)
    proj = linear(h, heads * hd)
    attention = [qkv, proj, 2 * h] + ([2 * hd] if m.qk_layernorm else [])
    dense_mlp = [linear(fused * ffn, h), linear(h, ffn)]
    held = [i for s in stages for i in range(s.start, s.end)]
    layers = len(held)
    n_moe = sum(1 for i in held if moe[i])
    n_dense = layers - n_moe
    params = expert = largest = 0
    units = [sum(attention) + sum(dense_mlp)] if n_dense else []

    def add(count: int, sizes: list[int], is_expert: bool = False) -> None:
        nonlocal params, expert, largest
        if count and sizes:
            total = count * sum(sizes)
            params += total
            expert += total if is_expert else 0
            largest = max(largest, *sizes)

    add(layers, attention)
    add(n_dense, dense_mlp)
    if n_moe:
        experts = m.num_moe_experts
        local = experts // ep if experts % ep == 0 else -(-experts // ep)
        moe_layer = [experts * h]  # router, replicated
        add(n_moe, moe_layer)
        # fc1 (gate; up), fc2
        routed = [2 * local * m.moe_ffn_size * h, local * m.moe_ffn_size * h]
        add(n_moe, routed, is_expert=True)
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            moe_layer += [linear(fused * shared, h), linear(h, shared)]
            add(n_moe, moe_layer[1:])
        units.append(sum(attention) + sum(moe_layer) + sum(routed))
    before_root = params
    first = any(s.embedding for s in stages)
    last = any(s.loss for s in stages)
    if first:
        add(1, [vocab // tp * h])
    if last:
        # final norm, output layer (tied without PP: the embedding itself)
        tied_here = m.share_embeddings_and_output_weights and first
        add(1, [h] + ([] if tied_here else [h * vocab // tp]))
    return _RankParams(params, expert, largest, layers, max(units, default=0), params - before_root)


Program = Sequence[tuple[int | None, int | None]]
"""A pipeline rank's steps as (forward chunk or None, backward chunk or None), in order
(`overlap.pipeline.schedules.pipeline_steps`, which this layer cannot import: the callers pass
it)."""


def estimate_memory(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    cpu: bool = True,
    program: Program | None = None,
    merged: bool = False,
    pp_rank: int | None = None,
    late_wgrad: bool = False,
) -> MemoryEstimate:
    """Peak memory of pipeline rank `pp_rank` (None: the rank whose peak is highest) for this
    configuration; pure arithmetic (module docstring). `program`: that rank's steps, whose forwards
    and backwards the activations follow (`overlap.perf.memory_model` passes the real one;
    None: one micro-batch through every chunk, a lower bound); `merged`: EP overlap runs each
    steady step's forward and backward together, layer by layer; `late_wgrad`: each backward's
    weight gradients run after the next task (overlapped p2p in plain 1F1B on the first stage,
    `overlap.pipeline.executor`)."""
    if pp_rank is None:
        if program is not None and layout.pp > 1:
            raise ValueError("estimate_memory: a program is one pipeline rank's; name the rank")
        ranks = range(max(1, layout.pp))
    else:
        ranks = range(pp_rank, pp_rank + 1)
    return peak_memory(
        cfg, layout, cpu, {r: program for r in ranks}, merged, {r for r in ranks if late_wgrad}
    )


def peak_memory(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    cpu: bool,
    programs: dict[int, Program | None],
    merged: bool = False,
    late_wgrad: set[int] | frozenset[int] = frozenset(),
    gemm_precision: str | None = None,
) -> MemoryEstimate:
    """The highest peak (the first, on a tie) of the pipeline ranks `programs` names, each walking
    its own program (`estimate_memory`'s arguments; `late_wgrad`: the ranks whose weight gradients
    run late; `gemm_precision`: the planner's GEMM precision, "fp8" / "mxfp8" keeping FP8 copies
    of the linears' inputs, `SAVED_INPUT_BYTES`; None: the run's own). What the ranks share (the
    pipeline split, the layer shape, each kind of layer's bytes) is worked out once: the layout
    search walks every rank of thousands of candidates."""
    pipe, plan = cfg.resolved.pipeline, cfg.resolved.overlap
    shape = replace(
        _layer_shape(cfg, layout, cpu), linear_bytes=SAVED_INPUT_BYTES.get(gemm_precision or "")
    )
    costs = _LayerCosts(cfg.resolved.model, shape, plan.defer_embedding_wgrad_compute)
    estimates = [
        _estimate_rank(cfg, layout, cpu, pipe, costs, r, program, merged, r in late_wgrad)
        for r, program in programs.items()
    ]
    return max(estimates, key=lambda e: e.total)


def _layer_shape(cfg: ConfigContainer, layout: ParallelLayout, cpu: bool) -> LayerShape:
    """What every layer's activations on every rank of `layout` depend on beyond the model."""
    m = cfg.resolved.model
    # a CP rank holds seq / CP tokens; p2p and all_gather score KV blocks in
    # `overlap.layers.block_attention` (keeping flash's set: Q, K, V, output and LSE), each block
    # at once: the local block (p2p) or the whole gathered sequence (all_gather)
    cp = max(1, layout.cp)
    seq = m.seq_length // cp
    kind = cfg.resolved.overlap.cp_comm_type
    # (a2a+p2p: a block holds its all-to-all group's tokens, for 1 / A of the heads)
    block_keys = {"p2p": seq, "all_gather": m.seq_length, "a2a+p2p": seq * layout.cp_a2a}.get(
        kind, 0
    )
    params_dtype = cfg.resolved.precision.params_dtype
    kernel, _why = attention_kernel(m.attention_backend, not cpu, params_dtype, m.seq_length)
    return LayerShape(
        tp=max(1, layout.tp),
        ep=max(1, layout.ep),
        sequence_parallel=layout.sequence_parallel,
        act_bytes=2 if _DTYPE_BYTES.get(params_dtype, 4) == 2 else 4,
        fused_attention=kernel != "unfused" or block_keys > 0,
        seq_length=seq,
        micro_batch=cfg.train.micro_batch_size,
        moe_token_dispatcher_type=cfg.resolved.kernels.moe_token_dispatcher_type,
        recompute=selective_modules(m),
        gathered_inputs=_gathered_inputs(cfg),
        cp_block_keys=block_keys,
        cp_kept_kv=kind in ("p2p", "a2a+p2p"),
    )


class _LayerCosts:
    """One layer's activations for a model and layer shape, by kind (MoE or dense): every layer of
    a kind costs the same, so each kind is priced once, not once per layer of every chunk; and each
    distinct chunk once, not once per pipeline rank holding one like it."""

    def __init__(self, m, shape: LayerShape, defer_output_wgrad: bool = False) -> None:
        self.m, self.shape = m, shape
        # the output layer's weight gradients deferred to the flush (`pipeline.output_wgrad`)
        self.defer_output_wgrad = defer_output_wgrad
        # which layers are MoE, by layer number (read for every layer of every chunk walked)
        self.moe = tuple(m.is_moe_layer(i) for i in range(m.num_layers))
        self._kinds: dict[bool, tuple[float, float, tuple[Block, ...]]] = {}
        self._chunks: dict[tuple, _Chunk] = {}

    def chunk(self, stage, pp: int) -> _Chunk:
        """`_chunk_memory` of `stage`: what it depends on is its layers' kinds, in order, and
        whether it embeds the tokens or ends with the loss."""
        kinds = self.moe[stage.start : stage.end]
        key = (kinds, stage.embedding, stage.loss, pp)
        if key not in self._chunks:
            self._chunks[key] = _chunk_memory(self.m, self, stage, pp)
        return self._chunks[key]

    def of(self, moe_layer: bool) -> tuple[float, float, tuple[Block, ...]]:
        """(the bytes a layer saves for backward, its backward's working set, both for the
        micro-batch's tokens; its blocks)."""
        if moe_layer not in self._kinds:
            m, shape = self.m, self.shape
            self._kinds[moe_layer] = (
                layer_bytes(m, shape, moe_layer) * shape.tokens,
                backward_working_bytes(m, shape, moe_layer) * shape.tokens,
                tuple(layer_blocks(m, shape, moe_layer)),
            )
        return self._kinds[moe_layer]


def _estimate_rank(
    cfg, layout, cpu, pipe, costs: _LayerCosts, pp_rank, program, merged, late_wgrad=False
) -> MemoryEstimate:
    m, prec = cfg.resolved.model, cfg.resolved.precision
    stages = pipe.rank_stages(pp_rank)
    counts = _rank_params(cfg, layout, stages, costs.moe)
    # the distributed optimizer shards the dense state over DP x CP (Megatron's data-parallel group
    # with CP), the experts' over expert-DP (carved from TP x CP x DP)
    cp = max(1, layout.cp)
    dp, edp = max(1, layout.dp) * cp, max(1, layout.edp)
    p_bytes = _DTYPE_BYTES.get(prec.params_dtype, 4)
    g_bytes = 4 if prec.grad_reduce_in_fp32 else p_bytes
    dense = counts.params - counts.expert
    o = cfg.resolved.overlap
    shard = -(-dense // dp) + -(-counts.expert // edp)
    owned = shard if o.use_distributed_optimizer else counts.params
    master = 4 * owned if p_bytes != 4 else 0  # an fp32 parameter is its own master
    # Megatron-FSDP keeps its shard of the gradients (optim_grads) and parameters
    # (optim_grads_params) and what is whole at the peak (module docstring)
    level = FSDP_SHARDING.index(o.data_parallel_sharding_strategy) if o.use_megatron_fsdp else 0
    ahead = min(max(1, FSDP_PREFETCH // max(1, counts.layer)), max(0, counts.attention_layers - 1))
    grads = shard + counts.root + 2 * counts.layer if level >= 2 else counts.params
    weights = shard + counts.root + (1 + ahead) * counts.layer if level >= 3 else counts.params
    shape = costs.shape
    chunks = tuple(costs.chunk(s, max(1, layout.pp)) for s in stages)
    if program is None:
        program = [(c, None) for c in range(len(stages))]
        program += [(None, c) for c in reversed(range(len(stages)))]
    limit = cfg.resolved.overlap.wgrad_deferral_limit
    walked = _walked(chunks, tuple(program), merged, late_wgrad, limit if limit > 0 else None)
    activations, transient, in_flight, peak_at = walked
    has_moe = any(any(costs.moe[s.start : s.end]) for s in stages)
    return MemoryEstimate(
        params=counts.params,
        expert_params=counts.expert,
        largest_tensor=counts.largest,
        param_bytes=min(weights, counts.params) * p_bytes,
        grad_bytes=min(grads, counts.params) * g_bytes,
        master_bytes=master,
        moment_bytes=8 * owned,
        # RoPE's cos and sin tables, fp32 [seq, head_dim], per attention layer
        buffer_bytes=counts.attention_layers * 2 * 4 * shape.seq_length * m.head_dim,
        activation_bytes=int(activations),
        transient_bytes=int(transient),
        runtime_bytes=CPU_RUNTIME_BYTES if cpu else 0,
        pp_rank=pp_rank,
        in_flight=in_flight,
        peak_at=peak_at,
        tokens=shape.tokens,
        blocks=costs.of(has_moe)[2] if m.num_layers else (),
        root_params=counts.root,
    )


def _gathered_inputs(cfg: ConfigContainer) -> frozenset[str]:
    """The column-parallel linears whose TP-overlap plan keeps the all-gathered input: a plan
    without a bulk dgrad slot (`overlap.layers.tp_overlap`); every other one keeps its shard."""
    kept = set()
    for name in ("qkv", "fc1"):
        plan = cfg.resolved.overlap.linear(name)
        if plan is not None and (plan.dgrad is None or plan.dgrad.method != BULK):
            kept.add(name)
    return frozenset(kept)


@dataclass(frozen=True)
class _Chunk:
    """One model chunk's activations for one micro-batch: what its forward leaves for backward, the
    largest layer's share (what a merged EP-overlap step adds before its backward half frees any),
    the working set of its layers' backward, and of its loss's (0 off the last stage); and what its
    backward leaves alive until the step's flush (the output layer's deferred weight gradient: its
    gathered input and the logits' gradient, which the queued GEMM reads; 0 without the
    deferral)."""

    saved: float
    largest_layer: float
    working: float
    loss_working: float
    deferred: float = 0.0

    def transient(self) -> float:
        return max(self.working, self.loss_working)


def _chunk_memory(m, costs: _LayerCosts, stage, pp: int) -> _Chunk:
    shape = costs.shape
    tokens, h, B = shape.tokens, m.hidden_size, shape.act_bytes
    layers = [costs.of(moe) for moe in costs.moe[stage.start : stage.end]]
    per_layer = [saved for saved, _working, _blocks in layers]
    working = max((w for _saved, w, _blocks in layers), default=0.0)
    saved = sum(per_layer)
    if m.recompute_granularity == "full":
        # only each checkpointed run's input is kept; its backward recomputes the run whole
        runs = layer_chunks(m, stage.num_layers)
        kept = 0.0
        recomputed = 0.0
        for start, end, checkpointed in runs:
            run = sum(per_layer[start:end])
            if checkpointed:
                kept += B * h * tokens / shape.seq_div
                recomputed = max(recomputed, run)
            else:
                kept += run
        saved, working = kept, working + recomputed
    if stage.embedding:
        saved += INDEX_BYTES * tokens  # the token ids, which the embedding's backward scatters by
    loss_working = deferred = 0.0
    if stage.loss:
        vocab = m.vocab_size / shape.tp
        # the final norm's input and rstd, the output layer's (gathered) input, the logits, and per
        # token the log-sum-exp, the label and whether this rank holds it
        saved += tokens * ((B * h + 4) / shape.seq_div + B * h + B * vocab + 4 + INDEX_BYTES + 1)
        # backward: the logits' gradient, and one chunk of fp32 logits at a time
        loss_working = tokens * B * vocab + min(LOSS_CHUNK_BYTES, 4 * vocab * tokens)
        if costs.defer_output_wgrad:
            deferred = tokens * B * (h + vocab)
    elif pp > 1 and not m.deallocate_pipeline_outputs:
        # the output sent to the next stage, kept as its graph's root until its backward (released
        # at once with deallocate_pipeline_outputs)
        saved += B * h * tokens / shape.seq_div
    return _Chunk(saved, max(per_layer, default=0.0), working, loss_working, deferred)


@functools.lru_cache(maxsize=16384)
def _walked(
    chunks: tuple[_Chunk, ...],
    program: tuple,
    merged: bool,
    late_wgrad: bool,
    defer_limit: int | None = None,
) -> tuple[float, float, int, str]:
    """`_walk`, cached: the layout search walks tens of thousands of pipeline ranks, a tenth of
    them distinct (the same chunks under the same program)."""
    return _walk(chunks, program, merged, late_wgrad, defer_limit)


def _walk(
    chunks: list[_Chunk],
    program: Program,
    merged: bool,
    late_wgrad: bool = False,
    defer_limit: int | None = None,
) -> tuple[float, float, int, str]:
    """Follow the program's forwards (adding their chunk's activations) and backwards (freeing
    them); the peak is where the activations alive plus the running backward's working set are
    highest (a loss's backward first, with everything of its chunk alive, then its layers'). A
    merged step (EP overlap) runs its loss's backward first, then adds its forward's chunk layer
    by layer while its backward frees the other chunk's: at its peak one layer of the forward is
    in, and the forward half's working set (its all-to-all buffers, its experts' intermediates)
    beside the backward half's. `late_wgrad`: a backward's weight gradients run after the rank's
    next task (overlapped 1F1B's first stage), and what they read (its linear layers' inputs and
    output gradients) stays until then, counted as its chunk's saved activations (about as
    much). A chunk's `deferred` bytes stay alive from its backward to the flush after the program,
    for the first `defer_limit` (None: every) micro-batches (Megatron's `wgrad_deferral_limit`):
    the peak under the deferral grows with the step's micro-batches, so its program is the whole
    step's (`overlap.perf.memory_model.program`)."""
    alive = 0.0
    count = 0
    deferrals = 0  # micro-batches whose output-layer weight gradient waits for the flush
    owed = 0.0  # late_wgrad: the last backward's activations, freed after the next task
    # (kept, working, micro-batches alive, where: (what, chunk), worded once at the end: the
    # layout search walks millions of steps)
    best: tuple[float, float, int, tuple[str, int | None]] = (0.0, 0.0, 0, ("", None))

    def consider(kept: float, working: float, alive_count: int, what: str, chunk=None) -> None:
        nonlocal best
        if kept + working > best[0] + best[1]:
            best = (kept, working, alive_count, (what, chunk))

    def defer(b: _Chunk) -> float:
        nonlocal deferrals
        if not b.deferred or (defer_limit is not None and deferrals >= defer_limit):
            return 0.0
        deferrals += 1
        return b.deferred

    for forward, backward in program:
        if merged and forward is not None and backward is not None:
            f, b = chunks[forward], chunks[backward]
            consider(alive, b.loss_working, count, _LOSS)
            consider(alive + f.largest_layer, b.working + f.working, count + 1, _LAYERS, backward)
            alive += f.saved - b.saved + defer(b)
            continue
        if forward is not None:
            paying, owed = owed, 0.0
            alive += chunks[forward].saved
            count += 1
            consider(alive, 0.0, count, _FORWARD, forward)
            alive -= paying
        if backward is not None:
            paying, owed = owed, 0.0
            b = chunks[backward]
            consider(alive, b.loss_working, count, _LOSS)
            consider(alive, b.working, count, _LAYERS, backward)
            if late_wgrad:
                owed = b.saved
            else:
                alive -= b.saved
            alive += defer(b) - paying
            count -= 1
    if deferrals:
        consider(alive, 0.0, count, _FLUSH)
    kept, working, alive_count, (what, chunk) = best
    return kept, working, alive_count, what.format(chunk)


_LOSS, _FORWARD, _LAYERS, _FLUSH = (
    "the loss's backward",
    "chunk {}'s forward",
    "chunk {}'s layers' backward",
    "the flush (the deferred output-layer weight gradients)",
)


def check_representable(cfg: ConfigContainer, layout: ParallelLayout) -> MemoryEstimate:
    """Every command: refuse sizes that overflow 64-bit tensor sizes (a traceback deep inside torch
    otherwise)."""
    est = estimate_memory(cfg, layout)
    m = cfg.resolved.model
    if (
        est.largest_tensor >= _LIMIT
        or est.total >= _LIMIT
        or m.seq_length * cfg.train.micro_batch_size * m.hidden_size >= _LIMIT
    ):
        culprit = max(
            (
                "model.hidden_size",
                "model.vocab_size",
                "model.num_layers",
                "model.seq_length",
                "model.ffn_hidden_size",
                "model.num_moe_experts",
                "model.moe_ffn_hidden_size",
            ),
            key=lambda k: _field(cfg, k) or 0,
        )
        raise ConfigError(
            culprit,
            _field(cfg, culprit),
            f"these sizes cannot be represented: {_count(est.params)} parameters per rank, about "
            f"{gib(est.total)}; tensor sizes are 64-bit, so torch cannot allocate this on any "
            "machine.",
            "use realistic sizes (overlap explain --list-recipes lists working models).",
        )
    return est


def _field(cfg: ConfigContainer, key: str):
    """The value of `key` the estimate judged (a model field: the model that runs)."""
    section, _, name = key.partition(".")
    return getattr(cfg.resolved.model if section == "model" else getattr(cfg, section), name)


def forced(env=os.environ) -> bool:
    return env.get(FORCE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def host_memory_bytes() -> int:
    """This host's memory for our processes: physical memory, or the cgroup limit when that is
    smaller."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def max_local_ranks() -> int:
    return MAX_RANKS_PER_CORE * (os.cpu_count() or 1)


def check_local_launch(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    ranks: int,
    *,
    env=os.environ,
    host_bytes: int | None = None,
    cores: int | None = None,
    recipe: str | None = None,
    est: MemoryEstimate | None = None,
) -> MemoryEstimate:
    """`overlap run -g cpu`: `ranks` processes on this host. Refuse too many ranks for the cores,
    and a memory estimate (x ranks: they share the host) larger than the host, naming the estimate
    and the way out. `est`: the memory model's (`overlap.perf.memory_model`, which follows the
    schedule); None: one micro-batch's (a lower bound)."""
    est = est or estimate_memory(cfg, layout, cpu=True)
    if forced(env):
        return est
    cores = cores if cores is not None else (os.cpu_count() or 1)
    cap = MAX_RANKS_PER_CORE * cores
    if ranks > cap:
        raise ConfigError(
            "-ng/--num_gpus",
            ranks,
            f"{ranks} local CPU ranks on {cores} core(s) is more than {MAX_RANKS_PER_CORE} per "
            "core "
            f"({cap}); every rank is a process with its own torch runtime, so the run would crawl "
            "or exhaust the host.",
            f"use -ng {cap} or fewer (a cluster: --emit-slurm, or torchrun), or set {FORCE_ENV}=1 "
            "to start them anyway.",
        )
    host = host_bytes if host_bytes is not None else host_memory_bytes()
    need = est.total * ranks
    if need > host:
        # One rank fits but not all of them: the rank count is the culprit; else the model itself.
        key, value = _culprit(cfg, recipe) if est.total > host else ("-ng/--num_gpus", ranks)
        raise ConfigError(
            key,
            value,
            f"this run needs about {gib(need)} on this host ({ranks} local rank(s) x "
            f"{est.describe()}), and the host has {gib(host)}.",
            "use a smaller model (fewer/narrower layers, e.g. -mr qwen3_moe_tiny or dense_tiny), "
            "fewer local ranks, more parallelism to shard it (-tp / -ep), a cluster "
            "(--emit-slurm), or set "
            f"{FORCE_ENV}=1 if you know the estimate is wrong.",
        )
    return est


def check_device(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    device_bytes: int,
    device_name: str,
    *,
    env=os.environ,
    recipe: str | None = None,
    est: MemoryEstimate | None = None,
) -> MemoryEstimate:
    """A GPU rank: refuse an estimate larger than its device's memory before the model is built
    (`est` as `check_local_launch` takes it)."""
    est = est or estimate_memory(cfg, layout, cpu=False)
    if not forced(env) and est.total > device_bytes:
        key, value = _culprit(cfg, recipe)
        raise ConfigError(
            key,
            value,
            f"one rank needs about {est.describe()}, and {device_name} has {gib(device_bytes)}.",
            "shard the model further (-tp, -ep, -pp, the distributed optimizer: "
            "ddp.use_distributed_optimizer=true), recompute activations (-rl), use a smaller -mb, "
            "or "
            f"set {FORCE_ENV}=1 if you know the estimate is wrong.",
        )
    return est


def _culprit(cfg: ConfigContainer, recipe: str | None) -> tuple[str, object]:
    """What to name when one rank does not fit: an extreme size when there is one, else the model
    (recipe)."""
    m = cfg.resolved.model
    for key, value, extreme in (
        ("model.num_layers", m.num_layers, 1024),
        ("model.hidden_size", m.hidden_size, 65536),
        ("model.seq_length", m.seq_length, 2**20),
        ("model.vocab_size", m.vocab_size, 2**22),
        ("train.micro_batch_size", cfg.train.micro_batch_size, 4096),
    ):
        if value > extreme:
            return key, value
    return ("-mr/--model_recipe_name", recipe) if recipe else ("model.hidden_size", m.hidden_size)


def check_run_resources(
    cfg: ConfigContainer,
    layout: ParallelLayout,
    args,
    env=os.environ,
    estimate: Callable[[bool], MemoryEstimate] | None = None,
) -> MemoryEstimate | None:
    """`overlap run`, before a rank starts (or, in a rank under torchrun, before the model is
    built), with `estimate(cpu)` (the memory model's, `overlap.perf.memory_model`, which the
    command passes; None: one micro-batch's lower bound):

    - a Slurm script (--emit-slurm): nothing to check here, the cluster's nodes are not this host;
    - a rank of our own local launcher: the launcher already checked;
    - a rank under torchrun / srun: on GPU its device's memory; on CPU this host, shared by
      LOCAL_WORLD_SIZE ranks;
    - the local launcher (-g cpu): the rank count and this host's memory for all of them.
    """
    if getattr(args, "emit_slurm", None) is not None:
        return None
    gpu = args.gpu != "cpu"
    if "RANK" in env and "WORLD_SIZE" in env:
        if env.get("OVERLAP_LAUNCHED") == "1":
            return None
        if gpu:
            import torch

            if not torch.cuda.is_available():
                return None  # the rank's own device setup reports a missing GPU
            index = int(env.get("LOCAL_RANK", "0"))
            props = torch.cuda.get_device_properties(index % max(1, torch.cuda.device_count()))
            return check_device(
                cfg,
                layout,
                props.total_memory,
                props.name,
                env=env,
                recipe=getattr(args, "model_recipe_name", None),
                est=estimate(False) if estimate else None,
            )
        local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
        est = estimate(True) if estimate else estimate_memory(cfg, layout, cpu=True)
        if not forced(env) and est.total * local > host_memory_bytes():
            return check_local_launch(
                cfg,
                layout,
                local,
                env=env,
                recipe=getattr(args, "model_recipe_name", None),
                est=est,
            )
        return est
    if gpu:
        return None  # cmd_run refuses a local GPU launch with its own message
    return check_local_launch(
        cfg,
        layout,
        args.num_gpus,
        env=env,
        recipe=getattr(args, "model_recipe_name", None),
        est=estimate(True) if estimate else None,
    )
