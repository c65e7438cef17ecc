"""The overlap rules of ConfigContainer.finalize, one test per rule and per decided quirk.

Covers Megatron-Bridge's suite `tests/unit_tests/training/test_comm_overlap.py` (TP gate, PP
selection, DP defaults, EP-overlap asserts, delay-wgrad asserts, preset -> dict conversion) plus the
places where we deliberately differ from it (precedence, logged decisions, distributed-optimizer
sync, honouring an explicit overlap_grad_reduce).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from overlap.config import (
    BulkOverlapCfg,
    CommOverlapConfig,
    DDPConfig,
    ModelConfig,
    OptimizerConfig,
    PipelineOverlapCfg,
    RingExchangeOverlapCfg,
    SchedulerConfig,
    TrainConfig,
    TransformerLayerTPOverlapCfg,
)
from overlap.config.comm_overlap import BRIDGE_DP_BUCKET_SIZE
from overlap.config.mixed_precision import (
    MIXED_PRECISION_PRESETS,
    MixedPrecisionConfig,
    Precision,
    get_mixed_precision_config,
)
from overlap.config.tp_overlap import get_tp_overlap_preset
from overlap.errors import ConfigError
from tests.configs import container as build
from tests.configs import dense_model as dense
from tests.configs import moe_model as moe

TP_SIZE_MSG = "Disabling tensor parallel communication overlap due to TP size < 2."
TP_NO_SP_MSG = "Disabling tensor parallel communication overlap due to sequence_parallel=False."
TP_NO_PRESET_MSG = (
    "Tensor parallel overlap: No overlap config provided. Initializing TP comm overlap with the "
    "default config."
)
H12288 = "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048"
LORA_70B = "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora"


# --- helpers --------------------------------------------------------------------------------------
def ep_on(**kw) -> CommOverlapConfig:
    return CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, **kw)


def dist_opt() -> DDPConfig:
    return DDPConfig(use_distributed_optimizer=True)


def dist_optimizer() -> OptimizerConfig:
    return OptimizerConfig(use_distributed_optimizer=True)


# --- CommOverlapConfig surface --------------------------------------------------------------------
def test_comm_overlap_config_requires_tp_comm_overlap_keyword():
    with pytest.raises(TypeError):
        CommOverlapConfig()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        CommOverlapConfig(True)  # type: ignore[misc]  (kw_only)


def test_comm_overlap_config_defaults_are_auto():
    c = CommOverlapConfig(tp_comm_overlap=False)
    assert c.tp_comm_bootstrap_backend == "nccl"
    assert c.strict is False
    auto = [
        f.name
        for f in dataclasses.fields(c)
        if f.name not in ("tp_comm_overlap", "tp_comm_bootstrap_backend", "strict")
    ]
    assert len(auto) == 14  # Bridge's 13 and ours, p2p_warmup_depth
    assert all(getattr(c, name) is None for name in auto)


def test_data_parallel_size_is_the_layouts_and_a_typed_value_must_agree():
    """Bridge's container writes comm_overlap.data_parallel_size; ours leaves the input as typed
    (the layout holds DP) and refuses a typed value that disagrees instead of ignoring it."""
    cfg = build(co=CommOverlapConfig(tp_comm_overlap=False))
    assert cfg.finalize(4).layout.dp == 4
    assert cfg.comm_overlap.data_parallel_size is None
    build(co=CommOverlapConfig(tp_comm_overlap=False, data_parallel_size=4)).finalize(4)
    bad = build(co=CommOverlapConfig(tp_comm_overlap=False, data_parallel_size=2))
    with pytest.raises(ConfigError, match=r"comm_overlap.data_parallel_size=2: .*DP = 4"):
        bad.finalize(4)


def test_finalize_without_comm_overlap_still_records_every_decision():
    res = build(co=None).finalize(1)
    fields = [d.field for d in res.decisions.decisions]
    for name in (
        "model.tp_comm_overlap",
        "model.overlap_p2p_comm",
        "model.batch_p2p_comm",
        "model.overlap_moe_expert_parallel_comm",
        "model.delay_wgrad_compute",
        "ddp.overlap_grad_reduce",
        "ddp.overlap_param_gather",
        "ddp.align_param_gather",
        "ddp.bucket_size",
    ):
        assert name in fields


# --- TP gate --------------------------------------------------------------------------------------
def _asked(res) -> dict[str, str | None]:
    """What the per-GEMM plan asked of each TP slot, as the decision table records it (None: the
    slot is not in the plan, Transformer Engine's default applies)."""
    prefix = "model.tp_comm_overlap_cfg."
    return {
        d.field.removeprefix(prefix): d.requested
        for d in res.decisions.decisions
        if d.field.startswith(prefix) and d.field != prefix + "gpu_kernel_knobs"
    }


def test_tp_overlap_not_requested_is_off_by_default():
    cfg = build()
    res = cfg.finalize(1)
    d = res.decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.decided_by) == (None, False, "default")
    assert cfg.resolved.overlap.tp_comm_overlap is False
    assert cfg.resolved.overlap.tp_slots == ()
    assert cfg.resolved.overlap.tp_comm_bootstrap_backend is None


def test_tp_overlap_disabled_when_tp_size_below_2(caplog):
    cfg = build(co=CommOverlapConfig(tp_comm_overlap=True))
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(1)
    d = res.decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.decided_by) == (True, False, "rule")
    assert d.reason == TP_SIZE_MSG
    assert cfg.resolved.overlap.tp_comm_overlap is False
    assert any(TP_SIZE_MSG in r.getMessage() for r in caplog.records)


def test_tp_overlap_disabled_without_sequence_parallel(caplog):
    cfg = build(dense(tensor_model_parallel_size=2), co=CommOverlapConfig(tp_comm_overlap=True))
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(2)
    d = res.decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.reason) == (True, False, TP_NO_SP_MSG)
    assert any(TP_NO_SP_MSG in r.getMessage() for r in caplog.records)


def test_tp_gate_checks_run_in_reference_order():
    # TP size is checked before sequence parallel (the reference then checks for Transformer Engine;
    # our runtime's overlap needs no extra backend).
    res = build(dense(), co=CommOverlapConfig(tp_comm_overlap=True)).finalize(1)
    assert res.decisions.get("model.tp_comm_overlap").reason == TP_SIZE_MSG
    res = build(
        dense(tensor_model_parallel_size=2), co=CommOverlapConfig(tp_comm_overlap=True)
    ).finalize(2)
    assert res.decisions.get("model.tp_comm_overlap").reason == TP_NO_SP_MSG


