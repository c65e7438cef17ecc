"""The anchor test's tiny random Hugging Face Qwen3 / Qwen3-MoE models (hidden 32, 2 layers, 4
experts; weights redrawn at std 0.2, norm weights around 1), saved with `save_pretrained` together
with their fp32 logits and gradients on one fixed batch: the source models of
`tests/test_hf_anchor.py` and `tests/test_convert_cli.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 16, 2, 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # head_dim != hidden / heads, as in Qwen3-30B-A3B
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attn_implementation="eager",
)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)


def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def anchor_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
    )


def save_reference_model(kind: str, folder: Path) -> dict:
    """Save a tiny random HF model to `folder`; return its logits and the grads of the mean
    cross-entropy. "moe_unnormalised": the MoE model with norm_topk_prob=false (transformers'
    default); "moe_sparse_step": with decoder_sparse_step=2 (layer 0 dense, layer 1 MoE: our
    per-layer moe_layer_freq [0, 1]); "dense_tied": the dense model with tie_word_embeddings=true
    (one tensor for the embedding and the LM head; its gradient is the sum of both uses)."""
    torch.manual_seed(0)
    if kind.startswith("moe"):
        sparse = dict(decoder_sparse_step=2) if kind == "moe_sparse_step" else {}
        config = transformers.Qwen3MoeConfig(
            **COMMON, **dict(MOE, norm_topk_prob=kind != "moe_unnormalised"), **sparse
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    # "dense_tied": tie_word_embeddings=true (Qwen3 0.6B-4B), our
    # share_embeddings_and_output_weights
    else:
        tied = dict(COMMON, tie_word_embeddings=kind == "dense_tied")
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**tied))
    randomise(model, 1)
    model.save_pretrained(folder)
    tokens, labels = anchor_batch()
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    loss.backward()
    return {
        "logits": logits.detach(),
        "loss": loss.item(),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
        "state": {n: t.detach().clone() for n, t in model.state_dict().items()},
    }
