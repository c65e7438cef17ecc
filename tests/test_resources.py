"""The per-rank memory estimate (overlap.launch.resources): its parameter count is the model's own
(checked against the meta-device model), absurd sizes are refused without overflow, and the
local-launch limits say what to do."""

from __future__ import annotations

import pytest

from overlap.errors import ConfigError
from overlap.harness import resolve_run
from overlap.launch import resources
from overlap.training.dp_overlap_noops import _meta_chunk_params


def resolved(argv: str):
    job = resolve_run(argv.split(), [])
    return job.cfg, job.resolution


@pytest.mark.parametrize(
    "argv",
    [
        "-m qwen -mr dense_tiny -ng 1",
        "-m qwen -mr dense_tiny -ng 2 -tp 2",
        # one tensor, counted once
        "-m qwen -mr dense_tiny -ng 2 -tp 2 model.share_embeddings_and_output_weights=true",
        "-m qwen -mr qwen3_moe_tiny -ng 4 -ep 4",
        "-m qwen -mr qwen3_moe_tiny -ng 4 -tp 2 -ep 2 model.moe_layer_freq=2 "
        "model.moe_shared_expert_intermediate_size=64",
        "-m qwen -mr qwen3_30b_a3b -g h100 -ng 16",
    ],
)
def test_parameter_count_is_the_models(argv):
    cfg, res = resolved(argv)
    est = resources.estimate_memory(cfg, res.layout)
    meta = [p for chunk in _meta_chunk_params(cfg, res) for p in chunk]
    assert est.params == sum(p.numel() for p in meta)
    assert est.expert_params == sum(p.numel() for p in meta if getattr(p, "is_expert", False))
    assert est.largest_tensor == max(p.numel() for p in meta)


def test_distributed_optimizer_shards_the_state_and_bf16_adds_masters():
    cfg, res = resolved("-m qwen -mr dense_tiny -ng 2")
    plain = resources.estimate_memory(cfg, res.layout)
    # fp32: two moments, the parameter is its own master
    assert plain.optimizer_bytes == 8 * plain.params
    cfg, res = resolved(
        "-m qwen -mr dense_tiny -ng 2 -c bf16 ddp.use_distributed_optimizer=true "
        "optimizer.use_distributed_optimizer=true"
    )
    sharded = resources.estimate_memory(cfg, res.layout)
    assert sharded.param_bytes == 2 * sharded.params
    assert sharded.optimizer_bytes == 12 * -(-sharded.params // 2)


def test_absurd_sizes_do_not_overflow():
    """Refused where the command line is resolved (`harness.prepare` runs `check_representable`
    before anything builds even a meta-device model)."""
    with pytest.raises(ConfigError, match="cannot be represented"):
        resolved(
            "-m qwen -mr dense_tiny -ng 1 model.hidden_size=100000000000000000000 "
            "model.kv_channels=32"
        )


def test_local_launch_limits():
    cfg, res = resolved("-m qwen -mr dense_tiny -ng 2")
    resources.check_local_launch(cfg, res.layout, 2, env={}, host_bytes=2**40, cores=2)
    with pytest.raises(ConfigError, match=r"more than 8 per core \(16\)") as info:
        resources.check_local_launch(cfg, res.layout, 17, env={}, host_bytes=2**40, cores=2)
    assert info.value.field == "-ng/--num_gpus" and resources.FORCE_ENV in info.value.fix
    with pytest.raises(ConfigError, match="MiB on this host") as info:
        resources.check_local_launch(cfg, res.layout, 2, env={}, host_bytes=2**29, cores=2)
    # one rank fits, two do not: the rank count is named
    assert info.value.field == "-ng/--num_gpus"
    with pytest.raises(ConfigError) as info:
        resources.check_local_launch(
            cfg, res.layout, 2, env={}, host_bytes=2**20, cores=2, recipe="dense_tiny"
        )
    assert info.value.field == "-mr/--model_recipe_name"
    resources.check_local_launch(
        cfg, res.layout, 17, env={resources.FORCE_ENV: "1"}, host_bytes=2**20, cores=2
    )


def test_device_limit():
    cfg, res = resolved("-m qwen -mr qwen3_30b_a3b -g h100 -ng 8")
    with pytest.raises(ConfigError, match="NVIDIA H100 has 1.00 GiB"):
        resources.check_device(
            cfg, res.layout, 2**30, "NVIDIA H100", env={}, recipe="qwen3_30b_a3b"
        )
    resources.check_device(cfg, res.layout, 2**50, "big", env={})


def test_a_gpu_rank_under_torchrun_checks_its_device(monkeypatch):
    """No GPU needed: torch.cuda is stood in for; the rank compares the estimate with its device's
    memory."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(total_memory=2**30, name="Fake GPU"),
    )
    cfg, res = resolved("-m qwen -mr qwen3_30b_a3b -g h100 -ng 8")
    args = SimpleNamespace(
        gpu="h100", emit_slurm=None, num_gpus=8, model_recipe_name="qwen3_30b_a3b"
    )
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}
    with pytest.raises(ConfigError, match="Fake GPU has 1.00 GiB") as info:
        resources.check_run_resources(cfg, res.layout, args, env=env)
    assert info.value.field == "-mr/--model_recipe_name"
    assert (
        resources.check_run_resources(cfg, res.layout, args, env={**env, "OVERLAP_LAUNCHED": "1"})
        is None
    )
    assert (
        resources.check_run_resources(
            cfg, res.layout, SimpleNamespace(**{**vars(args), "emit_slurm": "x"}), env=env
        )
        is None
    )
