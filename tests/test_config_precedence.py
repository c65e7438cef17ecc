"""Precedence (user > model/ddp config > rule), decided_by labels, strict mode, idempotent finalize
and its order."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import pytest

from overlap.config import (
    CommOverlapConfig,
    ConfigContainer,
    DDPConfig,
    ModelConfig,
    OptimizerConfig,
)
from overlap.config.mixed_precision import MixedPrecisionConfig
from overlap.config.overrides import apply_overrides
from overlap.decisions import DEFAULT, MODEL_CONFIG, RULE, USER, Decision, DecisionLog
from overlap.errors import ConfigError
from tests.configs import container as build
from tests.configs import dense_model as model
from tests.configs import moe_model as moe


def co(**kw) -> CommOverlapConfig:
    return CommOverlapConfig(tp_comm_overlap=False, **kw)


def test_decided_by_labels():
    assert (USER, MODEL_CONFIG, RULE, DEFAULT) == ("user", "model config", "rule", "default")


# --- user > model config > rule -------------------------------------------------------------------
def test_pp_rule_then_model_config_then_user():
    # Rule only.
    cfg = build(model(pipeline_model_parallel_size=2))
    d = cfg.finalize(2).decisions.get("model.batch_p2p_comm")
    assert (d.requested, d.effective, d.decided_by) == (None, True, "rule")
    # A value set on the model config wins over the rule.
    cfg = build(model(pipeline_model_parallel_size=2, batch_p2p_comm=False))
    d = cfg.finalize(2).decisions.get("model.batch_p2p_comm")
    assert (d.requested, d.effective, d.decided_by) == (False, False, "model config")
    assert cfg.resolved.overlap.batch_p2p_comm is False
    # A value on CommOverlapConfig wins over the model config.
    cfg = build(
        model(pipeline_model_parallel_size=2, batch_p2p_comm=False), co=co(batch_p2p_comm=True)
    )
    d = cfg.finalize(2).decisions.get("model.batch_p2p_comm")
    assert (d.requested, d.effective, d.decided_by) == (True, True, "user")
    assert cfg.resolved.overlap.batch_p2p_comm is True


def test_model_level_values_survive_comm_overlap_object():
    # Quirk fixed on purpose: in the reference, auto-defaults overwrote values set directly on the
    # model as soon as comm_overlap was set. Here the model value stands unless CommOverlapConfig
    # says otherwise.
    cfg = build(
        model(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            overlap_p2p_comm=False,
            defer_embedding_wgrad_compute=True,
            wgrad_deferral_limit=5,
        ),
        co=co(),
    )
    res = cfg.finalize(2)
    assert cfg.resolved.overlap.overlap_p2p_comm is False
    assert cfg.resolved.overlap.defer_embedding_wgrad_compute is True
    assert cfg.resolved.overlap.wgrad_deferral_limit == 5
    for name in (
        "model.overlap_p2p_comm",
        "model.defer_embedding_wgrad_compute",
        "model.wgrad_deferral_limit",
    ):
        assert res.decisions.get(name).decided_by == "model config"


def test_ddp_rule_then_ddp_config_then_user():
    dist = dict(use_distributed_optimizer=True)
    cfg = build(ddp=DDPConfig(**dist))
    d = cfg.finalize(4).decisions.get("ddp.overlap_grad_reduce")
    assert (d.effective, d.decided_by) == (True, "rule")

    cfg = build(ddp=DDPConfig(overlap_grad_reduce=False, **dist))
    d = cfg.finalize(4).decisions.get("ddp.overlap_grad_reduce")
    assert (d.requested, d.effective, d.decided_by) == (False, False, "model config")
    assert "ddp" in d.reason

    cfg = build(ddp=DDPConfig(overlap_grad_reduce=False, **dist), co=co(overlap_grad_reduce=True))
    d = cfg.finalize(4).decisions.get("ddp.overlap_grad_reduce")
    assert (d.requested, d.effective, d.decided_by) == (True, True, "user")
    assert cfg.resolved.overlap.overlap_grad_reduce is True


def test_user_false_beats_ddp_true_for_param_gather():
    cfg = build(
        ddp=DDPConfig(use_distributed_optimizer=True, overlap_param_gather=True),
        co=co(overlap_param_gather=False),
    )
    d = cfg.finalize(4).decisions.get("ddp.overlap_param_gather")
    assert (d.requested, d.effective, d.decided_by) == (False, False, "user")


def test_bucket_size_precedence():
    dist = DDPConfig(use_distributed_optimizer=True, bucket_size=5000)
    cfg = build(ddp=dist)
    d = cfg.finalize(4).decisions.get("ddp.bucket_size")
    assert (d.effective, d.decided_by) == (5000, "model config")
    cfg = build(
        ddp=DDPConfig(use_distributed_optimizer=True, bucket_size=5000), co=co(bucket_size=7000)
    )
    d = cfg.finalize(4).decisions.get("ddp.bucket_size")
    assert (d.effective, d.decided_by) == (7000, "user")


def test_ep_overlap_user_false_beats_model_true():
    cfg = build(
        moe(overlap_moe_expert_parallel_comm=True, mtp_num_layers=5),
        co=co(overlap_moe_expert_parallel_comm=False),
    )
    res = cfg.finalize(2)  # prerequisites are not checked when the effective value is off
    d = res.decisions.get("model.overlap_moe_expert_parallel_comm")
    assert (d.requested, d.effective, d.decided_by) == (False, False, "user")
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is False


def test_default_label_for_untouched_fields():
    res = build().finalize(1)
    for name in (
        "model.tp_comm_overlap",
        "model.overlap_moe_expert_parallel_comm",
        "model.delay_wgrad_compute",
        "model.defer_embedding_wgrad_compute",
        "optimizer.overlap_param_gather_with_optimizer_step",
    ):
        assert res.decisions.get(name).decided_by == "default", name


def test_tp_request_on_model_config_is_labelled_model_config():
    cfg = build(model(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True))
    d = cfg.finalize(2).decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.decided_by) == (True, True, "model config")


def test_tp_requested_off_by_user():
    cfg = build(
        model(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True), co=co()
    )
    d = cfg.finalize(2).decisions.get("model.tp_comm_overlap")
    assert (d.requested, d.effective, d.decided_by) == (False, False, "user")


# --- strict mode ----------------------------------------------------------------------------------
def test_strict_tp_overlap_at_tp1_is_error():
    cfg = build(co=CommOverlapConfig(tp_comm_overlap=True, strict=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(1)
    assert exc.value.field == "model.tp_comm_overlap"
    assert "strict" in str(exc.value)
    assert "TP size < 2" in str(exc.value)


def test_non_strict_tp_overlap_at_tp1_logs_warning(caplog):
    cfg = build(co=CommOverlapConfig(tp_comm_overlap=True))
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(1)
    d = res.decisions.get("model.tp_comm_overlap")
    assert d.requested is True and d.effective is False and d.overridden
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("model.tp_comm_overlap" in r.getMessage() for r in warnings)


def test_strict_grad_reduce_in_fp32_contradicting_preset_is_error():
    cfg = build(ddp=DDPConfig(grad_reduce_in_fp32=False), co=co(strict=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(1)
    assert exc.value.field == "ddp.grad_reduce_in_fp32"
    assert "mixed_precision.grad_reduce_in_fp32" in str(exc.value)


def test_non_strict_grad_reduce_in_fp32_contradiction_is_logged(caplog):
    cfg = build(ddp=DDPConfig(grad_reduce_in_fp32=False, fp8_param_gather=True))
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(1)
    d = res.decisions.get("ddp.grad_reduce_in_fp32")
    assert (d.requested, d.effective) == (False, True)
    assert d.overridden
    assert res.precision.grad_reduce_in_fp32 is True  # the mixed-precision preset owns it
    assert cfg.ddp.grad_reduce_in_fp32 is False  # the alias stays as typed
    d = res.decisions.get("ddp.fp8_param_gather")
    assert (d.requested, d.effective) == (True, False)
    assert res.precision.fp8_param_gather is False
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "ddp.grad_reduce_in_fp32" in messages and "ddp.fp8_param_gather" in messages


def test_grad_reduce_in_fp32_agreeing_with_preset_is_not_a_contradiction():
    cfg = build(ddp=DDPConfig(grad_reduce_in_fp32=True), co=co(strict=True))
    d = cfg.finalize(1).decisions.get("ddp.grad_reduce_in_fp32")
    assert not d.overridden


def test_grad_reduce_in_fp32_set_through_mixed_precision():
    mp = MixedPrecisionConfig(bf16=True, params_dtype="bfloat16", grad_reduce_in_fp32=False)
    cfg = build(mp=mp, co=co(strict=True))
    assert cfg.finalize(1).precision.grad_reduce_in_fp32 is False


def test_strict_param_gather_without_distributed_optimizer_is_error():
    cfg = build(co=co(overlap_param_gather=True, strict=True))
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(4)
    assert exc.value.field == "ddp.overlap_param_gather"


def test_strict_sequence_parallel_at_tp1_is_error():
    with pytest.raises(ConfigError) as exc:
        build(model(sequence_parallel=True), co=co(strict=True)).finalize(1)
    assert exc.value.field == "model.sequence_parallel"
    cfg = build(model(sequence_parallel=True))
    d = cfg.finalize(1).decisions.get("model.sequence_parallel")
    assert (d.requested, d.effective) == (True, False)
    # the model section keeps what was typed; the layout carries what runs
    assert cfg.model.sequence_parallel is True and cfg.resolved.layout.sequence_parallel is False


def test_strict_mode_accepts_honoured_requests():
    cfg = build(
        moe(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ddp=DDPConfig(use_distributed_optimizer=True),
        co=co(
            strict=True,
            overlap_moe_expert_parallel_comm=True,
            delay_wgrad_compute=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            overlap_p2p_comm=True,
        ),
    )
    res = cfg.finalize(4)
    assert not any(d.overridden for d in res.decisions.decisions)
    assert res.decisions.strict is True


def test_strict_through_override():
    cfg = build()
    apply_overrides(cfg, ["comm_overlap.strict=true", "comm_overlap.tp_comm_overlap=true"])
    with pytest.raises(ConfigError):
        cfg.finalize(1)


def test_decision_log_strict_unit():
    log = DecisionLog(strict=True)
    assert log.record("x", None, 3, RULE, "auto") == 3
    assert log.record("y", True, True, USER, "ok") is True
    with pytest.raises(ConfigError) as exc:
        log.record("z", True, False, RULE, "cannot.", fix="do something")
    assert exc.value.field == "z"
    assert exc.value.fix == "do something"
    assert [d.field for d in log.decisions] == ["x", "y"]


def test_decision_log_non_strict_unit(caplog):
    log = DecisionLog(strict=False)
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        assert log.record("z", True, False, RULE, "cannot") is False
    assert log.get("z").overridden
    assert "z: requested True, using False (cannot)" in caplog.text
    with pytest.raises(KeyError):
        log.get("missing")


def test_decision_json_and_table():
    d = Decision("model.x", None, {"a": {"method": "bulk"}}, RULE, "why")
    assert set(d.to_json()) == {"field", "requested", "effective", "decided_by", "reason"}
    json.dumps(d.to_json())
    log = DecisionLog(strict=False)
    log.record("model.tp_comm_overlap", None, False, DEFAULT, "not requested")
    table = log.format_table()
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["field", "requested", "effective", "decided"]
    assert lines[1].startswith("---")
    assert "model.tp_comm_overlap" in lines[2] and " - " in lines[2]


# --- finalize: idempotent, snapshot, order --------------------------------------------------------
def _state(cfg: ConfigContainer):
    return (
        dataclasses.asdict(cfg.model),
        dataclasses.asdict(cfg.ddp),
        dataclasses.asdict(cfg.optimizer),
        dataclasses.asdict(cfg.comm_overlap) if cfg.comm_overlap else None,
        copy.deepcopy(cfg.mixed_precision),  # a preset's name stays a name
        dict(cfg.env_vars),
        dataclasses.asdict(cfg.resolved.model),
    )


@pytest.mark.parametrize("setup", ["moe_pp", "dp", "tp_request"])
def test_finalize_twice_gives_identical_decisions_and_configs(setup):
    if setup == "moe_pp":
        cfg = build(
            moe(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                moe_token_dispatcher_type="flex",
                moe_flex_dispatcher_backend="torch",
            ),
            co=co(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True),
        )
        world = 4
    elif setup == "dp":
        cfg = build(ddp=DDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False))
        world = 8
    else:
        cfg = build(model(sequence_parallel=True), co=CommOverlapConfig(tp_comm_overlap=True))
        world = 1
    first = cfg.finalize(world)
    state1 = _state(cfg)
    second = cfg.finalize(world)
    assert second.decisions.decisions == first.decisions.decisions
    assert second.layout == first.layout
    assert _state(cfg) == state1


def test_edits_after_finalize_are_not_seen():
    cfg = build(model(pipeline_model_parallel_size=2))
    cfg.finalize(2)
    cfg.model.batch_p2p_comm = False
    cfg.finalize(2)
    assert cfg.resolved.overlap.batch_p2p_comm is True  # re-resolved from the first snapshot
    fresh = build(model(pipeline_model_parallel_size=2, batch_p2p_comm=False))
    fresh.finalize(2)
    assert fresh.resolved.overlap.batch_p2p_comm is False


def test_finalize_does_not_change_user_comm_overlap_fields():
    cfg = build(co=co(overlap_grad_reduce=True))
    cfg.finalize(4)
    assert cfg.comm_overlap.overlap_grad_reduce is True
    # the rule's value lands in the plan, not on the request
    assert cfg.comm_overlap.overlap_p2p_comm is None


def test_the_resolved_values_live_only_in_the_plan():
    """Both spellings are inputs: after finalize the direct fields still hold what was typed (None:
    not set), and the resolved values are the plan's alone."""
    cfg = build(
        model(pipeline_model_parallel_size=2, defer_embedding_wgrad_compute=True),
        co=co(overlap_grad_reduce=True, bucket_size=1000),
        ddp=DDPConfig(use_distributed_optimizer=True),
    )
    plan = cfg.finalize(4).overlap
    typed = (
        cfg.model.batch_p2p_comm,
        cfg.model.defer_embedding_wgrad_compute,
        cfg.model.wgrad_deferral_limit,
        cfg.model.tp_comm_overlap,
        cfg.ddp.overlap_grad_reduce,
        cfg.ddp.bucket_size,
        cfg.optimizer.overlap_param_gather_with_optimizer_step,
    )
    assert typed == (None, True, None, None, None, None, None)
    assert (plan.batch_p2p_comm, plan.defer_embedding_wgrad_compute, plan.wgrad_deferral_limit) == (
        True,
        True,
        -1,
    )
    assert (plan.overlap_grad_reduce, plan.bucket_size, plan.tp_comm_overlap) == (True, 1000, False)


