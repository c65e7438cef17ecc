"""The 19 tensor-parallel overlap presets match Megatron-Bridge's table value by value (its
`comm_overlap.py` `userbuffers_*` presets)."""

from __future__ import annotations

import dataclasses

import pytest

import overlap.config.tp_overlap as tpo
from overlap.config.tp_overlap import (
    TP_OVERLAP_PRESETS,
    BulkOverlapCfg,
    PipelineOverlapCfg,
    RingExchangeOverlapCfg,
    TransformerLayerTPOverlapCfg,
    get_tp_overlap_preset,
)
from overlap.errors import ConfigError

# Legend of the reference table: "B4,2" = Bulk(num_sm=4, cga_size=2), set_sm_margin False;
# "P24,2,4" = Pipeline(num_sm=24, cga_size=2, num_splits=4); "R" = RingExchange with defaults;
# flags: "m" = set_sm_margin True, "f8" = fp8_buf True, "agg" = aggregate True, "cga2" = cga_size 2.
# Columns: qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad, proj_fprop, fc2_fprop.
SIX = ("qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad", "proj_fprop", "fc2_fprop")
MIDDLE = ("qkv_fprop", "proj_dgrad", "fc1_fprop", "fc2_dgrad")

TABLE: dict[str, tuple[str | None, ...]] = {
    "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192": (
        "B4,2",
        "B24,2",
        "B2,2",
        "B4,2",
        "P24,2,4 m",
        "P16,2,4 m",
    ),
    "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192": (
        "B4,2",
        "B24,2",
        "B2,2",
        "B4,2",
        "R m",
        "R m",
    ),
    "userbuffers_bf16_b200_h8192_tp2_mbs1_seqlen8192": (
        "B16,2",
        "B24,2",
        "B2,2",
        "B4,2",
        "P32,2,4 m",
        "P16,2,4 m",
    ),
    "userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192": (
        "B4,2",
        "B24,2",
        "B2,2",
        "B4,2",
        "R m",
        "R m",
    ),
    "userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192": (
        "B2,2",
        "B24,2",
        "B2,2",
        "B2,2",
        "P24,2,4 m",
        "P8,2,4 m",
    ),
    "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192": (
        "B2,2",
        "B24,2",
        "B2,2",
        "B2,2",
        "R m",
        "R m",
    ),
    "userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192": (
        "B8,2",
        "B24,2",
        "B2,2",
        "B2,2",
        "P32,2,4 m",
        "P8,2,4 m",
    ),
    "userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192": (
        "B8,2",
        "B32,2",
        "B2,2",
        "B8,2",
        "R m",
        "R m",
    ),
    "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora": (
        "B2,2",
        None,
        "P16,2,4 m f8",
        None,
        "R cga2 m f8",
        "R cga2 m f8",
    ),
    "userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora": (
        "B2,2",
        None,
        "P16,2,4 m f8",
        None,
        "P32,2,4 m f8",
        "P16,2,4 m f8",
    ),
    "userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048": (
        "B8,2",
        "B16,2",
        "B4,2",
        "B16,2",
        "P16,2,4 m",
        "P24,2,4 m",
    ),
    "userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048": (
        "B8,2",
        "B16,2",
        "B4,2",
        "B16,2",
        "P16,2,4 m f8",
        "P24,2,4 m f8",
    ),
    "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048": (
        "B4,2",
        "B4,2",
        "B2,2",
        "B4,2",
        "P24,2,4 m",
        "R m",
    ),
    "userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048": (
        "B4,2",
        "B4,2",
        "B2,2",
        "B4,2",
        "R m",
        "R m",
    ),
    "userbuffers_bf16_b200_h12288_tp4_mbs1_seqlen2048": (
        "B4,2",
        "B16,2",
        "B2,2",
        "B8,2",
        "R m",
        "R m",
    ),
    "userbuffers_fp8_b200_h12288_tp4_mbs1_seqlen2048": (
        "B4,2",
        "B16,2",
        "B2,2",
        "B8,2",
        "R m",
        "R m",
    ),
    "userbuffers_bf16_b200_h6144_tp2_mbs1_seqlen4096": (
        "B8,2",
        "B32,2",
        "B2,2",
        "B8,2",
        "R m",
        "R m",
    ),
    "userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096": (
        "B8,2",
        "B32,2",
        "B2,2",
        "B8,2",
        "R m",
        "P24,2,4 m",
    ),
    "userbuffers_fp8_b200_h18432_tp8_mbs1_seqlen4096": (
        "B8,2",
        "B32,2",
        "B2,2",
        "B8,2",
        "R m",
        "R m",
    ),
}

# The four middle layers: plain "R" everywhere except the two LoRA presets.
MIDDLE_SPECIAL = {
    "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora": "R m",
    "userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora": "R agg",
}


