"""Hugging Face `config.json` (Qwen3ForCausalLM / Qwen3MoeForCausalLM) <-> our ModelConfig.

Every field of config.json is accounted for: mapped to a ModelConfig field, required at the one
value our model computes (refused otherwise: a model that would silently compute something else is
worse than an error), or listed in `METADATA` as having no effect on the weights or the forward
pass. An unknown field is refused too: a newer transformers may add a switch that changes the math,
and we would rather say so than ignore it.

A run from a pretrained folder takes its architecture from here (`apply_pretrained`, which
`ConfigContainer.finalize` runs): each field it replaces is a row of the decision table's
checkpoint section, its reason `PRETRAINED`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from overlap.config.architecture import TransformerArchitecture, moe_layer_freq_for
from overlap.config.model import ModelConfig
from overlap.decisions import RULE, USER, DecisionLog
from overlap.errors import CheckpointError, ConfigError

log = logging.getLogger("overlap.hf")

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}

# The reason of every architecture decision a pretrained folder makes (the harness refuses one that
# beats the user's own override or flag by it).
PRETRAINED = "from the pretrained checkpoint's config.json"

# The architecture fields a checkpoint's own description of its model decides (a Hugging Face
# config.json), each with the attribute compared: its effective value
# (kv_channels=None and kv_channels=hidden/heads are the same model). A pretrained folder's
# architecture replaces the recipe's by these at finalize, and hf's `check_model_matches` compares
# them; MOE_FIELDS only for a model with experts.
ARCH_FIELDS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "query_groups",
    "kv_channels": "head_dim",
    "ffn_hidden_size": "ffn_size",
    "vocab_size": "vocab_size",
    "layernorm_epsilon": "layernorm_epsilon",
    "rotary_base": "rotary_base",
    "qk_layernorm": "qk_layernorm",
    "gated_linear_unit": "gated_linear_unit",
    "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias",
    "share_embeddings_and_output_weights": "share_embeddings_and_output_weights",
    "num_moe_experts": "num_moe_experts",
}
MOE_FIELDS = {
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_size",
    "moe_layer_freq": "moe_layer_pattern",
    "moe_router_pre_softmax": "moe_router_pre_softmax",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
}

# Fields with no effect on the weights or on the logits (generation, tokenizer ids, bookkeeping), or
# whose only effect is in training and which a run sets itself (router_aux_loss_coef ->
# model.moe_aux_loss_coeff, max_position_embeddings -> an upper bound for model.seq_length;
# `sliding_window` / `max_window_layers` matter only with use_sliding_window, which is refused).
METADATA = {
    "architectures",
    "model_type",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "output_router_logits",
    "router_aux_loss_coef",
    "max_position_embeddings",
    "sliding_window",
    "max_window_layers",
    "_name_or_path",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "tokenizer_class",
}
MAPPED = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "hidden_act",
    "use_sliding_window",
    "layer_types",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "shared_expert_intermediate_size",
}


def _refuse(key: str, value: Any, why: str, fix: str) -> ConfigError:
    return ConfigError(f"config.json:{key}", value, why, fix)


def read_hf_config(folder: str | Path) -> dict:
    path = Path(folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            "checkpoint.pretrained_checkpoint",
            str(path),
            f"config.json cannot be read ({type(exc).__name__}: {exc}).",
            "point it at a Hugging Face model folder.",
        ) from None


def rope_theta(hf: dict) -> float:
    """RoPE base: transformers 5 keeps it in `rope_parameters`, v4 files in a flat `rope_theta`;
    only the plain (unscaled) rotary embedding is ours."""
    params = hf.get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" or set(params) - {"rope_theta", "rope_type", "type"}:
        raise _refuse(
            "rope_parameters",
            params,
            "only the plain RoPE (rope_type 'default') is built here; scaled variants (yarn, "
            "dynamic, linear, partial rotary) change the rotation.",
            "use a checkpoint without RoPE scaling.",
        )
    if hf.get("rope_scaling"):
        raise _refuse(
            "rope_scaling",
            hf["rope_scaling"],
            "RoPE scaling changes the rotation; only plain RoPE is built here.",
            "use a checkpoint without RoPE scaling.",
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def moe_layer_freq(hf: dict, num_layers: int) -> int | list[int]:
    """Our moe_layer_freq for HF's rule (layer i is MoE iff i is not in mlp_only_layers and (i + 1)
    % decoder_sparse_step == 0): the int k where every k-th layer from 0 is MoE, else the per-layer
    0/1 list. Refused when no layer would be MoE (that is a dense model with experts configured)."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense_only = set(hf.get("mlp_only_layers") or [])
    moe = [i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)]
    if not any(moe):
        raise _refuse(
            "decoder_sparse_step/mlp_only_layers",
            {"decoder_sparse_step": step, "mlp_only_layers": sorted(dense_only)},
            f"these leave none of the {num_layers} layers MoE.",
            "use a checkpoint with at least one MoE layer, or a dense Qwen3 one.",
        )
    return moe_layer_freq_for(moe)