def test_finalize_order_mixed_precision_before_ep_check():
    cfg = build(moe(), co=co(overlap_moe_expert_parallel_comm=True), mp=None)
    apply_overrides(cfg, ["mixed_precision=bf16_mixed"])
    assert cfg.finalize(2).precision.bf16 is True
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True


def test_finalize_order_layout_before_rules():
    # The DP size used by the DP rule comes from the layout stage: world 8 / (TP 2 x PP 2) = 2.
    cfg = build(
        model(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2),
        ddp=DDPConfig(use_distributed_optimizer=True),
    )
    res = cfg.finalize(8)
    assert res.layout.dp == 2
    assert cfg.resolved.overlap.overlap_grad_reduce is True


def test_finalize_order_flex_validation_after_rules():
    # The flex backend check runs last: an EP-overlap prerequisite error is reported before a device
    # problem.
    calls = []

    def device():
        calls.append(1)
        return None

    cfg = build(
        moe(
            moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", mtp_num_layers=2
        ),
        co=co(overlap_moe_expert_parallel_comm=True),
    )
    with pytest.raises(ConfigError) as exc:
        cfg.finalize(2, device=device)
    assert exc.value.field == "model.mtp_num_layers"
    assert calls == []


def test_finalize_rejects_world_size_below_one():
    with pytest.raises(ConfigError):
        build().finalize(0)


