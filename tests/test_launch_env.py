"""Launch-environment rules (Bridge HEAD's `run_script.py` environment compatibility): one test per
rule row."""

from __future__ import annotations

import pytest

from overlap.errors import ConfigError
from overlap.launch.env import (
    CUDA_DEVICE_MAX_CONNECTIONS,
    NVTE_BWD_LAYERNORM_SM_MARGIN,
    NVTE_FWD_LAYERNORM_SM_MARGIN,
    RULE_VARIABLES,
    VALID_ACCELERATORS,
    LaunchEnvInputs,
    apply_launch_env,
    compute_launch_env,
    default_gpus_per_node,
    format_launch_env,
)
from overlap.layout import ParallelLayout

CDMC = CUDA_DEVICE_MAX_CONNECTIONS


def inputs(
    accelerator: str = "h100",
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    dp: int = 8,
    backend: str | None = None,
    dispatcher: str = "alltoall",
    a2a_overlap: bool = False,
) -> LaunchEnvInputs:
    return LaunchEnvInputs(
        accelerator=accelerator,
        layout=ParallelLayout(world_size=tp * cp * pp * dp, tp=tp, cp=cp, pp=pp),
        moe_flex_dispatcher_backend=backend,
        moe_token_dispatcher_type=dispatcher,
        overlap_moe_expert_parallel_comm=a2a_overlap,
    )


def by_name(settings):
    return {s.name: s for s in settings}


def values(settings):
    return {s.name: s.value for s in settings}


def test_default_is_8_connections_and_margin_16():
    settings = compute_launch_env(inputs())
    assert [s.name for s in settings] == list(RULE_VARIABLES)
    assert values(settings) == {
        CDMC: "8",
        NVTE_FWD_LAYERNORM_SM_MARGIN: "16",
        NVTE_BWD_LAYERNORM_SM_MARGIN: "16",
    }
    assert all(s.source == "rule" and s.reason for s in settings)


@pytest.mark.parametrize("backend", ["deepep", "hybridep"])
def test_flex_fast_backend_gives_32_connections_and_margin_20(backend):
    settings = by_name(compute_launch_env(inputs(backend=backend, dispatcher="flex")))
    assert settings[CDMC].value == "32"
    assert backend in settings[CDMC].reason
    assert settings[NVTE_FWD_LAYERNORM_SM_MARGIN].value == "20"
    assert settings[NVTE_BWD_LAYERNORM_SM_MARGIN].value == "20"


def test_backend_without_flex_dispatcher_keeps_defaults():
    settings = values(compute_launch_env(inputs(backend="deepep", dispatcher="alltoall")))
    assert settings == {
        CDMC: "8",
        NVTE_FWD_LAYERNORM_SM_MARGIN: "16",
        NVTE_BWD_LAYERNORM_SM_MARGIN: "16",
    }


@pytest.mark.parametrize("accelerator", ["b200", "b300", "gb200", "gb300", "vr200"])
def test_sm100_class_gives_32_even_with_tp(accelerator):
    # HEAD rule: unconditional on these GPUs (unlike the older run_plugins variant that also
    # required DP or PP > 1).
    settings = by_name(compute_launch_env(inputs(accelerator=accelerator, tp=8, dp=1)))
    assert settings[CDMC].value == "32"
    assert "SM100" in settings[CDMC].reason
    assert settings[NVTE_FWD_LAYERNORM_SM_MARGIN].value == "16"


def test_h100_tp_without_a2a_overlap_gives_1():
    setting = by_name(compute_launch_env(inputs(tp=4, dp=2)))[CDMC]
    assert setting.value == "1"
    assert "TP>1" in setting.reason and "launch order" in setting.reason


def test_h100_cp_without_a2a_overlap_gives_1():
    setting = by_name(compute_launch_env(inputs(cp=2, dp=4)))[CDMC]
    assert setting.value == "1"
    assert "CP>1" in setting.reason


def test_h100_tp_with_a2a_overlap_stays_8():
    setting = by_name(compute_launch_env(inputs(tp=2, dp=4, a2a_overlap=True)))[CDMC]
    assert setting.value == "8"
    assert "overlap" in setting.reason


def test_h100_tp_with_deepep_and_no_a2a_overlap_gives_1():
    # The TP/CP rule runs after the backend rule and replaces its 32; the margins keep the deepep
    # value.
    settings = by_name(compute_launch_env(inputs(tp=2, backend="deepep", dispatcher="flex")))
    assert settings[CDMC].value == "1"
    assert settings[NVTE_FWD_LAYERNORM_SM_MARGIN].value == "20"


def test_cpu_leaves_everything_unset_with_reason():
    settings = compute_launch_env(
        inputs(accelerator="cpu", tp=2, backend="deepep", dispatcher="flex")
    )
    assert [s.name for s in settings] == list(RULE_VARIABLES)
    for s in settings:
        assert s.value is None
        assert s.source == "rule"
        assert "not applicable on CPU" in s.reason
    env: dict[str, str] = {}
    apply_launch_env(settings, env)
    assert env == {}


