"""The one place that calls torch.distributed collectives and point-to-point operations.

Every call is asynchronous underneath and returns a `CommHandle`; synchronous callers simply
`wait()` at once. Every call is named by *kind* (`tp_ag`, `tp_rs`, `tp_ar`, `ep_dispatch`,
`ep_combine`, `dp_rs`, `dp_ar`, `dp_ag`, `pp_send`, ...) and recorded in the tracer with launch,
completion (on the tracer's timeline: the work's future on gloo, so a transfer that finished long
before anybody waited is not charged as late; a CUDA event on NCCL, see `overlap.parallel.trace`)
and wait times, and in the run's program recorder (`CommSession.program`,
`overlap.parallel.program`) with its group, operation and size. A point-to-point call is one posted
unit whose ops share one completion, as NCCL gives one work for a whole batch.

How communication behaves is the run's `CommSession` - its mode, NCCL's rules, its program recorder,
its modelled link - which the run builds and makes active for its extent (`using`; the calls here
read the active one, `session()`): no switch is process-wide, so two runs in one process (the tests'
shared worlds run many jobs per rank, a dry run beside the code that reports it) never see each
other's mode or records, and a session ends with the `with` that began it, on errors too.

NCCL's rules (`CommSession(nccl_rules=True)`): gloo run as NCCL shows itself, with every rank's
program recorded for the replay under NCCL's streams (docs/gpu.md).

Modes (`CommSession(mode)`):
- "real": the collective runs.
- "none": no transfer at all; outputs keep the right shapes (inputs are echoed). Losses are
  meaningless in this mode; its only use is the compute-only floor of a benchmark (`T_ideal`).
- "none:FAMILY[,FAMILY]" (e.g. "none:ep"): only the kinds of those families (the kind's prefix
  before "_") are free, the rest run for real: the floor that isolates one parallel dimension's
  communication from the others'.

On a modelled link (`CommSession(link=...)`, `overlap.parallel.link_model`) a collective still runs
for real, and its handle's completion is held back to the link's deadline.

On gloo, a summing reduce-scatter runs as an all-to-all of the chunks plus a local sum (see
`reduce_scatter`).

Every op launched here is registered until it has been waited for, completion callback included
(`outstanding`, `drain_outstanding`), so the end of a run can drain whatever is still in flight
before the groups go (`overlap.parallel.teardown`). That registry, like the groups' looked-up sizes
and ranks, is the process's, not a run's: it is the work in flight on the process's groups, which
outlive any run (`overlap.parallel.groups`), and whoever destroys the groups must drain all of it,
whichever run launched it.

Around it: `overlap.parallel.groups` creates the groups, `overlap.parallel.ring` passes chunks
around a group's ring with the point-to-point calls here.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from overlap.errors import ConfigError
from overlap.launch.kinds import family, parse_families
from overlap.parallel import link_model, streams
from overlap.parallel.program import COMPUTE, SIDE, TIMING, OpRecord, ProgramRecorder
from overlap.parallel.run_local import RunLocal
from overlap.parallel.trace import CommEvent, RulesTimeline, active_recorder, now, recorder

log = logging.getLogger("overlap.comm")


# --- torch's entry points, chosen once by feature detection ---------------------------------------
# The supported torch range is 2.11 (the GPU machines' build) up to the pin (2.13.0). torch 2.13
# named the single-tensor gather and reduce-scatter `all_gather_single` / `reduce_scatter_single`
# and deprecated `all_gather_into_tensor` / `reduce_scatter_tensor`, the only names 2.11 has. Each
# operation takes the first of its names this torch offers (not a version test: a build that
# backports or drops a name is still served), and `torch_apis()` says which was taken.
_TORCH_NAMES = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
}


def _first_available(namespace: Any, names: Sequence[str]) -> tuple[str, Callable[..., Any]]:
    """The first of `names` that `namespace` (torch.distributed) has, with the function."""
    for name in names:
        fn = getattr(namespace, name, None)
        if fn is not None:
            return name, fn
    raise RuntimeError(
        f"torch {torch.__version__}: torch.distributed has none of {', '.join(names)} "
        "(supported: torch >= 2.11, up to the pin in pyproject.toml)"
    )


_API = {op: _first_available(dist, names) for op, names in _TORCH_NAMES.items()}


def torch_apis() -> dict[str, str]:
    """Which torch.distributed function each operation calls here ("all_gather" ->
    "all_gather_single" on 2.13, "all_gather_into_tensor" on 2.11): the device script's env step
    and the run's start-up log report it."""
    return {op: f"torch.distributed.{name}" for op, (name, _fn) in _API.items()}


