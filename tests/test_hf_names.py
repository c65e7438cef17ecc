"""HF conversion pieces without transformers: the name mapping and tensor transforms (both
directions, whole and sharded), the sharded safetensors writer / reader, and config.json's refusals
(every field we cannot honour is an error naming it, never ignored)."""

from __future__ import annotations

import copy

import pytest
import torch

from overlap.errors import ConfigError
from overlap.hf.config_json import hf_config_from_model, model_config_from_hf
from overlap.hf.load import DictSource, check_source, read_shard
from overlap.hf.names import mappings, merge_qkv, split_qkv, to_hf, unfuse_experts
from overlap.hf.safetensors_io import SafetensorsReader, write_sharded
from overlap.layers.init import Shard

HF = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
    "tie_word_embeddings": False,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_position_embeddings": 512,
    "dtype": "float32",
    "router_aux_loss_coef": 0.001,
}


def _hf_tensors(cfg) -> dict[str, torch.Tensor]:
    """Random HF per-expert tensors for the model `cfg` (shapes from our full tensors through
    `to_hf`)."""
    gen = torch.Generator().manual_seed(0)
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {
        "qkv": (cfg.query_groups * (cfg.num_attention_heads // cfg.query_groups + 2) * d, h),
        "fc1": (2, cfg.ffn_size, h),
    }
    out = {}
    for m in mappings(cfg):
        if m.kind == "qkv":
            full = torch.randn(shapes["qkv"], generator=gen)
        elif m.kind == "fc1":
            full = torch.randn(shapes["fc1"], generator=gen)
        elif m.kind == "expert_down":
            full = torch.randn(cfg.num_moe_experts, h, cfg.moe_ffn_size, generator=gen)
        elif m.kind.startswith("expert"):
            full = torch.randn(cfg.num_moe_experts, cfg.moe_ffn_size, h, generator=gen)
        elif "embedding" in m.ours or "output_layer" in m.ours:
            full = torch.randn(cfg.vocab_size, h, generator=gen)
        elif "linear_proj" in m.ours:
            full = torch.randn(h, cfg.num_attention_heads * d, generator=gen)
        elif "router" in m.ours:
            full = torch.randn(cfg.num_moe_experts, h, generator=gen)
        else:
            full = torch.randn(
                d if "q_layernorm" in m.ours or "k_layernorm" in m.ours else h, generator=gen
            )
        out.update(to_hf(m, full, cfg))
    return out


def test_qkv_merge_is_per_query_group():
    # 4 heads of dim 2, 2 groups: rows 0-3 group 0
    q = torch.arange(4 * 2).reshape(4 * 2, 1).float()
    k = 100 + torch.arange(2 * 2).reshape(4, 1).float()
    v = 200 + torch.arange(2 * 2).reshape(4, 1).float()
    fused = merge_qkv(q, k, v, groups=2)
    assert fused.flatten().tolist() == [
        0,
        1,
        2,
        3,
        100,
        101,
        200,
        201,
        4,
        5,
        6,
        7,
        102,
        103,
        202,
        203,
    ]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, 2, 2), (q, k, v)))


def test_mapping_both_directions_and_every_shard():
    cfg = model_config_from_hf(HF)
    hf = _hf_tensors(cfg)
    source = DictSource(hf)
    maps = check_source(cfg, source, "mem")
    back = {}
    for m in maps:
        full = read_shard(m, source, cfg, None)
        back.update(to_hf(m, full, cfg))
        dim = {"qkv": 0, "fc1": 1, "same": 0}.get(m.kind, 0)
        if "linear_proj" in m.ours:
            dim = 1
        if full.dim() > 1 and ("norm" not in m.ours and "router" not in m.ours):
            for i in range(2):
                part = read_shard(m, source, cfg, Shard(dim, i, 2))
                assert torch.equal(part, full.chunk(2, dim=dim)[i]), (m.ours, i)
    assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf)


