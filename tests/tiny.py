"""The tiny model the multi-process tests train: 64 wide, 16 tokens, optionally 4 experts (top-2)."""

from __future__ import annotations

from overlap.config import ConfigContainer, ModelConfig, OptimizerConfig, SchedulerConfig, TrainConfig


def tiny_config(moe: bool, precision: str, layers: int, overrides: list[str], iters: int,
                **layout) -> ConfigContainer:
    from overlap.config.overrides import apply_overrides

    model = ModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                        ffn_hidden_size=128, vocab_size=256, seq_length=16, qk_layernorm=True, **layout)
    if moe:
        model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size = 4, 2, 32
        model.moe_aux_loss_coeff = 1e-2
    cfg = ConfigContainer(model=model, train=TrainConfig(global_batch_size=8, micro_batch_size=1, train_iters=iters),
                          optimizer=OptimizerConfig(lr=1e-3), scheduler=SchedulerConfig(lr_warmup_iters=1),
                          mixed_precision=precision)
    apply_overrides(cfg, overrides)
    return cfg
