"""Start N local ranks (one process each) and watch them: every fault ends the job with one line
that names its cause.

Each rank is the same `overlap run ...` command line with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set, exactly what torchrun would give it, so local and cluster runs share one code path.

Output: each rank's stdout and stderr go to its own log file, `<log dir>/overlap-rank<r>.log` (a
fresh `overlap-run-*` folder in the temporary directory), and the launcher forwards them to its
stderr as they come, so a healthy run looks as it always did. Once a rank has failed, nothing more
is forwarded: the other ranks' collateral errors (a peer's connection closed, a collective timed
out) stay in their logs, and the launcher prints one line - the cause first, then a summary of the
collateral failures and where the logs are. A Python traceback is held back until its rank's fate is
known (forwarded if the rank carries on or ends well; else left in the log). The log folder is
removed after a clean run and kept (and named) after a failure.

Which rank caused a failure, in this order:
0. a rank whose own error says the disk is full (a rank writing to that disk from C++ may die of
   SIGABRT first);
1. a rank killed by a signal the launcher did not send ("rank 1 of 4 killed by SIGKILL"), if it died
   within `SIGNAL_TIE_S` of the first failure (the others only fail because it is gone) - unless it
   had reported an error of its own first (`overlap: error: ...`, printed as the command exits):
   then it failed on that error and the signal came as it left (a C++ thread aborting the exit);
2. a rank that stopped making progress: still running (or stopped, e.g. by SIGSTOP) after the others
   failed, when their errors are only collateral (timeouts, closed connections) - the launcher kills
   it and names it;
3. otherwise the first rank to fail.
When the cause is a refusal - the ranks exited 2 with one ConfigError, e.g. a checkpoint this run
cannot resume - the launch ends as that refusal would before launch: its line alone, exit 2.
Exit times come from one waiter thread per rank, so "first" is when the rank died, not when the
launcher looked.

The ranks die with the launcher: on Linux each rank is started with the parent-death signal set
(prctl PR_SET_PDEATHSIG = SIGKILL), so a launcher killed with SIGKILL takes its ranks with it
instead of leaving them training as orphans. SIGTERM (and SIGHUP) to the launcher unwind like Ctrl-C
(`Interrupted`, carrying the signal: `overlap` exits 128 + signal number, 143 for SIGTERM, 130 for
Ctrl-C, with one line).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from overlap.errors import RankFailure

# after a failure, how long the other ranks get to notice and exit before they are killed
GRACE_S = 10.0
STOPPED_GRACE_S = 1.0  # once only stopped/hung ranks are left, how long before they are killed
SIGNAL_TIE_S = 1.0
DISK_FULL = re.compile(r"no space left on device", re.I)
HOLD_S = 3.0  # a traceback the rank survives this long was only logged: forward it after all
STOP_S = 3.0  # after Ctrl-C / SIGTERM, how long the ranks get to exit before SIGKILL
POLL_S = 0.05
# a rank's exit status for a refusal (a ConfigError: the command line's convention)
REFUSAL_CODE = 2
LOG_NAME = "overlap-rank{rank}.log"
# the launcher's stderr, where rank output is forwarded, is a terminal
STDERR_TTY_ENV = "OVERLAP_STDERR_TTY"
# a rank whose parent is no longer this pid exits (cli._join_launcher)
LAUNCHER_PID_ENV = "OVERLAP_LAUNCHER_PID"

# Errors a rank raises because a peer is gone or silent, not because of its own fault.
COLLATERAL = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|[Tt]imed out|[Tt]imeout|"
    r"ECONNRESET|EPIPE|ECONNREFUSED|Connection refused|peer .*(closed|died|gone)|"
    r"NCCL communicator was aborted|interrupted|KeyboardInterrupt",
    re.I,
)


# torch prefixes an uncaught exception's lines with "[rank0]: "
_RANK_PREFIX = re.compile(rb"^\[rank\d+\]:\s?")
_RANK_PREFIX_TEXT = re.compile(r"^\[rank\d+\]:\s?")
# Where a rank's output may turn into a failure report: held back until the rank's fate is known (a
# rank's own one-line error too: the launcher's account of the failure carries it, once).
_HOLD_FROM = re.compile(
    rb"Traceback \(most recent call last\)|\[overlap rank \d+\] (ERROR|WARNING teardown)|"
    rb"overlap: error: "
)
_FINAL_ERROR = b"overlap: error: "
# gloo's "[/.../pair.cc:537] "
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


class Interrupted(KeyboardInterrupt):
    """The launcher was told to stop (Ctrl-C, SIGTERM, SIGHUP); `signum` says by what. The ranks
    were stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.ranks_stopped = False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(
    base: Mapping[str, str], rank: int, world: int, addr: str, port: int
) -> dict[str, str]:
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    # one compute thread per rank: ranks share the machine's cores
    env.setdefault("OMP_NUM_THREADS", "1")
    # the rank's output reaches its log (and the terminal) as it happens
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- ranks die with their launcher ----------------------------------------------------------------
_PR_SET_PDEATHSIG = 1
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):  # pragma: no cover - no libc prctl
    _PRCTL = None