def _expected(spec: str | None) -> object:
    """Build the expected per-GEMM object from a table cell written in the reference's legend."""
    if spec is None:
        return None
    head, *flags = spec.split()
    unknown = set(flags) - {"m", "f8", "agg", "cga2"}
    assert not unknown, f"bad test spec {spec!r}"
    margin, fp8 = "m" in flags, "f8" in flags
    kind, numbers = head[0], [int(n) for n in head[1:].split(",") if n]
    if kind == "B":
        assert not ({"f8", "agg", "cga2"} & set(flags))
        num_sm, cga = numbers
        return BulkOverlapCfg(num_sm=num_sm, cga_size=cga, set_sm_margin=margin)
    if kind == "P":
        num_sm, cga, splits = numbers
        return PipelineOverlapCfg(
            num_sm=num_sm, cga_size=cga, num_splits=splits, set_sm_margin=margin, fp8_buf=fp8
        )
    assert kind == "R" and not numbers
    return RingExchangeOverlapCfg(
        aggregate="agg" in flags,
        set_sm_margin=margin,
        fp8_buf=fp8,
        cga_size=2 if "cga2" in flags else 1,
    )


def test_exactly_19_presets_all_exported():
    assert len(TABLE) == 19
    assert set(TP_OVERLAP_PRESETS) == set(TABLE)
    for name, preset in TP_OVERLAP_PRESETS.items():
        assert getattr(tpo, name) is preset
        assert name in tpo.__all__
        assert isinstance(preset, TransformerLayerTPOverlapCfg)
    module_presets = {n for n in dir(tpo) if n.startswith("userbuffers_")}
    assert module_presets == set(TABLE)
    for name in (
        "TP_OVERLAP_PRESETS",
        "get_tp_overlap_preset",
        "TransformerLayerTPOverlapCfg",
        "TPOverlapCfg",
    ):
        assert name in tpo.__all__


def test_star_import_gives_every_preset():
    namespace: dict[str, object] = {}
    exec("from overlap.config.tp_overlap import *", namespace)
    assert set(TABLE) <= set(namespace)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_row_value_by_value(name):
    preset = get_tp_overlap_preset(name)
    for field, spec in zip(SIX, TABLE[name], strict=True):
        got, want = getattr(preset, field), _expected(spec)
        assert type(got) is type(want), (name, field)
        assert got == want, (name, field, got, want)
    middle_spec = MIDDLE_SPECIAL.get(name, "R")
    for field in MIDDLE:
        got = getattr(preset, field)
        assert type(got) is RingExchangeOverlapCfg, (name, field)
        assert got == _expected(middle_spec), (name, field, got)


def test_lora_middle_layers_explicitly():
    lora70 = tpo.userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora
    lora405 = tpo.userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora
    for field in MIDDLE:
        assert getattr(lora70, field).set_sm_margin is True
        assert getattr(lora70, field).aggregate is False
        assert getattr(lora405, field).aggregate is True
        assert getattr(lora405, field).set_sm_margin is False
    assert lora70.qkv_wgrad is None and lora70.fc1_wgrad is None
    assert lora405.qkv_wgrad is None and lora405.fc1_wgrad is None


def test_per_gemm_objects_are_not_shared():
    seen: set[int] = set()
    for preset in TP_OVERLAP_PRESETS.values():
        for f in dataclasses.fields(preset):
            value = getattr(preset, f.name)
            if value is not None:
                assert id(value) not in seen
                seen.add(id(value))


def test_layer_field_order():
    assert [f.name for f in dataclasses.fields(TransformerLayerTPOverlapCfg)] == [
        "qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad", "qkv_fprop",
        "proj_dgrad", "fc1_fprop", "fc2_dgrad", "proj_fprop", "fc2_fprop",
    ]  # fmt: skip


def test_layer_requires_all_fields():
    with pytest.raises(TypeError):
        TransformerLayerTPOverlapCfg()


def test_per_gemm_field_order_and_defaults():
    # fmt: skip
    assert [f.name for f in dataclasses.fields(PipelineOverlapCfg)] == [
        "num_sm",
        "cga_size",
        "num_splits",
        "set_sm_margin",
        "fp8_buf",
        "atomic_gemm",
        "method",
    ]
    # fmt: skip
    assert [f.name for f in dataclasses.fields(RingExchangeOverlapCfg)] == [
        "aggregate",
        "method",
        "num_sm",
        "cga_size",
        "set_sm_margin",
        "fp8_buf",
        "atomic_gemm",
    ]
    assert [f.name for f in dataclasses.fields(BulkOverlapCfg)] == [
        "num_sm",
        "cga_size",
        "set_sm_margin",
        "method",
    ]
    ring = RingExchangeOverlapCfg()
    fields = (ring.aggregate, ring.num_sm, ring.cga_size, ring.set_sm_margin, ring.fp8_buf)
    assert fields + (ring.atomic_gemm,) == (False, 1, 1, False, False, False)
    with pytest.raises(TypeError):
        PipelineOverlapCfg(num_sm=1, cga_size=1, num_splits=1)  # set_sm_margin is required
    with pytest.raises(TypeError):
        BulkOverlapCfg(num_sm=1, cga_size=1)


