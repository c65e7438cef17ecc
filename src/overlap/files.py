"""Writing files so that nothing planted in a folder can redirect the write, and a full disk is
said in one line.

Checkpoint, log and trace folders are often shared (a team's scratch space), and runs often write
as root. A file opened by name with `open(path, "w")` follows a symbolic link someone left at that
name and truncates whatever it points to; a fixed temporary name (`x.tmp`) can be planted the same
way. So every file a run writes is created under a *fresh* name in its folder (random, opened with
`O_CREAT | O_EXCL | O_NOFOLLOW`: the kernel refuses if anything, a link included, is already there)
and then renamed onto its final name: a rename replaces a link that was there instead of writing
through it. `write_replace` writes the whole file first (readers see the old content or the new,
never a torn one); `create_replacing` renames at once and hands back the open file, for streams
that grow while the run goes on (the `--metrics` JSON lines).
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import IO

from overlap.errors import NoSpaceError

_FRESH_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fresh_name(path: Path) -> Path:
    """A name beside `path` that nobody can have planted in advance (hidden, random)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def create_exclusive(path: str | os.PathLike, binary: bool = False) -> IO:
    """Open a new file at `path` for writing: fails if anything (a file, a link) is there. The mode
    is 0o666 less the umask, as `open` gives."""
    fd = os.open(path, _FRESH_FLAGS, 0o666)
    return os.fdopen(fd, "wb" if binary else "w")


def write_replace(path: str | os.PathLike, data: str | bytes) -> None:
    """Write `data` to a fresh file beside `path`, flush it to disk, and rename it onto `path`."""
    path = Path(path)
    tmp = fresh_name(path)
    try:
        with create_exclusive(tmp, binary=isinstance(data, bytes)) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def create_replacing(path: str | os.PathLike) -> IO:
    """A new, empty text file now named `path` (whatever was there, a link included, is replaced,
    never written through), open for writing."""
    path = Path(path)
    tmp = fresh_name(path)
    f = create_exclusive(tmp)
    try:
        os.replace(tmp, path)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
    return f


def is_no_space(exc: BaseException | None) -> bool:
    """A full disk (or quota) anywhere in `exc`'s chain of causes."""
    while exc is not None:
        if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(
            exc
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def no_space(folder: str | os.PathLike, what: str, after: str) -> NoSpaceError:
    """The one-line error for a write into `folder` that the disk had no room for: `what` failed
    (the command's own words), the bytes free there now, and `after`: what was left behind."""
    folder = Path(folder)
    probe = next((p for p in (folder, *folder.absolute().parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    return NoSpaceError(f"no space left on device: {what} ({free} bytes free in {folder}); {after}")