def _die_with_parent(parent: int):
    """A preexec_fn: the child gets SIGKILL when the launcher dies (looked up before fork: nothing
    to import)."""

    def preexec() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died between fork and prctl
            os._exit(1)

    return preexec if _PRCTL is not None else None


# --- one rank -------------------------------------------------------------------------------------
@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen
    log_path: Path
    exited_at: float | None = None
    killed_by_us: bool = False
    hung: str | None = None  # why it is blamed for stopping, when it is
    _log: object = None
    _pending: bytes = (
        b""  # bytes read but not yet forwarded (an unfinished line, or a held traceback)
    )
    # a traceback being held back until the rank's fate is known
    _held: list[bytes] = field(default_factory=list)
    _held_since: float = 0.0
    # the held lines include the rank's own final error line ("overlap: error: ..."): the rank is
    # ending, however long that takes on a loaded machine, and the launcher's account says it
    _final: bool = False

    def start_waiter(self) -> None:
        def wait() -> None:
            self.proc.wait()
            self.exited_at = time.monotonic()

        threading.Thread(target=wait, name=f"overlap-rank{self.rank}-waiter", daemon=True).start()

    @property
    def code(self) -> int | None:
        return self.proc.returncode if self.exited_at is not None else None

    def state(self) -> str:
        """The kernel's process state letter (R, S, D, T = stopped, Z), '' when unknown."""
        try:
            text = Path(f"/proc/{self.proc.pid}/stat").read_text()
            return text.rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return ""

    def read_new(self) -> bytes:
        if self._log is None:
            self._log = open(self.log_path, "rb")
        return self._log.read()

    def forward(self, out, live: bool) -> None:
        """Forward what the rank wrote since last time (`live`), holding back everything from a
        traceback on until the rank's fate is known (`release_held`), or until it has carried on for
        HOLD_S."""
        data = self._pending + self.read_new()
        lines = data.split(b"\n")
        self._pending = lines.pop()
        for line in lines:
            line += b"\n"
            bare = _RANK_PREFIX.sub(b"", line)
            opens = _HOLD_FROM.match(bare) is not None
            if not self._held and opens:
                self._held_since = time.monotonic()
            self._final = self._final or bare.startswith(_FINAL_ERROR)
            if self._held or opens:
                self._held.append(line)
            elif live:
                out.write(line)
        if (
            live
            and self._held
            and time.monotonic() - self._held_since > HOLD_S
            and self.code is None
            and not self._final
        ):
            self.release_held(out)  # a logged traceback the rank survived
        head = _RANK_PREFIX.sub(b"", self._pending)[:9]
        if (
            live
            and self._pending
            and not self._held
            and not b"Traceback".startswith(head)
            and not b"[rank".startswith(self._pending[:5])
        ):
            out.write(self._pending)  # an unfinished line (a progress bar) goes out now
            self._pending = b""

    def release_held(self, out) -> None:
        for line in self._held:
            out.write(line)
        self._held = []
        self._final = False

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def _lines(self) -> list[str]:
        """This rank's log, line by line: stripped, without torchrun's rank prefix, blanks
        dropped."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        lines = (_RANK_PREFIX_TEXT.sub("", ln).strip() for ln in text.splitlines())
        return [ln for ln in lines if ln]

    def said_error(self) -> str:
        """The error this rank reported itself: its last `overlap: error:` line, which the command
        prints just before it exits ("" if it printed none)."""
        said = [ln for ln in self._lines() if ln.startswith("overlap: error: ")]
        return said[-1].removeprefix("overlap: error: ") if said else ""

    def last_error(self) -> str:
        """The last line that reads like an error in this rank's log (the exception of its
        traceback)."""
        for line in reversed(self._lines()):
            if re.match(
                r"^(overlap: error:|[A-Za-z_.]*(Error|Exception|Interrupt)\b|torch\.\S+Error|"
                r"terminate called|RuntimeError)",
                line,
            ):
                return _SOURCE_LOCATION.sub("", line.removeprefix("overlap: error: "))
        return ""


# --- the launcher ---------------------------------------------------------------------------------
def launch_local(
    command: Sequence[str],
    world: int,
    env: Mapping[str, str],
    addr: str = "127.0.0.1",
    prefixes: Sequence[Sequence[str]] = (),
    log_dir: str | os.PathLike | None = None,
    term_grace_s: float | None = None,
) -> None:
    """Run `command` once per rank and wait; raise RankFailure with the one-line account of a
    failure. `prefixes`, when given, holds one command prefix per rank (e.g. the `ip netns exec`
    that starts it in its network namespace); `addr` is the rendezvous address (MASTER_ADDR).

    `term_grace_s` (the ranks handle SIGTERM: `train.exit_signal_handler`): a SIGTERM to the
    launcher is forwarded and the ranks get that long to save a checkpoint and exit; if every rank
    then exits 0 the launch ends normally (a preemption handled, not a failure) instead of raising
    `Interrupted`."""
    if prefixes and len(prefixes) != world:
        raise ValueError(f"{len(prefixes)} command prefixes for {world} ranks")
    # free here; a fresh network namespace (prefixes) has an empty port space anyway
    port = free_port()
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="overlap-run-"))
    logs.mkdir(parents=True, exist_ok=True)
    out = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
    ranks: list[_Rank] = []
    failure: str | None = None
    interrupted: Interrupted | None = None
    previous = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    env = {**env, LAUNCHER_PID_ENV: str(os.getpid())}
    if sys.stderr.isatty():
        # rank 0 may draw its progress bar: its output reaches this terminal
        env[STDERR_TTY_ENV] = "1"
    try:
        preexec = _die_with_parent(os.getpid())
        for r in range(world):
            path = logs / LOG_NAME.format(rank=r)
            with open(path, "wb") as sink:
                proc = subprocess.Popen(
                    [*(prefixes[r] if prefixes else ()), *command],
                    env=rank_env(env, r, world, addr, port),
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=preexec,
                )
            ranks.append(_Rank(r, proc, path))
        for rk in ranks:
            rk.start_waiter()
        failure = _watch(ranks, world, out)
    except KeyboardInterrupt as exc:
        interrupted = exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
        # SIGTERM: a rank without a handler ends at once, wherever it is (a Ctrl-C in a terminal has
        # already reached every rank as SIGINT; whatever they print while unwinding stays in their
        # logs). With the exit handler, the ranks stop at the next step boundary, save, and exit 0.
        handled = term_grace_s is not None and interrupted.signum == signal.SIGTERM
        _stop(ranks, signal.SIGTERM, term_grace_s if handled else STOP_S)
        interrupted.ranks_stopped = True
        if handled and all(rk.proc.returncode == 0 for rk in ranks):
            interrupted = None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(ranks, None, 0.0)  # nothing may outlive the launcher
        if failure is None and interrupted is None and out is not None:
            for rk in ranks:
                try:
                    rk.forward(out, live=True)
                    rk.release_held(out)
                    if rk._pending:
                        out.write(rk._pending)
                except OSError:
                    pass
            out.flush()
        for rk in ranks:
            rk.close()
    if failure is not None and failure.refusal:
        # the ranks refused (a ConfigError, e.g. a checkpoint that this run cannot resume): said as
        # the same refusal before launch would be, exit 2; the logs hold nothing more
        if log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
        raise RankFailure(failure.line, exit_code=2)
    if failure is not None:
        where = f"Rank logs: {logs / LOG_NAME.format(rank='<r>')}"
        raise RankFailure(f"{failure.line.rstrip('.')}. {where}")
    if log_dir is None:
        # a clean run or an interruption: nothing to look at
        shutil.rmtree(logs, ignore_errors=True)
    if interrupted is not None:
        raise interrupted


@dataclass(frozen=True)
class Failure:
    """How a launch failed: the one line, and whether the ranks refused (exit 2)."""

    line: str
    refusal: bool


def _watch(ranks: list[_Rank], world: int, out) -> Failure | None:
    """Forward output until every rank has exited; on a failure stop forwarding, give the others
    GRACE_S to notice, kill what is left, and return the account (None: all ranks ended well)."""
    first_fail: float | None = None
    deadline: float | None = None
    while True:
        now = time.monotonic()
        failed = [rk for rk in ranks if rk.code not in (None, 0)]
        if failed and first_fail is None:
            first_fail = min(rk.exited_at for rk in failed)
            deadline = now + GRACE_S
        if out is not None and first_fail is None:
            for rk in ranks:
                rk.forward(out, live=True)
                if rk.code == 0 and rk._held:
                    rk.release_held(out)  # it ended well: the traceback was only logged
            out.flush()
        alive = [rk for rk in ranks if rk.code is None]
        if not alive:
            break
        if first_fail is not None:
            # Only stopped (or unresponsive) ranks left while the others have failed: they are the
            # ones that stopped making progress; no need to sit out the whole grace period.
            if (
                all(rk.state() == "T" for rk in alive)
                and now - max(rk.exited_at for rk in ranks if rk.exited_at) > STOPPED_GRACE_S
            ):
                deadline = now
            if now >= deadline:
                for rk in alive:
                    state = rk.state()
                    rk.hung = (
                        "its process was stopped, e.g. by SIGSTOP"
                        if state == "T"
                        else f"still running {GRACE_S:.0f} s after the others failed"
                    )
                    rk.killed_by_us = True
                    rk.proc.kill()
                _join(ranks, 5.0)
                break
        time.sleep(POLL_S)
    if first_fail is None:
        return None
    cause = _cause(ranks)
    refused = [rk.last_error() for rk in cause if rk.code == REFUSAL_CODE]
    if len(refused) == len(cause) and refused[0]:
        # every rank that ended on its own error refused the same way (the others, waiting for
        # it, were stopped or failed for lack of it): the refusal, as a pre-launch one reads
        return Failure(refused[0], refusal=True)
    return Failure(describe_failure(ranks, world), refusal=False)


def _failed(ranks: list[_Rank]) -> list[_Rank]:
    """Ranks that ended with a failure of their own (not killed by the launcher), first first."""
    return sorted(
        (rk for rk in ranks if rk.code not in (None, 0) and not rk.killed_by_us),
        key=lambda rk: rk.exited_at,
    )


def _cause(ranks: list[_Rank]) -> list[_Rank]:
    """The rank(s) that caused a failure (the rules in the module docstring)."""
    failed = _failed(ranks)
    hung = [rk for rk in ranks if rk.hung]
    first = failed[0] if failed else None
    signalled = [
        rk
        for rk in failed
        if rk.code < 0
        and not _died_leaving(rk)
        and first is not None
        and rk.exited_at - first.exited_at <= SIGNAL_TIE_S
    ]
    own_errors = [
        rk
        for rk in failed
        if (rk.code > 0 or _died_leaving(rk)) and not COLLATERAL.search(_error_of(rk))
    ]
    # A full disk is every writer's cause: a rank whose C++ stream writer hits it aborts (SIGABRT)
    # in a destructor, while another rank says it in Python - that line, not the abort, is the
    # cause.
    disk_full = [rk for rk in own_errors if DISK_FULL.search(_error_of(rk))]
    if disk_full:
        return disk_full[:1]
    if signalled:
        return [signalled[0]]
    if hung and not own_errors:
        return hung
    return [own_errors[0] if own_errors else first]


def _died_leaving(rk: _Rank) -> bool:
    """Killed by a signal after it reported its own error: the signal came while it was leaving
    (e.g. a C++ thread aborting the interpreter's exit), the error is what failed."""
    return rk.code is not None and rk.code < 0 and bool(rk.said_error())


def _error_of(rk: _Rank) -> str:
    """The error a failed rank stands for: what it said itself if a signal then ended it."""
    said = rk.said_error() if rk.code is not None and rk.code < 0 else ""
    return said or rk.last_error()


def describe_failure(ranks: list[_Rank], world: int) -> str:
    """The one line: the cause first, then the collateral failures summarised."""
    failed = _failed(ranks)
    hung = [rk for rk in ranks if rk.hung]
    cause = _cause(ranks)
    head = "; ".join(_account(rk, world) for rk in cause)
    others = [rk for rk in failed + [h for h in hung if h not in failed] if rk not in cause]
    if not others:
        return f"{head}; the other ranks were stopped" if world > 1 else head
    kinds: dict[str, list[int]] = {}
    said = {_error_of(rk) for rk in cause}
    for rk in others:
        err = _error_of(rk)
        what = (
            ""
            if rk.killed_by_us
            else "the same error"
            if err and err in said
            else _shorten(err or _code_text(rk.code))
        )
        kinds.setdefault(what, []).append(rk.rank)
    summary = "; ".join(
        f"{_ranks(rs)} then failed: {what}"
        if what
        else f"{_ranks(rs)} still running, stopped by the launcher"
        for what, rs in kinds.items()
    )
    return f"{head} ({summary})"


def _account(rk: _Rank, world: int) -> str:
    who = f"rank {rk.rank} of {world}"
    if rk.hung:
        return f"{who} stopped making progress ({rk.hung}); the launcher killed it"
    if _died_leaving(rk):
        said = _shorten(rk.said_error(), 2000)
        return f"{who} failed: {said} (then killed by {signal_name(-rk.code)} as it exited)"
    if rk.code is not None and rk.code < 0:
        return f"{who} killed by {signal_name(-rk.code)}"
    err = rk.last_error()
    # the cause in full: the rank's own line was held back, so this is where it is said
    return f"{who} failed ({_code_text(rk.code)})" + (f": {_shorten(err, 2000)}" if err else "")


def _code_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by {signal_name(-code)}" if code < 0 else f"exit code {code}"


def _ranks(rs: list[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, sorted(rs)))


def _shorten(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _join(ranks: list[_Rank], timeout: float) -> None:
    until = time.monotonic() + timeout
    for rk in ranks:
        try:
            rk.proc.wait(timeout=max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _stop(ranks: list[_Rank], sig: int | None, wait_s: float) -> None:
    """Send `sig` to the live ranks and give them `wait_s` to exit, then SIGKILL (sig None: SIGKILL
    at once). A second Ctrl-C or SIGTERM while waiting kills at once."""
    live = [rk for rk in ranks if rk.proc.poll() is None]
    if not live:
        return
    try:
        if sig is not None:
            for rk in live:
                try:
                    rk.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            _join(live, wait_s)
    except KeyboardInterrupt:
        pass
    finally:
        for rk in live:
            if rk.proc.poll() is None:
                rk.killed_by_us = True
                rk.proc.kill()
        for rk in live:
            try:
                rk.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                pass


def _raise_interrupt(signum: int, frame) -> None:
    raise Interrupted(signum)


def python_module_command(module: str, argv: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", module, *argv]