def test_pipeline_fp8_buf_default_is_plain_false():
    # Deliberate: the reference's default is the truthy 1-tuple (False,).
    cfg = PipelineOverlapCfg(num_sm=1, cga_size=1, num_splits=1, set_sm_margin=False)
    assert cfg.fp8_buf is False
    assert type(cfg.fp8_buf) is bool
    assert cfg.atomic_gemm is False
    # ...and so no bf16 preset's pipeline GEMM ends up with an FP8 buffer.
    for name, preset in TP_OVERLAP_PRESETS.items():
        for f in dataclasses.fields(preset):
            value = getattr(preset, f.name)
            if isinstance(value, PipelineOverlapCfg):
                assert type(value.fp8_buf) is bool
                if "_bf16_" in name:
                    assert value.fp8_buf is False


def test_method_strings():
    assert (
        PipelineOverlapCfg(num_sm=1, cga_size=1, num_splits=1, set_sm_margin=False).method
        == "pipeline"
    )
    assert RingExchangeOverlapCfg().method == "ring_exchange"
    assert BulkOverlapCfg(num_sm=1, cga_size=1, set_sm_margin=False).method == "bulk"
    methods = {
        getattr(p, f.name).method
        for p in TP_OVERLAP_PRESETS.values()
        for f in dataclasses.fields(p)
        if getattr(p, f.name) is not None
    }
    assert methods == {"pipeline", "ring_exchange", "bulk"}


def test_to_dict_nested_form():
    d = tpo.userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192.to_dict()
    assert list(d) == [f.name for f in dataclasses.fields(TransformerLayerTPOverlapCfg)]
    assert d["qkv_dgrad"] == {"num_sm": 4, "cga_size": 2, "set_sm_margin": False, "method": "bulk"}
    assert d["proj_fprop"] == {
        "num_sm": 24, "cga_size": 2, "num_splits": 4, "set_sm_margin": True,
        "fp8_buf": False, "atomic_gemm": False, "method": "pipeline",
    }  # fmt: skip
    assert d["qkv_fprop"] == {
        "aggregate": False, "method": "ring_exchange", "num_sm": 1, "cga_size": 1,
        "set_sm_margin": False, "fp8_buf": False, "atomic_gemm": False,
    }  # fmt: skip
    assert all(type(v) is dict for v in d.values())


def test_to_dict_drops_top_level_none_only():
    for name in MIDDLE_SPECIAL:
        d = TP_OVERLAP_PRESETS[name].to_dict()
        assert "qkv_wgrad" not in d and "fc1_wgrad" not in d
        assert len(d) == 8
        assert d["fc1_dgrad"]["fp8_buf"] is True
        assert all(type(v) is dict for v in d.values())
    # Nested values are kept as they are, including falsy ones.
    d = tpo.userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora.to_dict()
    assert d["qkv_fprop"]["aggregate"] is True and d["qkv_fprop"]["set_sm_margin"] is False
    # A nested value that is None stays; only whole-GEMM Nones go.
    layer = TransformerLayerTPOverlapCfg(
        *([None] * 9), BulkOverlapCfg(num_sm=None, cga_size=2, set_sm_margin=False)
    )
    assert layer.to_dict() == {
        "fc2_fprop": {"num_sm": None, "cga_size": 2, "set_sm_margin": False, "method": "bulk"}
    }


def test_to_dict_does_not_alias_the_preset():
    preset = tpo.userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192
    d = preset.to_dict()
    d["qkv_dgrad"]["num_sm"] = 999
    assert preset.qkv_dgrad.num_sm == 4


def test_unknown_preset_raises_config_error():
    with pytest.raises(ConfigError) as info:
        get_tp_overlap_preset("userbuffers_bf16_h100_h2048_tp1_mbs1_seqlen4096")
    err = info.value
    assert err.field == "comm_overlap.tp_comm_overlap_cfg"
    assert err.value == "userbuffers_bf16_h100_h2048_tp1_mbs1_seqlen4096"
    assert "unknown" in err.why
    assert err.fix.startswith("use one of: ")
    assert err.fix == "use one of: " + ", ".join(sorted(TABLE))
    assert "comm_overlap.tp_comm_overlap_cfg" in str(err)
    assert isinstance(err, ValueError)


def test_get_returns_the_registered_object():
    for name in TABLE:
        assert get_tp_overlap_preset(name) is TP_OVERLAP_PRESETS[name]
