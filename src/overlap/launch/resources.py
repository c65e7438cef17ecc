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
- a rough activation term for one micro-batch (Korthikanti et al.'s ~34 s b h bytes per layer in 16
  bit, doubled for fp32, divided by TP under sequence parallel, plus the routed experts' rows (less
  with selective `moe_act` / `moe` recompute) and the logits) - rough on purpose: it is there to
  refuse what cannot fit, not to plan;
- on CPU ranks, the Python + torch runtime itself (~0.25 GiB per process, measured ~0.33 GiB for a
  tiny rank).

`schedule=True` (the planner, `overlap plan`) adds what the schedule keeps alive on top of that one
micro-batch, as Megatron's theoretical memory estimate does: under 1F1B the first stage holds
min(PP, micro-batches) micro-batches of its layers (interleaved: x (1 + (p - 1) / (p v))), and under
EP overlap the merged schedule keeps a second micro-batch's layer being computed plus both
micro-batches' dispatch buffers alive. The run checks leave it off: they refuse what cannot fit, a
lower bound is what they need.

`prepare` refuses, for every command, a configuration whose sizes cannot even be represented (a
tensor or the total past 2^63 bytes: torch would overflow). `overlap run -g cpu` compares the
estimate x the local ranks (they all share this host) with this host's memory (the smaller of
physical memory and the cgroup limit), and caps the local ranks at `MAX_RANKS_PER_CORE` x the cores;
a GPU rank compares it with its device's memory. `OVERLAP_FORCE_RESOURCES=1` skips the host, device
and rank-count refusals (the estimate is only an estimate); the representability check stays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from overlap.config.container import ConfigContainer
from overlap.config.layout import ParallelLayout
from overlap.config.pipeline_layout import resolve_pipeline_layout
from overlap.errors import ConfigError

