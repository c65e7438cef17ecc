"""The MoE dispatchers' split sizes on the host: the one host read of a layer's micro-batch, and its
dry-run answer.

An all-to-all needs its split sizes on the host, so each dispatcher reads the exchanged counts once
per layer and micro-batch (`read_split_sizes`). In a dry run (`overlap run --dry-run`,
`overlap.perf.dry_run`) the tensors are fakes with no values and nobody knows the routing, so that
read is answered instead by balanced routing (`balanced_routing`): each EP rank spreads its T
x k routed (token, expert) pairs over the E experts as evenly as integers allow, T x k // E per
expert, and the remainder goes one extra pair to each of the next (T x k) % E experts, starting at a
different expert on each EP rank, so that the receivers stay as even as the senders. Every EP rank
holds the same number of tokens (one micro-batch shape), so each rank can work out what its peers
send it. A capacity without padding clamps the counts as the routing would. The loop permutation
(`moe_permute_fusion=false`, one data-dependent `torch.where` per expert, each a host sync on a GPU)
is answered the same way (`loop_permutation_counts`). This is the only place that answers a read
with something else, and only inside a dry run's `with balanced_routing(...)`: it must say so in its
report. The switch is the dry run's, not the process's (a context variable, as the run's
communication session and recorder are): code running beside it, or after it, reads for real.

On CUDA the read must not wait for more than the counts: a plain `.tolist()` copies on the current
stream, so it waits for everything queued there - in the EP-overlap step, the other micro-batch's
weight-gradient GEMMs issued as cover before the counts' wait. So the counts go to pinned host
memory on a side stream that waits for the counts exchange itself (`CommHandle.output_on`: the
exchange's input was written before its launch, its output by the exchange; a counts group of one
member - EP 1, or the `ep` family made free - exchanges nothing, and the side stream then follows
the compute stream to where the counts were written), queued before the scheduler's wait issues
that cover, and the host waits for that copy's event only. The side stream is the process's named
"split_sizes" stream from the high-priority pool (`overlap.parallel.streams`: a low-priority pool
stream can be a communicator's). (Not yet run on a GPU; tests run this branch on the CPU with
stand-in streams.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from overlap.parallel import comm, streams


@dataclass(frozen=True)
class BalancedRouting:
    """Balanced routing of `tokens` tokens per EP rank, `topk` experts each, over `num_experts`
    experts split in `ep_size` equal blocks (EP rank r owns experts r x E/ep ... (r+1) x E/ep -
    1)."""

    tokens: int
    topk: int
    num_experts: int
    ep_size: int
    # at most this many rows per expert from one rank (an unpadded capacity)
    capacity: int | None = None

    def pairs(self, source: int, expert: int) -> int:
        """Routed (token, expert) pairs EP rank `source` sends to `expert`."""
        base, extra = divmod(self.tokens * self.topk, self.num_experts)
        count = base + (1 if (expert - source * extra) % self.num_experts < extra else 0)
        return count if self.capacity is None else min(count, self.capacity)

    def alltoall_counts(self, ep_rank: int) -> list[int]:
        """`AllToAllDispatcher`'s host counts on EP rank `ep_rank`: [E] rows it sends per expert,
        then [ep x E_local] rows it receives per (source rank, local expert)."""
        el = self.num_experts // self.ep_size
        sent = [self.pairs(ep_rank, g) for g in range(self.num_experts)]
        received = [self.pairs(s, ep_rank * el + e) for s in range(self.ep_size) for e in range(el)]
        return sent + received

    def flex_counts(self, ep_rank: int) -> list[list[list[int]]]:
        """`FlexDispatcher`'s host counts on EP rank `ep_rank`: [2 (sent, received), ep, 1 +
        E_local], each entry (rows, pairs per local expert). A token crosses to a rank once whatever
        number of its experts live there; the pairs a rank gets are taken to come from distinct
        tokens (at most T), the most rows, so the dry run's bytes are an upper bound for this
        routing."""
        el = self.num_experts // self.ep_size

        def entry(source: int, dest: int) -> list[int]:
            pairs = [self.pairs(source, dest * el + e) for e in range(el)]
            return [min(self.tokens, sum(pairs)), *pairs]

        return [
            [entry(ep_rank, r) for r in range(self.ep_size)],
            [entry(s, ep_rank) for s in range(self.ep_size)],
        ]


SPLIT_SIZE_READ = "split sizes"
LOOP_PERMUTATION = "loop permutation"
"""What an answer stood in for: a dispatcher's split-size read, or one expert's data-dependent
selection in the loop permutation."""

# None outside a dry run; in one, told of every answered read (`balanced_routing`)
_ANSWERED: ContextVar[Callable[[str], None] | None] = ContextVar(
    "overlap_split_sizes_answered", default=None
)


@contextmanager
def balanced_routing(on_answer: Callable[[str], None]) -> Iterator[None]:
    """Dry run only: inside the block answer the split-size reads (and the loop permutation's
    selections) with balanced routing, calling `on_answer(what)` for each answer (`SPLIT_SIZE_READ`
    or `LOOP_PERMUTATION`) so that the report can count them (and name the reading line); what was
    in force before comes back after."""
    token = _ANSWERED.set(on_answer)
    try:
        yield
    finally:
        _ANSWERED.reset(token)


def loop_permutation_counts(tokens: int, topk: int, num_experts: int) -> list[int] | None:
    """In a dry run, the rows per expert the loop permutation would select from `tokens` tokens
    under balanced routing (one answer per expert, as each expert's selection is one read); None
    outside one. Any EP rank's counts are a rotation of these, so the kept totals a capacity leaves
    match the dispatcher's own answer."""
    answered = _ANSWERED.get()
    if answered is None:
        return None
    routing = BalancedRouting(tokens, topk, num_experts, 1)
    counts = []
    for expert in range(num_experts):
        answered(LOOP_PERMUTATION)
        counts.append(routing.pairs(0, expert))
    return counts


def read_split_sizes(
    sent: torch.Tensor,
    exchange: comm.CommHandle,
    wait: Callable[[comm.CommHandle], torch.Tensor],
    balanced: Callable[[], list[int]],
) -> tuple[list[int], torch.Tensor]:
    """THE host read of a layer's split sizes: waits for the counts `exchange` (by the scheduler's
    `wait`) and returns (the int64 counts `sent` then those received, flattened, as host ints - in a
    dry run `balanced()`, the same list from `BalancedRouting` -, the received counts tensor)."""
    answered = _ANSWERED.get()
    if answered is not None:
        answered(SPLIT_SIZE_READ)
        return balanced(), wait(exchange)
    if streams.api().on_device(sent):
        copied, host = _copy_on_side_stream(sent, exchange)
        received = wait(exchange)
        copied.synchronize()
        return host.tolist(), received
    received = wait(exchange)
    return torch.cat([sent.reshape(-1), received.reshape(-1)]).tolist(), received


def _copy_on_side_stream(sent: torch.Tensor, exchange: comm.CommHandle) -> tuple[Any, torch.Tensor]:
    """CUDA: queue the copy of `sent` and of what `exchange` receives into pinned host memory on the
    side stream, ordered after the exchange alone (module docstring); returns (the copy's event, the
    host tensor it fills)."""
    api = streams.api()
    side = streams.named("split_sizes", sent.device)
    received = exchange.output_on(side)
    host = api.pinned(sent.numel() + received.numel(), torch.int64)
    with api.use(side):
        for t, part in ((sent, host[: sent.numel()]), (received, host[sent.numel() :])):
            # made on the current stream, read here: not reused before this copy is done
            api.keep_for(t, side)
            part.copy_(t.reshape(-1), non_blocking=True)
        copied = api.event()
        copied.record(side)
    return copied, host
