"""User-facing errors.

A user mistake (bad field value, impossible layout, unmet prerequisite) is reported as one paragraph
that names the field, the value and the fix, and the command line exits with status 2 without a
traceback. Everything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration the user can fix: names the field, the offending value, why it is wrong and
    how to fix it."""

    # Raised on every rank at the same point, after a collective that told each of them (`agreed`).
    agreed: bool = False

    def __init__(self, field: str, value: Any, why: str, fix: str) -> None:
        self.field = field
        self.value = value
        self.why = why
        self.fix = fix
        super().__init__(f"{field}={value!r}: {why} Fix: {fix}")


class NotBuiltError(ConfigError):
    """A valid request for a capability the overlap runtime does not implement yet. Never faked,
    always said."""

    def __init__(self, field: str, value: Any, what: str, fix: str) -> None:
        super().__init__(field, value, f"{what} is not built in the overlap runtime yet.", fix)


def agreed(error: ConfigError) -> ConfigError:
    """`error`, marked as raised by every rank at the same point after a collective that told each
    of them, which completed on every rank (e.g. a checkpoint any rank found corrupt): the peers
    are alive, in step and leaving too, so a rank's teardown can be the ordinary one, barrier
    included, rather than a failing rank's (`overlap.parallel.teardown.shutdown`), whose gloo
    workers may still hold an op when the interpreter finalizes and abort the process. Not for
    DCP's collective failures: a peer may have died in them (a full disk aborts a C++ writer)."""
    error.agreed = True
    return error


# A rule: (field, value, ok, why, fix), or (field, value, ok, why, fix, kind) for a row whose error
# is not the table's kind (a NotBuiltError's `why` is its subject: what is not built).
Rule = tuple[Any, ...]


def broken_rules(rules: Iterable[Rule], kind: type[ConfigError] = ConfigError) -> list[ConfigError]:
    """The error of every broken row of a rule table, in table order (what `explain` lists):
    every row is read, so none may rely on an earlier one holding."""
    return [_error(row, kind) for row in rules if not row[2]]


def check_rules(rules: Iterable[Rule], kind: type[ConfigError] = ConfigError) -> None:
    """Raise the first broken row of a rule table; the rows after it are not read (a generator's
    later rows may rely on the earlier ones holding)."""
    for row in rules:
        if not row[2]:
            raise _error(row, kind)


def _error(row: Rule, kind: type[ConfigError]) -> ConfigError:
    field, value, _, why, fix, *named = row
    return (named[0] if named else kind)(field, value, why, fix)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be written or honoured (missing, truncated, another model's): names
    the folder or file, and the tensor where one is at fault."""


class NonFiniteError(ConfigError):
    """Training stopped on a NaN/Inf loss or gradient (ddp.check_for_nan_in_grad), before anything
    was updated."""


class RankFailure(RuntimeError):
    """A worker rank died or hung, or refused (a ConfigError found by the ranks: `exit_code` 2, as
    the same refusal before launch); names the rank so the others are not left waiting."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class NoSpaceError(RuntimeError):
    """A write that the disk (or a quota) had no room for: the machine's state, not a mistake in
    the command, so exit 1, but one line that says where and how much is free, never a
    traceback."""


class ProgramError(RuntimeError):
    """What the ranks' recorded communication programs would do wrong on NCCL
    (`overlap.parallel.program`: a mismatched collective, an unmatched message, a deadlock), one
    finding per line."""
