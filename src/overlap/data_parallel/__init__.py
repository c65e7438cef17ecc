"""Data-parallel communication: bucketed gradient buffers, (overlapped) gradient reduction, the
distributed optimizer and its (overlapped, optionally fp8) parameter gather."""

from overlap.data_parallel.ddp import DistributedDataParallel
from overlap.data_parallel.distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedDataParallel", "DistributedOptimizer"]
