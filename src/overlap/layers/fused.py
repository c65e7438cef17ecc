"""Runs an elementwise chain eager or compiled: `run(fn, requested, *args)`.

`fn` is the one implementation (a pure function of tensors and Python scalars); its compiled form is
`torch.compile(fn, fullgraph=True, dynamic=True)`, made once per function and backend and shared by
every call site: `fullgraph` so that a graph break is an error rather than a silent split into eager
pieces, `dynamic` because token counts vary (the MoE rows per expert differ every step), so one
graph serves every size; sizes 0 and 1 get their own graph (dynamo specialises them), which bounds
the recompiles per function to a handful (dtypes, grad or not).

Whether it runs compiled is `overlap.config.fusion.fusion_on` for the switch and the tensors'
device. Under a `TorchDispatchMode` (the host-sync recorder, the dry run's fake tensors) the eager
function runs: dynamo does not trace under such a mode, and the eager ops are exactly what the mode
is there to see (the compiled graph is made of them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from overlap.config.fusion import fusion_on

BACKEND = "inductor"

_compiled: dict[tuple[Callable, str], Callable] = {}


def compiled(fn: Callable, backend: str = BACKEND) -> Callable:
    """`fn` compiled whole (fullgraph) for symbolic sizes, made on first use and kept."""
    key = (fn, backend)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)
    return _compiled[key]


def compiling(requested: bool | None, x: torch.Tensor) -> bool:
    """Whether a chain whose switch is `requested` (None: unset) runs compiled on `x`'s device."""
    return fusion_on(requested, x.device.type)[0] and not is_in_torch_dispatch_mode()


def run(fn: Callable, requested: bool | None, x: torch.Tensor, *args: Any) -> Any:
    """`fn(x, *args)`, compiled when the switch `requested` turns it on for `x` (`compiling`)."""
    return compiled(fn)(x, *args) if compiling(requested, x) else fn(x, *args)
