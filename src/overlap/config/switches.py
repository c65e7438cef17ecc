"""The one engine that decides an overlap switch from its rules, and records the decision in the
run's table (`overlap.decisions`).

The rules are data: a `Switch` declares how its value is decided (the request, else an automatic
value) and its `Rule`s - a request turned off, a prerequisite or conflict (an error), a value that
does nothing here (a no-op row) - each with its message; `decide` walks them, records the decision
and raises or warns as the rule says. A rule reads the knobs by any of their spellings
(`overlap.config.aliases`), which is why the engine is configuration's and the table it writes is
not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from overlap.config.aliases import request, spellings
from overlap.decisions import DEFAULT, MODEL_CONFIG, RULE, USER, DecisionLog
from overlap.errors import check_rules

Text = str | Callable[[Any], str]  # a message, or a function of the run that writes it (sizes)
_READ = object()  # a rule's value is its field's, read from the run


class Rule(NamedTuple):
    """One prerequisite, conflict or no-op as data: it applies when `when(run)` holds; its message
    names `field` with `value` (by default the field's own, `run.read(field)`), says `why` and how
    to `fix` it. Field and texts are strings or functions of the run. A knob with several
    spellings is named as the user typed it (`typed`)."""

    field: Text
    when: Callable[[Any], bool]
    why: Text
    fix: Text
    value: Any = _READ

    def hit(self, run: Any) -> tuple[str, Any, str, str] | None:
        """(field, value, why, fix) when the rule applies to `run`, else None."""
        if not self.when(run):
            return None
        field = typed(_say(self.field, run), run.sections)
        value = self.value
        value = run.read(field) if value is _READ else value(run) if callable(value) else value
        return field, value, _say(self.why, run), _say(self.fix, run)


def typed(field: str, sections: Mapping[str, Any]) -> str:
    """`field`, or the spelling of its knob the user typed when that is another one of those
    `sections` holds (an error names what the user wrote, not the knob's home)."""
    names = spellings(field)
    if not names or any(name.partition(".")[0] not in sections for name in names):
        return field
    return request(sections, field).spelling or field


def _say(text: Text, run: Any) -> str:
    return text(run) if callable(text) else text


def refuse(rules: Iterable[Rule], run: Any) -> None:
    """Raise the first rule that applies (a prerequisite not met or a conflict is always an error),
    as a row of `errors.check_rules`, the rule tables' one raising engine; the rules after it are
    not read."""
    hits = filter(None, (rule.hit(run) for rule in rules))
    check_rules((field, value, False, why, fix) for field, value, why, fix in hits)


def _off(_run: Any) -> tuple[bool, str]:
    return False, "off unless requested"


# (when, why, fix): a request for the switch on is turned off, with that reason
Off = tuple[Callable[[Any], bool], str, str]


class Switch(NamedTuple):
    """An overlap switch as data: its row in the decision table, which also names the knob its
    request is read from (any spelling: `aliases.request`) and its plan field; its automatic value
    and its rules, in the order `decide` applies them."""

    field: str
    auto: Callable[[Any], tuple[Any, str]] = _off  # (value, why) when nothing is asked
    by: str = DEFAULT  # who decides that value: DEFAULT (off unless asked) or RULE (the layout)
    off: tuple[Off, ...] = ()  # a request for it on is turned off by the first that applies
    needs: tuple[Rule, ...] = ()  # prerequisites and conflicts of the value in effect, when on
    checks: tuple[Rule, ...] = ()  # errors whatever the value in effect
    noops: tuple[Rule, ...] = ()  # the value in effect does nothing here
    asked: tuple[str, str] | None = None  # why a request on / off stands (None: who set it)
    note: Callable[[Any, Any], str | None] | None = None  # added to the why, given the value
    # the layout's own value and why: the request is not read (a request is a no-op row)
    fixed: Callable[[Any], tuple[Any, str] | None] | None = None


def decide(log: DecisionLog, switch: Switch, run: Any) -> Any:
    """Decide `switch` for `run` (its `sections` by name, its `resolved` switches by plan field):
    the layout's fixed value, else the request (comm_overlap's spelling beats the direct one,
    `aliases.request`) unless a rule turns it off, else the automatic value; record it in `log`,
    store it in `run.resolved`, then raise the first error and warn of the no-ops its rules
    find."""
    fixed = switch.fixed(run) if switch.fixed else None
    if fixed is not None:
        value = log.record(switch.field, None, fixed[0], RULE, fixed[1])
    else:
        value = _requested(log, switch, request(run.sections, switch.field), run)
    run.resolved[switch.field.partition(".")[2]] = value
    refuse((*(switch.needs if value else ()), *switch.checks), run)
    noops_in(log, switch.noops, run)
    return value


def noops_in(log: DecisionLog, rules: Iterable[Rule], run: Any) -> None:
    """Every no-op rule that applies to `run`: a warning row in `log` (an error under strict)."""
    for rule in rules:
        if hit := rule.hit(run):
            log.noop(*hit)


def _requested(log: DecisionLog, switch: Switch, req: Any, run: Any) -> Any:
    if req.value:
        for when, why, fix in switch.off:
            if when(run):
                return log.record(switch.field, req.value, False, RULE, why, fix)
    if req.spelling is None:
        (value, why), requested, by = switch.auto(run), None, switch.by
    else:
        value = requested = req.value
        # typed on comm_overlap: an aliased switch's home, or a switch only comm_overlap has
        own = req.spelling == switch.field and switch.field.startswith("comm_overlap.")
        home = req.on_home or own
        by = USER if home else MODEL_CONFIG
        if switch.asked:
            why = switch.asked[0] if value else switch.asked[1]
        elif home:
            why = "set on comm_overlap"
        else:
            why = f"set directly on {req.spelling.split('.')[0]}"
    extra = switch.note(run, value) if switch.note else None
    return log.record(
        switch.field, requested, value, by, why if extra is None else f"{why}; {extra}"
    )
