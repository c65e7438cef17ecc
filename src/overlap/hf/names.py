"""Our parameter names <-> Hugging Face Qwen3 / Qwen3-MoE names, and the tensor transforms between
them.

Our names are the same in every layout (`overlap.model.gpt`): global layer numbers, stacked experts.
A `Mapping` says which HF tensors make one of our parameters and how (`kind`):

- `same`: one HF tensor, same shape (norms, embedding, LM head, o_proj, router);
- `qkv`: our fused QKV is laid out per query group, [q heads of g | k_g | v_g] for each group g (see
  `SelfAttention.qkv`); HF keeps q_proj / k_proj / v_proj apart, heads group-major (query head i
  reads kv head i // heads_per_group, as `repeat_kv` does), so the merge is an interleave by group;
- `fc1`: our dense fc1 is [2, ffn, hidden] = [gate; up]; HF has gate_proj and up_proj;
- `expert_fc1` / `expert_down`: our stacked [num_experts, ...] tensors, fc1 [E, 2 * I, H] with each
  expert's gate rows first; HF on disk holds one tensor per expert
  (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), transformers 5 in memory (and some
  checkpoints on disk) the fused `mlp.experts.gate_up_proj` [E, 2 * I, H] (gate first: our fc1 as it
  is) and `mlp.experts.down_proj` [E, H, I].

RoPE needs no permutation: ours is rotate-half on [first half, second half] like HF's
(`layers/rotary.py`). The transforms are pure functions on full tensors; `overlap.hf.load` applies
the same functions to the slices a rank reads (a TP cut of QKV is a cut by whole groups, so merging
the slices gives the rank's shard).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from overlap.config.architecture import TransformerArchitecture


@dataclass(frozen=True)
class Mapping:
    """Our parameter `ours` is made of the HF tensors `hf` by the transform `kind` (see the module
    docstring).

    For the expert kinds `hf` holds the layer's expert prefix (`model.layers.{i}.mlp.experts`): the
    per-expert and the fused names both derive from it."""

    ours: str
    kind: str
    hf: tuple[str, ...]


EXPERT_KINDS = ("expert_fc1", "expert_down")
_PER_EXPERT = {"expert_fc1": ("gate_proj", "up_proj"), "expert_down": ("down_proj",)}


def mappings(cfg: TransformerArchitecture) -> list[Mapping]:
    """Every parameter of the whole (unsplit) model `cfg`, in our naming order, with its HF
    source."""
    out = [Mapping("embedding.weight", "same", ("model.embed_tokens.weight",))]
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        attn = hf + "self_attn."
        out += [
            Mapping(ours + "input_layernorm.weight", "same", (hf + "input_layernorm.weight",)),
            Mapping(
                ours + "self_attention.linear_qkv.weight",
                "qkv",
                (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            ),
            Mapping(ours + "self_attention.q_layernorm.weight", "same", (attn + "q_norm.weight",)),
            Mapping(ours + "self_attention.k_layernorm.weight", "same", (attn + "k_norm.weight",)),
            Mapping(ours + "self_attention.linear_proj.weight", "same", (attn + "o_proj.weight",)),
            Mapping(
                ours + "pre_mlp_layernorm.weight", "same", (hf + "post_attention_layernorm.weight",)
            ),
        ]
        if cfg.is_moe_layer(i):
            experts = (hf + "mlp.experts",)
            out += [
                Mapping(ours + "mlp.router.weight", "same", (hf + "mlp.gate.weight",)),
                Mapping(ours + "mlp.experts.fc1_weight", "expert_fc1", experts),
                Mapping(ours + "mlp.experts.down_weight", "expert_down", experts),
            ]
        else:
            out += [
                Mapping(
                    ours + "mlp.linear_fc1.weight",
                    "fc1",
                    (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                ),
                Mapping(ours + "mlp.linear_fc2.weight", "same", (hf + "mlp.down_proj.weight",)),
            ]
    out.append(Mapping("final_layernorm.weight", "same", ("model.norm.weight",)))
    # tied: the output layer is the embedding (no tensor of its own)
    if not cfg.share_embeddings_and_output_weights:
        out.append(Mapping("output_layer.weight", "same", ("lm_head.weight",)))
    return out


def per_expert_names(prefix: str, kind: str, expert: int) -> list[str]:
    """The on-disk per-expert HF names of expert `expert` (what `save_pretrained` writes): gate and
    up for fc1."""
    return [f"{prefix}.{expert}.{leaf}.weight" for leaf in _PER_EXPERT[kind]]


def fused_name(prefix: str, kind: str) -> str:
    """The transformers-5 fused name holding this kind for all experts."""
    return f"{prefix}.down_proj" if kind == "expert_down" else f"{prefix}.gate_up_proj"


# --- transforms (pure, full tensors; also valid on a cut by whole groups / rows / experts) --------
def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [groups * heads_per_group * d, h], k and v [groups * d, h] -> our fused [groups * (hpg + 2)
    * d, h]."""
    hidden = q.shape[-1]
    parts = [t.reshape(groups, -1, hidden) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def split_qkv(
    qkv: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `merge_qkv`: our fused QKV -> (q_proj, k_proj, v_proj) weights."""
    hidden = qkv.shape[-1]
    per_group = qkv.reshape(groups, -1, hidden)
    q, k, v = per_group.split([per_group.shape[1] - 2 * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, hidden).contiguous(),
        k.reshape(-1, hidden).contiguous(),
        v.reshape(-1, hidden).contiguous(),
    )


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate_proj, up_proj [ffn, h] -> our fc1 [2, ffn, h]."""
    return torch.stack([gate, up])


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our fc1 [2, ffn, h] -> (gate_proj, up_proj)."""
    return fc1[0].contiguous(), fc1[1].contiguous()


def stack_experts(per_expert: list[list[torch.Tensor]]) -> torch.Tensor:
    """Each expert's HF tensors (gate, up for fc1; down), in expert order -> our stacked [E, out,
    in]."""
    return torch.stack([torch.cat(parts) for parts in per_expert])


def unstack_expert(stacked: torch.Tensor, kind: str, expert: int) -> list[torch.Tensor]:
    """The inverse of `stack_experts` for one expert: its HF tensors, in `per_expert_names`
    order."""
    return [part.contiguous() for part in stacked[expert].chunk(len(_PER_EXPERT[kind]))]


def to_hf(
    mapping: Mapping, full: torch.Tensor, cfg: TransformerArchitecture
) -> dict[str, torch.Tensor]:
    """Our full tensor -> the HF tensors it is made of, under their on-disk names (per-expert for
    experts)."""
    if mapping.kind == "same":
        return {mapping.hf[0]: full}
    if mapping.kind == "qkv":
        return dict(zip(mapping.hf, split_qkv(full, cfg.query_groups, cfg.head_dim)))
    if mapping.kind == "fc1":
        return dict(zip(mapping.hf, split_gate_up(full)))
    if mapping.kind in EXPERT_KINDS:
        return _per_expert(mapping.hf[0], mapping.kind, full)
    raise ValueError(f"unknown mapping kind {mapping.kind!r}")


def _per_expert(prefix: str, kind: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked [E, ...] expert tensor of `kind` (ours, or transformers 5's fused one: the same
    layout) -> the per-expert HF tensors under their on-disk names."""
    return {
        name: part
        for e in range(stacked.shape[0])
        for name, part in zip(per_expert_names(prefix, kind, e), unstack_expert(stacked, kind, e))
    }


def unfuse_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A transformers-5 fused expert tensor -> the per-expert tensors `save_pretrained` writes for
    it (any other tensor is returned as it is): the on-disk naming that export writes and the round
    trip compares in."""
    prefix, _, leaf = name.rpartition(".")
    if not prefix.endswith(".mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
        return {name: tensor}
    return _per_expert(prefix, "expert_down" if leaf == "down_proj" else "expert_fc1", tensor)
