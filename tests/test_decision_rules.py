"""The rule engine of the overlap switches (`decide` walking a `Switch` and its `Rule`s,
`overlap.config.switches`): what each kind of row does to the decision table, on a toy run with
one section, so the engine's contract is pinned apart from the real tables in `comm_overlap.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from overlap.config.switches import Rule, Switch, decide
from overlap.decisions import DEFAULT, MODEL_CONFIG, RULE, DecisionLog
from overlap.errors import ConfigError


@dataclass
class Model:
    """A section with one switch and one size the rules read."""

    swap: bool | None = None
    size: int = 1


class Run:
    """The run protocol the engine reads: sections by name, the switches decided so far."""

    def __init__(self, **fields: Any) -> None:
        self.sections = {"model": Model(**fields)}
        self.resolved: dict[str, Any] = {}

    def read(self, field: str) -> Any:
        section, _, name = field.partition(".")
        return getattr(self.sections[section], name)


NEEDS_SIZE = Rule(
    "model.size", lambda s: s.read("model.size") < 2, "swap needs size >= 2.", "use size 2."
)
SWAP = Switch(
    "model.swap",
    off=((lambda s: s.read("model.size") > 8, "too big to swap", "use size 8 or less."),),
    needs=(NEEDS_SIZE,),
    noops=(Rule("model.swap", lambda s: s.read("model.size") == 4, "4 swaps to itself", "drop."),),
)


def test_nothing_asked_takes_the_automatic_value_and_stores_it_under_the_plan_field():
    log, run = DecisionLog(strict=False), Run(size=1)
    assert decide(log, SWAP, run) is False
    assert run.resolved == {"swap": False}
    d = log.get("model.swap")
    assert (d.requested, d.effective, d.decided_by, d.reason) == (
        None,
        False,
        DEFAULT,
        "off unless requested",
    )


def test_an_off_row_records_the_request_turned_off_with_its_reason_and_strict_refuses_it():
    log = DecisionLog(strict=False)
    assert decide(log, SWAP, Run(swap=True, size=9)) is False
    d = log.get("model.swap")
    assert (d.requested, d.effective, d.decided_by, d.reason) == (
        True,
        False,
        RULE,
        "too big to swap",
    )
    with pytest.raises(ConfigError) as exc:
        decide(DecisionLog(strict=True), SWAP, Run(swap=True, size=9))
    assert "too big to swap" in str(exc.value) and "use size 8 or less." in str(exc.value)


def test_needs_are_errors_only_with_the_switch_on_naming_the_field_value_and_fix():
    decide(DecisionLog(strict=False), SWAP, Run(swap=False, size=1))  # off: not checked
    with pytest.raises(ConfigError) as exc:
        decide(DecisionLog(strict=False), SWAP, Run(swap=True, size=1))
    assert (exc.value.field, exc.value.value) == ("model.size", 1)
    assert "swap needs size >= 2." in str(exc.value) and "use size 2." in str(exc.value)


def test_a_noop_row_warns_with_the_value_in_effect_and_strict_refuses_it():
    log = DecisionLog(strict=False)
    decide(log, SWAP, Run(swap=True, size=4))
    assert [(n.field, n.value, n.why) for n in log.noops] == [
        ("model.swap", True, "4 swaps to itself")
    ]
    d = log.get("model.swap")
    assert (d.decided_by, d.reason) == (MODEL_CONFIG, "set directly on model")
    with pytest.raises(ConfigError):
        decide(DecisionLog(strict=True), SWAP, Run(swap=True, size=4))


def test_a_fixed_value_is_recorded_without_reading_the_request():
    fixed = SWAP._replace(
        fixed=lambda s: (False, "size 3: nothing to swap") if s.read("model.size") == 3 else None
    )
    log = DecisionLog(strict=True)  # the request is not read, so nothing is dishonoured
    assert decide(log, fixed, Run(swap=True, size=3)) is False
    d = log.get("model.swap")
    assert (d.requested, d.effective, d.decided_by) == (None, False, RULE)


def test_checks_apply_whatever_the_value_and_texts_may_be_functions_of_the_run():
    check = Rule(
        "model.size",
        lambda s: s.read("model.size") == 0,
        lambda s: f"size {s.read('model.size')} holds nothing.",
        "use size 1 or more.",
    )
    with pytest.raises(ConfigError) as exc:
        decide(DecisionLog(strict=False), SWAP._replace(checks=(check,)), Run(swap=False, size=0))
    assert "size 0 holds nothing." in str(exc.value)
