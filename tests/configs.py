"""The configurations the tests share, one builder per kind of model a test needs.

- `dense_model` / `moe_model` / `container`: models that are only resolved (`finalize`), never
  built: the config, layout and overlap-rule tests.
- `tiny_config`: the tiny model the multi-process tests train (64 wide, 16 tokens, optionally 4
  experts top-2), as a whole run configuration.
- `ep_overlap_model`: the 32-wide MoE model the EP-overlap schedule tests compare against the plain
  loop.
- `moe_layer_model`: one MoE layer's configuration (32 wide, 8 experts top-2, fp32 parameters), for
  the dispatcher and layer tests.
- `bare_plan` / `bare_kernels`: the overlap plan and the kernels a model built from a bare (never
  finalized) configuration is built with, as a finalized run's layers get `cfg.resolved.overlap`
  and `cfg.resolved.kernels`.
- `layer_ranges`: the transformer layers each model chunk of a pipeline layout holds, for the
  pipeline-split tests.

Every model builder takes model fields as keywords, which replace its own values.
"""

from __future__ import annotations

from overlap.config import (
    CommOverlapConfig,
    ConfigContainer,
    DDPConfig,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
)
from overlap.config.comm_overlap import OverlapPlan
from overlap.config.mixed_precision import Precision
from overlap.decisions import DecisionLog
from overlap.kernels import Kernels
from overlap.kernels.choices import resolve_kernels
from overlap.kernels.device import probe_device
from overlap.layout.pipeline import PipelineLayout


def dense_model(**fields) -> ModelConfig:
    """A dense model for validation: 8 layers, 64 wide, 8 heads, vocabulary 512, sequence 64."""
    base = dict(num_layers=8, hidden_size=64, num_attention_heads=8, vocab_size=512, seq_length=64)
    return ModelConfig(**{**base, **fields})


def moe_model(**fields) -> ModelConfig:
    """`dense_model` with 4 experts (top-2) over expert parallel size 2."""
    base = dict(num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=2)
    return dense_model(**{**base, **fields})


def container(
    model: ModelConfig | None = None,
    co: CommOverlapConfig | None = None,
    mp: str | None = "bf16_mixed",
    ddp: DDPConfig | None = None,
    optimizer: OptimizerConfig | None = None,
    train: TrainConfig | None = None,
) -> ConfigContainer:
    """A run configuration around `model` (None: `dense_model()`): bf16 mixed precision, global
    batch 16, the default DDP and optimizer sections, no comm_overlap section unless `co` is
    given."""
    return ConfigContainer(
        model=model or dense_model(),
        comm_overlap=co,
        mixed_precision=mp,
        ddp=ddp or DDPConfig(),
        optimizer=optimizer or OptimizerConfig(),
        train=train or TrainConfig(global_batch_size=16),
    )


TINY = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=16,
    qk_layernorm=True,
)
TINY_MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2
)


def tiny_config(
    moe: bool,
    precision: str | None,
    layers: int,
    overrides: list[str],
    iters: int,
    global_batch_size: int = 8,
    micro_batch_size: int = 1,
    **fields,
) -> ConfigContainer:
    """The tiny model (`TINY`, with `TINY_MOE`'s experts if `moe`) with `layers` layers as a run of
    `iters` iterations: AdamW at lr 1e-3 after one warm-up iteration, `precision` (a mixed-precision
    preset name, or None: fp32); `fields` set model fields (layout, sizes), then the `overrides`
    (`section.field=value`) apply."""
    from overlap.config.overrides import apply_overrides

    model = ModelConfig(num_layers=layers, **{**TINY, **(TINY_MOE if moe else {}), **fields})
    train = TrainConfig(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, train_iters=iters
    )
    cfg = ConfigContainer(
        model=model,
        train=train,
        optimizer=OptimizerConfig(lr=1e-3),
        scheduler=SchedulerConfig(lr_warmup_iters=1),
        mixed_precision=precision,
    )
    apply_overrides(cfg, overrides)
    return cfg


def ep_overlap_model(**fields) -> ModelConfig:
    """The EP-overlap tests' MoE model: 3 layers, 32 wide, 4 experts top-2, init std 0.1."""
    base = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=64,
        vocab_size=128,
        seq_length=16,
        qk_layernorm=True,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=1e-2,
        init_method_std=0.1,
    )
    return ModelConfig(**{**base, **fields})


def moe_layer_model(**fields) -> ModelConfig:
    """One MoE layer's configuration: 32 wide, 8 experts top-2 (64 wide each), fp32 parameters."""
    base = dict(
        hidden_size=32,
        num_attention_heads=4,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=64,
        moe_aux_loss_coeff=1e-2,
        params_dtype="float32",
    )
    return ModelConfig(**{**base, **fields})


def bare_plan(**switches) -> OverlapPlan:
    """The resolved overlap plan for a model a test builds without `finalize` (layer, model and
    schedule tests): the named switches as given, every other one off."""
    return OverlapPlan(**switches)


def bare_kernels(model: ModelConfig) -> Kernels:
    """The kernels of a model a test builds without `finalize`, on the CPU: the rules finalize
    applies (decisions recorded nowhere), and the token dispatcher as typed (a dispatcher this
    runtime does not build is refused by the layer that builds it,
    `overlap.layers.moe.moe_layer.dispatcher_class`)."""
    typed = (model.moe_token_dispatcher_type, model.moe_flex_dispatcher_backend)
    log = DecisionLog(strict=False)
    return resolve_kernels(
        model, Precision.of(model).params_dtype, log, False, probe_device, typed, True
    )


def layer_ranges(layout: PipelineLayout) -> list[list[tuple[int, int]]]:
    """[pp_rank][chunk] -> (start, end) of that model chunk's transformer layers."""
    return [[(s.start, s.end) for s in layout.rank_stages(r)] for r in range(layout.pp)]