def _require(hf: dict, key: str, neutral: Any, why: str) -> None:
    value = hf.get(key, neutral)
    if value != neutral and not (neutral is None and value in ([], {}, False)):
        raise _refuse(key, value, why, f"use a checkpoint with {key}={json.dumps(neutral)}.")


def model_config_from_hf(hf: dict, seq_length: int | None = None) -> ModelConfig:
    """The ModelConfig of the model config.json describes, or a ConfigError naming the field we
    cannot honour.

    `seq_length` is a training choice (config.json's max_position_embeddings is only its upper
    bound); without one the converter uses min(4096, max_position_embeddings), which sizes nothing
    but the rotary table."""
    arch = (hf.get("architectures") or [None])[0]
    kind = ARCHITECTURES.get(arch) or (
        hf.get("model_type") if hf.get("model_type") in ARCHITECTURES.values() else None
    )
    if kind is None:
        raise _refuse(
            "architectures",
            hf.get("architectures"),
            f"only {sorted(ARCHITECTURES)} are converted.",
            "use a Qwen3 or Qwen3-MoE checkpoint.",
        )
    unknown = sorted(set(hf) - METADATA - MAPPED)
    if unknown:
        raise _refuse(
            unknown[0],
            hf[unknown[0]],
            f"this field (of {unknown}) has no counterpart in our model, and "
            "ignoring it could change what the model computes.",
            "use a plain Qwen3 / Qwen3-MoE config.",
        )
    _require(hf, "hidden_act", "silu", "our MLPs are SwiGLU (silu).")
    _require(hf, "attention_bias", False, "our Qwen3 attention has no q/k/v/o biases.")
    _require(hf, "attention_dropout", 0.0, "our attention has no dropout.")
    _require(
        hf,
        "use_sliding_window",
        False,
        "sliding-window attention is not built; every layer attends fully.",
    )
    _require(
        hf,
        "shared_expert_intermediate_size",
        None,
        "Qwen3-MoE has no shared expert; a checkpoint with one is another architecture (Qwen2-MoE) "
        "whose names are not mapped.",
    )
    if any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise _refuse(
            "layer_types",
            hf["layer_types"],
            "only full attention is built.",
            "use a checkpoint without sliding-window layers.",
        )
    tied = hf.get("tie_word_embeddings", False)
    if not isinstance(tied, bool):
        raise _refuse("tie_word_embeddings", tied, "expected true or false.", "fix config.json.")
    heads = int(hf["num_attention_heads"])
    layers = int(hf["num_hidden_layers"])
    max_pos = int(hf.get("max_position_embeddings", 4096))
    cfg = ModelConfig(
        num_layers=layers,
        hidden_size=int(hf["hidden_size"]),
        num_attention_heads=heads,
        num_query_groups=int(hf.get("num_key_value_heads", heads)),
        # head_dim is not always hidden/heads (Qwen3-30B-A3B: 128, not 64); read it, never derive it
        kv_channels=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        vocab_size=int(hf["vocab_size"]),
        seq_length=seq_length or min(4096, max_pos),
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        rotary_base=rope_theta(hf),
        qk_layernorm=True,
        gated_linear_unit=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        share_embeddings_and_output_weights=tied,
    )
    if kind == "qwen3_moe":
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not experts:
            raise _refuse(
                "num_experts",
                experts,
                "a Qwen3-MoE checkpoint without experts.",
                "convert it as Qwen3ForCausalLM.",
            )
        norm = hf.get("norm_topk_prob", False)  # transformers' default: false
        if not isinstance(norm, bool):
            raise _refuse("norm_topk_prob", norm, "expected true or false.", "fix config.json.")
        cfg.moe_router_pre_softmax = not norm
        cfg.num_moe_experts = int(experts)
        cfg.moe_router_topk = int(hf.get("num_experts_per_tok", 8))
        cfg.moe_ffn_hidden_size = int(hf["moe_intermediate_size"])
        cfg.moe_layer_freq = moe_layer_freq(hf, layers)
        cfg.moe_aux_loss_coeff = float(hf.get("router_aux_loss_coef", 0.0))
    else:
        for key in (
            "num_experts",
            "num_local_experts",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
            "norm_topk_prob",
            "num_experts_per_tok",
        ):
            if key in hf:
                raise _refuse(
                    key,
                    hf[key],
                    "a MoE field in a dense Qwen3 config.",
                    "use architectures=['Qwen3MoeForCausalLM'] for a MoE checkpoint.",
                )
    return cfg


