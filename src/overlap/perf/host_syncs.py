"""Host synchronisations of a step, found on a CPU: every op that would make the host wait for the
GPU.

On a GPU the host must stay ahead of the device for overlap to work: each read of device data on the
host (`.item()`, `.tolist()`, `bool(t)`, a copy to the host) and each op whose output size depends
on the values (`nonzero`, boolean-mask indexing, `torch.where(cond)` with one argument,
`masked_select`, `unique`, `bincount`, `repeat_interleave` without `output_size`) waits for
everything queued before it, and so does a copy from pageable host memory to the device (a
`torch.tensor` of Python data made on the device, a host tensor's `.to(device)` that is not pinned
and non-blocking: CUDA stages it through a driver buffer and synchronises the stream). On a CPU
these ops run without waiting for anything, so timing cannot find them: `HostSyncRecorder`
classifies by the op's name (`sync_reason`), from a dispatch mode (what aten runs) and a function
mode (what never reaches aten: `Tensor.tolist`, `Tensor.cpu`, `Tensor.numpy`,
`torch.tensor(list)`), and names our line that asked for it (`caller`, the source-line attribution
`overlap run --dry-run` uses for its host reads too).

Each record says which of the step's needed reads it is (`HostSync.kind`): the MoE split sizes
(`overlap.layers.moe.split_sizes.read_split_sizes`, the one read an all-to-all needs), one of
`INTENDED_READS` (the logged loss, the gradient norm), a tensor the caller names as living on the
host on a GPU run too (`host_tensors`: torch's Adam keeps its step counts on the CPU and reads them,
no device sync: `HOST_TENSOR`), or None: a sync the step should not have. The host-sync budget test
(tests/test_host_syncs.py) holds a training step to its exact count.
"""

from __future__ import annotations

import linecache
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from overlap.layers.moe import split_sizes
from overlap.layers.moe.split_sizes import read_split_sizes

SPLIT_SIZES = "the MoE split sizes"
HOST_TENSOR = "a host tensor's value (no device synchronisation; unknown to the dry run)"

# src/overlap: "our code" when a read is traced to its line
PACKAGE = Path(__file__).resolve().parent.parent
# the watchers (this module, the dry run) and the split-size hook: not the code a read is traced to
_OWN_FILES = {
    str(Path(__file__).resolve()),
    str(Path(__file__).with_name("dry_run.py").resolve()),
    str(Path(split_sizes.__file__).resolve()),
}
# torch's own machinery between an op and the code that called it: not what a reader wants named as
# the caller
_TORCH_PLUMBING = (
    "torch/_subclasses/",
    "torch/utils/",
    "torch/_ops.py",
    "torch/_compile.py",
    "torch/_dynamo/",
    "torch/overrides.py",
    "torch/_tensor.py",
)

# The host reads a step is meant to make, by (file in the package, function, text of the line):
# anything else the dry run or the recorder finds is unintended (the host-sync budget). The MoE
# split sizes are answered by balanced routing instead (`overlap.layers.moe.split_sizes`) and are
# intended by construction.
INTENDED_READS = (
    ("training/trainer.py", "train_step", "float(loss_sum)", "the logged loss"),
    (
        "optim/adam.py",
        "global_grad_norm",
        "float(total)",
        "the gradient norm (clipping, the log, the fp16 overflow skip: overlap.optim.loss_scaler; "
        "the sync-free MoE dispatch's overflow count: overlap.layers.moe.rank_capacity)",
    ),
)

