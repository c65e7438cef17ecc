"""`section.field=value` overrides: parsing, type checks, did-you-mean, special sections, and clear
errors."""

from __future__ import annotations

import pytest

from overlap.config import CommOverlapConfig, ConfigContainer, MixedPrecisionConfig, ModelConfig
from overlap.config.overrides import apply_override, apply_overrides, parse_value
from overlap.errors import ConfigError


@pytest.fixture
def cfg() -> ConfigContainer:
    return ConfigContainer()


def error_of(cfg: ConfigContainer, item: str) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        apply_override(cfg, item)
    return exc.value


# --- unknown keys ---------------------------------------------------------------------------------
def test_unknown_section_suggests_the_closest(cfg):
    err = error_of(cfg, "modle.num_layers=4")
    assert err.field == "modle.num_layers"
    assert "unknown configuration key" in err.why
    assert "did you mean model" in err.fix


def test_unknown_key_suggests_the_closest(cfg):
    err = error_of(cfg, "model.num_layer=4")
    assert err.field == "model.num_layer"
    assert "did you mean" in err.fix and "num_layers" in err.fix


def test_unknown_key_without_close_match_lists_valid_names(cfg):
    err = error_of(cfg, "ddp.zzzzzzzz=1")
    assert "valid names:" in err.fix
    assert "overlap_grad_reduce" in err.fix


def test_unknown_key_in_comm_overlap_section(cfg):
    err = error_of(cfg, "comm_overlap.overlap_moe_expert_parallel=true")
    assert "overlap_moe_expert_parallel_comm" in err.fix


def test_private_snapshot_is_not_a_section(cfg):
    err = error_of(cfg, "_requested.model=1")
    assert "unknown configuration key" in err.why


def test_too_deep_key_is_rejected(cfg):
    err = error_of(cfg, "model.a.b=1")
    assert "section.field=value" in err.fix


# --- types ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "item,expected_type",
    [
        ("model.num_layers=abc", "int"),
        ("model.num_layers=4.5", "int"),
        ("model.num_layers=true", "int"),
        ("model.bf16=3", "bool"),
        ("model.bf16=yes_please", "bool"),
        ("train.global_batch_size=null", "int"),
        ("model.recompute_modules=5", "list"),
        ("optimizer.lr=fast", "float"),
    ],
)
def test_wrong_type_is_config_error(cfg, item, expected_type):
    before = ModelConfig()
    err = error_of(cfg, item)
    assert err.field == item.split("=")[0]
    assert "expected" in err.why
    assert expected_type in err.why
    assert cfg.model == before  # nothing was applied


def test_int_value(cfg):
    assert apply_override(cfg, "model.num_layers=4") == ("model.num_layers", 4)
    assert cfg.model.num_layers == 4


def test_bool_values(cfg):
    apply_override(cfg, "model.qk_layernorm=true")
    assert cfg.model.qk_layernorm is True
    apply_override(cfg, "model.qk_layernorm=False")
    assert cfg.model.qk_layernorm is False


def test_int_becomes_float_for_float_fields(cfg):
    apply_override(cfg, "optimizer.lr=1")
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    apply_override(cfg, "optimizer.lr=3e-4")
    assert cfg.optimizer.lr == pytest.approx(3e-4)


def test_string_value(cfg):
    apply_override(cfg, "model.moe_token_dispatcher_type=flex")
    assert cfg.model.moe_token_dispatcher_type == "flex"


# --- lists and null -------------------------------------------------------------------------------
def test_list_parsing(cfg):
    assert apply_override(cfg, "model.recompute_modules=[core_attn,mlp]") == (
        "model.recompute_modules",
        ["core_attn", "mlp"],
    )
    assert cfg.model.recompute_modules == ["core_attn", "mlp"]


def test_comma_list_without_brackets(cfg):
    apply_override(cfg, "model.cuda_graph_scope=attn,moe_router")
    assert cfg.model.cuda_graph_scope == ["attn", "moe_router"]


def test_single_item_list(cfg):
    apply_override(cfg, "model.recompute_modules=mlp")
    assert cfg.model.recompute_modules == ["mlp"]


def test_null_for_optional_fields(cfg):
    apply_override(cfg, "model.num_moe_experts=8")
    apply_override(cfg, "model.num_moe_experts=null")
    assert cfg.model.num_moe_experts is None
    apply_override(cfg, "model.virtual_pipeline_model_parallel_size=null")
    assert cfg.model.virtual_pipeline_model_parallel_size is None