def described_fields(theirs: TransformerArchitecture) -> dict[str, str]:
    """The fields config.json decides of the model it describes, each with the attribute compared:
    `ARCH_FIELDS`, and `MOE_FIELDS` for a model with experts."""
    return {**ARCH_FIELDS, **(MOE_FIELDS if theirs.is_moe else {})}


def apply_pretrained(
    model: ModelConfig, folder: str, tokenizer_vocab: int | None, decisions: DecisionLog
) -> int:
    """The architecture of a run from the Hugging Face `folder` (checkpoint.pretrained_checkpoint),
    as Bridge builds its model provider from the HF config: every field config.json describes
    (`ARCH_FIELDS`, and `MOE_FIELDS` for a Qwen3-MoE) replaces `model`'s, and each value that
    differs from the recipe's is a decision of the checkpoint section (start-up log and `overlap
    explain`; the harness refuses one that beats the user's own override or flag,
    `harness.check_pretrained_overrides`). A recipe without experts also takes the checkpoint's
    router aux-loss coefficient. A field config.json has that this runtime cannot honour is refused
    (`model_config_from_hf`). Returns the folder's vocabulary (its embedding rows).
    `ConfigContainer.finalize(pretrained=apply_pretrained)` runs it: config sits below hf/, so its
    callers hand it in."""
    m, theirs = model, model_config_from_hf(read_hf_config(folder), model.seq_length)
    if tokenizer_vocab is not None and tokenizer_vocab > theirs.vocab_size:
        raise ConfigError(
            "tokenizer.vocab_size",
            tokenizer_vocab,
            f"the pretrained checkpoint {folder} has {theirs.vocab_size} embedding rows: larger "
            "token ids have no embedding.",
            f"drop --vocab_size (the model takes {theirs.vocab_size} from config.json), or use "
            "the checkpoint's tokenizer.",
        )
    fields = described_fields(theirs)
    if theirs.is_moe and not m.is_moe:
        fields["moe_aux_loss_coeff"] = "moe_aux_loss_coeff"
    before = {name: getattr(m, attr) for name, attr in fields.items()}  # read before changing
    for name, attr in fields.items():
        value = getattr(theirs, attr)
        if before[name] != value:
            setattr(m, name, getattr(theirs, name))
            decisions.record_in(
                "checkpoint",
                f"model.{name}",
                before[name],
                value,
                RULE,
                f"{PRETRAINED} ({folder})",
            )
    # Training choices that route the released weights' tokens otherwise than the model was
    # trained (transformers drops no token and routes by the scores): honoured, and said beside
    # the architecture
    for name, on, what in (
        (
            "moe_expert_capacity_factor",
            m.moe_expert_capacity_factor is not None,
            "tokens beyond each expert's capacity are dropped",
        ),
        (
            "moe_router_force_load_balancing",
            bool(m.moe_router_force_load_balancing),
            "routing ignores the router's scores (a benchmark setting)",
        ),
    ):
        if theirs.is_moe and on:
            value = getattr(m, name)
            decisions.record_in(
                "checkpoint",
                f"model.{name}",
                value,
                value,
                USER,
                f"{what}: the pretrained MoE is trained differently from how it was released",
            )
            log.warning("model.%s=%s with pretrained weights: %s", name, value, what)
    return theirs.vocab_size


