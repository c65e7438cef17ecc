"""No tensor is made on torch's default device behind the code's back.

GPU ranks install no default device (`torch.set_default_device` is a TorchFunctionMode that taxes
every torch call of the step), so every factory call in our code must name its device or take it
from an input (`ParallelState.device` for what has no input). A call that does not would make a CPU
tensor on a GPU rank: a device mix-up, or a silent host round trip. On the CPU ranks of the tests it
would pass unnoticed, so this test watches the calls themselves: it builds the tiny models (dense
and MoE, under TP, EP and PP) and trains them for a step under a TorchFunctionMode that records
every factory call from our source that does not pass `device`, by its line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import overlap
from overlap.parallel.state import ParallelState
from overlap.training.trainer import Trainer
from tests.configs import tiny_config
from tests.world import run_world

SOURCE = Path(overlap.__file__).parent
# torch's factories: without `device` each makes its tensor on the default device (torch.as_tensor
# of a tensor keeps the tensor's, and is told apart below)
FACTORIES: set[Callable] = {
    torch.empty,
    torch.empty_strided,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.arange,
    torch.range,
    torch.linspace,
    torch.logspace,
    torch.eye,
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}


class FactoryWatch(TorchFunctionMode):
    """Records `path:line torch.name` of every factory call made directly by our code without a
    device."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func in FACTORIES
            and kwargs.get("device") is None
            and not (func is torch.as_tensor and args and isinstance(args[0], torch.Tensor))
        ):
            caller = sys._getframe(1)  # the frame that called torch.<factory>
            path = Path(caller.f_code.co_filename)
            if path.is_relative_to(SOURCE):
                self.sites.add(
                    f"{path.relative_to(SOURCE.parent)}:{caller.f_lineno} torch.{func.__name__}"
                )
        return func(*args, **kwargs)


def _build_and_train(moe: bool, layout: dict[str, Any]) -> list[str]:
    """This rank's undeviced factory calls while building the Trainer and training one step (exit
    checks on)."""
    cfg = tiny_config(moe, "bf16_mixed", 2, ["train.exit_duration_in_mins=1000"], 1, **layout)
    res = cfg.finalize(dist.get_world_size())
    with FactoryWatch() as watch:
        Trainer(cfg, ParallelState(res.layout)).train()
    return sorted(watch.sites)


@pytest.mark.parametrize(
    "moe,layout",
    [
        (False, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
        (True, dict(expert_model_parallel_size=2)),
        (True, dict(pipeline_model_parallel_size=2)),
    ],
    ids=["dense_tp2_sp", "moe_ep2", "moe_pp2"],
)
def test_every_factory_call_names_its_device(moe: bool, layout: dict[str, Any]) -> None:
    sites = sorted({site for rank in run_world(2, _build_and_train, moe, layout) for site in rank})
    assert not sites, "factory calls without a device (made on the default device):\n" + "\n".join(
        sites
    )


def test_the_watch_sees_a_call_without_a_device() -> None:
    """The watch itself: a call from our source without `device` is recorded, one with it is not."""
    from overlap.layers.rotary import RotaryEmbedding

    with FactoryWatch() as watch:
        RotaryEmbedding(8, 10000.0, 4, torch.device("cpu"))
    assert not watch.sites
    with FactoryWatch() as watch:
        exec(compile("torch.zeros(())", str(SOURCE / "probe.py"), "exec"), {"torch": torch})
    assert watch.sites == {"overlap/probe.py:1 torch.zeros"}
