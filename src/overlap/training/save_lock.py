"""One writer per save folder: a lock file that a run holds while it owns `checkpoint.save`.

Two runs saving into one folder would load and overwrite each other's checkpoints, and each would
prune the other's. Rank 0 of a run takes `<save>/.overlap_save.lock` before it touches the folder
(removing stale temporary folders included) and gives it back when the run ends. The lock is an
`flock` on that file, so the kernel releases it however the process ends (an exception, a signal,
SIGKILL); the file also names its holder (pid, host, start time), so a second writer is told who
holds it. A file left behind by a holder that died is taken over with a warning: on this host when
its pid no longer runs, elsewhere when nobody holds its `flock`. A live pid on this host that the
file names is refused even if `flock` succeeded (a filesystem that ignores `flock`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
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
        host = socket.gethostname()
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
            if previous.get("host") == host and _alive(pid):
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                raise self._refusal(previous)
            why = "no longer runs" if previous.get("host") == host else "does not hold it any more"
            log.warning(
                "%s: taking over a stale lock of %s, which %s", self.path, _describe(previous), why
            )
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, json.dumps({"pid": os.getpid(), "host": host, "started": time.time()}).encode(), 0
        )
        os.fsync(fd)
        self._fd = fd

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