def check_model_matches(model: TransformerArchitecture, hf: dict, folder: str | Path) -> None:
    """`overlap run ... checkpoint.pretrained_checkpoint=<HF folder>`: our configured model must be
    the one in config.json; the first field that differs is named with both values."""
    theirs = model_config_from_hf(hf, seq_length=model.seq_length)
    fields = described_fields(theirs)
    for field, attr in fields.items():
        ours_value, their_value = getattr(model, attr), getattr(theirs, attr)
        if ours_value != their_value:
            raise ConfigError(
                f"model.{field}",
                ours_value,
                f"the Hugging Face checkpoint {folder} has {field}={their_value!r} (from its "
                f"config.json), this run configures {ours_value!r}.",
                f"set model.{field}={their_value}, or load a checkpoint of the configured model.",
            )
    max_pos = hf.get("max_position_embeddings")
    if max_pos is not None and model.seq_length > int(max_pos):
        log.warning(
            "model.seq_length=%d exceeds the checkpoint's max_position_embeddings=%s: positions "
            "past it were never trained",
            model.seq_length,
            max_pos,
        )


def hf_config_from_model(cfg: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """config.json for our model `cfg`. `base` (the config.json an import came from) keeps the
    fields we do not model (token ids, max_position_embeddings, ...); every architecture field is
    written from `cfg`."""
    if (
        not cfg.qk_layernorm
        or not cfg.gated_linear_unit
        or cfg.add_bias_linear
        or cfg.add_qkv_bias
        or cfg.moe_shared_expert_intermediate_size
    ):
        raise ConfigError(
            "model",
            "not Qwen3",
            "only Qwen3 / Qwen3-MoE models (QK norm, SwiGLU, no biases, no shared expert) have a "
            "Hugging Face layout here.",
            "export a Qwen3-style model.",
        )
    out = dict(base or {})
    moe = cfg.is_moe
    out.update(
        {
            "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if moe else "qwen3",
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.query_groups,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.layernorm_epsilon,
            "tie_word_embeddings": cfg.share_embeddings_and_output_weights,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "dtype": dtype,
            "rope_parameters": {"rope_theta": cfg.rotary_base, "rope_type": "default"},
        }
    )
    out.pop("rope_theta", None)
    out.pop("torch_dtype", None)
    out.setdefault("max_position_embeddings", cfg.seq_length)
    out.setdefault("initializer_range", cfg.init_method_std)
    if moe:
        out.pop("num_local_experts", None)
        out.update(
            {
                "num_experts": cfg.num_moe_experts,
                "num_experts_per_tok": cfg.moe_router_topk,
                "moe_intermediate_size": cfg.moe_ffn_size,
                "norm_topk_prob": not cfg.moe_router_pre_softmax,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)],
                "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            }
        )
    return out