def test_optional_int_accepts_int(cfg):
    apply_override(cfg, "model.virtual_pipeline_model_parallel_size=2")
    assert cfg.model.virtual_pipeline_model_parallel_size == 2


# --- special sections -----------------------------------------------------------------------------
def test_env_vars_value_is_text(cfg):
    assert apply_override(cfg, "env_vars.X=1") == ("env_vars.X", "1")
    assert cfg.env_vars == {"X": "1"}
    apply_override(cfg, "env_vars.CUDA_DEVICE_MAX_CONNECTIONS=32")
    assert cfg.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


def test_env_vars_needs_exactly_one_name(cfg):
    err = error_of(cfg, "env_vars.A.B=1")
    assert "env_vars.NAME=value" in err.fix
    error_of(cfg, "env_vars=1")


def test_mixed_precision_preset_by_name(cfg):
    assert apply_override(cfg, "mixed_precision=bf16_mixed") == ("mixed_precision", "bf16_mixed")
    assert isinstance(cfg.mixed_precision, MixedPrecisionConfig)
    assert cfg.mixed_precision.bf16 is True
    assert cfg.mixed_precision.params_dtype == "bfloat16"


def test_mixed_precision_null_and_unknown(cfg):
    apply_override(cfg, "mixed_precision=bf16_mixed")
    apply_override(cfg, "mixed_precision=null")
    assert cfg.mixed_precision is None
    err = error_of(cfg, "mixed_precision=bf17")
    assert err.field == "mixed_precision"
    error_of(cfg, "mixed_precision=3")


def test_mixed_precision_field_on_a_named_preset():
    cfg = ConfigContainer(mixed_precision="bf16_mixed")
    apply_override(cfg, "mixed_precision.grad_reduce_in_fp32=false")
    assert isinstance(cfg.mixed_precision, MixedPrecisionConfig)
    assert cfg.mixed_precision.bf16 is True
    assert cfg.mixed_precision.grad_reduce_in_fp32 is False
    assert cfg.finalize(1).precision.grad_reduce_in_fp32 is False


def test_mixed_precision_field_without_a_preset(cfg):
    apply_override(cfg, "mixed_precision.fp8_param_gather=true")
    assert cfg.mixed_precision == MixedPrecisionConfig(fp8_param_gather=True)


def test_comm_overlap_override_creates_the_object(cfg):
    assert cfg.comm_overlap is None
    apply_override(cfg, "comm_overlap.overlap_moe_expert_parallel_comm=true")
    assert isinstance(cfg.comm_overlap, CommOverlapConfig)
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm is True
    # created on the user's behalf: TP overlap not requested
    assert cfg.comm_overlap.tp_comm_overlap is None
    assert cfg.comm_overlap.delay_wgrad_compute is None


def test_comm_overlap_override_keeps_existing_object():
    cfg = ConfigContainer(comm_overlap=CommOverlapConfig(tp_comm_overlap=True, bucket_size=10))
    apply_override(cfg, "comm_overlap.delay_wgrad_compute=false")
    assert cfg.comm_overlap.tp_comm_overlap is True
    assert cfg.comm_overlap.bucket_size == 10
    assert cfg.comm_overlap.delay_wgrad_compute is False


def test_comm_overlap_created_by_override_resolves_tp_as_not_requested(cfg):
    apply_override(cfg, "comm_overlap.overlap_p2p_comm=false")
    d = cfg.finalize(1).decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.decided_by) == (None, False, "default")


def test_tp_preset_by_name(cfg):
    apply_override(
        cfg, "comm_overlap.tp_comm_overlap_cfg=userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048"
    )
    assert (
        cfg.comm_overlap.tp_comm_overlap_cfg == "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048"
    )


# --- syntax ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "item",
    ["+model.num_layers=3", "++model.num_layers=3", "~model.num_layers", "~model.num_layers=3"],
)
def test_hydra_prefixes_rejected(cfg, item):
    err = error_of(cfg, item)
    assert err.field == "override"
    assert "prefixes are not supported" in err.why


def test_missing_equals_rejected(cfg):
    err = error_of(cfg, "model.num_layers")
    assert "section.field=value" in err.why


def test_value_may_contain_equals(cfg):
    apply_override(cfg, "env_vars.NCCL_DEBUG_SUBSYS=a=b")
    assert cfg.env_vars["NCCL_DEBUG_SUBSYS"] == "a=b"