def log_torch_apis() -> None:
    """Say at start-up which entry points this torch gave: the older ones are a fallback."""
    older = {op: name for op, name in torch_apis().items() if not name.endswith("_single")}
    if older:
        log.info(
            "torch %s: %s (the older names; torch 2.13 calls them *_single)",
            torch.__version__,
            ", ".join(f"{op} via {name}" for op, name in older.items()),
        )


_MODES = ("real", "none")
_group_sizes: dict[ProcessGroup, int] = {}
_group_ranks: dict[ProcessGroup, int] = {}
_group_backends: dict[ProcessGroup, str] = {}
_group_members: dict[ProcessGroup, list[int]] = {}


def parse_mode(mode: str) -> tuple[str, frozenset[str] | None]:
    """ "real" | "none" | "none:ep,dp" -> (mode, families made free; None = every family). A
    ConfigError (field --comm-mode) for anything else, unknown family names included: a typo must
    not make a "floor" a real run."""
    base, sep, rest = mode.partition(":")
    if base not in _MODES or (sep and base != "none"):
        raise ConfigError(
            "--comm-mode", mode, "expected real, none or none:FAMILY[,FAMILY].", "e.g. none:ep."
        )
    return base, (frozenset(parse_families("--comm-mode", mode, rest)) if sep else None)


@dataclass(frozen=True)
class CommSession:
    """How one run's communication behaves; built by the run (`overlap run`, a dry run, a test's
    job) and active while it runs (`using`).

    `mode`: "real", "none" or "none:FAMILY[,FAMILY]" (module notes; a ConfigError naming
    --comm-mode otherwise). `program`: the recorder of this rank's posts and waits
    (`overlap.parallel.program`; None: nothing recorded). `nccl_rules`: gloo under NCCL's rules, to
    find on a CPU what would break on GPUs (tests, `overlap run --nccl-rules`), which records the
    program (a started recorder of its own unless one is given):

    - the host is not told when a collective completes (the tracer's `RulesTimeline`: on NCCL a
      work's future completes at enqueue and `wait()` orders the stream, not the host), so the
      runtime takes the decisions it takes on GPUs, and the tracer the GPU timeline's path, fed by
      gloo's own completion;
    - point-to-point tags are dropped on the wire: messages between two ranks on a group meet in
      posting order;
    - every rank's program is recorded (`program`), for `overlap.parallel.program.replay` to play
      the ranks together with NCCL's streams: rendezvous sends, one stream per communicator in issue
      order.
    (A point-to-point call's ops share one completion on every backend, as NCCL gives one work for a
    whole batch.) The data still travel over gloo, so losses are real. `link`: the modelled link
    (`overlap.parallel.link_model`), whose clocks and launch boards are this session's own; it needs
    tags and host-visible completion, so a session with both it and NCCL's rules is refused (as it
    is on NCCL). `one_queue`: the timing waits are placed as with `CUDA_DEVICE_MAX_CONNECTIONS=1`
    (`overlap.parallel.trace`), for the replay that models one hardware queue."""

    mode: str = "real"
    nccl_rules: bool = False
    one_queue: bool = False
    program: ProgramRecorder | None = None
    link: link_model.LinkModel | None = None
    # mode "none": the families made free (None: all); parsed from `mode`
    _base: str = field(init=False, repr=False)
    _free: frozenset[str] | None = field(init=False, repr=False)
    # the modelled link's clocks and boards (None: real completion only); a `replace`d session
    # starts its own
    network: link_model.ModelledNetwork | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        base, free = parse_mode(self.mode)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_free", free)
        if self.nccl_rules and self.link is not None:
            raise ConfigError(
                "--network",
                "model",
                "the modelled link delays the host, and NCCL's rules hide completion from the "
                "host.",
                "use --network real with the NCCL rules.",
            )
        network = None if self.link is None else link_model.ModelledNetwork(self.link)
        object.__setattr__(self, "network", network)
        if self.nccl_rules and self.program is None:
            object.__setattr__(self, "program", ProgramRecorder(enabled=True))

    def models(self, kind: str) -> bool:
        """Whether ops of `kind` complete on this session's modelled link."""
        return self.network is not None and self.network.models(kind)

    def is_free(self, kind: str) -> bool:
        """Whether this op is faked (the benchmark floors). Run control (`ctl_*`: every rank
        agreeing to stop) and checkpoint gathers (`*_ckpt`) are never faked: they carry decisions
        and state, and faking them would let ranks disagree (a save at different iterations hangs)
        or write one rank's shard as everyone's."""
        if family(kind) == "ctl" or kind.endswith("_ckpt"):
            return False
        return self._base == "none" and (self._free is None or family(kind) in self._free)


