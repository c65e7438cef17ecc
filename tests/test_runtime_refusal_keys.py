"""Every `section.field` the runtime refusals name - the key a refusal is filed under and the keys
its advice tells the user to set - is a key `overlap explain --list-keys` accepts, so the advice can
be followed as written."""

from __future__ import annotations

import ast
import inspect
import re

from overlap.config.overrides import override_key_rows
from overlap.layers.moe.moe_layer import unbuilt_dispatch
from overlap.training import runtime_refusals


def _keys() -> set[str]:
    return {key for key, _, _, _ in override_key_rows()}


def _named_keys(keys: set[str]) -> set[str]:
    """The `section.field` words in the string literals of the module and of the dispatchers' rows
    its table takes (`unbuilt_dispatch`; f-strings' literal parts included); `train.exit_*`-style
    wildcards are left out."""
    sections = sorted({key.split(".")[0] for key in keys}, key=len, reverse=True)
    pattern = re.compile(rf"\b(?:{'|'.join(sections)})\.[a-z][a-z0-9_]*(?![\w*])")
    named = set()
    for source in (runtime_refusals, unbuilt_dispatch):
        for node in ast.walk(ast.parse(inspect.getsource(source))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named.update(pattern.findall(node.value))
    return named


def test_every_key_a_runtime_refusal_names_exists():
    keys = _keys()
    named = _named_keys(keys)
    assert "model.deallocate_pipeline_outputs" in named  # the scan finds the table's keys
    assert "model.moe_expert_capacity_factor" in named  # and the dispatchers' rows
    assert sorted(named - keys) == []