def test_fused_expert_layout_reads_like_per_expert():
    cfg = model_config_from_hf(HF)
    hf = _hf_tensors(cfg)
    fused = dict(hf)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts"
        gate = torch.stack([fused.pop(f"{p}.{e}.gate_proj.weight") for e in range(4)])
        up = torch.stack([fused.pop(f"{p}.{e}.up_proj.weight") for e in range(4)])
        fused[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        fused[f"{p}.down_proj"] = torch.stack(
            [fused.pop(f"{p}.{e}.down_proj.weight") for e in range(4)]
        )
    unfused = {k: v for n, t in fused.items() for k, v in unfuse_experts(n, t).items()}
    assert unfused.keys() == hf.keys() and all(torch.equal(unfused[n], hf[n]) for n in hf)
    for m in check_source(cfg, DictSource(fused), "mem"):
        for shard in (None, Shard(0, 1, 2)):
            assert torch.equal(
                read_shard(m, DictSource(fused), cfg, shard),
                read_shard(m, DictSource(hf), cfg, shard),
            )


def test_mixed_or_incomplete_checkpoints_are_refused():
    cfg = model_config_from_hf(HF)
    hf = _hf_tensors(cfg)
    with pytest.raises(ConfigError, match="not in the checkpoint"):
        check_source(cfg, DictSource({k: v for k, v in hf.items() if "lm_head" not in k}), "mem")
    with pytest.raises(ConfigError, match="no place for"):
        check_source(cfg, DictSource({**hf, "model.extra.weight": torch.zeros(1)}), "mem")
    mixed = {**hf, "model.layers.0.mlp.experts.down_proj": torch.zeros(4, 16, 8)}
    with pytest.raises(ConfigError, match="both fused"):
        check_source(cfg, DictSource(mixed), "mem")


def test_sharded_write_and_lazy_sliced_read(tmp_path):
    tensors = {f"t{i}": torch.arange(64.0).reshape(8, 8) + i for i in range(5)}
    files = write_sharded(tmp_path, tensors, max_shard_bytes=600)
    assert "model.safetensors.index.json" in files and len(files) > 2
    reader = SafetensorsReader(tmp_path)
    assert reader.names() == set(tensors)
    assert torch.equal(reader.read("t3", 1, 2, 4), tensors["t3"][:, 2:4])
    assert torch.equal(reader.read("t4"), tensors["t4"])


def test_config_both_directions():
    cfg = model_config_from_hf(HF)
    assert (
        cfg.head_dim,
        cfg.query_groups,
        cfg.rotary_base,
        cfg.num_moe_experts,
        cfg.moe_ffn_size,
    ) == (8, 2, 1e6, 4, 8)
    assert model_config_from_hf(hf_config_from_model(cfg, "float32", None)) == cfg
    dense = {
        k: v
        for k, v in HF.items()
        if k
        not in (
            "num_local_experts",
            "num_experts_per_tok",
            "norm_topk_prob",
            "moe_intermediate_size",
            "decoder_sparse_step",
            "mlp_only_layers",
            "router_aux_loss_coef",
        )
    }
    dense.update(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", layer_types=["full_attention"] * 2
    )
    assert not model_config_from_hf(dense).is_moe
    every_other = model_config_from_hf({**HF, "mlp_only_layers": [1]})
    assert every_other.moe_layer_freq == 2
    # decoder_sparse_step=2 makes layer 1 (not 0) MoE: no int k says that, the per-layer list does,
    # and it exports back to the same layers (as mlp_only_layers).
    odd = model_config_from_hf({**HF, "decoder_sparse_step": 2})
    assert odd.moe_layer_freq == [0, 1] and [odd.is_moe_layer(i) for i in range(2)] == [False, True]
    exported = hf_config_from_model(odd, "float32", None)
    assert exported["mlp_only_layers"] == [0] and model_config_from_hf(exported) == odd
    unnormalised = model_config_from_hf({**HF, "norm_topk_prob": False})
    assert unnormalised.moe_router_pre_softmax and not cfg.moe_router_pre_softmax
    assert hf_config_from_model(unnormalised, "float32", None)["norm_topk_prob"] is False


@pytest.mark.parametrize(
    "change,field",
    [
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
        (
            {"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0}},
            "rope_parameters",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"decoder_sparse_step": 3}, "decoder_sparse_step"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size"),
        ({"some_new_switch": 1}, "some_new_switch"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "architectures"),
    ],
)
def test_refusals_name_the_field(change, field):
    hf = copy.deepcopy(HF)
    hf.update(change)
    with pytest.raises(ConfigError, match=f"config.json:{field}"):
        model_config_from_hf(hf)