# The active run's session, set only by `using` (`overlap.parallel.run_local`: a context variable,
# and the process's one active session for autograd's device threads).
_SESSION: RunLocal[CommSession] = RunLocal("overlap_comm_session")


def session() -> CommSession:
    """The active run's session; outside any run's `using`, a plain one (real, no rules, nothing
    recorded), new at each call, so nothing done to it outlives the call."""
    active = _SESSION.get()
    return CommSession() if active is None else active


@contextmanager
def using(run: CommSession) -> Iterator[CommSession]:
    """Make `run` the active session for the `with` block; under NCCL's rules the run's recorder
    (`trace.recording`, entered first) takes the rules' timeline for that long (the one it had
    comes back after)."""
    traced = active_recorder() if run.nccl_rules else None
    timeline = None if traced is None else traced.timeline
    with _SESSION.activate(run):
        if traced is not None:
            traced.timeline = RulesTimeline(run.one_queue)
        try:
            yield run
        finally:
            if traced is not None:
                traced.timeline = timeline


class _Posted:
    """What one posted call returned: a collective's work, or the works of a batch of point-to-point
    ops - one per op on gloo, ONE for the whole batch on NCCL (torch's coalescing manager) - so
    never indexed per op: every op of a batch completes with the batch."""

    def __init__(self, works: Sequence[dist.Work | None]) -> None:
        self.works = [w for w in works if w is not None]
        self._waited = False

    def wait(self, timeout: timedelta | None = None) -> None:
        """Wait for every work of the call, once: the ops of a batch share it, and a gloo send's
        work waited a second time waits for a send that never comes. (On NCCL a wait orders the
        current stream; the runtime waits every op from the compute stream, so one wait orders it
        for all.)"""
        if self._waited:
            return
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        self._waited = True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def get_future(self) -> torch.futures.Future:
        """Completes with the call (RuntimeError where a work has no future, as some of gloo's)."""
        if len(self.works) == 1:
            return self.works[0].get_future()
        return torch.futures.collect_all([w.get_future() for w in self.works])


def _group_name(group: ProcessGroup) -> str:
    return str(getattr(group, "group_name", id(group)))


def _record(
    program: ProgramRecorder | None, group: ProcessGroup, ops: Sequence[OpRecord]
) -> int | None:
    """Record a posted unit in `program` (the active session's); its number, None unrecorded."""
    if program is None:
        return None
    return program.post(_group_name(group), group_members(group), ops)


def _op_record(
    kind: str,
    op: str,
    tensor: torch.Tensor,
    peer: int | None = None,
    splits: tuple[Sequence[int], Sequence[int]] | None = None,
) -> OpRecord:
    return OpRecord(
        kind,
        op,
        str(tensor.dtype).removeprefix("torch."),
        tensor.numel(),
        peer,
        None if splits is None else (tuple(splits[0]), tuple(splits[1])),
    )


def group_size(group: ProcessGroup) -> int:
    if group not in _group_sizes:
        _group_sizes[group] = dist.get_world_size(group)
    return _group_sizes[group]


def _backend(group: ProcessGroup) -> str:
    if group not in _group_backends:
        _group_backends[group] = str(dist.get_backend(group))
    return _group_backends[group]


def group_members(group: ProcessGroup) -> list[int]:
    """The global ranks of `group`, in group-rank order (point-to-point peers are named by global
    rank)."""
    if group not in _group_members:
        _group_members[group] = dist.get_process_group_ranks(group)
    return _group_members[group]


def group_rank(group: ProcessGroup) -> int:
    if group not in _group_ranks:
        _group_ranks[group] = dist.get_rank(group)
    return _group_ranks[group]


def forget_lookups() -> set[ProcessGroup]:
    """Drop every group's looked-up size, rank, members and backend (teardown); returns the groups
    they named."""
    known = {*_group_sizes, *_group_ranks, *_group_backends, *_group_members}
    for cache in (_group_sizes, _group_ranks, _group_backends, _group_members):
        cache.clear()
    return known


# Ops launched and not yet waited for, completion callback included (strong references: an op nobody
# waited for keeps its buffers until `drain_outstanding`, as the transfer may still be writing into
# them). The process's, not a run's (module notes): the groups they run on are the process's.
_outstanding: set[CommHandle] = set()


