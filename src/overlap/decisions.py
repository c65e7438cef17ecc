"""Decision records: every resolved value says what was asked, what is in effect, who decided and
why - the run's "loud and explained decisions", which every layer of the resolution writes (the
overlap switches, the precision, the layout, checkpoints, the kernel choices of `overlap.kernels`).

This is the fix for the reference's worst habit (turning overlap off with a warning nobody reads):
the table is logged at start-up, printed by `overlap explain`, and strict mode turns any request
that could not be honoured into an error. It sits below every package that records (it imports
only `overlap.errors`); the engine that decides an overlap switch from its rules is
`overlap.config.switches`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from overlap.errors import ConfigError

# the configuration's channel: what a resolution decided, whichever package's rule decided it
log = logging.getLogger("overlap.config")

# Who decided an effective value.
USER = "user"  # set on CommOverlapConfig (or by a harness flag that writes there)
# set directly on the model / ddp / optimizer config (by a recipe or an override)
MODEL_CONFIG = "model config"
RULE = "rule"  # derived by a rule from the layout or from another field
DEFAULT = "default"  # nothing asked for it; the automatic default
# Who set a value on the command line (the "command line" and "other settings" sections).
FLAG = "flag"
OVERRIDE = "override"
RECIPE = "recipe"


@dataclass(frozen=True)
class Decision:
    field: str
    requested: Any
    effective: Any
    decided_by: str
    reason: str

    @property
    def overridden(self) -> bool:
        """A request that was not honoured: the user asked for a value and got another."""
        return self.requested is not None and self.requested != self.effective

    def to_json(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in asdict(self).items()}


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


@dataclass(frozen=True)
class NoOp:
    """A switch that is on but can do nothing in this configuration (said, never silent; an error
    under strict)."""

    field: str
    value: Any
    why: str
    fix: str

    to_json = Decision.to_json


class DecisionLog:
    """Ordered decisions of one finalize(); `strict` turns a dishonoured request or a no-op switch
    into a ConfigError at once.

    Sections: `decisions` (the overlap fields), `command_line` (flags beaten by overrides,
    layout-derived recipe values), `noops` (switches that are on and do nothing), `other` (runtime
    settings that are not overlap decisions, with their source; filled by the harness)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.decisions: list[Decision] = []
        self.command_line: list[Decision] = []
        self.noops: list[NoOp] = []
        self.other: list[Decision] = []
        # Decisions outside the overlap table, one section each ("checkpoint", "data"), in recording
        # order.
        self.sections: dict[str, list[Decision]] = {}

    def _check(self, decision: Decision, fix: str | None, warn: bool = True) -> None:
        """An overridden request: an error under strict, else a warning - or, for a flag the user's
        own override beat (`warn` False), an info line: that precedence is the reference harness's
        and the user's choice (the MoE guide's command relies on it), said in the log and the
        command-line section, not warned about."""
        if decision.overridden:
            if self.strict:
                raise ConfigError(
                    decision.field,
                    decision.requested,
                    f"strict mode: this request cannot be honoured: {decision.reason.rstrip('.')}.",
                    fix
                    or "change the request, or drop --strict / comm_overlap.strict to accept the "
                    "logged decision.",
                )
            log.log(
                logging.WARNING if warn else logging.INFO,
                "%s: requested %r, using %r (%s)",
                decision.field,
                decision.requested,
                decision.effective,
                decision.reason,
            )

    def record(
        self,
        field: str,
        requested: Any,
        effective: Any,
        decided_by: str,
        reason: str,
        fix: str | None = None,
    ) -> Any:
        decision = Decision(field, requested, effective, decided_by, reason)
        self._check(decision, fix)
        self.decisions.append(decision)
        return effective

    def record_in(
        self, section: str, field: str, requested: Any, effective: Any, decided_by: str, reason: str
    ) -> None:
        """A decision of another part of the run (checkpoints, data): its own section, not the
        overlap table."""
        self.sections.setdefault(section, []).append(
            Decision(field, requested, effective, decided_by, reason)
        )

    def record_command_line(self, decision: Decision) -> None:
        """A flag beaten by an override (logged in its section; an error under strict) or a recipe
        value derived from the layout."""
        self._check(
            decision,
            "keep either the flag or the override (they disagree), or drop --strict.",
            warn=False,
        )
        self.command_line.append(decision)

    def noop(self, field: str, value: Any, why: str, fix: str) -> None:
        """`field` is on but does nothing here: warn (start-up log and explain), or refuse under
        strict."""
        if self.strict:
            raise ConfigError(
                field, value, f"strict mode: this switch is on but does nothing here: {why}.", fix
            )
        log.warning("%s=%r does nothing here: %s. Fix: %s", field, value, why, fix)
        self.noops.append(NoOp(field, value, why, fix))

    def attribute(self, source: Callable[[str], str]) -> None:
        """Name who set each value the resolution took "directly from the model config":
        `source(field)` says "override", "flag -x" or "recipe" (the harness knows the command line;
        the resolution does not)."""

        def named(rows: list[Decision]) -> list[Decision]:
            return [
                replace(d, decided_by=source(d.field)) if d.decided_by == MODEL_CONFIG else d
                for d in rows
            ]

        self.decisions = named(self.decisions)
        self.sections = {name: named(rows) for name, rows in self.sections.items()}

    def get(self, field: str) -> Decision:
        for d in self.decisions:
            if d.field == field:
                return d
        raise KeyError(field)

    def to_json(self) -> dict[str, Any]:
        return {
            "decisions": [d.to_json() for d in self.decisions],
            "command_line": [d.to_json() for d in self.command_line],
            "noops": [n.to_json() for n in self.noops],
            **{name: [d.to_json() for d in rows] for name, rows in self.sections.items()},
            "other_settings": [
                {"field": d.field, "value": _jsonable(d.effective), "source": d.decided_by}
                for d in self.other
            ],
        }

    def format_table(self) -> str:
        """Aligned text table for logs and `overlap explain`."""
        return _decision_table(self.decisions)

    def format_sections(self) -> str:
        """The overlap table plus every non-empty extra section, as `explain` prints and the
        start-up log shows."""
        parts = ["Overlap decisions:\n" + self.format_table()]
        if self.command_line:
            parts.append(
                "Command line (flags apply first, overrides after; a flag an override beats is "
                "named):\n" + _decision_table(self.command_line, ("flag asked", "in effect"))
            )
        if self.noops:
            parts.append(
                "Switches that are on but do nothing here:\n"
                + "\n".join(
                    f"  {n.field}={_short(n.value)}: {n.why}. Fix: {n.fix}" for n in self.noops
                )
            )
        for name, rows in self.sections.items():
            parts.append(f"{name.capitalize()} decisions:\n" + _decision_table(rows))
        if self.other:
            parts.append(
                "Other settings (not overlap decisions):\n"
                + _table(
                    ("field", "value", "set by"),
                    [(d.field, _short(d.effective), d.decided_by) for d in self.other],
                )
            )
        return "\n\n".join(parts)


def _decision_table(
    decisions: list[Decision], asked: tuple[str, str] = ("requested", "effective")
) -> str:
    return _table(
        ("field", *asked, "decided by", "why"),
        [
            (
                d.field,
                "-" if d.requested is None else _short(d.requested),
                _short(d.effective),
                d.decided_by,
                d.reason,
            )
            for d in decisions
        ],
    )


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the last column is free text and is not padded."""
    rows = [header, *rows]
    n = len(header) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(n)]
    lines = []
    for i, r in enumerate(rows):
        lines.append(("  ".join(r[j].ljust(widths[j]) for j in range(n)) + "  " + r[n]).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * max(3, len(header[n])))
    return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{k}: {v.get('method', v) if isinstance(v, dict) else v}"
                for k, v in list(value.items())[:3]
            )
            + (", ..." if len(value) > 3 else "")
            + "}"
        )
    return str(value)