def test_tp_overlap_enabled_with_preset_name():
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=H12288),
    )
    res = cfg.finalize(2)
    d = res.decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.decided_by) == (True, True, "user")
    assert cfg.resolved.overlap.tp_comm_overlap is True
    asked = _asked(res)
    assert asked["qkv_dgrad"] == "bulk" and asked["proj_fprop"].startswith("pipeline")
    assert None not in asked.values()  # every slot is in this preset
    knobs = res.decisions.get("model.tp_comm_overlap_cfg.gpu_kernel_knobs").effective
    assert "num_sm" in knobs and "cga_size" in knobs
    assert cfg.resolved.overlap.tp_comm_bootstrap_backend == "nccl"
    assert cfg.model.tp_comm_overlap_cfg is None  # the request was comm_overlap's
    plan = res.decisions.get("model.tp_comm_overlap_cfg")
    assert (plan.requested, plan.effective, plan.decided_by) == (H12288, H12288, "user")


def test_tp_overlap_enabled_with_preset_object_converts_to_dict():
    preset = get_tp_overlap_preset(H12288)
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=preset),
    )
    by_object = _asked(cfg.finalize(2))
    by_name = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=H12288),
    ).finalize(2)
    assert by_object == _asked(by_name)
    assert set(by_object) == {f.name for f in dataclasses.fields(TransformerLayerTPOverlapCfg)}
    # The shared module-level preset is not mutated by the conversion.
    assert isinstance(get_tp_overlap_preset(H12288).qkv_dgrad, BulkOverlapCfg)


def test_tp_overlap_dict_drops_top_level_none_only():
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=LORA_70B),
    )
    res = cfg.finalize(2)
    asked = _asked(res)
    assert {s for s, v in asked.items() if v is None} == {"qkv_wgrad", "fc1_wgrad"}
    assert len([v for v in asked.values() if v is not None]) == 8
    assert "fp8_buf" in res.decisions.get("model.tp_comm_overlap_cfg.gpu_kernel_knobs").effective


def test_tp_overlap_arbitrary_preset_filters_none():
    custom = TransformerLayerTPOverlapCfg(
        qkv_dgrad=BulkOverlapCfg(num_sm=2, cga_size=2, set_sm_margin=False),
        qkv_wgrad=None,
        fc1_dgrad=None,
        fc1_wgrad=None,
        qkv_fprop=RingExchangeOverlapCfg(),
        proj_dgrad=None,
        fc1_fprop=None,
        fc2_dgrad=None,
        proj_fprop=PipelineOverlapCfg(num_sm=8, cga_size=2, num_splits=4, set_sm_margin=True),
        fc2_fprop=None,
    )
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=custom),
    )
    asked = _asked(cfg.finalize(2))
    assert {s for s, v in asked.items() if v is not None} == {
        "qkv_dgrad",
        "qkv_fprop",
        "proj_fprop",
    }
    assert asked["proj_fprop"] == "pipeline x4"


def test_tp_overlap_without_preset_uses_default_config():
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True),
    )
    res = cfg.finalize(2)
    plan = res.decisions.get("model.tp_comm_overlap_cfg")
    assert plan.reason == TP_NO_PRESET_MSG
    assert plan.effective is None
    assert cfg.resolved.overlap.tp_comm_overlap is True
    assert set(_asked(res).values()) == {None} and cfg.resolved.overlap.tp_slots
    assert cfg.resolved.overlap.tp_comm_bootstrap_backend == "nccl"


def test_tp_bootstrap_backend_user_value_is_kept():
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_bootstrap_backend="mpi"),
    )
    cfg.finalize(2)
    assert cfg.resolved.overlap.tp_comm_bootstrap_backend == "mpi"


def test_tp_overlap_unknown_preset_name_is_config_error():
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg="userbuffers_nope"),
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "comm_overlap.tp_comm_overlap_cfg"


def test_tp_overlap_plan_of_wrong_type_is_config_error():
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg={"qkv_dgrad": {}}),
    )  # type: ignore
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "comm_overlap.tp_comm_overlap_cfg"


def test_tp_overlap_off_clears_plan_and_backend():
    cfg = build(dense(), co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=H12288))
    cfg.finalize(1)
    assert cfg.resolved.overlap.tp_comm_overlap is False
    assert cfg.resolved.overlap.tp_slots == ()
    assert cfg.resolved.overlap.tp_comm_bootstrap_backend is None


def test_finalize_keeps_user_request_and_preset_in_snapshot():
    # Reference test_finalize: the wrapper and the snapshot keep tp_comm_overlap True and the preset
    # object. Quirk decided differently from the reference: the TP downgrade is NOT written back
    # into the user's object.
    preset = get_tp_overlap_preset(H12288)
    cfg = build(dense(), co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=preset))
    cfg.finalize(1)
    assert cfg.comm_overlap.tp_comm_overlap is True
    assert cfg._requested.comm_overlap.tp_comm_overlap is True
    assert isinstance(cfg._requested.comm_overlap.tp_comm_overlap_cfg, TransformerLayerTPOverlapCfg)
    assert cfg.resolved.overlap.tp_comm_overlap is False


# --- PP selection ---------------------------------------------------------------------------------
def _p2p(cfg) -> tuple[bool, bool]:
    """The resolved (overlap_p2p_comm, batch_p2p_comm)."""
    return cfg.resolved.overlap.overlap_p2p_comm, cfg.resolved.overlap.batch_p2p_comm


def test_pp1_turns_both_p2p_flags_off():
    cfg = build()
    res = cfg.finalize(1)
    assert _p2p(cfg) == (False, False)
    assert res.decisions.get("model.overlap_p2p_comm").decided_by == "rule"


def test_pp_with_vpp_overlaps_p2p_unbatched():
    cfg = build(dense(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2))
    res = cfg.finalize(4)
    assert _p2p(cfg) == (True, False)
    assert res.decisions.get("model.overlap_p2p_comm").decided_by == "rule"
    assert res.decisions.get("model.batch_p2p_comm").decided_by == "rule"


def test_pp_without_vpp_batches_p2p():
    cfg = build(dense(pipeline_model_parallel_size=4))
    cfg.finalize(4)
    assert _p2p(cfg) == (False, True)


def test_pp_vpp_one_counts_as_no_virtual_pipeline():
    cfg = build(dense(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=1))
    cfg.finalize(2)
    assert _p2p(cfg) == (False, True)