_aten = torch.ops.aten
# aten ops that read device data on the host whatever their arguments (the packet: every overload)
_ALWAYS = {
    _aten._local_scalar_dense: "a scalar read (.item(), float(t), int(t), bool(t))",
    _aten.equal: "torch.equal (its bool comes back to the host)",
    _aten.nonzero: "nonzero (also torch.where(cond) and argwhere): the output size is read",
    _aten.masked_select: "masked_select: the output size is read",
    _aten._unique: "unique: the output size is read",
    _aten._unique2: "unique: the output size is read",
    _aten.unique_dim: "unique: the output size is read",
    _aten.unique_consecutive: "unique_consecutive: the output size is read",
    _aten.bincount: "bincount: reads the values' min and max",
}
_INDEXING = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
# Called from Python, never reaching aten on a CPU (or only as an op that does not show the read)
_HOST_COPIES = {
    torch.Tensor.tolist: "Tensor.tolist: a copy to the host",
    torch.Tensor.cpu: "Tensor.cpu: a copy to the host",
    torch.Tensor.numpy: "Tensor.numpy: a copy to the host",
}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def sync_reason(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str | None:
    """Why aten op `func` with these arguments would make the host wait for the GPU, or None if it
    would not."""
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return _ALWAYS[packet]
    if packet in _INDEXING and any(
        _is_mask(i) for i in tree_flatten(args[1] if len(args) > 1 else ())[0]
    ):
        return "boolean-mask indexing: the output size is read"
    if func is _aten.repeat_interleave.Tensor or func is _aten.repeat_interleave.self_Tensor:
        if kwargs.get("output_size") is None:
            return (
                "repeat_interleave of a tensor of repeats without output_size: the output size is "
                "read"
            )
    if host_copy(func, args, kwargs):
        return "a copy to the host"
    if pageable_upload(func, args, kwargs):
        return (
            "a host-to-device copy from pageable memory (stage it in pinned memory and copy "
            "non-blocking)"
        )
    return None


def pageable_upload(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether aten op `func` copies host memory to a device synchronously: the source is not
    page-locked, or the copy is not asked to be non-blocking (CUDA then waits for the stream)."""
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        source = args[0]
        blocking = not kwargs.get("non_blocking", False)
    elif func is _aten.copy_.default:
        target, source = args[0].device, args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    else:
        return False
    return (
        target is not None
        and torch.device(target).type != "cpu"
        and source.device.type == "cpu"
        and (blocking or not source.is_pinned())
    )


def host_copy(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether aten op `func` copies device data into host memory (on a GPU the host waits for it: a
    read without `.item()`)."""
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        return (
            target is not None
            and torch.device(target).type == "cpu"
            and args[0].device.type != "cpu"
        )
    return (
        func is _aten.copy_.default
        and args[0].device.type == "cpu"
        and args[1].device.type != "cpu"
    )


# a code object's file -> overlap/... when it is our code, else None
_relative_names: dict[str, str | None] = {}


def package_path(filename: str) -> str | None:
    """`filename` as overlap/..., or None when it is not our code (this module and the split-size
    hook are not: they only watch)."""
    if filename not in _relative_names:
        path = Path(filename).resolve()
        ours = path.is_relative_to(PACKAGE) and str(path) not in _OWN_FILES
        _relative_names[filename] = str(path.relative_to(PACKAGE.parent)) if ours else None
    return _relative_names[filename]


def our_frame(frame):
    """The innermost frame of our code from `frame` outwards, or None (autograd's own threads have
    none)."""
    while frame is not None and package_path(frame.f_code.co_filename) is None:
        frame = frame.f_back
    return frame


def caller(frame=None) -> tuple[str, str, str, str | None] | None:
    """(file:line, function, line text, torch function in between) of the innermost frame of our
    code on the current stack, or None when there is none."""
    frame = frame or sys._getframe(1)
    ours = our_frame(frame)
    if ours is None:
        return None
    via = None
    while frame is not ours:
        name = frame.f_code.co_filename
        if via is None and "torch/" in name and not any(p in name for p in _TORCH_PLUMBING):
            via = f"{name.split('site-packages/')[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    name, line = ours.f_code.co_filename, ours.f_lineno
    return (
        f"{package_path(name)}:{line}",
        ours.f_code.co_name,
        linecache.getline(name, line).strip(),
        via,
    )


def intended_read(site: str, function: str, code: str) -> str | None:
    """Why the read at this line is one the step needs (`INTENDED_READS`), or None."""
    for path, fn, text, why in INTENDED_READS:
        if site.startswith(f"overlap/{path}:") and function == fn and text in code:
            return why
    return None


@dataclass(frozen=True)
class HostSync:
    """One op of the step that would synchronise the host with the GPU."""

    # file:line of our code that asked for it (overlap/...), or a placeholder when none is on the
    # stack
    site: str
    function: str
    code: str  # the line's text
    op: str  # the aten op or the Python function
    reason: str
    via: str | None  # the torch function between our line and the op, if any (an optimizer step)
    # SPLIT_SIZES, HOST_TENSOR, the dry run's reason for an intended read, or None: not needed
    kind: str | None

    def describe(self) -> str:
        via = f" via {self.via}" if self.via else ""
        return f"{self.site} ({self.function}): {self.code}{via} -> {self.op}: {self.reason}"


def _split_size_read(frame: FrameType | None) -> bool:
    """The op was asked for by `read_split_sizes` itself: not by anything it calls (the scheduler's
    wait inside it runs queued weight-gradient GEMMs, whose syncs are not the split sizes)."""
    while frame is not None and (
        frame.f_code.co_filename == __file__ or "/torch/" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    return frame is not None and frame.f_code is read_split_sizes.__code__


class _FunctionWatch(TorchFunctionMode):
    """What the dispatch mode cannot see: host copies and tensors made from Python data."""

    def __init__(self, recorder: HostSyncRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _HOST_COPIES.get(func)
        # `device="cpu"` spelled out makes a host tensor on a GPU run too (torch's foreach Adam
        # wraps its step increment so): no copy. A device taken from a tensor is the GPU there,
        # whatever it is here.
        if (
            reason is None
            and func in _FROM_DATA
            and args
            and not isinstance(args[0], torch.Tensor)
            and kwargs.get("device") != "cpu"
        ):
            reason = "a tensor from Python data: a host-to-device copy from pageable memory"
        if reason is None:
            return func(*args, **kwargs)
        self.recorder.record(sys._getframe(1), getattr(func, "__name__", str(func)), reason)
        # the aten ops it runs (a copy to the host on a GPU) are this one read
        self.recorder.inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.recorder.inside -= 1


class HostSyncRecorder(TorchDispatchMode):
    """`with HostSyncRecorder() as rec:` records in `rec.syncs` every op run inside that would
    synchronise the host with a GPU (module docstring), on this thread and in autograd's backward.
    `host_tensors`: tensors that stay on the host on a GPU run as well, whose scalar reads are
    HOST_TENSOR (no device sync)."""

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.syncs: list[HostSync] = []
        self.inside = 0
        self._host = {id(t) for t in host_tensors}  # the caller keeps them alive for the recording
        self._functions = _FunctionWatch(self)

    def __enter__(self) -> HostSyncRecorder:
        self._functions.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._functions.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.inside:
            reason = sync_reason(func, args, kwargs)
            if reason is not None:
                host = func is _aten._local_scalar_dense.default and id(args[0]) in self._host
                self.record(sys._getframe(1), str(func), reason, HOST_TENSOR if host else None)
        return func(*args, **kwargs)

    def record(self, frame: FrameType, op: str, reason: str, kind: str | None = None) -> None:
        site, function, code, via = caller(frame) or (
            "(no line of ours on the stack)",
            "-",
            "",
            None,
        )
        kind = kind or (
            SPLIT_SIZES if _split_size_read(frame) else intended_read(site, function, code)
        )
        self.syncs.append(HostSync(site, function, code, op, reason, via, kind))

    def by_kind(self) -> Counter:
        """How many syncs of each kind (None: the ones the step should not have)."""
        return Counter(s.kind for s in self.syncs)

    def unneeded(self) -> list[str]:
        """The syncs of no needed kind, one line per site with its count, for an assertion
        message."""
        sites = Counter(s.describe() for s in self.syncs if s.kind is None)
        return [f"x{n} {line}" for line, n in sites.items()]
