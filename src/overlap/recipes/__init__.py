"""Recipes: content the harness applies on top of the configuration, kept apart from its mechanics
(as Megatron-Bridge keeps its recipes apart from its config classes). `models` holds the model
recipes (`-m FAMILY -mr NAME`, `models.yaml`), `perf` Megatron-Bridge's perf recipes for a model,
GPU and precision (`perf.yaml`). Both build `overlap.config` sections; nothing in config needs
them."""
