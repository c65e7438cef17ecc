"""The runtime's own CUDA streams (timing, the split sizes' copy) and the small CUDA surface they
use, behind one object that tests replace with stand-ins.

Why streams of our own. torch hands out streams from per-device pools of 32, round robin: a
low-priority pool, from which ProcessGroupNCCL takes its communicators' streams,
`torch.cuda.Stream()` draws, and `Future.then` runs its callbacks on; and a high-priority pool that
NCCL leaves alone (its `is_high_priority_stream` option is off). A wait put on a low-priority pool
stream - a timing callback's, a side copy's - lands, once the round robin wraps, on some
communicator's stream: that communicator's later operations then wait for another group's
collective, a false dependency that is slow for certain and can close a cycle across pipeline
neighbours (a hang). So the runtime never times through `Future.then`, and every stream it waits on
is `named(purpose, device)`: drawn once from the high-priority pool and kept for the process (two of
the pool's 32; nothing else of ours draws from it).

One hardware queue. With `CUDA_DEVICE_MAX_CONNECTIONS=1` (the launch rule for TP > 1 without EP
overlap, as Megatron's) every stream feeds one hardware queue in submission order, so a wait on any
stream holds every later submission of every stream until it is satisfied. `one_queue()` says
whether this process runs so; the tracer then times a collective's end where the compute stream
waits for it anyway (`overlap.parallel.trace.DeviceTimeline`), and the program replay models that
queue (`overlap.parallel.program.replay(one_queue=True)`).

Process-wide on purpose, unlike a run's communication session and recorder: the CUDA surface and
the named streams are properties of the process and its devices, not of a run. Two runs in one
process draw from the same device's stream pools, so they share the two named streams rather than
each draw two more (the pool's round robin would then hand a communicator's stream to one of them);
and the CUDA surface is the device API the process has. Only tests replace it (`set_api`), for the
extent of a block, on a CPU where no run has a device.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

CONNECTIONS_VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"


def one_queue(environ: dict[str, str] | None = None) -> bool:
    """Whether CUDA feeds every stream of this process into one hardware queue (module docstring):
    `CUDA_DEVICE_MAX_CONNECTIONS=1`, as the launcher set it before CUDA started."""
    return (os.environ if environ is None else environ).get(CONNECTIONS_VARIABLE) == "1"


class CudaStreams:
    """What the runtime asks of CUDA for its side and timing streams. Tests give a stand-in with the
    same methods (`set_api`), so the CUDA branches run on a CPU."""

    def on_device(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lives where streams apply (a CUDA tensor)."""
        return tensor.is_cuda

    def new_stream(self, device: torch.device) -> Any:
        """A stream from the high-priority pool (module docstring; a negative priority draws from
        it)."""
        return torch.cuda.Stream(device, priority=-1)

    def use(self, stream: Any) -> AbstractContextManager:
        """Make `stream` the current stream inside the block (a work's `wait()` then orders it)."""
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def follow_current(self, stream: Any) -> None:
        """`stream` waits for everything queued so far on the current stream."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory: a copy into it can run asynchronously."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor` (made on another stream) is read on `stream`: the allocator must not reuse it
        before `stream` is done with it."""
        tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()


_api: CudaStreams = CudaStreams()
_named: dict[tuple[str, Any], Any] = {}


def api() -> CudaStreams:
    return _api


def named(purpose: str, device: torch.device) -> Any:
    """This process's stream for `purpose` ("timing", "split_sizes") on `device`, made on first use
    from the high-priority pool and reused."""
    key = (purpose, device)
    if key not in _named:
        _named[key] = _api.new_stream(device)
    return _named[key]


@contextmanager
def set_api(replacement: CudaStreams) -> Iterator[CudaStreams]:
    """Tests: run the block with `replacement` (stand-in streams and events) as the CUDA surface,
    with fresh named streams; restored after."""
    global _api
    saved, saved_named = _api, dict(_named)
    _api = replacement
    _named.clear()
    try:
        yield replacement
    finally:
        _api = saved
        _named.clear()
        _named.update(saved_named)
