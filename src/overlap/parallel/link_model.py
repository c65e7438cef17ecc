"""The modelled link: an emulated interconnect's cost, added to collectives that really run.

A run's `comm.CommSession(link=LinkModel(...))` is the `--network model:LATENCY,BANDWIDTH` fallback
when no emulated interconnect can be set up. The collective still runs for real
(`overlap.parallel.comm`), so the data stays correct, but its completion is held back to `max(real
completion, start + modelled time)`. Real gloo traffic on a small CPU box is CPU work that fights
the compute for the cores; a modelled delay is pure waiting, which is what a fast interconnect looks
like to the compute, so overlap measured against it is credible (see docs/architecture.md,
"Measuring overlap honestly"). Each group has a "link free at" clock (`GroupLink.reserve`): two ops
in flight on one group queue one behind the other instead of overlapping for free. The clocks and
boards are the run's (`ModelledNetwork`, built by its session): two runs in one process never queue
on each other's.

A transfer on a modelled link starts when every side has posted, as NCCL's do: a point-to-point
send's posting time travels in a one-element stamp ahead of its payload (`comm.p2p`, resolved by
`receive_deadline`), and every rank writes a collective's launch time into a table in shared memory
(`LaunchBoard`), read once the collective's data is in, so its link time runs from the last rank's
launch. A receive posted early cannot have its transfer "happen" before the send exists, and a rank
that waits for a late peer does not get the link time hidden behind that wait. The modelled link is
a single-host emulation (one clock, one shared memory): a group spanning hosts is refused.

Known limit of the measurement: the link clocks are per process group, so collectives on two
different groups over the same ranks (e.g. dp and ep) do not queue behind each other as they would
on one physical link.

This module calls no torch.distributed function: the comm layer builds a group's board collectively
(`comm._launch_board`) and asks here for the deadlines.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from overlap.errors import ConfigError
from overlap.launch.kinds import family
from overlap.parallel.trace import CommEvent, now

# Bytes a ring moves per byte of the op's payload, as in the usual bus-bandwidth convention. The
# payload is the full tensor: the input of all-reduce / reduce-scatter / all-to-all, the gathered
# output of all-gather.
_LINK_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}

# A resolver of an op's modelled completion: asked with `waited` (whether the caller has waited for
# the op's data), it returns the deadline, or None while a side's posting time is not known yet.
Resolver = Callable[[bool], "float | None"]


@dataclass(frozen=True)
class LinkModel:
    """A modelled interconnect: each op costs `latency + factor x payload / bandwidth` seconds on
    its group's link. `families` (e.g. ("ep",)) limits it to those kinds' families; the others
    complete when their data is there, so a benchmark of one dimension's overlap is not mixed with
    another dimension's link time."""

    latency_s: float
    bandwidth_Bps: float
    families: tuple[str, ...] | None = None

    def applies_to(self, kind: str) -> bool:
        return self.families is None or family(kind) in self.families

    def seconds(self, op: str, payload_bytes: int, group_size: int) -> float:
        factor = _LINK_FACTORS.get(op, _LINK_FACTORS["p2p"])(group_size)
        return self.latency_s + factor * payload_bytes / self.bandwidth_Bps


class GroupLink:
    """One group's link on a run's modelled network: its "link free at" clock, so that two ops in
    flight on the group queue one behind the other, and its launch board (None before the group's
    first modelled collective, which opens it: `comm._launch_board`)."""

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.board: LaunchBoard | None = None

    def reserve(self, op: str, payload_bytes: int, size: int, t_launch: float) -> float:
        """Book the op on this link after whatever is already queued there; return its modelled
        completion."""
        with self.lock:
            start = max(t_launch, self.free_at)
            self.free_at = start + self.link.seconds(op, payload_bytes, size)
            return self.free_at

    def open_board(self, name: str, size: int, rank: int) -> LaunchBoard:
        """Open this group's launch board in file `name` (every member, with the same name)."""
        self.board = LaunchBoard(self, name, size, rank)
        return self.board