class CommHandle:
    """An in-flight collective (or one op of a point-to-point call). `wait()` blocks until the data
    is there (on NCCL: orders the current stream after it) and the completion callback has run, and
    returns the output tensor (if any). The ops of one point-to-point call share one `_Posted`:
    waiting for one waits for the call."""

    def __init__(
        self,
        event: CommEvent,
        posted: _Posted | None,
        result: torch.Tensor | None,
        finish: Callable[[], None] | None = None,
        deadline_from: link_model.Resolver | None = None,
        unit: int | None = None,
        program: ProgramRecorder | None = None,
    ) -> None:
        self.event = event
        self._posted = posted
        self._result = result
        self._finish = finish
        # Modelled completion (the session's link); None: the real completion is the completion. A
        # modelled transfer learns it only once every side's posting time is known (the launch
        # board, `p2p`'s stamps): from `deadline_from`, None until then.
        self._deadline: float | None = None
        self._deadline_from = deadline_from
        self._done = posted is None
        self._local = posted is None  # never left the rank (a group of one, a free kind)
        # the recorded program's unit, and the program (the posting session's), while recording
        self._unit, self._program = unit, program
        # then()'s future: done once `_mark_done` has run. The callback runs on the backend's
        # thread; waiting for this future too means a waited handle has nothing left to run on
        # another thread.
        self._callback: torch.futures.Future | None = None
        # the timeline of the run that launched it: its marks are read on that one, wherever waited
        self._timeline = timeline = recorder().timeline
        if posted is None:
            event.t_done = timeline.mark()
            return
        if timeline.host_sees_completion:
            try:
                self._callback = posted.get_future().then(self._mark_done)
            except RuntimeError:
                # some gloo ops (reduce_scatter) have no future: completion is then taken at wait()
                pass
        else:
            # a device timeline: the collective's end on the device (its timing stream waits for
            # it, now or at the compute stream's wait), resolved when the recorder drains
            event.t_done = timeline.done_mark(posted)
            if event.t_done is not None and timeline.times_at_launch:
                self._record_wait(TIMING)
        _outstanding.add(self)

    def _record_wait(self, stream: str = COMPUTE) -> None:
        if self._program is not None:
            self._program.wait(self._unit, stream)

    def _mark_done(self, fut: torch.futures.Future) -> None:
        if self._deadline is None and self._deadline_from is not None:
            # None while the stamp is not in yet: then at wait()
            self._deadline = self._deadline_from(False)
            if self._deadline is None:
                return
        if self.event.t_done is None:
            self.event.t_done = max(now(), self._deadline or 0.0)

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            self._complete(None)
        return self._result

    def output_on(self, stream: Any) -> torch.Tensor | None:
        """The op's output tensor, with `stream` made to wait for the op on the device, the host not
        waiting (a work's `wait()` on NCCL orders the current stream): for a reader on another
        stream than the one `wait()` will order, which then waits for this op and for nothing queued
        on that one. Call it before `wait()` (which drops the works), and `wait()` is still owed.

        An op that never left the rank (a group of one, a free kind) wrote its output on the current
        stream when it was launched: `stream` then waits for what the current stream has queued."""
        api = streams.api()
        if self._local:
            api.follow_current(stream)
            return self._result
        if self._posted is None:
            raise RuntimeError(
                f"{self.event.kind}: output_on after wait(): the op's works are gone"
            )
        with api.use(stream):
            for work in self._posted.works:
                work.wait()
        self._record_wait(SIDE)
        return self._result

    def reap(self) -> bool:
        """If the op is known complete - a query that never blocks (on NCCL the device's own event;
        gloo knows a send complete only once waited) - drop what it holds without waiting, so no
        stream is made to wait on it, and return True (also once waited). For sends whose buffers
        should go as soon as they are out. Ops with a finish step or a modelled deadline are left to
        `wait`."""
        if self._done:
            return True
        if (
            self._finish is not None
            or self._deadline_from is not None
            or not self._posted.is_completed()
        ):
            return False
        if self._callback is not None and not self._callback.done():
            return False
        self._done = True
        _outstanding.discard(self)
        self._posted = self._callback = None
        return True

    def _complete(self, deadline: float | None) -> None:
        """Wait for the op and its callback, then run the finish step. `deadline` (time.monotonic())
        bounds the wait for the teardown of a failing run; past it, RuntimeError (the op stays
        outstanding)."""
        self._record_wait()
        timeline = self._timeline
        self.event.t_wait_start = timeline.mark()
        if deadline is None:
            self._posted.wait()
            if timeline.time_done(self.event.t_done):  # one hardware queue: timed from here
                self._record_wait(TIMING)
            if self._callback is not None:
                self._callback.wait()
        else:
            self._posted.wait(timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            while self._callback is not None and not self._callback.done():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.event.kind}: the completion callback did not run in time"
                    )
                time.sleep(1e-3)
        if self._deadline is None and self._deadline_from is not None:
            self._deadline = self._deadline_from(True)
        if self._deadline is not None:
            remaining = self._deadline - now()
            if remaining > 0:
                time.sleep(remaining)  # a modelled link is waiting, not work: sleep, never spin
        self.event.t_wait_end = timeline.mark()
        if self.event.t_done is None and timeline.host_sees_completion:  # no future: known only now
            self.event.t_done = max(self.event.t_wait_end, self._deadline or 0.0)
        self._done = True
        _outstanding.discard(self)
        if self._finish is not None:
            self._finish()
        # Drop the works, the callback future and the finish step: they hold transfer buffers (a
        # reduce-scatter's full-size receive buffer) that callers keeping the handle until the next
        # step must not keep alive.
        self._posted = self._callback = self._finish = self._deadline_from = None


