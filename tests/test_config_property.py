"""Property-based: random small configurations either resolve (and then satisfy the overlap
invariants) or fail with the clear ConfigError, never with another exception."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap.config import (
    CommOverlapConfig,
    ConfigContainer,
    DDPConfig,
    ModelConfig,
    OptimizerConfig,
    TrainConfig,
)
from overlap.config.overrides import apply_override
from overlap.errors import ConfigError
from overlap.kernels.device import DeviceInfo

DEVICES = [
    None,
    DeviceInfo("NVIDIA H100 80GB HBM3", 9),
    DeviceInfo("Tesla V100-SXM2-32GB", 7),
    DeviceInfo("NVIDIA GB200", 10),
    DeviceInfo("NVIDIA B200", 10),
]

maybe_bool = st.sampled_from([None, None, True, False])

# A valid baseline is drawn first, then up to two faults are injected, so that about half of the
# examples resolve and the others fail for one or two reasons at a time (every reason the validation
# knows appears among the faults).
FAULTS = (
    "world",
    "ep",
    "experts",
    "topk",
    "layers",
    "heads",
    "seq",
    "sp",
    "vpp_pp1",
    "recompute",
    "graph",
    "dispatch",
    "precision",
    "gbs",
    "grad_fp32",
    "bucket",
    "preset",
    "mtp",
    "shared_overlap",
    "mbs",
)
VALID_RECOMPUTE = [
    (None, None, None, None),
    (None, None, None, None),
    ("selective", None, None, ["core_attn", "mlp"]),
    ("selective", None, None, ["moe"]),
    ("full", "uniform", 1, None),
    ("full", "block", 2, None),
]
BAD_RECOMPUTE = [
    (None, "uniform", None, None),
    (None, None, 1, None),
    ("selective", None, None, ["bogus"]),
    ("half", None, None, None),
    ("full", None, None, None),
    ("full", "uniform", 0, None),
]
VALID_GRAPHS = [
    ("none", None),
    ("none", None),
    ("none", ["attn"]),
    ("transformer_engine", ["attn"]),
    ("transformer_engine", ["moe_router", "moe_preprocess"]),
    ("transformer_engine", ["moe"]),
    ("transformer_engine", "attn,mlp"),
    ("transformer_engine", ""),
    ("local", ["full_iteration"]),
]
BAD_GRAPHS = [
    ("local", ["attn"]),
    ("transformer_engine", ["full_iteration"]),
    ("cudnn", None),
    ("transformer_engine", ["bogus"]),
]
VALID_DISPATCH = [
    ("alltoall", None),
    ("alltoall", None),
    ("flex", "torch"),
    ("flex", None),
    ("alltoall", "torch"),
    ("flex", "deepep"),
    ("flex", "hybridep"),
]
BAD_DISPATCH = [("allgather", None), ("bogus", None), ("flex", "magic"), ("alltoall", "deepep")]


@st.composite
def configs(draw):
    faults = draw(st.sets(st.sampled_from(FAULTS), max_size=2))
    tp = draw(st.sampled_from([1, 2]))
    pp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 1, 2]))
    dp = draw(st.sampled_from([1, 2, 4]))
    world = tp * pp * cp * dp + (1 if "world" in faults else 0)
    stage = tp * cp * dp
    dense = draw(st.sampled_from([False, False, False, True]))
    if "ep" in faults:
        ep = draw(st.sampled_from([1, 2, 4, 8]))
    elif dense:
        ep = 1
    else:
        ep = draw(st.sampled_from([d for d in (2, 4, 8) if stage % d == 0] or [1]))
    if "experts" in faults:
        experts = draw(st.sampled_from([0, 1, 3, ep + 1]))
    else:
        experts = None if dense else draw(st.sampled_from([2 * ep, 4 * ep]))
    vp = 2 if "vpp_pp1" in faults else draw(st.sampled_from([None, None, 2] if pp > 1 else [None]))
    recompute = draw(st.sampled_from(BAD_RECOMPUTE if "recompute" in faults else VALID_RECOMPUTE))
    graph = draw(st.sampled_from(BAD_GRAPHS if "graph" in faults else VALID_GRAPHS))
    dispatch = draw(st.sampled_from(BAD_DISPATCH if "dispatch" in faults else VALID_DISPATCH))
    mbs = 0 if "mbs" in faults else draw(st.sampled_from([1, 2]))
    model = ModelConfig(
        num_layers=pp * (vp or 1) * draw(st.sampled_from([1, 2]))
        + (1 if "layers" in faults else 0),
        hidden_size=96 if "heads" in faults else 64,
        num_attention_heads=6 if "heads" in faults else 8,
        num_query_groups=draw(st.sampled_from([None, 2, 4])),
        vocab_size=512,
        seq_length=63 if "seq" in faults else 64,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=(tp > 1) != ("sp" in faults),
        num_moe_experts=experts,
        moe_router_topk=(experts or 1) + 1 if "topk" in faults else draw(st.sampled_from([1, 2])),
        moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 32])),
        moe_token_dispatcher_type=dispatch[0],
        moe_flex_dispatcher_backend=dispatch[1],
        moe_shared_expert_overlap="shared_overlap" in faults,
        recompute_granularity=recompute[0],
        recompute_method=recompute[1],
        recompute_num_layers=recompute[2],
        recompute_modules=recompute[3],
        cuda_graph_impl=graph[0],
        cuda_graph_scope=graph[1],
        gradient_accumulation_fusion=draw(st.booleans()),
        add_bias_linear=draw(st.booleans()),
        mtp_num_layers=2 if "mtp" in faults else draw(st.sampled_from([None, 0, 1])),
        bf16=draw(st.booleans()),
        overlap_moe_expert_parallel_comm=draw(maybe_bool),
        delay_wgrad_compute=draw(st.sampled_from([None] * 6 + [True, False])),
        overlap_p2p_comm=draw(st.sampled_from([None, None, None, True, False])),
        tp_comm_overlap=draw(maybe_bool),
    )
    co = None
    if draw(st.booleans()):
        co = CommOverlapConfig(
            tp_comm_overlap=draw(maybe_bool),
            tp_comm_overlap_cfg="nope"
            if "preset" in faults
            else draw(
                st.sampled_from(
                    [
                        None,
                        "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048",
                        "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora",
                    ]
                )
            ),
            overlap_p2p_comm=draw(st.sampled_from([None, None, None, True, False])),
            batch_p2p_comm=draw(st.sampled_from([None, None, None, True, False])),
            overlap_grad_reduce=draw(maybe_bool),
            overlap_param_gather=draw(maybe_bool),
            overlap_param_gather_with_optimizer_step=draw(
                st.sampled_from([None, None, True, False])
            ),
            bucket_size=0 if "bucket" in faults else draw(st.sampled_from([None, None, 1000])),
            overlap_moe_expert_parallel_comm=draw(st.sampled_from([None, True, True, False])),
            delay_wgrad_compute=draw(st.sampled_from([None, None, None, True, False])),
            strict=draw(st.booleans()),
        )
    elif "bucket" in faults or "preset" in faults:
        co = CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg="nope", bucket_size=0)
    dist = draw(st.booleans())
    cfg = ConfigContainer(
        model=model,
        comm_overlap=co,
        mixed_precision="bf17"
        if "precision" in faults
        else draw(st.sampled_from(["bf16_mixed", "bf16_mixed", "fp16_mixed", "fp32", None])),
        ddp=DDPConfig(
            use_distributed_optimizer=dist,
            overlap_grad_reduce=draw(maybe_bool),
            grad_reduce_in_fp32=draw(st.booleans()) if "grad_fp32" in faults else None,
        ),
        optimizer=OptimizerConfig(use_distributed_optimizer=dist or draw(st.booleans())),
        train=TrainConfig(
            global_batch_size=max(mbs, 1) * dp * draw(st.sampled_from([1, 2, 4]))
            + (1 if "gbs" in faults else 0),
            micro_batch_size=mbs,
        ),
    )
    return cfg, world, draw(st.sampled_from(DEVICES))


def _check_invariants(cfg: ConfigContainer, res, world: int) -> None:
    m, ddp, o = cfg.model, cfg.ddp, res.overlap
    lay = res.layout
    assert lay.tp * lay.pp * lay.cp * lay.dp == world
    assert isinstance(o.use_distributed_optimizer, bool)
    assert not (o.overlap_p2p_comm and o.batch_p2p_comm)
    # either spelling true turns it on (the runtime reads the plan)
    assert o.use_distributed_optimizer == bool(
        ddp.use_distributed_optimizer or cfg.optimizer.use_distributed_optimizer
    )
    if o.tp_comm_overlap:
        assert lay.tp >= 2 and lay.sequence_parallel
    else:
        assert o.tp_slots == ()
    # what runs: as typed, off without a TP group (the model section keeps what was typed)
    assert lay.sequence_parallel == (m.sequence_parallel and lay.tp >= 2)
    if o.delay_wgrad_compute:
        assert o.overlap_moe_expert_parallel_comm
    if o.overlap_moe_expert_parallel_comm:
        assert lay.ep > 1 and (m.num_moe_experts or 0) > 1
        assert m.moe_token_dispatcher_type in ("alltoall", "flex")
        assert res.precision.bf16 or res.precision.fp16
        assert m.recompute_granularity != "full" and "moe" not in (m.recompute_modules or [])
        assert not o.moe_shared_expert_overlap
        assert lay.pp == 1 or m.virtual_pipeline_model_parallel_size is not None
    k = res.kernels  # the dispatcher that runs (the model keeps what was asked)
    if k.moe_token_dispatcher_type == "flex":
        assert k.moe_flex_dispatcher_backend in ("torch", "deepep", "hybridep")
    else:
        assert k.moe_flex_dispatcher_backend is None
    if o.overlap_param_gather:  # the distributed optimizer's state is sharded over DP x CP
        assert o.use_distributed_optimizer and lay.dp * lay.cp > 1
    if o.bucket_size is not None:
        assert o.bucket_size >= 1
    if res.decisions.strict:
        assert not any(d.overridden for d in res.decisions.decisions)
    json.dumps(res.decisions.to_json())
    res.decisions.format_table()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_random_configs_resolve_or_raise_config_error(case):
    cfg, world, dev = case
    try:
        res = cfg.finalize(world, device=lambda: dev)
    except ConfigError as exc:
        assert exc.field and exc.why and exc.fix
        assert str(exc).startswith(f"{exc.field}=")
        return
    _check_invariants(cfg, res, world)
    again = cfg.finalize(world, device=lambda: dev)
    assert again.decisions.decisions == res.decisions.decisions


OVERRIDE_KEYS = [
    "model.num_layers",
    "model.bf16",
    "model.recompute_modules",
    "model.num_moe_experts",
    "optimizer.lr",
    "comm_overlap.overlap_moe_expert_parallel_comm",
    "env_vars.X",
    "mixed_precision",
    "mixed_precision.grad_reduce_in_fp32",
    "model.cuda_graph_scope",
    "modle.x",
    "ddp.bucket_size",
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(OVERRIDE_KEYS), st.text(alphabet="ab1.-,[]{}:'\"!&*%@ ", max_size=8))
def test_random_override_values_apply_or_raise_config_error(key, raw):
    cfg = ConfigContainer()
    try:
        apply_override(cfg, f"{key}={raw}")
    except ConfigError:
        pass