class ModelledNetwork:
    """One run's modelled link (`comm.CommSession(link=...)`): the `LinkModel` and each group's
    `GroupLink`, so two runs in one process never queue on each other's clocks or share a board.
    A group's link is held by weak reference to the group: the run's network keeps no group alive
    past the teardown that frees it."""

    def __init__(self, link: LinkModel) -> None:
        self.link = link
        self._groups: weakref.WeakKeyDictionary[ProcessGroup, GroupLink] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def models(self, kind: str) -> bool:
        """Whether ops of `kind` complete on the modelled link."""
        return self.link.applies_to(kind)

    def on(self, group: ProcessGroup) -> GroupLink:
        """`group`'s link, made at its first use."""
        with self._lock:
            if group not in self._groups:
                self._groups[group] = GroupLink(self.link)
            return self._groups[group]

    def check_one_host(self, hosts: list[str]) -> None:
        """A ConfigError (field --network) unless a group's members (their `hosts`) share one host,
        as the modelled link's one clock and one shared memory need."""
        if len(set(hosts)) > 1:
            value = f"model:{self.link.latency_s * 1e3:g}ms,{self.link.bandwidth_Bps:g}B/s"
            raise ConfigError(
                "--network",
                value,
                "the modelled link is a single-host emulation (one clock, one shared memory), and "
                f"this group spans hosts {sorted(set(hosts))}.",
                "use --network real (or tbf:RATE on one host).",
            )


class LaunchBoard:
    """Every rank's launch time of each modelled collective on one group, for the link to start at
    the last one.

    A table [SLOTS, group size] of (sequence number, time) in a file in shared memory that the
    group's ranks map: a rank writes its entry when it launches the collective, before the
    collective can complete anywhere, so once the data is in every entry is there to read, at no
    cost in communication (gathering the times over the group instead cost a small collective per
    op, about 5% of an EP step here). Collectives are launched in the same order on every rank, so
    the n-th launch on the group is the same op everywhere, and they are booked on the group's link
    in that order, whichever completes first here. Opened by every member at the group's first
    modelled collective, under the file name its first member chose (`board_file_name`)."""

    SLOTS = 4096  # a rank runs at most this many collectives ahead of a peer on one group

    def __init__(self, link: GroupLink, name: str, size: int, rank: int) -> None:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.path = os.path.join(folder, name)
        self.link = link
        self.size, self.rank, self.next = size, rank, 0
        # seq -> (op, payload bytes), launched and not yet booked
        self.unbooked: dict[int, tuple[str, int]] = {}
        # seq -> (last launch, deadline), until its handle took it
        self.booked: dict[int, tuple[float, float]] = {}
        self.to_book = 0  # the next op to book on the link
        self.lock = threading.Lock()
        nbytes = self.SLOTS * self.size * 2 * 8
        with open(self.path, "a+b") as f:
            # every member, same size: creates it or leaves it as it is
            os.ftruncate(f.fileno(), nbytes)
            self._map = mmap.mmap(f.fileno(), nbytes)
        # Entry (slot, rank) is the doubles [2 (slot x size + rank)] (sequence number + 1) and
        # [... + 1] (launch time). A plain memoryview, not a tensor: this is read on the completion
        # path of every op, where a tensor's indexing and reductions cost ~75 us of the core the
        # rank computes on, the memoryview ~4 us.
        self.table = memoryview(self._map).cast("d")
        # Closed when nothing uses it any more - neither its run's network nor a handle's deadline
        # resolver - or at exit.
        weakref.finalize(self, _close_board, self.table, self._map, self.path)

    def post(self, t_launch: float, op: str, payload_bytes: int) -> int:
        """Write this rank's launch time of its next collective on the group; returns the op's
        sequence number."""
        with self.lock:
            seq, self.next = self.next, self.next + 1
            self.unbooked[seq] = (op, payload_bytes)
        entry = 2 * ((seq % self.SLOTS) * self.size + self.rank)
        self.table[entry + 1] = t_launch
        # Written last: the entry is whole once this is there. This relies on the host keeping
        # stores (and loads) in program order, as x86 does; a weakly ordered CPU (ARM) would need a
        # fence here and in _last_launch.
        self.table[entry] = seq + 1
        return seq

    def _last_launch(self, seq: int) -> float | None:
        """The latest launch time of op `seq` over the group, or None while a rank's entry is not in
        yet."""
        first = 2 * (seq % self.SLOTS) * self.size
        # each entry's number is read before its time
        row = self.table[first : first + 2 * self.size].tolist()
        if any(number != seq + 1 for number in row[0::2]):
            return None
        return max(row[1::2])

    def deadline(self, seq: int, waited: bool) -> tuple[float, float] | None:
        """Op `seq`'s (last launch, modelled completion): booked on the link from its last launch,
        after every earlier op of the group (booked first if they are not yet). Asked once the op's
        data is in, by the completion callback (`waited` False) or by the waiter, who waits for an
        entry still missing (a rank can complete before a peer launched only where it receives
        nothing from it); None if the callback finds one missing."""
        with self.lock:
            while self.to_book <= seq:
                last = self._last_launch(self.to_book)
                while last is None and waited:
                    time.sleep(1e-4)
                    last = self._last_launch(self.to_book)
                if last is None:
                    return None
                op, payload = self.unbooked.pop(self.to_book)
                ready = min(last, now())
                deadline = self.link.reserve(op, payload, self.size, ready)
                self.booked[self.to_book] = ready, deadline
                self.to_book += 1
            return self.booked.pop(seq)