def completion_visible() -> bool:
    """Whether the host learns when a collective's data is complete (gloo) - not on a device
    timeline (NCCL, or gloo under NCCL's rules), where a collective completes on the device while
    the host runs ahead. What the schedules decide while something is in flight must not depend on
    it there."""
    return recorder().timeline.host_sees_completion


def _launch(
    kind: str,
    op: str,
    group: ProcessGroup,
    nbytes: int,
    launch: Callable[[], dist.Work | None],
    result: torch.Tensor | None,
    fake: Callable[[], None] | None = None,
    finish: Callable[[], None] | None = None,
    payload_bytes: int | None = None,
    record: Sequence[OpRecord] = (),
) -> CommHandle:
    """Record and start one collective. `payload_bytes` is what the modelled link carries when it
    differs from `nbytes` (the recorded input size), as for all-gather. On a modelled link this
    rank's launch time goes on the group's board first. `record`: the op as the program recorder
    keeps it."""
    event = CommEvent(
        kind=kind, op=op, group_size=group_size(group), nbytes=nbytes, t_launch=recorder().mark()
    )
    recorder().add_comm(event)
    run = session()
    if run.is_free(kind) or event.group_size == 1:
        if fake is not None:
            fake()  # stands in for the transfer and its `finish` both
        return CommHandle(event, None, result)
    carried = nbytes if payload_bytes is None else payload_bytes
    deadline_from = None
    if run.models(kind):
        board = _launch_board(run.network, group)
        deadline_from = link_model.collective_deadline(board, event, op, carried)
    posted = _Posted([launch()])
    unit = _record(run.program, group, record)
    return CommHandle(event, posted, result, finish, deadline_from, unit, run.program)


def _launch_board(
    network: link_model.ModelledNetwork, group: ProcessGroup
) -> link_model.LaunchBoard:
    """`group`'s launch board on the run's modelled `network`, opened collectively at its first
    modelled collective: the members check that they share one host, and the first member names the
    file."""
    link = network.on(group)
    if link.board is None:
        network.check_one_host(all_gather_object(socket.gethostname(), group))
        name = [link_model.board_file_name()]
        dist.broadcast_object_list(name, src=group_members(group)[0], group=group)
        link.open_board(name[0], group_size(group), group_rank(group))
    return link.board


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, kind: str, op: ReduceOp = ReduceOp.SUM
) -> CommHandle:
    """In-place all-reduce of `tensor` over `group`."""
    return _launch(
        kind,
        "all_reduce",
        group,
        _nbytes(tensor),
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True),
        tensor,
        record=[_op_record(kind, "all_reduce", tensor)],
    )


def all_gather(
    tensor: torch.Tensor, group: ProcessGroup, kind: str, into: torch.Tensor | None = None
) -> CommHandle:
    """Concatenate every rank's `tensor` along dim 0 (rank order); the handle returns the gathered
    tensor. `into`: gather in place into that buffer, whose group-rank-th slice of dim 0 is
    `tensor` itself (a bucket's parameters and this rank's shard of them, as Megatron gathers): no
    output is allocated and nothing is copied afterwards."""
    size = group_size(group)
    inp = tensor.contiguous()
    if into is None:
        out = inp.new_empty((inp.shape[0] * size, *inp.shape[1:]))
    else:
        out = into
        _check_own_slice(kind, "all_gather", out, inp, group_rank(group), size)

    def fake() -> None:
        out.copy_(inp.repeat((size,) + (1,) * (inp.dim() - 1)))

    _name, gather = _API["all_gather"]
    return _launch(
        kind,
        "all_gather",
        group,
        _nbytes(inp),
        lambda: gather(out, inp, group=group, async_op=True),
        out,
        fake,
        payload_bytes=_nbytes(out),
        record=[_op_record(kind, "all_gather", inp)],
    )


