"""Layout and model validation in ConfigContainer.finalize, and the recipes (Qwen3-30B-A3B reference
dimensions)."""

from __future__ import annotations

import pytest

from overlap.config import ConfigContainer, ModelConfig, TrainConfig
from overlap.errors import ConfigError, NotBuiltError
from overlap.recipes.models import RECIPES, get_recipe
from tests.configs import container, dense_model, moe_model


def model(**kw) -> ModelConfig:
    return dense_model(**{"num_layers": 4, **kw})


def moe(**kw) -> ModelConfig:
    return moe_model(**{"num_layers": 4, "num_moe_experts": 8, **kw})


def build(m: ModelConfig, gbs: int = 16, mbs: int = 1) -> ConfigContainer:
    return container(m, train=TrainConfig(global_batch_size=gbs, micro_batch_size=mbs))


def error(cfg: ConfigContainer, world: int) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(world)
    return exc.value


# --- layout ---------------------------------------------------------------------------------------
def test_world_not_divisible_by_tp_pp_cp():
    err = error(
        build(
            model(
                tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2
            )
        ),
        6,
    )
    assert err.field == "-ng/--num_gpus"
    assert err.value == 6
    assert "TP x PP x CP" in err.why and "= 4" in err.why


def test_world_not_divisible_by_cp():
    err = error(build(model(context_parallel_size=4)), 6)
    assert err.field == "-ng/--num_gpus"


def test_ep_not_dividing_ranks_per_stage():
    err = error(build(moe(expert_model_parallel_size=4)), 6)
    assert err.field == "model.expert_model_parallel_size"
    assert "must divide" in err.why


def test_experts_not_divisible_by_ep():
    err = error(build(moe(num_moe_experts=6, expert_model_parallel_size=4)), 4)
    assert err.field == "model.num_moe_experts"
    assert "expert_model_parallel_size" in err.why


def test_heads_not_divisible_by_tp():
    err = error(
        build(
            model(
                num_attention_heads=6,
                hidden_size=96,
                tensor_model_parallel_size=4,
                sequence_parallel=True,
            )
        ),
        4,
    )
    assert err.field == "model.num_attention_heads"
    assert "tensor_model_parallel_size" in err.why


def test_query_groups_not_divisible_by_tp():
    err = error(
        build(model(num_query_groups=2, tensor_model_parallel_size=4, sequence_parallel=True)), 4
    )
    assert err.field == "model.num_query_groups"


def test_global_batch_not_divisible_by_micro_batch_times_dp():
    err = error(build(model(), gbs=12, mbs=2), 4)
    assert err.field == "train.global_batch_size"
    assert "2 x 4" in err.why


def test_vpp_with_pp1_is_error():
    err = error(build(model(virtual_pipeline_model_parallel_size=2)), 1)
    assert err.field == "model.virtual_pipeline_model_parallel_size"


def test_layers_not_divisible_by_pp_times_vpp():
    # 2 layers per stage cannot make 4 virtual-pipeline chunks: the split names the VPP field (and
    # the counts)
    err = error(
        build(
            model(
                num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4
            )
        ),
        2,
    )
    assert err.field == "model.virtual_pipeline_model_parallel_size" and "2 layers" in err.why
    err = error(build(model(num_layers=5, pipeline_model_parallel_size=2)), 2)
    assert err.field == "model.num_layers"


def test_moe_with_tp_requires_sequence_parallel():
    err = error(build(moe(tensor_model_parallel_size=2)), 4)
    assert err.field == "model.sequence_parallel"
    assert err.value is False
    build(moe(tensor_model_parallel_size=2, sequence_parallel=True)).finalize(4)


def test_dense_model_with_ep_is_error():
    err = error(build(model(expert_model_parallel_size=2)), 2)
    assert err.field == "model.expert_model_parallel_size"


def test_context_parallel_is_fine_for_explain():
    cfg = build(moe(context_parallel_size=2))
    res = cfg.finalize(4)
    assert (res.layout.cp, res.layout.dp, res.layout.ep) == (2, 2, 2)


@pytest.mark.parametrize(
    "name",
    [
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    ],
)
def test_parallel_sizes_must_be_positive(name):
    err = error(build(moe(**{name: 0})), 2)
    assert err.field == f"model.{name}"