def test_pp_user_override_wins():
    cfg = build(
        dense(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
        co=CommOverlapConfig(tp_comm_overlap=False, overlap_p2p_comm=False, batch_p2p_comm=False),
    )
    res = cfg.finalize(8)
    assert _p2p(cfg) == (False, False)
    assert res.decisions.get("model.overlap_p2p_comm").decided_by == "user"
    assert res.decisions.get("model.batch_p2p_comm").decided_by == "user"


def test_pp_user_none_keeps_rule_value():
    # Reference test_override_user_cfgs: None user values keep the default (batch_p2p stays True).
    cfg = build(
        dense(pipeline_model_parallel_size=2),
        co=CommOverlapConfig(tp_comm_overlap=False, overlap_p2p_comm=False),
    )
    res = cfg.finalize(2)
    assert cfg.resolved.overlap.batch_p2p_comm is True
    assert res.decisions.get("model.batch_p2p_comm").decided_by == "rule"


def test_the_deeper_warm_up_is_decided_with_its_cost_and_refused_where_it_cannot_act():
    """comm_overlap.p2p_warmup_depth (ours): 1 unless asked; asked under overlapped plain 1F1B, the
    row says what it buys and costs; with batched p2p or a virtual pipeline it is a no-op row (an
    error under strict), and a value below 1 is an error naming the field."""
    overlapped = dict(tp_comm_overlap=False, overlap_p2p_comm=True, batch_p2p_comm=False)
    cfg = build(dense(pipeline_model_parallel_size=4))
    res = cfg.finalize(4)
    assert res.overlap.p2p_warmup_depth == 1
    assert res.decisions.get("comm_overlap.p2p_warmup_depth").decided_by == "rule"
    cfg = build(
        dense(pipeline_model_parallel_size=4),
        co=CommOverlapConfig(**overlapped, p2p_warmup_depth=2),
    )
    res = cfg.finalize(4)
    assert res.overlap.p2p_warmup_depth == 2
    row = res.decisions.get("comm_overlap.p2p_warmup_depth")
    assert row.decided_by == "user" and "2 x (PP - rank - 1) warm-up forwards" in row.reason
    assert "more micro-batches' activations" in row.reason
    assert not res.decisions.noops
    for model, co in (
        (dense(pipeline_model_parallel_size=4), dict(tp_comm_overlap=False)),
        (dense(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), overlapped),
        (dense(), overlapped),
    ):
        res = build(model, co=CommOverlapConfig(**co, p2p_warmup_depth=2)).finalize(
            model.pipeline_model_parallel_size
        )
        assert res.overlap.p2p_warmup_depth == 1
        assert "comm_overlap.p2p_warmup_depth" in {n.field for n in res.decisions.noops}
        strict = build(model, co=CommOverlapConfig(**co, p2p_warmup_depth=2, strict=True))
        with pytest.raises(ConfigError) as exc:
            strict.finalize(model.pipeline_model_parallel_size)
        assert exc.value.field == "comm_overlap.p2p_warmup_depth"
    with pytest.raises(ConfigError) as exc:
        build(
            dense(pipeline_model_parallel_size=4),
            co=CommOverlapConfig(**overlapped, p2p_warmup_depth=0),
        ).finalize(4)
    assert exc.value.field == "comm_overlap.p2p_warmup_depth" and exc.value.value == 0


def test_pp_both_p2p_flags_true_is_error():
    cfg = build(
        dense(pipeline_model_parallel_size=2),
        co=CommOverlapConfig(tp_comm_overlap=False, overlap_p2p_comm=True, batch_p2p_comm=True),
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "comm_overlap.batch_p2p_comm"


def test_the_p2p_conflict_names_the_spelling_the_user_typed():
    """Bridge's direct spelling on the model is an alias of comm_overlap's: the error names the
    one the user wrote."""
    cfg = build(
        dense(pipeline_model_parallel_size=2, batch_p2p_comm=True),
        co=CommOverlapConfig(tp_comm_overlap=False, overlap_p2p_comm=True),
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "model.batch_p2p_comm"


def test_pp_user_batch_on_with_rule_overlap_on_is_error():
    cfg = build(
        dense(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        co=CommOverlapConfig(tp_comm_overlap=False, batch_p2p_comm=True),
    )
    with pytest.raises(ConfigError):
        cfg.finalize(2)


def test_embedding_wgrad_defaults():
    cfg = build()
    cfg.finalize(1)
    assert cfg.resolved.overlap.defer_embedding_wgrad_compute is False
    assert cfg.resolved.overlap.wgrad_deferral_limit == -1


def test_embedding_wgrad_user_values():
    cfg = build(
        co=CommOverlapConfig(
            tp_comm_overlap=False, defer_embedding_wgrad_compute=True, wgrad_deferral_limit=3
        )
    )
    cfg.finalize(1)
    assert cfg.resolved.overlap.defer_embedding_wgrad_compute is True
    assert cfg.resolved.overlap.wgrad_deferral_limit == 3


@pytest.mark.parametrize("where", ["comm_overlap", "model"])
def test_a_negative_wgrad_deferral_limit_other_than_minus_one_is_refused_in_either_spelling(where):
    """The rule judges the resolved limit, whichever spelling set it; the error names the model
    field (Megatron-Core's home of the limit)."""
    if where == "comm_overlap":
        cfg = build(co=CommOverlapConfig(tp_comm_overlap=False, wgrad_deferral_limit=-5))
    else:
        cfg = build(model=dense(wgrad_deferral_limit=-5))
    with pytest.raises(ConfigError) as err:
        cfg.finalize(1)
    assert err.value.field == "model.wgrad_deferral_limit" and err.value.value == -5


# --- DP defaults ----------------------------------------------------------------------------------
def test_dp_defaults_with_distributed_optimizer():
    cfg = build(ddp=dist_opt(), optimizer=dist_optimizer())
    res = cfg.finalize(4)
    assert (
        cfg.resolved.overlap.bucket_size == 134217728 == BRIDGE_DP_BUCKET_SIZE == 128 * 1024 * 1024
    )
    assert cfg.resolved.overlap.overlap_grad_reduce is True
    assert cfg.resolved.overlap.overlap_param_gather is True
    assert cfg.resolved.overlap.align_param_gather is False
    assert cfg.resolved.overlap.overlap_param_gather_with_optimizer_step is False
    for name in ("ddp.bucket_size", "ddp.overlap_grad_reduce", "ddp.overlap_param_gather"):
        assert res.decisions.get(name).decided_by == "rule"


def test_dp_one_with_distributed_optimizer_has_no_overlap():
    cfg = build(ddp=dist_opt(), optimizer=dist_optimizer())
    cfg.finalize(1)
    assert cfg.resolved.overlap.bucket_size is None
    assert cfg.resolved.overlap.overlap_grad_reduce is False
    assert cfg.resolved.overlap.overlap_param_gather is False
    assert cfg.resolved.overlap.align_param_gather is False


def test_dp_align_param_gather_with_pp_and_vpp():
    cfg = build(
        dense(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
    )
    res = cfg.finalize(16)
    assert res.layout.dp == 4
    assert cfg.resolved.overlap.align_param_gather is True
    assert cfg.resolved.overlap.bucket_size == BRIDGE_DP_BUCKET_SIZE


def test_dp_no_align_with_pp_but_no_vpp():
    cfg = build(dense(pipeline_model_parallel_size=4), ddp=dist_opt(), optimizer=dist_optimizer())
    cfg.finalize(16)
    assert cfg.resolved.overlap.align_param_gather is False


def test_dp_defaults_do_not_apply_without_distributed_optimizer():
    cfg = build()
    res = cfg.finalize(4)
    assert cfg.resolved.overlap.overlap_grad_reduce is False
    assert cfg.resolved.overlap.overlap_param_gather is False
    assert cfg.resolved.overlap.bucket_size is None
    assert "distributed optimizer" in res.decisions.get("ddp.overlap_grad_reduce").reason


@pytest.mark.parametrize("where", ["comm_overlap", "ddp"])
def test_explicit_overlap_grad_reduce_honoured_without_distributed_optimizer(where):
    co = (
        CommOverlapConfig(tp_comm_overlap=False, overlap_grad_reduce=True)
        if where == "comm_overlap"
        else None
    )
    ddp = DDPConfig(overlap_grad_reduce=True) if where == "ddp" else DDPConfig()
    cfg = build(co=co, ddp=ddp)
    res = cfg.finalize(4)
    d = res.decisions.get("ddp.overlap_grad_reduce")
    assert (d.requested, d.effective) == (True, True)
    assert d.decided_by == ("user" if where == "comm_overlap" else "model config")
    assert cfg.resolved.overlap.overlap_grad_reduce is True
    # Megatron DDP default bucket, not the 128M of the DP rule
    assert cfg.resolved.overlap.bucket_size == 40_000_000
    assert cfg.resolved.overlap.overlap_param_gather is False


def test_overlap_param_gather_without_distributed_optimizer_is_logged_dishonoured(caplog):
    cfg = build(co=CommOverlapConfig(tp_comm_overlap=False, overlap_param_gather=True))
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(4)
    d = res.decisions.get("ddp.overlap_param_gather")
    assert (d.requested, d.effective, d.decided_by) == (True, False, "rule")
    assert d.overridden
    assert cfg.resolved.overlap.overlap_param_gather is False
    assert any("ddp.overlap_param_gather" in r.getMessage() for r in caplog.records)


def test_overlap_grad_reduce_at_dp1_is_dishonoured():
    cfg = build(co=CommOverlapConfig(tp_comm_overlap=False, overlap_grad_reduce=True))
    res = cfg.finalize(1)
    d = res.decisions.get("ddp.overlap_grad_reduce")
    assert (d.requested, d.effective) == (True, False)
    assert cfg.resolved.overlap.overlap_grad_reduce is False


@pytest.mark.parametrize("which", ["ddp", "optimizer"])
def test_distributed_optimizer_sync_between_ddp_and_optimizer(which):
    ddp = dist_opt() if which == "ddp" else DDPConfig()
    opt = dist_optimizer() if which == "optimizer" else OptimizerConfig()
    cfg = build(ddp=ddp, optimizer=opt)
    res = cfg.finalize(4)
    # the plan, which the runtime reads, has it on; both spellings stay as typed (None: not set)
    assert res.overlap.use_distributed_optimizer is True
    assert cfg.ddp.use_distributed_optimizer is (True if which == "ddp" else False)
    assert cfg.optimizer.use_distributed_optimizer is (True if which == "optimizer" else None)
    other = "optimizer" if which == "ddp" else "ddp"
    d = res.decisions.get(f"{other}.use_distributed_optimizer")
    assert (d.effective, d.decided_by) == (True, "rule")
    # Quirk fixed on purpose: the reference skipped the DP defaults when only the optimizer had it
    # on.
    assert cfg.resolved.overlap.overlap_grad_reduce is True
    assert cfg.resolved.overlap.bucket_size == BRIDGE_DP_BUCKET_SIZE


def test_overlap_param_gather_with_optimizer_step_never_automatic():
    cfg = build(
        dense(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
    )
    cfg.finalize(4)
    assert cfg.resolved.overlap.overlap_param_gather_with_optimizer_step is False


def test_overlap_param_gather_with_optimizer_step_honoured_with_pp_vpp():
    cfg = build(
        dense(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
        co=CommOverlapConfig(tp_comm_overlap=False, overlap_param_gather_with_optimizer_step=True),
    )
    res = cfg.finalize(4)
    assert cfg.resolved.overlap.overlap_param_gather_with_optimizer_step is True
    # Honoured, but our overlapped param gather already launches its first bucket inside the step: a
    # no-op row (under the spelling typed), and an error under strict.
    noop = {n.field: n for n in res.decisions.noops}[
        "comm_overlap.overlap_param_gather_with_optimizer_step"
    ]
    assert "already launches the first bucket" in noop.why
    direct = build(
        dense(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ddp=dist_opt(),
        optimizer=dataclasses.replace(
            dist_optimizer(), overlap_param_gather_with_optimizer_step=True
        ),
    ).finalize(4)
    assert "optimizer.overlap_param_gather_with_optimizer_step" in {
        n.field for n in direct.decisions.noops
    }
    strict = build(
        dense(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
        co=CommOverlapConfig(
            tp_comm_overlap=False, strict=True, overlap_param_gather_with_optimizer_step=True
        ),
    )
    with pytest.raises(ConfigError, match="on but does nothing"):
        strict.finalize(4)


def test_overlap_param_gather_with_optimizer_step_dishonoured_without_pp():
    cfg = build(
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
        co=CommOverlapConfig(tp_comm_overlap=False, overlap_param_gather_with_optimizer_step=True),
    )
    res = cfg.finalize(4)
    d = res.decisions.get("optimizer.overlap_param_gather_with_optimizer_step")
    assert (d.requested, d.effective) == (True, False)


def test_user_bucket_size_wins_and_must_be_positive():
    cfg = build(ddp=dist_opt(), co=CommOverlapConfig(tp_comm_overlap=False, bucket_size=1000))
    res = cfg.finalize(4)
    assert cfg.resolved.overlap.bucket_size == 1000
    assert res.decisions.get("ddp.bucket_size").decided_by == "user"
    # the error names the spelling typed: comm_overlap's, or Bridge's DDP alias
    with pytest.raises(ConfigError) as exc:
        build(ddp=dist_opt(), co=CommOverlapConfig(tp_comm_overlap=False, bucket_size=0)).finalize(
            4
        )
    assert exc.value.field == "comm_overlap.bucket_size"
    ddp = dataclasses.replace(dist_opt(), bucket_size=0)
    with pytest.raises(ConfigError) as exc:
        build(ddp=ddp, co=CommOverlapConfig(tp_comm_overlap=False)).finalize(4)
    assert exc.value.field == "ddp.bucket_size"


def test_setup_complete_tp_dp():
    # Reference test_setup_method_complete: TP4+SP, preset, DP4, distributed optimizer.
    cfg = build(
        dense(tensor_model_parallel_size=4, sequence_parallel=True),
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
        co=CommOverlapConfig(tp_comm_overlap=True, tp_comm_overlap_cfg=H12288),
    )
    cfg.finalize(16)
    assert cfg.resolved.overlap.tp_comm_overlap is True
    assert cfg.resolved.overlap.tp_slots
    assert cfg.resolved.overlap.tp_comm_bootstrap_backend == "nccl"
    plan = cfg.resolved.overlap
    assert plan.overlap_grad_reduce is True and plan.overlap_param_gather is True
    assert cfg.resolved.overlap.bucket_size == 128 * 1024 * 1024


def test_setup_tp_off_dp_on():
    # Reference test_setup_with_t5_config: TP2+SP, tp overlap False, DP2 -> TP off, DDP param gather
    # on.
    cfg = build(
        dense(tensor_model_parallel_size=2, sequence_parallel=True),
        ddp=dist_opt(),
        optimizer=dist_optimizer(),
        co=CommOverlapConfig(tp_comm_overlap=False),
    )
    cfg.finalize(4)
    assert cfg.resolved.overlap.tp_comm_overlap is False
    assert cfg.resolved.overlap.overlap_param_gather is True


# --- EP overlap prerequisites ---------------------------------------------------------------------
def _ep_case(world=2, mp="bf16_mixed", **model_kw):
    return build(moe(**model_kw), co=ep_on(), mp=mp), world


def test_ep_overlap_minimal_valid_config():
    cfg, world = _ep_case()
    res = cfg.finalize(world)
    d = res.decisions.get("model.overlap_moe_expert_parallel_comm")
    assert (d.requested, d.effective, d.decided_by) == (True, True, "user")
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_ep_overlap_off_by_default():
    cfg = build(moe())
    res = cfg.finalize(2)
    d = res.decisions.get("model.overlap_moe_expert_parallel_comm")
    assert (d.requested, d.effective, d.decided_by) == (None, False, "default")


EP_PREREQ_CASES = [
    # (id, model kwargs, world, mixed precision, expected field, message fragment)
    (
        "ep1",
        dict(expert_model_parallel_size=1),
        2,
        "bf16_mixed",
        "model.expert_model_parallel_size",
        "expert_model_parallel_size > 1",
    ),
    (
        "one_expert",
        dict(num_moe_experts=1, moe_router_topk=1),
        2,
        "bf16_mixed",
        "model.num_moe_experts",
        "num_moe_experts > 1",
    ),
    (
        "dense",
        dict(num_moe_experts=None),
        2,
        "bf16_mixed",
        "model.num_moe_experts",
        "num_moe_experts > 1",
    ),
    (
        "allgather",
        dict(moe_token_dispatcher_type="allgather"),
        2,
        "bf16_mixed",
        "model.moe_token_dispatcher_type",
        "'alltoall' or 'flex'",
    ),
    ("fp32", dict(), 2, "fp32", "model.bf16", "bf16 or fp16"),
    (
        "pp_without_vpp",
        dict(pipeline_model_parallel_size=2),
        4,
        "bf16_mixed",
        "model.virtual_pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size "
        "> 1",
    ),
    (
        "full_recompute",
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        2,
        "bf16_mixed",
        "model.recompute_granularity",
        "disable full recomputation",
    ),
    (
        "recompute_method",
        dict(recompute_method="uniform"),
        2,
        "bf16_mixed",
        "model.recompute_method",
        "disable recomputation method",
    ),
    (
        "recompute_num_layers",
        dict(recompute_num_layers=1),
        2,
        "bf16_mixed",
        "model.recompute_num_layers",
        "recompute_num_layers must be None",
    ),
    (
        "moe_recompute",
        dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
        2,
        "bf16_mixed",
        "model.recompute_modules",
        "disable moe in recompute_modules",
    ),
    (
        "shared_overlap",
        dict(moe_shared_expert_overlap=True, moe_shared_expert_intermediate_size=32),
        2,
        "bf16_mixed",
        "model.moe_shared_expert_overlap",
        "disable moe_shared_expert_overlap",
    ),
    ("mtp2", dict(mtp_num_layers=2), 2, "bf16_mixed", "model.mtp_num_layers", "at most one layer"),
    (
        "graph_moe",
        dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["moe"]),
        2,
        "bf16_mixed",
        "model.cuda_graph_scope",
        "moe",
    ),
    (
        "graph_mlp",
        dict(cuda_graph_impl="transformer_engine", cuda_graph_scope="attn,mlp"),
        2,
        "bf16_mixed",
        "model.cuda_graph_scope",
        "mlp",
    ),
]


@pytest.mark.parametrize(
    "case_id,model_kw,world,mp,field,fragment", EP_PREREQ_CASES, ids=[c[0] for c in EP_PREREQ_CASES]
)
def test_ep_overlap_prerequisite_fails_naming_field(case_id, model_kw, world, mp, field, fragment):
    cfg, world = _ep_case(world=world, mp=mp, **model_kw)
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(world)
    err = exc.value
    assert err.field == field
    assert fragment in str(err)
    assert field in str(err)
    assert err.fix  # every prerequisite error names the fix
    assert type(err) is ConfigError


def test_ep_overlap_rejects_old_torch(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu121")
    cfg, world = _ep_case()
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(world)
    assert exc.value.field == "torch"
    assert "torch version < 2.6.0" in str(exc.value)


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0a0+git1234", "2.10.1+cu128", "3.0.0"])
def test_ep_overlap_torch_version_compared_numerically(monkeypatch, version):
    monkeypatch.setattr(torch, "__version__", version)
    cfg, world = _ep_case()
    cfg.finalize(world)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


@pytest.mark.parametrize("mtp", [None, 0, 1])
def test_ep_overlap_accepts_mtp_none_zero_one(mtp):
    cfg, world = _ep_case(mtp_num_layers=mtp)
    cfg.finalize(world)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_ep_overlap_with_pp_and_vpp_is_fine():
    cfg, world = _ep_case(
        world=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    cfg.finalize(world)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_ep_overlap_with_selective_recompute_is_fine():
    cfg, world = _ep_case(
        recompute_granularity="selective", recompute_modules=["core_attn", "mlp", "layernorm"]
    )
    cfg.finalize(world)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_ep_overlap_with_flex_dispatcher_is_fine():
    cfg, world = _ep_case(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="torch")
    cfg.finalize(world)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_ep_overlap_graph_scope_ignored_without_te_graphs():
    cfg, world = _ep_case(cuda_graph_impl="none", cuda_graph_scope=["moe"])
    cfg.finalize(world)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_ep_overlap_prerequisites_are_errors_even_without_strict():
    cfg = build(moe(expert_model_parallel_size=1), co=ep_on(strict=False))
    with pytest.raises(ConfigError):
        cfg.finalize(2)


def test_ep_overlap_requested_on_model_config_is_checked_and_kept():
    # Quirk fixed on purpose: the reference reset a model-level EP flag to False once comm_overlap
    # was set.
    cfg = build(
        moe(overlap_moe_expert_parallel_comm=True), co=CommOverlapConfig(tp_comm_overlap=False)
    )
    res = cfg.finalize(2)
    d = res.decisions.get("model.overlap_moe_expert_parallel_comm")
    assert (d.effective, d.decided_by) == (True, "model config")
    with pytest.raises(ConfigError):
        build(moe(overlap_moe_expert_parallel_comm=True, mtp_num_layers=2)).finalize(2)


def test_ep_overlap_precision_check_sees_mixed_precision():
    # Finalize order: mixed precision runs before the EP precision check, so bf16_mixed satisfies it
    # even though the model itself was built with bf16=False; fp16 satisfies it too.
    for mp in ("bf16_mixed", "fp16_mixed"):
        cfg = build(moe(bf16=False), co=ep_on(), mp=mp)
        cfg.finalize(2)
        assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True
    # Without a preset the model's own flags stand.
    cfg = build(moe(bf16=True, params_dtype="bfloat16"), co=ep_on(), mp=None)
    cfg.finalize(2)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True
    with pytest.raises(ConfigError) as exc:
        build(moe(), co=ep_on(), mp=None).finalize(2)
    assert exc.value.field == "model.bf16"


# --- delay_wgrad_compute --------------------------------------------------------------------------
def test_delay_wgrad_requires_ep_overlap():
    cfg = build(moe(), co=CommOverlapConfig(tp_comm_overlap=False, delay_wgrad_compute=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "comm_overlap.delay_wgrad_compute"
    assert "overlap_moe_expert_parallel_comm is required for delay_wgrad_compute" in str(exc.value)


def test_delay_wgrad_requested_on_model_requires_ep_overlap():
    """The error names the spelling the user typed (the alias `model.delay_wgrad_compute`)."""
    with pytest.raises(ConfigError) as exc:
        build(moe(delay_wgrad_compute=True)).finalize(2)
    assert exc.value.field == "model.delay_wgrad_compute"
    assert "model.overlap_moe_expert_parallel_comm=true" in exc.value.fix


def test_delay_wgrad_with_ep_overlap():
    cfg = build(moe(), co=ep_on(delay_wgrad_compute=True))
    res = cfg.finalize(2)
    assert cfg.resolved.overlap.delay_wgrad_compute is True
    assert res.decisions.get("model.delay_wgrad_compute").decided_by == "user"


def test_delay_wgrad_with_overlap_grad_reduce_and_grad_accum_fusion():
    cfg = build(
        moe(gradient_accumulation_fusion=True),
        co=ep_on(delay_wgrad_compute=True),
        ddp=DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True),
    )
    cfg.finalize(2)
    assert cfg.resolved.overlap.delay_wgrad_compute is True
    assert cfg.resolved.overlap.overlap_grad_reduce is True


def test_delay_wgrad_model_only_flags_both_kept():
    cfg = build(moe(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True))
    res = cfg.finalize(2)
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True
    assert cfg.resolved.overlap.delay_wgrad_compute is True
    assert res.decisions.get("model.delay_wgrad_compute").decided_by == "model config"


def test_delay_wgrad_off_by_default_even_with_ep_overlap():
    cfg = build(moe(), co=ep_on())
    cfg.finalize(2)
    assert cfg.resolved.overlap.delay_wgrad_compute is False


def _graph_moe(**kw) -> ModelConfig:
    return moe(cuda_graph_impl="transformer_engine", **kw)


def test_delay_wgrad_cuda_graph_attn_requires_grad_accum_fusion():
    cfg = build(_graph_moe(cuda_graph_scope=["attn"]), co=ep_on(delay_wgrad_compute=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "model.gradient_accumulation_fusion"
    assert "gradient_accumulation_fusion" in str(exc.value)


def test_delay_wgrad_cuda_graph_attn_is_checked_whatever_the_graph_impl():
    # the reference checks the module list even with cuda_graph_impl none
    cfg = build(
        moe(cuda_graph_impl="none", cuda_graph_scope=["attn"]), co=ep_on(delay_wgrad_compute=True)
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "model.gradient_accumulation_fusion"


@pytest.mark.parametrize("bias", ["add_bias_linear", "add_qkv_bias"])
def test_delay_wgrad_cuda_graph_attn_rejects_attention_bias(bias):
    model = _graph_moe(cuda_graph_scope=["attn"], gradient_accumulation_fusion=True, **{bias: True})
    cfg = build(model, co=ep_on(delay_wgrad_compute=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert "attention bias" in str(exc.value)
    assert bias in str(exc.value)


def test_delay_wgrad_attention_bias_error_names_the_field_that_is_set():
    # The error must name the bias field that is actually on, with its real value.
    model = _graph_moe(
        cuda_graph_scope=["attn"], gradient_accumulation_fusion=True, add_qkv_bias=True
    )
    cfg = build(model, co=ep_on(delay_wgrad_compute=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    section, name = exc.value.field.split(".")
    assert section == "model"
    assert getattr(model, name) == exc.value.value, (
        f"error reports {exc.value.field}={exc.value.value!r}, but the config has "
        f"{name}={getattr(model, name)!r}"
    )


def test_delay_wgrad_cuda_graph_attn_with_supported_settings():
    cfg = build(
        _graph_moe(cuda_graph_scope=["attn"], gradient_accumulation_fusion=True),
        co=ep_on(delay_wgrad_compute=True),
    )
    cfg.finalize(2)
    assert cfg.resolved.overlap.delay_wgrad_compute is True


def test_delay_wgrad_cuda_graph_attn_scope_as_comma_string():
    cfg = build(_graph_moe(cuda_graph_scope="attn,moe_router"), co=ep_on(delay_wgrad_compute=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "model.gradient_accumulation_fusion"


def test_delay_wgrad_router_scope_with_shared_expert_requires_grad_accum_fusion():
    cfg = build(
        _graph_moe(cuda_graph_scope=["moe_router"], moe_shared_expert_intermediate_size=32),
        co=ep_on(delay_wgrad_compute=True),
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2)
    assert exc.value.field == "model.gradient_accumulation_fusion"


def test_delay_wgrad_router_scope_with_shared_expert_and_fusion_is_fine():
    cfg = build(
        _graph_moe(
            cuda_graph_scope=["moe_router"],
            moe_shared_expert_intermediate_size=32,
            gradient_accumulation_fusion=True,
            add_bias_linear=True,
        ),
        co=ep_on(delay_wgrad_compute=True),
    )
    cfg.finalize(2)  # the bias restriction is for the attn scope only
    assert cfg.resolved.overlap.delay_wgrad_compute is True


def test_delay_wgrad_router_scope_without_shared_expert_is_fine():
    cfg = build(
        _graph_moe(cuda_graph_scope=["moe_router", "moe_preprocess"]),
        co=ep_on(delay_wgrad_compute=True),
    )
    cfg.finalize(2)
    assert cfg.resolved.overlap.delay_wgrad_compute is True


@pytest.mark.parametrize("scope", [["full_iteration"], "full", ""])
def test_delay_wgrad_full_or_empty_scope_adds_no_constraint(scope):
    impl = "local" if scope == ["full_iteration"] else "transformer_engine"
    cfg = build(
        moe(cuda_graph_impl=impl, cuda_graph_scope=scope), co=ep_on(delay_wgrad_compute=True)
    )
    cfg.finalize(2)
    assert cfg.resolved.overlap.delay_wgrad_compute is True


# --- mixed precision ------------------------------------------------------------------------------
def test_mixed_precision_preset_values():
    assert set(MIXED_PRECISION_PRESETS) == {"bf16_mixed", "fp16_mixed", "fp32"}
    bf16 = get_mixed_precision_config("bf16_mixed")
    assert (
        bf16.bf16,
        bf16.fp16,
        bf16.params_dtype,
        bf16.grad_reduce_in_fp32,
        bf16.fp8_param_gather,
    ) == (True, False, "bfloat16", True, False)
    fp16 = get_mixed_precision_config("fp16_mixed")
    assert (fp16.bf16, fp16.fp16, fp16.params_dtype, fp16.grad_reduce_in_fp32) == (
        False,
        True,
        "float16",
        False,
    )
    fp32 = get_mixed_precision_config("fp32")
    assert (fp32.bf16, fp32.fp16, fp32.params_dtype, fp32.grad_reduce_in_fp32) == (
        False,
        False,
        "float32",
        False,
    )


def test_mixed_precision_preset_is_a_copy():
    a = get_mixed_precision_config("bf16_mixed")
    a.grad_reduce_in_fp32 = False
    assert get_mixed_precision_config("bf16_mixed").grad_reduce_in_fp32 is True


def test_unknown_mixed_precision_preset():
    with pytest.raises(ConfigError) as exc:
        get_mixed_precision_config("fp8")
    assert exc.value.field == "mixed_precision"
    with pytest.raises(ConfigError):
        build(mp="bf17_mixed").finalize(1)


def test_mixed_precision_finalize_rejects_contradictions():
    with pytest.raises(ConfigError):
        MixedPrecisionConfig(bf16=True, fp16=True, params_dtype="bfloat16").finalize()
    with pytest.raises(ConfigError) as exc:
        MixedPrecisionConfig(bf16=True, params_dtype="float32").finalize()
    assert exc.value.field == "mixed_precision.params_dtype"


def test_the_preset_decides_the_precision_and_writes_nothing_back():
    cfg = build(mp="bf16_mixed")
    p = cfg.finalize(1).precision
    assert (p.bf16, p.fp16, p.params_dtype) == (True, False, "bfloat16")
    assert (p.grad_reduce_in_fp32, p.fp8_param_gather) == (True, False)
    # the aliases keep what was typed: nothing
    assert (cfg.model.bf16, cfg.model.params_dtype, cfg.optimizer.bf16) == (None, None, None)
    assert cfg.ddp.grad_reduce_in_fp32 is None
    d = cfg.resolved.decisions.get("ddp.grad_reduce_in_fp32")
    assert (d.requested, d.effective, d.decided_by) == (None, True, "rule")


def test_no_mixed_precision_keeps_model_flags():
    cfg = build(dense(fp16=True, params_dtype="float16"), mp=None)
    p = cfg.finalize(1).precision
    assert (p.fp16, p.params_dtype) == (True, "float16")
    assert (p.grad_reduce_in_fp32, p.fp8_param_gather) == (False, False)
    assert p == Precision.of(cfg.model)  # a bare model's precision: the same decision


def test_without_a_preset_the_typed_dtype_is_checked():
    with pytest.raises(ConfigError) as exc:
        build(dense(params_dtype="int8"), mp=None).finalize(1)
    assert (exc.value.field, exc.value.value) == ("model.params_dtype", "int8")
    with pytest.raises(ConfigError) as exc:
        build(dense(bf16=True), mp=None).finalize(1)
    assert exc.value.field == "model.params_dtype" and "model.bf16=True" in exc.value.why


def test_shared_expert_overlap_without_shared_expert_is_a_logged_dishonoured_request():
    from overlap.config import ConfigContainer, ModelConfig
    from overlap.errors import ConfigError

    def cfg(strict: bool):
        c = ConfigContainer(model=ModelConfig(num_moe_experts=4, moe_shared_expert_overlap=True))
        if strict:
            from overlap.config import CommOverlapConfig

            c.comm_overlap = CommOverlapConfig(tp_comm_overlap=None, strict=True)
        return c

    c = cfg(False)
    d = c.finalize(1).decisions.get("model.moe_shared_expert_overlap")
    assert d.requested is True and d.effective is False and "no shared expert" in d.reason
    assert c.resolved.overlap.moe_shared_expert_overlap is False
    import pytest

    with pytest.raises(ConfigError, match="moe_shared_expert_overlap"):
        cfg(True).finalize(1)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({}, ["dropless", "exchange split sizes"]),
        (
            dict(moe_expert_capacity_factor=1.5),
            [
                "1.5",
                "lowest router weights",
                "still exchanged",
                "moe_pad_expert_input_to_capacity=true",
            ],
        ),
        (
            dict(
                moe_expert_capacity_factor=1.0,
                moe_pad_expert_input_to_capacity=True,
                moe_token_drop_policy="position",
            ),
            ["latest tokens", "static shapes, no split-size exchange"],
        ),
    ],
)
def test_expert_capacity_is_a_decision_that_says_what_the_dispatch_exchanges(kw, words):
    d = build(moe(**kw)).finalize(2).decisions.get("model.moe_expert_capacity_factor")
    assert d.effective == kw.get("moe_expert_capacity_factor")
    for word in words:
        assert word in d.reason, (word, d.reason)


def test_a_dense_model_has_no_expert_capacity_decision():
    with pytest.raises(KeyError):
        build(dense()).finalize(2).decisions.get("model.moe_expert_capacity_factor")


def test_forced_load_balancing_is_a_logged_benchmark_mode_and_refuses_a_recompute_that_reroutes():
    d = (
        build(moe(moe_router_force_load_balancing=True))
        .finalize(2)
        .decisions.get("model.moe_router_force_load_balancing")
    )
    assert d.effective is True and "random logits" in d.reason and "not for training" in d.reason
    with pytest.raises(KeyError):  # off: nothing to say
        build(moe()).finalize(2).decisions.get("model.moe_router_force_load_balancing")
    for kw in (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=["moe"]),
    ):
        with pytest.raises(ConfigError, match="moe_router_force_load_balancing") as err:
            build(moe(moe_router_force_load_balancing=True, **kw)).finalize(2)
        assert "recompute" in err.value.fix
    build(
        moe(
            moe_router_force_load_balancing=True,
            recompute_granularity="selective",
            recompute_modules=["core_attn"],
        )
    ).finalize(2)  # the router is not recomputed: fine


@pytest.mark.parametrize(
    "section, field",
    [
        (lambda: OptimizerConfig(lr=float("nan")), "optimizer.lr"),
        (lambda: OptimizerConfig(optimizer="sgd"), "optimizer.optimizer"),
        (lambda: SchedulerConfig(lr_decay_style="step"), "scheduler.lr_decay_style"),
        (lambda: TrainConfig(train_iters=0), "train.train_iters"),
        (
            lambda: TrainConfig(eval_time_start_step=3, eval_time_end_step=3),
            "train.eval_time_end_step",
        ),
        (lambda: ModelConfig(num_moe_experts=4, moe_router_topk=5), "model.moe_router_topk"),
        (lambda: ModelConfig(recompute_modules=["mla_up_proj"]), "model.recompute_modules"),
        (
            lambda: ModelConfig(cuda_graph_impl="local", cuda_graph_scope=["attn"]),
            "model.cuda_graph_scope",
        ),
    ],
)
def test_each_section_checks_its_own_fields(section, field):
    """A section's own rules run from the section (`validate()`), without a container or layout."""
    with pytest.raises(ConfigError) as exc:
        section().validate()
    assert exc.value.field == field


def test_every_default_section_is_valid():
    for section in (ModelConfig(), OptimizerConfig(), SchedulerConfig(), TrainConfig()):
        section.validate()


def test_the_layout_checks_itself_with_the_flag_names():
    """One layout check (ParallelLayout's), worded with the flags that set the sizes."""
    from overlap.layout import ParallelLayout

    with pytest.raises(ConfigError) as exc:
        ParallelLayout(world_size=6, tp=4)
    assert exc.value.field == "-ng/--num_gpus" and "TP x PP x CP" in exc.value.why
    with pytest.raises(ConfigError) as exc:
        ParallelLayout(world_size=4, pp=0)
    assert exc.value.field == "model.pipeline_model_parallel_size"
    # sequence parallelism needs a TP group: finalize turns a typed one off at TP 1 (a logged
    # decision), a layout built by hand cannot claim it
    with pytest.raises(ConfigError) as exc:
        ParallelLayout(world_size=2, sequence_parallel=True)
    assert exc.value.field == "model.sequence_parallel" and "TP=1" in exc.value.why
    assert ParallelLayout(world_size=2, tp=2, sequence_parallel=True).sequence_parallel


# --- context parallelism --------------------------------------------------------------------------
def _decision(res, field: str):
    return {d.field: d for d in res.decisions.decisions}[field]


def test_cp1_records_no_cp_exchange():
    res = build(dense()).finalize(1)
    assert _decision(res, "model.cp_comm_type").effective is None
    assert res.overlap.cp_comm_type is None
    assert res.overlap.cp_comm_overlap is False


def test_cp2_defaults_to_the_overlapped_ring():
    res = build(dense(context_parallel_size=2)).finalize(2)
    plan = res.overlap
    assert (plan.cp_comm_type, plan.cp_comm_overlap) == ("p2p", True)
    assert _decision(res, "model.cp_comm_type").decided_by == "rule"


@pytest.mark.parametrize("kind", ["all_gather", "a2a"])
def test_cp_collective_kinds_have_no_ring_to_overlap(kind):
    res = build(dense(context_parallel_size=2, cp_comm_type=kind)).finalize(2)
    assert (res.overlap.cp_comm_type, res.overlap.cp_comm_overlap) == (
        kind,
        False,
    )
    on = build(dense(context_parallel_size=2, cp_comm_type=kind, cp_comm_overlap=True))
    assert "model.cp_comm_overlap" in {n.field for n in on.finalize(2).decisions.noops}


def test_cp_serialised_ring_is_a_user_choice():
    res = build(dense(context_parallel_size=2, cp_comm_overlap=False)).finalize(2)
    assert res.overlap.cp_comm_overlap is False


def test_cp_settings_at_cp1_are_noops():
    res = build(dense(cp_comm_type="p2p", cp_comm_overlap=True)).finalize(1)
    noops = {n.field for n in res.decisions.noops}
    assert {"model.cp_comm_type", "model.cp_comm_overlap"} <= noops


def test_hierarchical_cp_needs_sizes_whose_product_is_cp():
    ok = build(
        dense(
            context_parallel_size=4,
            cp_comm_type="a2a+p2p",
            hierarchical_context_parallel_sizes=[2, 2],
        )
    ).finalize(4)
    assert (ok.overlap.cp_comm_type, ok.overlap.cp_comm_overlap) == ("a2a+p2p", True)
    assert ok.layout.cp_a2a == 2
    for sizes, field in (
        (None, "model.hierarchical_context_parallel_sizes"),
        ([2, 4], "model.hierarchical_context_parallel_sizes"),
        ([3, 1], "model.hierarchical_context_parallel_sizes"),
    ):
        with pytest.raises(ConfigError) as err:
            build(
                dense(
                    context_parallel_size=4,
                    cp_comm_type="a2a+p2p",
                    hierarchical_context_parallel_sizes=sizes,
                )
            ).finalize(4)
        assert err.value.field == field, sizes


@pytest.mark.parametrize(
    "fields, field, text",
    [
        (dict(cp_comm_type="ring"), "model.cp_comm_type", "p2p"),
        (dict(seq_length=66), "model.seq_length", "2 x CP = 4"),
        (
            dict(seq_length=68, tensor_model_parallel_size=4, sequence_parallel=True),
            "model.seq_length",
            "CP x TP = 8",
        ),
        (
            dict(cp_comm_type="a2a", num_attention_heads=6, num_query_groups=3),
            "model.cp_comm_type",
            "heads",
        ),
    ],
)
def test_cp_prerequisites_are_config_errors(fields, field, text):
    with pytest.raises(ConfigError) as err:
        build(dense(context_parallel_size=2, **fields)).finalize(8)
    assert err.value.field == field and text in str(err.value)
