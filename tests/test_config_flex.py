"""Flex token dispatch: apply_flex_dispatcher_backend, validate_flex_dispatcher_backend, and the
GPU/library gates.

Covers Megatron-Bridge's suite `tests/unit_tests/training/test_deepep.py` with a fake device probe
passed as `device=`, adapted to our decisions: flex on a dense model or on an unsupported GPU falls
back to alltoall as in the reference, but as a logged decision with a warning (an error under strict
mode), and the backend set without flex dispatch is a logged inactive decision rather than a silent
no-op.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest

import overlap.kernels.flex_backend as flex
from overlap.config import (
    CommOverlapConfig,
    ConfigContainer,
    ModelConfig,
    TrainConfig,
    apply_flex_dispatcher_backend,
)
from overlap.decisions import DecisionLog
from overlap.errors import ConfigError
from overlap.kernels.device import DeviceInfo, deepep_supported, hybridep_supported
from overlap.kernels.flex_backend import validate_flex_dispatcher_backend
from tests import configs
from tests.configs import moe_model

AMPERE = DeviceInfo("NVIDIA A100-SXM4-80GB", 8)
HOPPER = DeviceInfo("NVIDIA H100 80GB HBM3", 9)
B200 = DeviceInfo("NVIDIA B200", 10)
B300 = DeviceInfo("NVIDIA B300", 10)
GB200 = DeviceInfo("NVIDIA GB200", 10)
VOLTA = DeviceInfo("Tesla V100-SXM2-32GB", 7)
PASCAL = DeviceInfo("Tesla P100-PCIE-16GB", 6)
FUTURE = DeviceInfo("NVIDIA R100", 11)
WEIRD = DeviceInfo("NVIDIA X", 200)

DEEPEP_MSG = "DeepEP is supported for Ampere, Hopper, and Blackwell (B200/B300) GPUs"
HYBRIDEP_MSG = (
    "HybridEP is supported for GB200, GB300 with NVL72 and for Ampere, Hopper, B200 and B300 GPUs"
)


def moe(**kw) -> ModelConfig:
    return moe_model(**{"num_layers": 2, "num_attention_heads": 4, **kw})


def container(model: ModelConfig, strict: bool = False) -> ConfigContainer:
    co = CommOverlapConfig(tp_comm_overlap=False, strict=True) if strict else None
    return configs.container(model, co=co, train=TrainConfig(global_batch_size=8))


class Probe:
    """A fake device probe that counts its calls."""

    def __init__(self, dev: DeviceInfo | None) -> None:
        self.dev = dev
        self.calls = 0

    def __call__(self) -> DeviceInfo | None:
        self.calls += 1
        return self.dev


@pytest.fixture
def no_deep_ep(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        flex.importlib.util,
        "find_spec",
        lambda name, *a, **k: None if name == "deep_ep" else real(name, *a, **k),
    )


@pytest.fixture
def with_deep_ep(monkeypatch):
    real = importlib.util.find_spec
    fake = object()
    monkeypatch.setattr(
        flex.importlib.util,
        "find_spec",
        lambda name, *a, **k: fake if name == "deep_ep" else real(name, *a, **k),
    )


# --- apply_flex_dispatcher_backend ----------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "deepep", "hybridep"])
def test_apply_sets_flex_backend_and_disables_shared_overlap(backend):
    m = moe(
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_overlap=True,
        moe_shared_expert_intermediate_size=32,
    )
    apply_flex_dispatcher_backend(m, backend)
    assert m.moe_token_dispatcher_type == "flex"
    assert m.moe_flex_dispatcher_backend == backend
    assert m.moe_shared_expert_overlap is False


def test_apply_overrides_preexisting_values():
    m = moe(moe_token_dispatcher_type="allgather", moe_flex_dispatcher_backend="torch")
    apply_flex_dispatcher_backend(m, "deepep")
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend) == ("flex", "deepep")


def test_apply_logs_when_turning_shared_overlap_off(caplog):
    m = moe(moe_shared_expert_overlap=True)
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        apply_flex_dispatcher_backend(m, "torch")
    assert "moe_shared_expert_overlap" in caplog.text


def test_apply_needs_no_device():
    # Like the reference on CPU (#5732): building a deepep recipe does not probe the GPU; validation
    # does.
    m = moe()
    apply_flex_dispatcher_backend(m, "hybridep")
    assert m.moe_token_dispatcher_type == "flex"


def test_apply_none_selects_alltoall():
    m = moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep")
    apply_flex_dispatcher_backend(m, None)
    assert (m.moe_token_dispatcher_type, m.moe_flex_dispatcher_backend) == ("alltoall", None)


def test_apply_unknown_backend_is_error():
    m = moe()
    with pytest.raises(ConfigError) as exc:
        apply_flex_dispatcher_backend(m, "nccl_magic")
    assert exc.value.field == "model.moe_flex_dispatcher_backend"
    assert "unknown flex dispatcher backend" in str(exc.value)
    assert m.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize("experts", [None, 0])
def test_flex_on_a_dense_model_falls_back_with_a_warning_and_strict_refuses(experts, caplog):
    m = moe(num_moe_experts=experts, expert_model_parallel_size=1)
    apply_flex_dispatcher_backend(m, "deepep")
    cfg = container(m)
    probe = Probe(HOPPER)
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(1, device=probe)
    assert (
        cfg.resolved.kernels.moe_token_dispatcher_type == "alltoall"
        and cfg.resolved.kernels.moe_flex_dispatcher_backend is None
    )
    assert "only to MoE models" in res.decisions.get("model.moe_flex_dispatcher_backend").reason
    assert "only to MoE models" in caplog.text and probe.calls == 0
    m = moe(num_moe_experts=experts, expert_model_parallel_size=1)
    apply_flex_dispatcher_backend(m, "deepep")
    with pytest.raises(ConfigError) as exc:
        container(m, strict=True).finalize(1, device=Probe(HOPPER))
    assert exc.value.field == "model.moe_flex_dispatcher_backend" and "MoE" in str(exc.value)


# --- validate: inactive backend and missing backend -----------------------------------------------
def test_backend_alone_does_not_enable_flex(caplog):
    cfg = container(moe(moe_flex_dispatcher_backend="torch"))
    probe = Probe(HOPPER)
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(2, device=probe)
    d = res.decisions.get("model.moe_flex_dispatcher_backend")
    assert (d.requested, d.effective, d.decided_by) == ("torch", None, "rule")
    assert "inactive" in d.reason and "alone does not switch" in d.reason
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "alltoall"
    assert cfg.resolved.kernels.moe_flex_dispatcher_backend is None
    # finalize writes nothing back: the model keeps what was typed, the resolution what runs
    assert cfg.model.moe_flex_dispatcher_backend == "torch"
    assert probe.calls == 0
    assert "model.moe_flex_dispatcher_backend" in caplog.text


def test_backend_alone_is_error_in_strict_mode():
    with pytest.raises(ConfigError) as exc:
        container(moe(moe_flex_dispatcher_backend="deepep"), strict=True).finalize(
            2, device=Probe(VOLTA)
        )
    assert exc.value.field == "model.moe_flex_dispatcher_backend"
    assert "moe_token_dispatcher_type=flex" in exc.value.fix


def test_non_flex_type_with_gpu_backend_never_probes_device():
    # Reference TestValidateDeepEP (13): type alltoall with backend deepep on Volta -> no error, no
    # probe.
    probe = Probe(VOLTA)
    m = moe(moe_flex_dispatcher_backend="deepep")
    validate_flex_dispatcher_backend(m, DecisionLog(strict=False), probe)
    assert probe.calls == 0


def test_flex_without_backend_falls_back_to_alltoall(caplog):
    cfg = container(moe(moe_token_dispatcher_type="flex"))
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(2, device=Probe(None))
    d = res.decisions.get("model.moe_token_dispatcher_type")
    assert (d.requested, d.effective, d.decided_by) == ("flex", "alltoall", "rule")
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "alltoall"
    assert cfg.model.moe_token_dispatcher_type == "flex"
    assert "falls back to alltoall" in caplog.text


def test_flex_without_backend_is_error_in_strict_mode():
    with pytest.raises(ConfigError) as exc:
        container(moe(moe_token_dispatcher_type="flex"), strict=True).finalize(
            2, device=Probe(None)
        )
    assert exc.value.field == "model.moe_token_dispatcher_type"


def test_clearing_backend_after_apply_restores_alltoall():
    # Reference TestFlexDispatcherFallback (9): apply deepep, clear the backend, validate ->
    # alltoall.
    m = moe()
    apply_flex_dispatcher_backend(m, "deepep")
    m.moe_flex_dispatcher_backend = None
    runs = validate_flex_dispatcher_backend(m, DecisionLog(strict=False), Probe(HOPPER))
    assert runs == ("alltoall", None)


# --- validate: torch backend ----------------------------------------------------------------------
def test_torch_backend_is_fine_without_gpu():
    probe = Probe(None)
    cfg = container(moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="torch"))
    res = cfg.finalize(2, device=probe)
    d = res.decisions.get("model.moe_token_dispatcher_type")
    assert (d.effective, d.decided_by) == ("flex", "rule")
    assert "torch" in d.reason
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "flex"
    assert probe.calls == 0


def test_torch_backend_through_apply_then_finalize():
    m = moe()
    apply_flex_dispatcher_backend(m, "torch")
    cfg = container(m, strict=True)
    cfg.finalize(2, device=Probe(None))
    assert (
        cfg.resolved.kernels.moe_token_dispatcher_type,
        cfg.resolved.kernels.moe_flex_dispatcher_backend,
    ) == (
        "flex",
        "torch",
    )


def test_unknown_backend_in_validation_is_error():
    with pytest.raises(ConfigError) as exc:
        container(
            moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="magic")
        ).finalize(2, device=Probe(HOPPER))
    assert exc.value.field == "model.moe_flex_dispatcher_backend"


# --- validate: GPU backends -----------------------------------------------------------------------
def _gpu(backend: str) -> ConfigContainer:
    return container(moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend))


@pytest.mark.parametrize(
    "dev", [VOLTA, PASCAL, GB200, WEIRD], ids=["volta", "pascal", "gb200", "major200"]
)
def test_deepep_on_unsupported_gpu_falls_back_and_strict_refuses(dev, with_deep_ep, caplog):
    probe = Probe(dev)
    cfg = _gpu("deepep")
    with caplog.at_level(logging.WARNING, logger="overlap.config"):
        res = cfg.finalize(2, device=probe)
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "alltoall" and probe.calls == 1
    reason = res.decisions.get("model.moe_flex_dispatcher_backend").reason
    assert (
        DEEPEP_MSG in reason and f"Current GPU: {dev.name}" in reason and "alltoall" in caplog.text
    )
    with pytest.raises(ConfigError) as exc:
        container(
            moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"), strict=True
        ).finalize(2, device=Probe(dev))
    assert exc.value.field == "model.moe_flex_dispatcher_backend" and DEEPEP_MSG in str(exc.value)


@pytest.mark.parametrize("dev", [VOLTA, FUTURE], ids=["volta", "major11"])
def test_hybridep_on_unsupported_gpu_falls_back_and_strict_refuses(dev, with_deep_ep):
    cfg = _gpu("hybridep")
    res = cfg.finalize(2, device=Probe(dev))
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "alltoall"
    assert HYBRIDEP_MSG in res.decisions.get("model.moe_flex_dispatcher_backend").reason
    with pytest.raises(ConfigError) as exc:
        container(
            moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep"),
            strict=True,
        ).finalize(2, device=Probe(dev))
    assert HYBRIDEP_MSG in str(exc.value)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_gpu_backend_on_hopper_without_deep_ep_names_the_library(backend, no_deep_ep):
    with pytest.raises(ConfigError) as exc:
        _gpu(backend).finalize(2, device=Probe(HOPPER))
    assert exc.value.field == "model.moe_flex_dispatcher_backend"
    assert "deep_ep" in str(exc.value)
    assert "DeepEP library" in str(exc.value)
    assert "torch" in exc.value.fix


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_gpu_backend_without_any_gpu_is_error(backend, with_deep_ep):
    with pytest.raises(ConfigError) as exc:
        _gpu(backend).finalize(2, device=Probe(None))
    assert "needs a CUDA GPU" in str(exc.value)


@pytest.mark.parametrize(
    "backend,dev",
    [
        ("deepep", AMPERE),
        ("deepep", HOPPER),
        ("deepep", B200),
        ("deepep", B300),
        ("hybridep", AMPERE),
        ("hybridep", HOPPER),
        ("hybridep", GB200),
    ],
)
def test_gpu_backend_on_supported_gpu_with_library(backend, dev, with_deep_ep):
    probe = Probe(dev)
    cfg = _gpu(backend)
    res = cfg.finalize(2, device=probe)
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "flex"
    assert cfg.resolved.kernels.moe_flex_dispatcher_backend == backend
    assert res.decisions.get("model.moe_token_dispatcher_type").effective == "flex"
    assert probe.calls == 1


def test_device_error_propagates():
    # Reference TestApplyDeepEP (4): an error from the CUDA probe is not swallowed.
    def broken():
        raise RuntimeError("CUDA driver exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        _gpu("deepep").finalize(2, device=broken)


def test_device_support_tables():
    assert deepep_supported(AMPERE) and deepep_supported(HOPPER)
    assert deepep_supported(B200) and deepep_supported(B300)
    assert (
        not deepep_supported(GB200) and not deepep_supported(VOLTA) and not deepep_supported(WEIRD)
    )
    assert all(hybridep_supported(d) for d in (AMPERE, HOPPER, B200, GB200))
    assert not hybridep_supported(VOLTA) and not hybridep_supported(FUTURE)


def test_flex_with_ep_overlap_and_strict():
    cfg = container(moe(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="torch"))
    cfg.comm_overlap = CommOverlapConfig(
        tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True, strict=True
    )
    cfg.finalize(2, device=Probe(None))
    assert cfg.resolved.overlap.overlap_moe_expert_parallel_comm is True
    assert cfg.resolved.kernels.moe_token_dispatcher_type == "flex"