def test_unknown_dispatcher_and_recompute_and_graph_values():
    assert (
        error(build(moe(moe_token_dispatcher_type="ring")), 2).field
        == "model.moe_token_dispatcher_type"
    )
    assert error(build(moe(recompute_granularity="half")), 2).field == "model.recompute_granularity"
    assert error(build(moe(recompute_granularity="full")), 2).field == "model.recompute_method"
    assert (
        error(build(moe(recompute_granularity="full", recompute_method="uniform")), 2).field
        == "model.recompute_num_layers"
    )
    assert error(build(moe(cuda_graph_impl="cudnn")), 2).field == "model.cuda_graph_impl"
    assert (
        error(
            build(moe(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn", "bogus"])), 2
        ).field
        == "model.cuda_graph_scope"
    )
    assert (
        error(build(moe(cuda_graph_impl="local", cuda_graph_scope=["attn"])), 2).field
        == "model.cuda_graph_scope"
    )
    assert (
        error(
            build(moe(cuda_graph_impl="transformer_engine", cuda_graph_scope=["full_iteration"])), 2
        ).field
        == "model.cuda_graph_scope"
    )


def test_topk_must_fit_expert_count():
    assert error(build(moe(moe_router_topk=9)), 2).field == "model.moe_router_topk"


def test_tokenizer_types():
    """HuggingFaceTokenizer needs its file (tests/test_data.py loads one); SentencePiece is not
    built."""
    cfg = build(model())
    cfg.tokenizer.tokenizer_type = "HuggingFaceTokenizer"
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(1)
    assert exc.value.field == "tokenizer.tokenizer_model"
    cfg = build(model())
    cfg.tokenizer.tokenizer_type = "SentencePieceTokenizer"
    with pytest.raises(NotBuiltError) as exc:
        cfg.finalize(1)
    assert "not built" in str(exc.value)


# --- recipes --------------------------------------------------------------------------------------
def test_qwen3_30b_a3b_reference_dimensions():
    m = RECIPES["qwen3_30b_a3b"].build(16).model
    assert m.num_layers == 48
    assert m.hidden_size == 2048
    assert m.num_attention_heads == 32
    assert m.num_query_groups == 4
    assert m.kv_channels == 128
    assert m.ffn_hidden_size == 6144
    assert m.moe_ffn_hidden_size == 768
    assert m.num_moe_experts == 128
    assert m.moe_router_topk == 8
    assert m.vocab_size == 151936
    assert m.seq_length == 4096
    assert m.rotary_base == 1e6
    assert m.layernorm_epsilon == 1e-6
    assert m.qk_layernorm is True
    assert m.add_bias_linear is False and m.add_qkv_bias is False
    assert m.gated_linear_unit is True
    assert m.share_embeddings_and_output_weights is False
    assert m.init_method_std == 0.02
    assert m.moe_router_load_balancing_type == "aux_loss"
    assert m.moe_aux_loss_coeff == 1e-3
    assert m.moe_permute_fusion is True
    assert m.moe_token_dispatcher_type == "alltoall"
    assert m.moe_shared_expert_intermediate_size is None
    assert m.moe_layer_freq == 1


def test_qwen3_30b_a3b_16gpu_layout_and_overlap_off():
    cfg = get_recipe("qwen", "qwen3_30b_a3b").build(16)
    assert cfg.model.tensor_model_parallel_size == 1
    assert cfg.model.pipeline_model_parallel_size == 1
    assert cfg.model.expert_model_parallel_size == 16
    assert cfg.model.sequence_parallel is False
    assert cfg.model.virtual_pipeline_model_parallel_size is None
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (1024, 1)
    assert cfg.mixed_precision == "bf16_mixed"
    # many recipes ship with MoE overlap off: it must be enabled explicitly
    assert cfg.comm_overlap is None
    res = cfg.finalize(16)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is False
    assert (res.layout.dp, res.layout.ep) == (16, 16)


@pytest.mark.parametrize("ng", [1, 2, 8, 16, 32])
def test_recipes_finalize_on_common_world_sizes(ng):
    for recipe in RECIPES.values():
        recipe.build(ng).finalize(ng)


def test_recipe_lookup_errors():
    with pytest.raises(ConfigError) as exc:
        get_recipe("qwen", "no_such_recipe")
    assert exc.value.field == "-mr/--model_recipe_name"
    with pytest.raises(ConfigError) as exc:
        get_recipe("llama", "qwen3_30b_a3b")
    assert exc.value.field == "-m/--model_family_name"


def test_recipe_builds_are_independent():
    a = RECIPES["qwen3_30b_a3b"].build(16)
    a.model.num_layers = 1
    assert RECIPES["qwen3_30b_a3b"].build(16).model.num_layers == 48


# --- sizes must be positive -----------------------------------------------------------------------
@pytest.mark.parametrize("gbs", [0, -8])
def test_global_batch_size_must_be_positive(gbs):
    # 0 and -8 are multiples of micro_batch_size x DP, but no step can be built from them.
    err = error(build(model(), gbs=gbs, mbs=1), 2)
    assert err.field == "train.global_batch_size"


@pytest.mark.parametrize(
    "kw",
    [
        dict(kv_channels=-16),
        dict(ffn_hidden_size=-4),
        dict(num_query_groups=-2),
        dict(moe_ffn_hidden_size=-1, num_moe_experts=8),
        dict(moe_shared_expert_intermediate_size=-5, num_moe_experts=8),
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_negative_model_sizes_are_config_errors(kw):
    name = next(iter(kw))
    err = error(build(model(**kw)), 1)
    assert err.field == f"model.{name}"