FORCE_ENV = "OVERLAP_FORCE_RESOURCES"
MAX_RANKS_PER_CORE = 8
# Python + torch + gloo per CPU rank (a tiny rank peaks at ~340 MB RSS)
CPU_RUNTIME_BYTES = 256 * 2**20
_LIMIT = 2**63  # bytes / elements torch can address (int64 sizes)
_GIB = 2**30

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes by part (see the module docstring)."""

    params: int  # parameter count on this rank
    expert_params: int  # of which routed experts
    largest_tensor: int  # elements of the largest single parameter
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    runtime_bytes: int

    @property
    def total(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.runtime_bytes
        )

    def describe(self) -> str:
        parts = [
            ("parameters", gib(self.param_bytes)),
            ("gradients", gib(self.grad_bytes)),
            ("optimizer state", gib(self.optimizer_bytes)),
            ("activations", f"~{gib(self.activation_bytes)}"),
        ]
        if self.runtime_bytes:
            parts.append(("runtime", gib(self.runtime_bytes)))
        return (
            f"{gib(self.total)} per rank ({_count(self.params)} parameters; "
            + ", ".join(f"{name} {size}" for name, size in parts)
            + ")"
        )


def gib(nbytes: int | float) -> str:
    """A byte count for people: MiB below 1 GiB, GiB above (scientific past a million GiB)."""
    if nbytes < _GIB:
        return f"{nbytes / 2**20:.0f} MiB"
    if nbytes >= 1e6 * _GIB:
        return f"{nbytes / _GIB:.2e} GiB"
    return f"{nbytes / _GIB:.2f} GiB" if nbytes < 10 * _GIB else f"{nbytes / _GIB:,.0f} GiB"


def _count(n: int) -> str:
    return f"{n:.2e}" if n >= 10**15 else f"{n:,}"


def estimate_memory(
    cfg: ConfigContainer, layout: ParallelLayout, cpu: bool = True, schedule: bool = False
) -> MemoryEstimate:
    """Per-rank memory of rank 0 (its pipeline stage, TP / EP shard) for this configuration; pure
    arithmetic. `schedule`: also the micro-batches the pipeline / EP-overlap schedule keeps alive
    (module docstring)."""
    m, t, d = cfg.model, cfg.train, cfg.ddp
    tp, ep, dp = max(1, layout.tp), max(1, layout.ep), max(1, layout.dp)
    edp = max(1, layout.edp)
    pipe = resolve_pipeline_layout(m, max(1, layout.pp))
    h, hd, heads, groups = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups
    ffn, fused = m.ffn_size, 2 if m.gated_linear_unit else 1
    vocab = m.vocab_size

    def linear(out: int, inp: int) -> int:
        return out * inp // tp

    qkv = linear(groups * (heads // max(1, groups) + 2) * hd, h)
    proj = linear(h, heads * hd)
    attention = [qkv, proj, 2 * h] + ([2 * hd] if m.qk_layernorm else [])
    dense_mlp = [linear(fused * ffn, h), linear(h, ffn)]
    # The pipeline rank holding the most transformer layers (all its chunks), its MoE layers counted
    # one by one
    busiest = pipe.busiest_rank_layers()
    layers = len(busiest)
    n_moe = sum(1 for i in busiest if m.is_moe_layer(i))
    n_dense = layers - n_moe
    params = expert = largest = 0

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
        add(n_moe, [experts * h])  # router, replicated
        # fc1 (gate; up), fc2
        add(n_moe, [2 * local * m.moe_ffn_size * h, local * m.moe_ffn_size * h], is_expert=True)
        shared = m.moe_shared_expert_intermediate_size
        if shared:
            add(n_moe, [linear(fused * shared, h), linear(h, shared)])
    # embedding, final norm, output layer (first/last stage: both); tied without PP, the output
    # layer is the embedding
    tied_here = m.share_embeddings_and_output_weights and layout.pp == 1
    add(1, [vocab // tp * h, h] + ([] if tied_here else [h * vocab // tp]))

    p_bytes = _DTYPE_BYTES.get(m.params_dtype, 4)
    g_bytes = 4 if d.grad_reduce_in_fp32 else p_bytes
    state = 8 + (4 if p_bytes != 4 else 0)  # Adam moments (+ fp32 master for 16-bit parameters)
    dense = params - expert
    if d.use_distributed_optimizer:
        optimizer = state * (-(-dense // dp) + -(-expert // edp))
    else:
        optimizer = state * params
    s, b = m.seq_length, t.micro_batch_size
    act_bytes = 2 if p_bytes == 2 else 4
    per_layer = s * b * h * 17 * act_bytes  # ~34 s b h bytes in 16 bit
    if m.sequence_parallel and tp > 1:
        per_layer //= tp
    if m.is_moe and m.recompute_granularity != "full":
        # The routed experts' activations (balanced routing: top-k rows per local token on every EP
        # rank): fc1's output (2 ffn), the activation's intermediate and its output (1 ffn each);
        # selective "moe_act" keeps only fc1's output, "moe" none of them (the layer's input is the
        # residual, already counted)
        selective = m.recompute_granularity == "selective"
        modules = set(m.recompute_modules or ["core_attn"]) if selective else set()
        widths = 0 if "moe" in modules else 2 if "moe_act" in modules else 4
        rows = s * b // (tp if m.sequence_parallel else 1) * m.moe_router_topk
        per_layer += rows * m.moe_ffn_size * widths * act_bytes * n_moe // max(1, layers)
    if m.recompute_granularity == "full":
        # only the layer inputs are kept (plus one layer being recomputed)
        per_layer = s * b * h * act_bytes
        activations = per_layer * layers + s * b * h * 17 * act_bytes
    else:
        activations = per_layer * layers
    if schedule:
        activations = _scheduled_activations(cfg, layout, activations, per_layer, act_bytes)
    activations += 3 * s * b * (vocab // tp) * 4  # fp32 logits, their softmax and gradient
    return MemoryEstimate(
        params=params,
        expert_params=expert,
        largest_tensor=largest,
        param_bytes=params * p_bytes,
        grad_bytes=params * g_bytes,
        optimizer_bytes=optimizer,
        activation_bytes=activations,
        runtime_bytes=CPU_RUNTIME_BYTES if cpu else 0,
    )


def _scheduled_activations(
    cfg: ConfigContainer, layout: ParallelLayout, one: int, per_layer: int, act_bytes: int
) -> int:
    """Activations the schedule keeps alive, from those of one micro-batch (`one`) on this stage."""
    m, t = cfg.model, cfg.train
    pp = max(1, layout.pp)
    if pp > 1:
        micro = max(1, t.global_batch_size // (max(1, layout.dp) * t.micro_batch_size))
        vpp = max(1, m.virtual_pipeline_model_parallel_size or 1)
        in_flight = min(pp, micro)
        one = one * in_flight if vpp == 1 else int(one * in_flight * (1 + (pp - 1) / (pp * vpp)))
    if m.is_moe and cfg.resolved.overlap.overlap_moe_expert_parallel_comm:
        tokens = (
            m.seq_length * t.micro_batch_size // (max(1, layout.tp) if m.sequence_parallel else 1)
        )
        # dispatched rows, 2 micro-batches
        buffers = 2 * 2 * tokens * m.moe_router_topk * m.hidden_size * act_bytes
        one += per_layer + buffers  # the other micro-batch's layer in flight
    return one


def check_representable(cfg: ConfigContainer, layout: ParallelLayout) -> MemoryEstimate:
    """Every command: refuse sizes that overflow 64-bit tensor sizes (a traceback deep inside torch
    otherwise)."""
    est = estimate_memory(cfg, layout)
    m = cfg.model
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
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


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
) -> MemoryEstimate:
    """`overlap run -g cpu`: `ranks` processes on this host. Refuse too many ranks for the cores,
    and a memory estimate (x ranks: they share the host) larger than the host, naming the estimate
    and the way out."""
    est = estimate_memory(cfg, layout, cpu=True)
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
) -> MemoryEstimate:
    """A GPU rank: refuse an estimate larger than its device's memory before the model is built."""
    est = estimate_memory(cfg, layout, cpu=False)
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
    m = cfg.model
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
    cfg: ConfigContainer, layout: ParallelLayout, args, env=os.environ
) -> MemoryEstimate | None:
    """`overlap run`, before a rank starts (or, in a rank under torchrun, before the model is
    built):

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
            )
        local = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
        est = estimate_memory(cfg, layout, cpu=True)
        if not forced(env) and est.total * local > host_memory_bytes():
            return check_local_launch(
                cfg, layout, local, env=env, recipe=getattr(args, "model_recipe_name", None)
            )
        return est
    if gpu:
        return None  # cmd_run refuses a local GPU launch with its own message
    return check_local_launch(
        cfg, layout, args.num_gpus, env=env, recipe=getattr(args, "model_recipe_name", None)
    )