def test_recipe_env_replaces_rule_value_and_adds_sorted_extras():
    recipe = {
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        CDMC: "32",
        "NCCL_NVLS_ENABLE": "0",
        NVTE_FWD_LAYERNORM_SM_MARGIN: 10,
    }
    settings = compute_launch_env(inputs(tp=2), recipe_env=recipe)
    assert [s.name for s in settings] == [
        *RULE_VARIABLES,
        "NCCL_NVLS_ENABLE",
        "TORCH_NCCL_HIGH_PRIORITY",
    ]
    named = by_name(settings)
    assert (named[CDMC].value, named[CDMC].source) == ("32", "recipe")
    assert "replaces the rule value 1" in named[CDMC].reason
    assert named[NVTE_FWD_LAYERNORM_SM_MARGIN].value == "10"
    assert (
        named[NVTE_BWD_LAYERNORM_SM_MARGIN].value,
        named[NVTE_BWD_LAYERNORM_SM_MARGIN].source,
    ) == ("16", "rule")
    assert (named["NCCL_NVLS_ENABLE"].value, named["NCCL_NVLS_ENABLE"].source) == ("0", "recipe")


def test_recipe_env_rejects_non_text_values():
    with pytest.raises(ConfigError) as info:
        compute_launch_env(inputs(), recipe_env={"NCCL_NVLS_ENABLE": 1.5})
    assert info.value.field == "env_vars.NCCL_NVLS_ENABLE"


def test_user_env_wins_and_apply_never_overwrites():
    user = {CDMC: "2", "NCCL_NVLS_ENABLE": "1", "HOME": "/home/u"}
    recipe = {CDMC: "32", "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_HIGH_PRIORITY": "1"}
    settings = compute_launch_env(inputs(tp=2), recipe_env=recipe, user_env=user)
    named = by_name(settings)
    assert "HOME" not in named  # only names a rule or the recipe decides are reported
    for name in (CDMC, "NCCL_NVLS_ENABLE"):
        assert named[name].value == user[name]
        assert named[name].source == "user environment"
        assert named[name].reason == "set in the launching environment; never overridden"
    assert named["TORCH_NCCL_HIGH_PRIORITY"].source == "recipe"

    worker_env = {CDMC: "3", "PATH": "/usr/bin"}
    apply_launch_env(settings, worker_env)
    # already present: never overwritten, even by a user-environment setting
    assert worker_env[CDMC] == "3"
    assert worker_env["PATH"] == "/usr/bin"
    assert worker_env["NCCL_NVLS_ENABLE"] == "1"
    assert worker_env["TORCH_NCCL_HIGH_PRIORITY"] == "1"
    assert worker_env[NVTE_FWD_LAYERNORM_SM_MARGIN] == "16"


def test_user_env_wins_on_cpu_too():
    named = by_name(compute_launch_env(inputs(accelerator="cpu"), user_env={CDMC: "1"}))
    assert (named[CDMC].value, named[CDMC].source) == ("1", "user environment")
    assert named[NVTE_FWD_LAYERNORM_SM_MARGIN].value is None


def test_format_launch_env_lists_every_name_aligned():
    settings = compute_launch_env(
        inputs(tp=2),
        recipe_env={"TORCH_NCCL_HIGH_PRIORITY": "1"},
        user_env={NVTE_BWD_LAYERNORM_SM_MARGIN: "8"},
    )
    text = format_launch_env(settings)
    lines = text.splitlines()
    assert len(lines) == len(settings) + 1
    for s in settings:
        assert s.name in text
        assert s.source in text
    # The value column starts at the same offset on every row.
    offsets = {line.index(value) for line, value in zip(lines[1:], [s.value for s in settings])}
    assert len(offsets) == 1
    cpu_text = format_launch_env(compute_launch_env(inputs(accelerator="cpu")))
    assert cpu_text.count("(unset)") == 3


@pytest.mark.parametrize("bad", ["a100", "", "H100x"])
def test_unknown_accelerator_raises_config_error(bad):
    with pytest.raises(ConfigError) as info:
        compute_launch_env(inputs(accelerator=bad))
    assert info.value.field == "--gpu"
    assert info.value.value == bad
    for name in VALID_ACCELERATORS:
        assert name in info.value.fix
    with pytest.raises(ConfigError):
        default_gpus_per_node(bad, 8)


@pytest.mark.parametrize(
    "accelerator, expected",
    [("h100", 8), ("b200", 8), ("b300", 8), ("gb200", 4), ("gb300", 4), ("vr200", 4), ("r100", 1)],
)
def test_default_gpus_per_node(accelerator, expected):
    assert default_gpus_per_node(accelerator, 16) == expected


def test_default_gpus_per_node_cpu_is_all_ranks_local():
    assert default_gpus_per_node("cpu", 4) == 4
    assert default_gpus_per_node("cpu", 1) == 1
    with pytest.raises(ConfigError) as info:
        default_gpus_per_node("cpu", 0)
    assert info.value.field == "--num_gpus"
