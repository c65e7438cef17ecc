"""Models assembled from `overlap.layers`: the Qwen3-style GPT (dense or MoE)."""

from overlap.model.gpt import GPTModel, TransformerLayer

__all__ = ["GPTModel", "TransformerLayer"]