def test_unresolvable_interpolation_is_config_error(cfg):
    err = error_of(cfg, "model.num_layers=${nope}")
    assert "cannot be parsed" in err.why


@pytest.mark.parametrize("raw", ["[1,2", "{a", "]", "'abc", "*a", "%x", "@x"])
def test_malformed_value_is_config_error(cfg, raw):
    # A value that is not valid YAML must be reported as a ConfigError naming the key, like every
    # other mistake, so that the command line exits with status 2 and no traceback.
    err = error_of(cfg, f"model.num_layers={raw}")
    assert err.field == "model.num_layers"


@pytest.mark.parametrize(
    "raw,value",
    [
        ("3", 3),
        ("0.5", 0.5),
        ("true", True),
        ("null", None),
        ("name", "name"),
        ("[a,b]", ["a", "b"]),
        ("'quoted'", "quoted"),
    ],
)
def test_parse_value(raw, value):
    assert parse_value("k", raw) == value


def test_apply_overrides_returns_what_was_set_in_order(cfg):
    out = apply_overrides(
        cfg,
        [
            "model.num_layers=4",
            "comm_overlap.overlap_moe_expert_parallel_comm=true",
            "model.num_layers=6",
            "env_vars.A=x",
        ],
    )
    assert out == {
        "model.num_layers": 6,
        "comm_overlap.overlap_moe_expert_parallel_comm": True,
        "env_vars.A": "x",
    }
    assert cfg.model.num_layers == 6


def test_apply_overrides_stops_at_first_error(cfg):
    with pytest.raises(ConfigError):
        apply_overrides(cfg, ["model.num_layers=4", "model.bf16=3", "model.hidden_size=64"])
    assert cfg.model.num_layers == 4
    assert cfg.model.hidden_size == ModelConfig().hidden_size


def test_override_then_finalize_validates():
    cfg = ConfigContainer()
    apply_overrides(
        cfg, ["model.recompute_modules=[core_attn,bogus]", "model.recompute_granularity=selective"]
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(1)
    assert exc.value.field == "model.recompute_modules"


def test_every_listed_key_has_a_description():
    """`overlap explain --list-keys` prints each key's description (its field's comment)."""
    from overlap.config.overrides import list_override_keys, override_key_rows

    rows = override_key_rows()
    assert [key for key, _, _, doc in rows if not doc.strip()] == []
    lines = list_override_keys()
    assert len(lines) == len(rows)
    for line, (key, _, _, doc) in zip(lines, rows):
        assert line.startswith(key) and line.endswith(doc), line
    assert dict((r[0], r[3]) for r in rows)["train.train_iters"] == "optimizer steps to run (-ms)"


def test_field_docs_read_the_inline_comment_or_the_block_above():
    """Also the comment inside an assignment the formatter wrapped over several lines."""
    from dataclasses import dataclass

    from overlap.config.field_docs import field_docs

    @dataclass
    class Example:
        # --- a heading, not a description ---
        plain: int = 1
        inline: int = 2  # said inline
        # said above,
        # over two lines
        above: int = 3
        # said inside the wrap, a comment long enough that the line would not fit in 100
        wrapped: int = 4

    assert field_docs(Example) == {
        "inline": "said inline",
        "above": "said above, over two lines",
        "wrapped": "said inside the wrap, a comment long enough that the line would not fit in 100",
    }


def test_the_refusal_table_is_what_the_overrides_and_checks_refuse():
    """Every compatibility-only knob is refused by name from one table, and listed by
    --list-keys."""
    from overlap.config.overrides import list_override_keys
    from overlap.config.refusals import MOVED, NOT_CARRIED, UNBUILT_VALUES
    from overlap.errors import NotBuiltError

    listed = {line.split()[0] for line in list_override_keys()}
    for key in [*MOVED, *NOT_CARRIED]:
        assert key in listed
        with pytest.raises(ConfigError) as exc:
            apply_overrides(ConfigContainer(), [f"{key}=1"])
        assert exc.value.field == key
    for key, values in UNBUILT_VALUES.items():
        for value in values:
            assert f"{key}={value}" in listed
            section, name = key.split(".")
            cfg = ConfigContainer()
            if key == "model.recompute_modules":
                value, cfg.model.recompute_granularity = [value], "selective"
            setattr(getattr(cfg, section), name, value)
            with pytest.raises(NotBuiltError) as exc:
                cfg.finalize(1, require_libraries=False)
            assert exc.value.field == key
