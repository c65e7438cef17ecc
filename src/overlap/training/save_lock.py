"""One writer per save folder: a lock file that a run holds while it owns `checkpoint.save`.

Two runs saving into one folder would load and overwrite each other's checkpoints, and each would
prune the other's. Rank 0 of a run takes `<save>/.overlap_save.lock` before it touches the folder
(removing stale temporary folders included) and gives it back when the run ends. The lock is an
`flock` on that file, so the kernel releases it however the process ends (an exception, a signal,
SIGKILL); the file also names its holder (pid, host, start time), so a second writer is told who
holds it. A file left behind by a holder that died is taken over with a warning: on this host when
its process no longer runs, elsewhere when nobody holds its `flock`. A live holder on this host is
refused even if `flock` succeeded (a filesystem that ignores `flock`) - but a pid is not a process:
after a reboot or a container restart the pid can belong to something unrelated, which would block
the folder forever. So the file also records the kernel's boot id and the holder's start time
(`/proc/<pid>/stat`), and a live pid counts as the holder only if both match (for a file that lacks
them, written before they were recorded: only if the process started before the lock was taken).

The lock file is opened with `O_NOFOLLOW` and must be a regular file with one name: a link planted
at its name (the run truncates and writes the file) is refused, never written through.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

from overlap.errors import CheckpointError

LOCK_NAME = ".overlap_save.lock"

log = logging.getLogger("overlap.checkpoint")


def _holder(text: str) -> dict:
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _boot_id() -> str | None:
    """This kernel's boot id (changes with every boot; None where /proc does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None if
    unknown."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _boot_time() -> float | None:
    """The wall-clock time of this boot (`btime` in /proc/stat)."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _identity() -> dict:
    """What names this process beyond its pid: the host, the boot, the start time."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid_start_ticks": _start_ticks(os.getpid()),
        "started": time.time(),
    }


def _holder_runs(holder: dict) -> bool:
    """Whether the process `holder` names (on this host) still runs: its pid is alive and is the
    same process - the same boot and start time, or, for a file without them, a process that
    started before the lock was taken."""
    pid = holder["pid"]
    if not _alive(pid):
        return False
    boot = holder.get("boot_id")
    if boot is not None and boot != _boot_id():
        return False  # the machine (or its kernel) restarted: nothing from then runs
    ticks = _start_ticks(pid)
    if ticks is None:
        return True  # nothing to tell it apart by: a live pid is taken as the holder
    if holder.get("pid_start_ticks") is not None:
        return ticks == holder["pid_start_ticks"]
    boot_time, started = _boot_time(), holder.get("started")
    if boot_time is None or not isinstance(started, (int, float)):
        return True
    return boot_time + ticks / os.sysconf("SC_CLK_TCK") <= started + 1.0


def _describe(holder: dict) -> str:
    started = holder.get("started")
    since = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if started else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


class SaveFolderLock:
    """The lock of one save folder, held by this process between `acquire` and `release`."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise CheckpointError naming the run that holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        me = _identity()
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(os.read(fd, 4096).decode(errors="replace"))
                os.close(fd)
                raise self._refusal(holder) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            # the holder removed the file between our open and our lock: take the new one
            os.close(fd)
        previous = _holder(os.read(fd, 4096).decode(errors="replace"))
        pid = previous.get("pid")
        if isinstance(pid, int) and pid != os.getpid():
            here = previous.get("host") == me["host"]
            if here and _holder_runs(previous):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise self._refusal(previous)
            why = (
                ("no longer runs" if not _alive(pid) else "now belongs to another process")
                if here
                else "does not hold it any more"
            )
            log.warning(
                "%s: taking over a stale lock of %s, which %s", self.path, _describe(previous), why
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _open(self) -> int:
        """The lock file's descriptor; refused if its name is a link (or another kind of file, or
        a file with a second name) rather than written through."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise self._planted(f"a symbolic link to {os.readlink(self.path)}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            kind = "not a regular file" if not stat.S_ISREG(info.st_mode) else "a hard link"
            raise self._planted(f"{kind} ({info.st_nlink} names)")
        return fd

    def _planted(self, what: str) -> CheckpointError:
        return CheckpointError(
            "checkpoint.save",
            str(self.folder),
            f"the lock file {self.path} is {what}: the run would truncate and write whatever it "
            "points to, so it is refused.",
            f"remove {self.path} (nothing of a run is in it), then run again.",
        )

    def _refusal(self, holder: dict) -> CheckpointError:
        return CheckpointError(
            "checkpoint.save",
            str(self.folder),
            f"another run is saving into this folder ({_describe(holder)}; lock file {self.path}): "
            "two writers would overwrite and prune each other's checkpoints.",
            "wait for that run to end, or use another checkpoint.save folder; if that run is "
            f"gone (on another host), delete {self.path}.",
        )

    def release(self) -> None:
        """Give the lock back (idempotent): the file is removed, then unlocked."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __del__(self) -> None:
        self.release()