def _check_own_slice(
    kind: str, op: str, whole: torch.Tensor, part: torch.Tensor, rank: int, size: int
) -> None:
    """An in-place collective's contract: `part` is exactly slice `rank` of `size` of `whole`'s dim
    0 (same storage, same layout); anything else would read or write the wrong elements."""
    rows = whole.shape[0] // size
    if (
        whole.shape[0] != rows * size
        or part.shape != (rows, *whole.shape[1:])
        or not whole.is_contiguous()
        or part.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        or part.storage_offset() != whole.storage_offset() + rank * part.numel()
    ):
        raise ValueError(
            f"{op} ({kind}) in place: the shard must be slice {rank} of {size} of the buffer's "
            f"dim 0 (buffer {tuple(whole.shape)}, shard {tuple(part.shape)})"
        )


def reduce_scatter(
    tensor: torch.Tensor,
    group: ProcessGroup,
    kind: str,
    op: ReduceOp = ReduceOp.SUM,
    into: torch.Tensor | None = None,
) -> CommHandle:
    """Reduce `tensor` over `group` and keep this rank's 1/size slice of dim 0. `into`: write that
    slice there, in place - this rank's slice of `tensor` itself (a bucket's gradients and this
    rank's shard of them, as Megatron reduces): no output is allocated and nothing is copied
    afterwards."""
    size = group_size(group)
    inp = tensor.contiguous()
    if inp.shape[0] % size:
        raise ValueError(
            f"reduce_scatter ({kind}): dim 0 ({inp.shape[0]}) not divisible by group size {size}"
        )
    if into is None:
        out = inp.new_empty((inp.shape[0] // size, *inp.shape[1:]))
    else:
        out = into
        _check_own_slice(kind, "reduce_scatter", inp, out, group_rank(group), size)

    def fake() -> None:
        if into is None:
            out.copy_(inp.chunk(size)[group_rank(group)])
        # in place: the unreduced slice is already where the result goes

    if op == ReduceOp.SUM and _backend(group) == "gloo":
        # gloo's reduce-scatter costs ~3x the wall time and ~2.7x the CPU of an all-to-all of the
        # chunks plus a local sum (bench/results/gloo_costs.txt, 4 ranks, 11 MB fp32: 35 vs 14 ms),
        # and gives no future, so its completion cannot be observed. Same bytes on the wire: (n-1)/n
        # of the payload per rank. The sum is written once the chunks are in, so an output inside
        # the input (in place) is safe.
        recv = torch.empty_like(inp)

        def reduce_chunks() -> None:
            torch.sum(recv.view(size, *out.shape), dim=0, out=out)

        return _launch(
            kind,
            "reduce_scatter",
            group,
            _nbytes(inp),
            lambda: dist.all_to_all_single(recv, inp, group=group, async_op=True),
            out,
            fake,
            finish=reduce_chunks,
            record=[_op_record(kind, "reduce_scatter", inp)],
        )
    _name, scatter = _API["reduce_scatter"]
    return _launch(
        kind,
        "reduce_scatter",
        group,
        _nbytes(inp),
        lambda: scatter(out, inp, op=op, group=group, async_op=True),
        out,
        fake,
        record=[_op_record(kind, "reduce_scatter", inp)],
    )


def all_to_all(
    tensor: torch.Tensor,
    group: ProcessGroup,
    kind: str,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
) -> CommHandle:
    """All-to-all along dim 0 with optional uneven splits; the handle returns what was received."""
    inp = tensor.contiguous()
    rows = sum(output_split_sizes) if output_split_sizes is not None else inp.shape[0]
    out = inp.new_empty((rows, *inp.shape[1:]))

    def fake() -> None:
        if out.shape == inp.shape:
            out.copy_(inp)
        else:
            out.zero_()

    out_splits = list(output_split_sizes or []) or None
    in_splits = list(input_split_sizes or []) or None
    splits = (
        None
        if input_split_sizes is None or output_split_sizes is None
        else (input_split_sizes, output_split_sizes)
    )
    return _launch(
        kind,
        "all_to_all",
        group,
        _nbytes(inp),
        lambda: dist.all_to_all_single(
            out,
            inp,
            output_split_sizes=out_splits,
            input_split_sizes=in_splits,
            group=group,
            async_op=True,
        ),
        out,
        fake,
        record=[_op_record(kind, "all_to_all", inp, splits=splits)],
    )


class ManyHandle:
    """Several tensors in flight in one all-to-all (`all_to_all_many`); `wait()` returns them, as
    sent."""

    def __init__(
        self,
        handle: CommHandle,
        like: Sequence[torch.Tensor],
        widths: list[int],
        kept: tuple[torch.Tensor, ...] | None = None,
    ) -> None:
        self.handle = handle
        # metadata only: the sent tensors are not kept alive
        self._like = [(t.dtype, t.shape[1:]) for t in like]
        self._widths = widths
        self._kept = kept  # a group of one: the tensors themselves, which never left

    @property
    def event(self) -> CommEvent:
        return self.handle.event

    def wait(self) -> tuple[torch.Tensor, ...]:
        packed = self.handle.wait()
        if self._kept is not None:
            kept, self._kept = self._kept, None
            return kept
        if len(self._like) == 1:  # nothing was packed: the received bytes are the tensor, no copy
            dtype, shape = self._like[0]
            return (packed.view(dtype).reshape(packed.shape[0], *shape),)
        out, offset = [], 0
        for (dtype, shape), width in zip(self._like, self._widths):
            # A real copy with offset 0: a one-row slice counts as contiguous, and viewing it in
            # place as a wider dtype would fail on its byte offset.
            piece = packed[:, offset : offset + width].clone(memory_format=torch.contiguous_format)
            piece = piece.view(dtype)
            out.append(piece.reshape(packed.shape[0], *shape))
            offset += width
        return tuple(out)


def all_to_all_many(
    tensors: Sequence[torch.Tensor],
    group: ProcessGroup,
    kind: str,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
) -> ManyHandle:
    """All-to-all of several tensors that share their row splits (an MoE dispatch: rows and their
    combine weights) as ONE collective: each row's bytes travel side by side, bit-exact, whatever
    the dtypes. The bytes on the wire are the same as two all-to-alls; what is saved is a whole
    collective: its latency, its launch, and on gloo its fixed CPU cost (~0.8 ms per rank for a
    1-64 KB all-to-all with 4 ranks on 2 cores, bench/results/gloo_costs.txt)."""
    rows = tensors[0].shape[0]
    if any(t.shape[0] != rows for t in tensors):
        raise ValueError(
            f"all_to_all_many ({kind}): the tensors have different row counts "
            f"{[t.shape[0] for t in tensors]}"
        )
    if group_size(group) == 1:
        # Nothing leaves the rank (EP = 1): the op is recorded, but the tensors come back as they
        # are, without the packing, the copy and the unpacking, each a pass over every row (about
        # 6 ms per step, 0.6%, in bench/hf_compute_bench.py's MoE model, where no other cost
        # separates us from transformers).
        handle = _launch(
            kind, "all_to_all", group, sum(_nbytes(t) for t in tensors), lambda: None, None
        )
        return ManyHandle(handle, tensors, [], kept=tuple(t.detach() for t in tensors))
    parts = [
        t.detach().reshape(rows, math.prod(t.shape[1:])).contiguous().view(torch.uint8)
        for t in tensors
    ]
    packed = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    handle = all_to_all(packed, group, kind, output_split_sizes, input_split_sizes)
    return ManyHandle(handle, tensors, [p.shape[1] for p in parts])


def barrier(group: ProcessGroup | None = None) -> None:
    """A plain barrier (start-up and shutdown only; not traced)."""
    dist.barrier(group=group)


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (control messages only - checkpoint key lists,
    error reports - never training tensors; not traced)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def outstanding() -> list[CommHandle]:
    """The ops launched and not yet waited for, in launch order."""
    return sorted(_outstanding, key=lambda h: h.event.t_launch)


def drain_outstanding(timeout_s: float | None = None) -> list[str]:
    """Wait, in launch order, for every op launched and not yet waited for, and for its completion
    callback. `timeout_s` bounds the whole drain (a failing run: a dead peer never completes its
    side); the kinds of the ops given up on are returned and they are forgotten. None: wait as long
    as the process group's own timeout."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    abandoned: list[str] = []
    for handle in outstanding():
        try:
            handle._complete(deadline)
        except RuntimeError:
            if deadline is None:
                raise
            abandoned.append(handle.event.kind)
            _outstanding.discard(handle)
    return abandoned


P2P_SEND, P2P_RECV = "send", "recv"
# a modelled send's stamp travels under its payload's tag + this (pipeline tags stay below it)
STAMP_TAG = 1 << 24


def p2p(
    ops: Sequence[tuple[str, str, torch.Tensor, int, int]], group: ProcessGroup
) -> list[CommHandle]:
    """Post point-to-point transfers as ONE call on `group`: each op is (kind, "send" | "recv",
    tensor, peer global rank, tag); a received tensor is written in place. One op is posted alone,
    several as one `batch_isend_irecv` (one group call on NCCL: its sends and receives progress
    together, so two ranks that exchange with each other - a ring of two, a pair swap - never wait
    on each other). Each op gets its own handle (its own trace event), but they share the call's
    completion: NCCL returns one work for a whole batch, and waiting for any op waits for all.

    Tags name the message on gloo; NCCL ignores them and meets the k-th send from A to B with the
    k-th receive at B from A on the group (`overlap.parallel.program`). So callers must post the
    messages between two ranks on a group in the same order on both sides - the pipeline gives each
    direction of each edge its own group for that.

    On a modelled link the receive carries the link time, from the moment both sides have posted (a
    rendezvous, as NCCL's send/recv): every modelled send is preceded by a one-element stamp with
    its posting time (same peer, tag + `STAMP_TAG`, in the same call), and the receive completes at
    max(stamp, its own posting) + latency + bytes / bandwidth, queued behind what its group's link
    already carries. A receive posted early, as the overlapped pipeline schedule does, so has its
    transfer hidden behind whatever the receiver computes after the sender posted, and never before
    that; one posted just before it is needed pays it all. The ranks share the host's monotonic
    clock (the modelled link is a single-host emulation). Sends complete when the data is out. Bytes
    are recorded on the send only, so a per-iteration byte count is what crossed the links."""
    if not ops:
        return []
    for kind, op, _t, _peer, _tag in ops:
        if op not in (P2P_SEND, P2P_RECV):
            raise ValueError(f"p2p ({kind}): unknown op {op!r}")
    if len({family(kind) for kind, *_rest in ops}) > 1:
        raise ValueError(
            f"p2p: one call carries one family's kinds, got {[kind for kind, *_rest in ops]}"
        )
    size = group_size(group)
    events = [
        CommEvent(
            kind=kind,
            op="p2p",
            group_size=size,
            nbytes=_nbytes(t) if op == P2P_SEND else 0,
            t_launch=recorder().mark(),
        )
        for kind, op, t, _peer, _tag in ops
    ]
    for event in events:  # a receive is recorded with 0 bytes: counted once, at the send
        recorder().add_comm(event)
    run = session()
    if run.is_free(ops[0][0]) or size == 1:
        for _kind, op, t, _peer, _tag in ops:
            if op == P2P_RECV:
                t.zero_()
        return [
            CommHandle(event, None, t if op == P2P_RECV else None)
            for event, (_kind, op, t, _peer, _tag) in zip(events, ops)
        ]
    modelled = run.models(ops[0][0])
    # (op, tensor, peer, tag), a stamp right before its payload
    posts: list[tuple[str, torch.Tensor, int, int]] = []
    stamps: list[torch.Tensor | None] = []
    for _kind, op, t, peer, tag in ops:
        stamp = None
        if modelled:
            stamp = torch.full(
                (1,), now() if op == P2P_SEND else 0.0, dtype=torch.float64, device=t.device
            )
            posts.append((op, stamp, peer, tag + STAMP_TAG))
        stamps.append(stamp)
        posts.append((op, t, peer, tag))
    # under NCCL's rules: tags ignored
    wire = (lambda tag: 0) if run.nccl_rules else (lambda tag: tag)
    calls = [
        dist.P2POp(dist.isend if op == P2P_SEND else dist.irecv, t, peer, group, wire(tag))
        for op, t, peer, tag in posts
    ]
    if len(calls) == 1:
        call = calls[0]
        posted = _Posted([call.op(call.tensor, call.peer, group=group, tag=call.tag)])
    else:
        posted = _Posted(dist.batch_isend_irecv(calls))
    kinds = iter([kind for kind, *_rest in ops for _ in range(2 if modelled else 1)])
    records = [_op_record(next(kinds), op, t, peer) for op, t, peer, _tag in posts]
    unit = _record(run.program, group, records)
    handles = []
    for event, (_kind, op, t, _peer, _tag), stamp in zip(events, ops, stamps):
        deadline_from = None
        if stamp is not None and op == P2P_RECV:
            deadline_from = link_model.receive_deadline(
                run.network.on(group), _nbytes(t), event, stamp, posted.is_completed
            )
        handles.append(
            CommHandle(
                event,
                posted,
                t if op == P2P_RECV else None,
                None,
                deadline_from,
                unit,
                run.program,
            )
        )
    return handles