def _close_board(table: memoryview, mapped: mmap.mmap, path: str) -> None:
    """Unmap a launch board and remove its file."""
    table.release()
    mapped.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # another member unlinked it first


def board_file_name() -> str:
    """A fresh name for a launch board's file (the group's first member's choice is everyone's)."""
    return f"overlap-link-{os.getpid()}-{uuid.uuid4().hex}"


def collective_deadline(
    board: LaunchBoard, event: CommEvent, op: str, payload_bytes: int
) -> Resolver:
    """Post this rank's launch of a collective (`event`) on its group's board; the resolver of its
    modelled completion, which books it on the link from the last rank's launch."""
    seq = board.post(event.t_launch, op, payload_bytes)
    return _once(_readying(event, lambda waited: board.deadline(seq, waited)))


def receive_deadline(
    link: GroupLink,
    payload_bytes: int,
    event: CommEvent,
    stamp: torch.Tensor,
    complete: Callable[[], bool],
) -> Resolver:
    """A modelled receive's deadline, once the sender's stamp is in (None before): the link carries
    the payload from the moment both sides had posted, behind what its group's link already carries.
    Booked once, whichever thread asks first: the completion callback (`waited` False: only if
    `complete()`, the call being known complete) or the waiter (`waited` True: the call's wait has
    returned). A stamp later than now (another host's clock) is taken as now: the data is here."""

    def resolve(waited: bool) -> tuple[float, float] | None:
        if not waited and not complete():
            return None
        ready = max(min(float(stamp.item()), now()), event.t_launch)
        return ready, link.reserve("p2p", payload_bytes, event.group_size, ready)

    return _once(_readying(event, resolve))


def _once(resolve: Resolver) -> Resolver:
    """`resolve(waited)` asked until it gives a deadline, which is then kept (the callback and the
    waiter may both ask, from two threads)."""
    lock = threading.Lock()
    known: list[float] = []

    def ask(waited: bool) -> float | None:
        with lock:
            if not known:
                deadline = resolve(waited)
                if deadline is None:
                    return None
                known.append(deadline)
            return known[0]

    return ask


def _readying(event: CommEvent, resolve: Callable[[bool], tuple[float, float] | None]) -> Resolver:
    """`resolve(waited)` -> (ready, deadline) | None turned into a deadline resolver that records
    `event.t_ready`."""

    def ask(waited: bool) -> float | None:
        known = resolve(waited)
        if known is None:
            return None
        event.t_ready, deadline = known
        return deadline

    return ask