def test_the_resolved_run_is_frozen_and_holds_plain_switches():
    """finalize's Resolution is what the runtime reads: every overlap switch a plain value (the
    user's comm_overlap beats the model field, the rule fills the rest), and nothing can edit it."""
    cfg = build(
        moe(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            overlap_p2p_comm=False,
        ),
        co(overlap_p2p_comm=True, batch_p2p_comm=False, overlap_grad_reduce=True),
        ddp=DDPConfig(use_distributed_optimizer=True),
    )
    with pytest.raises(RuntimeError, match="finalize"):
        _ = cfg.resolved
    res = cfg.finalize(8)
    assert cfg.resolved is res
    plan = res.overlap
    assert (plan.overlap_p2p_comm, plan.batch_p2p_comm, plan.overlap_grad_reduce) == (
        True,
        False,
        True,
    )
    # DP 2, PP 2, VPP 2
    assert plan.overlap_param_gather is True and plan.align_param_gather is True
    assert plan.overlap_moe_expert_parallel_comm is False and plan.wgrad_deferral_limit == -1
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        assert value is None or type(value) in (bool, int, str, tuple), (f.name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.overlap_p2p_comm = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.layout = None
    assert cfg.finalize(8).overlap == plan  # re-resolved from the request: the same plan


def test_an_overlap_plan_refuses_a_value_that_is_not_plain():
    from overlap.config.comm_overlap import OverlapPlan

    with pytest.raises(TypeError, match="overlap_grad_reduce"):
        OverlapPlan(overlap_grad_reduce=None)


def test_each_overlap_switch_is_declared_once_with_one_alias():
    """Every comm_overlap switch has one alias, Bridge's direct spelling (`ALIASES`), which no
    section declares as a field: the section takes it as a keyword, an attribute and an override
    and keeps it as typed; the harness's flag/override reconciliation and the resolution both read
    the table."""
    from overlap.config.aliases import ALIASES, spellings
    from overlap.config.comm_overlap import OverlapPlan
    from overlap.config.overrides import apply_override

    sections = {"model": ModelConfig, "ddp": DDPConfig, "optimizer": OptimizerConfig}
    # ours, without a Bridge spelling: strict mode and the deeper 1F1B warm-up
    ours = {"strict", "p2p_warmup_depth"}
    switches = {f.name for f in dataclasses.fields(CommOverlapConfig)} - {
        *ours,
        "data_parallel_size",
    }
    homes = {
        alias: home.partition(".")[2]
        for alias, home in ALIASES.items()
        if home.startswith("comm_overlap.")
    }
    assert sorted(homes.values()) == sorted(switches)
    for alias, name in homes.items():
        section = alias.partition(".")[0]
        for cls in sections.values():
            assert name not in {f.name for f in dataclasses.fields(cls)}, name
        assert spellings(f"comm_overlap.{name}") == (f"comm_overlap.{name}", alias)
        assert spellings(alias) == (f"comm_overlap.{name}", alias)
        assert getattr(sections[section](), name) is None
        assert getattr(sections[section](**{name: 7}), name) == 7
        cfg = ConfigContainer()
        apply_override(cfg, f"{alias}=null")
        assert alias.partition(".")[2] in cfg.to_dict()[section]
    assert spellings("model.sequence_parallel") == ()
    assert spellings("optimizer.use_distributed_optimizer") == (
        "ddp.use_distributed_optimizer",
        "optimizer.use_distributed_optimizer",
    )
    plan = {f.name for f in dataclasses.fields(OverlapPlan)}
    # the model-only switches, the per-GEMM plan resolved into what each TP slot runs, and the
    # distributed optimizer and Megatron-FSDP (ddp's knobs, decided with the DP switches they gate)
    model_only = {"moe_shared_expert_overlap", "cp_comm_type", "cp_comm_overlap"}
    ddp_only = {"use_distributed_optimizer", "use_megatron_fsdp", "data_parallel_sharding_strategy"}
    assert plan - switches == model_only | {"tp_slots"} | ddp_only | (ours - {"strict"})
    assert switches - plan == {"tp_comm_overlap_cfg"}
