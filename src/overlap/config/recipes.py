"""Recipes: named, ready-to-run configurations (`-m FAMILY -mr NAME`).

- `qwen3_30b_a3b`: the exact Qwen3-30B-A3B dimensions and the reference's 16-GPU H100 layout
  (TP1/PP1, EP up to 16), for `explain`, planning and real clusters. Like the reference recipes it
  ships with EP overlap OFF: the user turns it on explicitly once the run works.
- `qwen3_moe_tiny`: structurally identical (GQA + QK-norm, SwiGLU experts, every layer MoE, top-k
  softmax router with aux loss, no shared expert), sized so a training step on 4 CPU ranks takes
  well under a second.
- `dense_tiny`: a small dense decoder of the same family, for TP / PP / DP work on 2 cores.
- `qwen3_235b_a22b`, `qwen3_8b`, `llama3_8b`, `llama3_70b`: real shapes (Hugging Face config.json of
  each model) for `overlap explain` and `overlap plan`; the runtime trains them as it trains any
  shape of their kind (nothing in them needs an unbuilt feature), on a cluster large enough to hold
  them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from overlap.config.container import ConfigContainer
from overlap.config.model import ModelConfig
from overlap.config.training import DDPConfig, OptimizerConfig, SchedulerConfig, TrainConfig
from overlap.errors import ConfigError


def qwen3_30b_a3b(num_gpus: int) -> ConfigContainer:
    # PP=1; the harness re-derives it per pipeline stage (Recipe.max_ep)
    ep = math.gcd(num_gpus, 16)
    model = ModelConfig(
        num_layers=48,
        hidden_size=2048,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        ffn_hidden_size=6144,
        vocab_size=151936,
        seq_length=4096,
        layernorm_epsilon=1e-6,
        rotary_base=1e6,
        qk_layernorm=True,
        gated_linear_unit=True,
        init_method_std=0.02,
        num_moe_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=True,
        moe_aux_loss_coeff=1e-3,
        moe_router_load_balancing_type="aux_loss",
        expert_model_parallel_size=ep,
    )
    return _cluster_recipe(model, 1024)  # distributed optimizer, NaN check: as the Bridge recipe


def qwen3_moe_tiny(num_gpus: int) -> ConfigContainer:
    ep = math.gcd(num_gpus, 4)  # PP=1; the harness re-derives it per pipeline stage (Recipe.max_ep)
    model = ModelConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=8,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=384,
        vocab_size=1024,
        seq_length=64,
        layernorm_epsilon=1e-6,
        rotary_base=1e6,
        qk_layernorm=True,
        gated_linear_unit=True,
        init_method_std=0.02,
        num_moe_experts=16,
        moe_router_topk=4,
        moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=True,
        moe_aux_loss_coeff=1e-3,
        moe_router_load_balancing_type="aux_loss",
        expert_model_parallel_size=ep,
    )
    return ConfigContainer(
        model=model,
        train=TrainConfig(
            global_batch_size=4 * num_gpus, micro_batch_size=2, train_iters=10, seed=1234
        ),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4),
        scheduler=SchedulerConfig(lr_warmup_iters=2),
        mixed_precision="bf16_mixed",
    )


def dense_tiny(num_gpus: int) -> ConfigContainer:
    model = ModelConfig(
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        num_query_groups=4,
        kv_channels=32,
        ffn_hidden_size=512,
        vocab_size=4096,
        seq_length=256,
        layernorm_epsilon=1e-6,
        rotary_base=1e6,
        qk_layernorm=True,
        gated_linear_unit=True,
        init_method_std=0.02,
    )
    return ConfigContainer(
        model=model,
        train=TrainConfig(
            global_batch_size=2 * num_gpus, micro_batch_size=1, train_iters=10, seed=1234
        ),
        optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-4),
        scheduler=SchedulerConfig(lr_warmup_iters=2),
        mixed_precision="fp32",
    )


def _cluster_recipe(model: ModelConfig, global_batch: int) -> ConfigContainer:
    """The training settings the real-shape recipes share (Bridge-style pretraining defaults,
    distributed optimizer, bf16)."""
    return ConfigContainer(
        model=model,
        train=TrainConfig(
            global_batch_size=global_batch, micro_batch_size=1, train_iters=100, seed=1234
        ),
        optimizer=OptimizerConfig(lr=3e-4, min_lr=3e-5, use_distributed_optimizer=True),
        scheduler=SchedulerConfig(lr_warmup_iters=500),
        ddp=DDPConfig(use_distributed_optimizer=True, check_for_nan_in_grad=True),
        mixed_precision="bf16_mixed",
    )


def qwen3_235b_a22b(num_gpus: int) -> ConfigContainer:
    """Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B config.json): 94 layers, hidden 4096, 64 query / 4 KV
    heads of 128, 128 experts of 1536 top-8, no shared expert. As the Bridge recipe, the embedding
    and the loss count as one layer each in the pipeline split: 94 + 2 = 96 layers divide over PP
    2/4/8/16 (x VPP), and at the published TP2 x PP8 x VPP4 x EP32 that is the layout
    "Ett|(t*3|)*30ttL" (its first chunk 2 layers + embedding, its last 2 + loss)."""
    # same family: 4 KV groups of 128, 128 experts top-8, vocabulary, rotary base
    cfg = qwen3_30b_a3b(num_gpus)
    cfg.model = replace(
        cfg.model,
        num_layers=94,
        hidden_size=4096,
        num_attention_heads=64,
        ffn_hidden_size=12288,
        moe_ffn_hidden_size=1536,
        expert_model_parallel_size=math.gcd(num_gpus, 32),
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    )
    cfg.train.global_batch_size = 2048
    return cfg


def _dense(
    layers: int,
    hidden: int,
    heads: int,
    groups: int,
    ffn: int,
    vocab: int,
    seq: int,
    eps: float,
    rotary: float,
    qk_norm: bool,
    global_batch: int,
) -> ConfigContainer:
    """A dense GQA SwiGLU decoder of real size (head dim 128), with the shared cluster training
    settings."""
    model = ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=128,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        seq_length=seq,
        layernorm_epsilon=eps,
        rotary_base=rotary,
        qk_layernorm=qk_norm,
        gated_linear_unit=True,
        init_method_std=0.02,
    )
    return _cluster_recipe(model, global_batch)


def qwen3_8b(num_gpus: int) -> ConfigContainer:
    """Qwen3-8B (Qwen/Qwen3-8B config.json): dense, 36 layers, hidden 4096, 32 query / 8 KV heads,
    FFN 12288."""
    return _dense(36, 4096, 32, 8, 12288, 151936, 4096, 1e-6, 1e6, True, 512)


def llama3_8b(num_gpus: int) -> ConfigContainer:
    """Llama-3 8B (meta-llama/Meta-Llama-3-8B config.json): 32 layers, hidden 4096, 32 query / 8 KV
    heads, FFN 14336, vocabulary 128256, rotary base 500000, RMSNorm eps 1e-5, no QK norm."""
    return _dense(32, 4096, 32, 8, 14336, 128256, 8192, 1e-5, 500000.0, False, 128)


def llama3_70b(num_gpus: int) -> ConfigContainer:
    """Llama-3 70B (meta-llama/Meta-Llama-3-70B config.json): 80 layers, hidden 8192, 64 query / 8
    KV heads, FFN 28672, vocabulary 128256, rotary base 500000, RMSNorm eps 1e-5, no QK norm."""
    return _dense(80, 8192, 64, 8, 28672, 128256, 8192, 1e-5, 500000.0, False, 128)


@dataclass(frozen=True)
class Recipe:
    family: str
    name: str
    build: Callable[[int], ConfigContainer]
    summary: str
    # EP = gcd(ranks per pipeline stage, max_ep) unless the user sets it: experts are carved out of
    # each stage's ranks, so the rule must see the layout the flags and overrides chose (None: the
    # recipe has no EP rule).
    max_ep: int | None = None

    def ep_for(self, ranks_per_stage: int) -> int:
        return math.gcd(ranks_per_stage, self.max_ep or 1)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "qwen",
            "qwen3_30b_a3b",
            qwen3_30b_a3b,
            "Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts top-8, EP=gcd(ranks per stage,16), "
            "bf16",
            16,
        ),
        Recipe(
            "qwen",
            "qwen3_moe_tiny",
            qwen3_moe_tiny,
            "Qwen3-MoE structure at toy size: 2 layers, hidden 128, 16 experts top-4, EP=gcd(ranks "
            "per stage,4), bf16",
            4,
        ),
        Recipe(
            "qwen",
            "dense_tiny",
            dense_tiny,
            "dense Qwen3-style decoder: 4 layers, hidden 256, fp32",
        ),
        Recipe(
            "qwen",
            "qwen3_235b_a22b",
            qwen3_235b_a22b,
            "Qwen3-235B-A22B: 94 layers, hidden 4096, 128 experts top-8, EP=gcd(ranks per "
            "stage,32), bf16",
            32,
        ),
        Recipe(
            "qwen",
            "qwen3_8b",
            qwen3_8b,
            "Qwen3-8B dense: 36 layers, hidden 4096, GQA 32/8, FFN 12288, bf16",
        ),
        Recipe(
            "llama",
            "llama3_8b",
            llama3_8b,
            "Llama-3 8B: 32 layers, hidden 4096, GQA 32/8, FFN 14336, seq 8192, bf16",
        ),
        Recipe(
            "llama",
            "llama3_70b",
            llama3_70b,
            "Llama-3 70B: 80 layers, hidden 8192, GQA 64/8, FFN 28672, seq 8192, bf16",
        ),
    )
}


def get_recipe(family: str, name: str) -> Recipe:
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ConfigError(
            "-mr/--model_recipe_name",
            name,
            "unknown recipe.",
            f"use one of: {', '.join(RECIPES)} (overlap explain --list-recipes).",
        )
    if recipe.family != family:
        raise ConfigError(
            "-m/--model_family_name",
            family,
            f"recipe {name} belongs to family '{recipe.family}'.",
            f"use -m {recipe.family}.",
        )
    return recipe
