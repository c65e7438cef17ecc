"""Decision records: every resolved overlap field says what was asked, what is in effect, who decided and why.

This is the fix for the reference's worst habit (turning overlap off with a warning nobody reads): the table is logged
at start-up, printed by `overlap explain`, and strict mode turns any request that could not be honoured into an error.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from overlap.errors import ConfigError

log = logging.getLogger("overlap.config")

# Who decided an effective value.
USER = "user"  # set on CommOverlapConfig (or by a harness flag that writes there)
MODEL_CONFIG = "model config"  # set directly on the model / ddp / optimizer config (by a recipe or an override)
RULE = "rule"  # derived by a rule from the layout or from another field
DEFAULT = "default"  # nothing asked for it; the automatic default


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


class DecisionLog:
    """Ordered decisions of one finalize(); `strict` turns a dishonoured request into a ConfigError at once."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.decisions: list[Decision] = []

    def record(self, field: str, requested: Any, effective: Any, decided_by: str, reason: str,
               fix: str | None = None) -> Any:
        decision = Decision(field, requested, effective, decided_by, reason)
        if decision.overridden:
            if self.strict:
                raise ConfigError(field, requested, f"strict mode: this request cannot be honoured: {reason.rstrip('.')}.",
                                  fix or "change the request, or drop --strict / comm_overlap.strict to accept the "
                                         "logged decision.")
            log.warning("%s: requested %r, using %r (%s)", field, requested, effective, reason)
        self.decisions.append(decision)
        return effective

    def get(self, field: str) -> Decision:
        for d in self.decisions:
            if d.field == field:
                return d
        raise KeyError(field)

    def to_json(self) -> list[dict[str, Any]]:
        return [d.to_json() for d in self.decisions]

    def format_table(self) -> str:
        """Aligned text table for logs and `overlap explain`."""
        rows = [("field", "requested", "effective", "decided by", "why")]
        for d in self.decisions:
            req = "-" if d.requested is None else _short(d.requested)
            rows.append((d.field, req, _short(d.effective), d.decided_by, d.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(r[j].ljust(widths[j]) for j in range(4)) + "  " + r[4])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 3)
        return "\n".join(lines)


def _short(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v.get('method', v) if isinstance(v, dict) else v}"
                               for k, v in list(value.items())[:3]) + (", ..." if len(value) > 3 else "") + "}"
    return str(value)
