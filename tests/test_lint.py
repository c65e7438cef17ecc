"""The formatter and linter hold for the whole tree (pyproject.toml's [tool.ruff]): a change that
breaks the format or a lint rule fails the suite, so CI keeps the tree readable without a separate
step."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
    beside = os.path.join(os.path.dirname(sys.executable), "ruff")
    if os.path.exists(beside):
        return [beside]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: it is in the test extra (pip install -e '.[test]').")
    return [found]


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_the_tree_is_formatted_and_lint_clean(command):
    result = subprocess.run(
        [*_ruff(), *command, "src", "tests", "bench"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, (
        f"ruff {' '.join(command)} found problems (run `ruff format src tests bench` and `ruff "
        f"check --fix src tests bench`):\n{result.stdout}{result.stderr}"
    )
