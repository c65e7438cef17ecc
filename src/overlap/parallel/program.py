"""Every rank's communication program, recorded at the one choke point (`comm.py`), and its replay
under NCCL's rules.

On a GPU, NCCL runs each communicator's operations on one CUDA stream per rank, in the order the
host issued them (torch builds one communicator per process group; since the groups are created with
the rank's device bound, point-to-point operations use the group's communicator too). That stream
and the matching rules are where a program that runs on gloo can still hang or corrupt data on NCCL:

- collectives of a group are matched by position: the n-th collective on a group is one operation on
  every member, so every member must issue the same sequence (same operation, kind, dtype and size)
  - gloo is as strict, but a mismatch of equal sizes (two buckets swapped) passes silently on both;
- point-to-point operations are matched in order per (group, sender, receiver), tags ignored: the
  k-th send from A to B is the k-th receive at B from A, whatever the tags say;
- a send completes only once its receive runs (rendezvous: never rely on buffering), and an
  operation runs only when everything issued before it on its stream has completed, so a send queued
  behind a receive that waits for the peer's send, which is itself queued behind the peer's own
  receive, never runs (head-of-line deadlock);
- a batch (`batch_isend_irecv`) is one group call: its operations progress together, each with its
  own peer;
- `wait()` blocks the compute stream (not the host), and every operation issued after it waits for
  it: for the replay, a rank's program simply stops at a wait until the awaited operation has
  completed;
- the runtime's other streams wait too: the timing stream for a collective's end (the tracer on a
  GPU timeline), the side stream that copies the MoE split sizes for the counts exchange. Each
  stream is its own hardware queue by default, and then such a wait holds nothing else; with
  `CUDA_DEVICE_MAX_CONNECTIONS=1` every stream of a rank feeds ONE hardware queue in submission
  order (`overlap.parallel.streams`), so any wait holds every later submission of the rank, posts
  included: `replay(one_queue=True)` plays that, and `queue_stalls` names each post such a wait
  would hold before the compute stream itself waits for the same operation (a false dependency).

`ProgramRecorder` keeps, per rank, the sequence of posts (one unit: a collective, a single
point-to-point operation or a batch) and waits. `replay` plays all ranks' programs together under
the rules above and returns what would go wrong on NCCL: mismatched collectives, unmatched or
mis-sized point-to-point messages, and deadlocks, each said with the ranks, the group and the
operations involved.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from overlap.errors import ProgramError

SEND, RECV = "send", "recv"


@dataclass(frozen=True)
class OpRecord:
    """One operation of a posted unit. `numel`: elements sent (a collective's input, a send) or
    received (a receive); `splits`: an all-to-all's (input splits, output splits) in rows, when
    uneven."""

    kind: str
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | broadcast | send | recv
    dtype: str
    numel: int
    peer: int | None = None  # point-to-point: the peer's global rank
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def describe(self) -> str:
        where = (
            ""
            if self.peer is None
            else (f" to rank {self.peer}" if self.op == SEND else f" from rank {self.peer}")
        )
        return f"{self.kind} ({self.op}{where}, {self.numel} x {self.dtype})"


@dataclass(frozen=True)
class Post:
    """A unit posted on a group's communicator: one collective, one point-to-point operation, or a
    batch."""

    unit: int
    group: str  # the process group's name (the same on every member)
    members: tuple[int, ...]  # global ranks, in group-rank order
    ops: tuple[OpRecord, ...]


COMPUTE, TIMING, SIDE = "compute", "timing", "side"


@dataclass(frozen=True)
class Wait:
    """A stream of the rank waits for `unit`: the compute stream (the host, on gloo), the tracer's
    timing stream, or the split sizes' side stream."""

    unit: int
    stream: str = COMPUTE


@dataclass(frozen=True)
class StepEnd:
    """The end of a training step (`ProgramRecorder.step_end`): what the analyses take as one step's
    program."""


Entry = Post | Wait | StepEnd


@dataclass
class ProgramRecorder:
    """The sequence of posts and waits of this rank (off until `start`)."""

    entries: list[Entry] = field(default_factory=list)
    enabled: bool = False
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        with self._lock:
            self.entries, self.enabled, self._next = [], True, 0

    def stop(self) -> list[Entry]:
        """Stop recording; returns what was recorded."""
        with self._lock:
            self.enabled = False
            entries, self.entries = self.entries, []
        return entries

    def post(self, group: str, members: Sequence[int], ops: Sequence[OpRecord]) -> int | None:
        """Record a unit; its number (for `wait`), or None while not recording."""
        if not self.enabled:
            return None
        with self._lock:
            unit, self._next = self._next, self._next + 1
            self.entries.append(Post(unit, group, tuple(members), tuple(ops)))
        return unit

    def wait(self, unit: int | None, stream: str = COMPUTE) -> None:
        if self.enabled and unit is not None:
            with self._lock:
                self.entries.append(Wait(unit, stream))

    def step_end(self) -> None:
        if self.enabled:
            with self._lock:
                self.entries.append(StepEnd())


# --- the replay -----------------------------------------------------------------------------------
OpKey = tuple[int, int, int]  # (rank, unit, index of the op in the unit)


def _collective_signature(op: OpRecord) -> tuple:
    return op.kind, op.op, op.dtype, op.numel if op.op != "all_to_all" else None


def _match(programs: dict[int, list[Entry]]) -> tuple[dict[OpKey, list[OpKey]], list[str]]:
    """Which operations meet which (module docstring); problems found on the way."""
    problems: list[str] = []
    partners: dict[OpKey, list[OpKey]] = defaultdict(list)
    collectives: dict[str, dict[int, list[tuple[OpKey, OpRecord]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    members_of: dict[str, tuple[int, ...]] = {}
    sends: dict[tuple[str, int, int], list[tuple[OpKey, OpRecord]]] = defaultdict(list)
    recvs: dict[tuple[str, int, int], list[tuple[OpKey, OpRecord]]] = defaultdict(list)
    for rank, entries in programs.items():
        for entry in entries:
            if not isinstance(entry, Post):
                continue
            members_of.setdefault(entry.group, entry.members)
            for i, op in enumerate(entry.ops):
                key = (rank, entry.unit, i)
                if op.op == SEND:
                    sends[(entry.group, rank, op.peer)].append((key, op))
                elif op.op == RECV:
                    recvs[(entry.group, op.peer, rank)].append((key, op))
                else:
                    collectives[entry.group][rank].append((key, op))
    for group, by_rank in collectives.items():
        members = members_of[group]
        absent = [r for r in members if r not in programs]
        counts = {r: len(by_rank.get(r, [])) for r in members if r in programs}
        for n in range(max(counts.values(), default=0)):
            issued = {r: by_rank[r][n] for r in counts if n < counts[r]}
            missing = sorted(r for r in counts if n >= counts[r])
            if missing and not absent:
                first = next(iter(issued.values()))[1]
                problems.append(
                    f"group {group} {list(members)}: collective #{n} {first.describe()} is issued "
                    "by ranks "
                    f"{sorted(issued)} but never by ranks {missing}"
                )
                break
            signatures = {r: _collective_signature(op) for r, (_k, op) in issued.items()}
            if len(set(signatures.values())) > 1:
                seen = "; ".join(f"rank {r}: {issued[r][1].describe()}" for r in sorted(issued))
                problems.append(
                    f"group {group} {list(members)}: collective #{n} differs between ranks ({seen})"
                )
                break
            a2a = [
                op for _k, op in issued.values() if op.op == "all_to_all" and op.splits is not None
            ]
            if len(a2a) == len(issued) == len(members):
                index = {r: i for i, r in enumerate(members)}
                for r, (_k, op) in issued.items():
                    for s, (_k2, other) in issued.items():
                        sent, got = op.splits[0][index[s]], other.splits[1][index[r]]
                        if sent != got:
                            problems.append(
                                f"group {group}: all-to-all #{n} ({op.kind}): rank {r} sends "
                                f"{sent} "
                                "rows "
                                f"to rank {s}, which expects {got}"
                            )
            keys = [k for k, _op in issued.values()]
            for k in keys:
                partners[k] = [o for o in keys if o != k]
    for pair in sorted(set(sends) | set(recvs)):
        group, src, dst = pair
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for n, ((skey, sop), (rkey, rop)) in enumerate(zip(out, into)):
            if (sop.dtype, sop.numel) != (rop.dtype, rop.numel):
                problems.append(
                    f"group {group}: message #{n} from rank {src} to rank {dst} is sent as "
                    f"{sop.describe()} and received as {rop.describe()} (tags are ignored: the "
                    "k-th send meets the k-th receive)"
                )
            partners[skey].append(rkey)
            partners[rkey].append(skey)
        for _, op in out[len(into) :]:
            if dst in programs:
                problems.append(
                    f"group {group}: rank {src} sends {op.describe()} that rank {dst} never "
                    "receives"
                )
        for _, op in into[len(out) :]:
            if src in programs:
                problems.append(
                    f"group {group}: rank {dst} receives {op.describe()} that rank {src} never "
                    "sends"
                )
    return partners, problems


def _blocks(entry: Entry, one_queue: bool) -> bool:
    """Whether `entry` holds the rank's later posts until its unit completes: a compute-stream wait
    always, any stream's wait with one hardware queue."""
    return isinstance(entry, Wait) and (one_queue or entry.stream == COMPUTE)


def replay(programs: dict[int, list[Entry]], one_queue: bool = False) -> list[str]:
    """Play every rank's program (rank -> entries) under NCCL's rules (module docstring); the
    problems found, empty when the programs match and complete. Ranks absent from `programs` are
    taken as not recorded: operations with them are not checked. `one_queue`: every stream of a rank
    feeds one hardware queue (`CUDA_DEVICE_MAX_CONNECTIONS=1`), so a timing or side stream's wait
    holds the rank's later posts as a compute wait does."""
    partners, problems = _match(programs)
    if problems:
        return problems
    units: dict[tuple[int, int], Post] = {}
    for rank, entries in programs.items():
        for entry in entries:
            if isinstance(entry, Post):
                units[(rank, entry.unit)] = entry
    queues: dict[tuple[int, str], deque[int]] = defaultdict(deque)
    position = {rank: 0 for rank in programs}
    done_ops: set[OpKey] = set()
    done_units: set[tuple[int, int]] = set()

    def at_head(key: OpKey) -> bool:
        rank, unit, _i = key
        if rank not in programs:
            return True  # not recorded: assumed to take part
        queue = queues.get((rank, units[(rank, unit)].group))
        return bool(queue) and queue[0] == unit

    progressed = True
    while progressed:
        progressed = False
        for rank, entries in programs.items():
            while position[rank] < len(entries):
                entry = entries[position[rank]]
                if isinstance(entry, Post):
                    queues[(rank, entry.group)].append(entry.unit)
                elif _blocks(entry, one_queue) and (rank, entry.unit) not in done_units:
                    break
                position[rank] += 1
                progressed = True
        for (rank, _group), queue in queues.items():
            while queue:
                unit = queue[0]
                post = units[(rank, unit)]
                for i in range(len(post.ops)):
                    key = (rank, unit, i)
                    if key not in done_ops and all(at_head(p) for p in partners.get(key, [])):
                        done_ops.add(key)
                        done_ops.update(p for p in partners.get(key, []))
                if not all((rank, unit, i) in done_ops for i in range(len(post.ops))):
                    break
                queue.popleft()
                done_units.add((rank, unit))
                progressed = True
    stuck = {
        rank: entries[position[rank]]
        for rank, entries in programs.items()
        if position[rank] < len(entries)
    }
    pending = {key: queue for key, queue in queues.items() if queue}
    if not stuck and not pending:
        return []
    lines = [
        "deadlock under NCCL's rules (one stream per communicator in issue order, sends wait for "
        f"their receives, tags ignored{'; one hardware queue per rank' if one_queue else ''}):"
    ]
    for rank in sorted(stuck):
        waited = units[(rank, stuck[rank].unit)]
        lines.append(
            f"  rank {rank}'s {stuck[rank].stream} stream waits for {_unit(waited)} on group "
            f"{waited.group} {list(waited.members)}"
        )
    for (rank, group), queue in sorted(pending.items()):
        head = units[(rank, queue[0])]
        missing = [
            p
            for i in range(len(head.ops))
            if (rank, queue[0], i) not in done_ops
            for p in partners.get((rank, queue[0], i), [])
            if not at_head(p)
        ]

        def front(peer: int, group: str = group) -> str:
            waiting = queues[(peer, group)]
            return _unit(units[(peer, waiting[0])]) if waiting else "nothing"

        behind = "; ".join(
            f"rank {p[0]} has {_unit(units[(p[0], p[1])])} queued behind {front(p[0])}"
            for p in missing[:2]
        )
        lines.append(
            f"  rank {rank} group {group}: {_unit(head)} cannot run ({len(queue)} "
            f"queued){': ' + behind if behind else ''}"
        )
    return lines


def early_send_waits(programs: dict[int, list[Entry]]) -> list[str]:
    """Waits on sends that can stall the compute: a wait on a unit of sends only, before the rank's
    last wait on a receive of that step (`StepEnd`), that is not known to be free - known free when
    the rank has already waited for something its peer posted after that peer waited for the send's
    receive (then the data are there). On NCCL such a wait puts the send's whole transfer - and the
    peer's readiness to receive - on the compute stream's critical path."""
    partners, problems = _match(programs)
    if problems:
        return problems
    units: dict[tuple[int, int], Post] = {}
    # (rank, unit) -> index of its post in the rank's program
    posted_at: dict[tuple[int, int], int] = {}
    first_wait: dict[tuple[int, int], int] = {}  # (rank, unit) -> index of its first wait
    for rank, entries in programs.items():
        for i, entry in enumerate(entries):
            if isinstance(entry, Post):
                units[(rank, entry.unit)] = entry
                posted_at[(rank, entry.unit)] = i
            elif _compute_wait(entry):
                first_wait.setdefault((rank, entry.unit), i)
    found = []
    for rank, entries in programs.items():
        last_receive, step_last = (
            -1,
            {},
        )  # index of an entry -> index of its step's last wait on a receive
        for i in range(len(entries) - 1, -1, -1):
            entry = entries[i]
            if isinstance(entry, StepEnd):
                last_receive = -1
            elif (
                _compute_wait(entry)
                and last_receive < 0
                and any(op.op == RECV for op in units[(rank, entry.unit)].ops)
            ):
                last_receive = i
            step_last[i] = last_receive
        for i, entry in enumerate(entries):
            if not _compute_wait(entry) or first_wait[(rank, entry.unit)] != i or i >= step_last[i]:
                continue
            post = units[(rank, entry.unit)]
            if not all(op.op == SEND for op in post.ops):
                continue
            for n, op in enumerate(post.ops):
                peer = op.peer
                received = [
                    first_wait.get((r, u)) for r, u, _i in partners.get((rank, entry.unit, n), [])
                ]
                if peer not in programs or not received or received[0] is None:
                    continue
                proven = any(
                    _compute_wait(e)
                    and any(
                        p[0] == peer and posted_at[(peer, p[1])] > received[0]
                        for k in range(len(units[(rank, e.unit)].ops))
                        for p in partners.get((rank, e.unit, k), [])
                    )
                    for e in entries[:i]
                )
                if not proven:
                    found.append(
                        f"rank {rank} waits for {op.describe()} (program entry {i}) before its "
                        "last "
                        f"receive, before it knows rank {peer} received it"
                    )
    return found


def _compute_wait(entry: Entry) -> bool:
    return isinstance(entry, Wait) and entry.stream == COMPUTE


def queue_stalls(programs: dict[int, list[Entry]]) -> list[str]:
    """With one hardware queue per rank (module docstring): every post a timing or side stream's
    wait holds before the rank's compute stream waits for the same unit - a false dependency (the
    post waits for an operation it does not need; across ranks, a possible cycle). Empty when every
    such wait sits at or after the compute stream's own wait, or no post follows it before that."""
    found = []
    for rank, entries in programs.items():
        units = {e.unit: e for e in entries if isinstance(e, Post)}
        waited: set[int] = set()  # units the compute stream has waited for so far
        for i, entry in enumerate(entries):
            if _compute_wait(entry):
                waited.add(entry.unit)
            if not isinstance(entry, Wait) or entry.stream == COMPUTE or entry.unit in waited:
                continue
            held = []
            for later in entries[i + 1 :]:
                if _compute_wait(later) and later.unit == entry.unit:
                    break
                if isinstance(later, Post):
                    held.append(later)
            if held:
                found.append(
                    f"rank {rank}: the {entry.stream} stream's wait for "
                    f"{_unit(units[entry.unit])} (program entry {i}) holds {len(held)} later "
                    f"post(s), first {_unit(held[0])}, that do not wait for it"
                )
    return found


def _unit(post: Post) -> str:
    return " + ".join(op.describe() for op in post.ops)


def check(programs: dict[int, list[Entry]], one_queue: bool = False) -> None:
    """`replay`, raising ProgramError with every problem when there is one."""
    problems = replay(programs, one_queue)
    if problems:
        raise ProgramError("\n".join(problems))


def summarize(entries: Iterable[Entry]) -> dict[str, dict[str, int]]:
    """Per kind: operations posted and elements moved (a rank's program, e.g. for the dry run's
    report)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"ops": 0, "elements": 0})
    for entry in entries:
        if isinstance(entry, Post):
            for op in entry.ops:
                out[op.kind]["ops"] += 1
                out[op.kind]["elements"] += op.numel
    return dict(out)
