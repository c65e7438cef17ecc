"""docs/results.md is bench/results_page.py's output from the committed results, so it cannot go
stale: a new or re-run result, a renumbered bench/commands.sh or an edited bench/results_notes.md
must come with the regenerated page (`python bench/results_page.py`). Every result file has a
command that names it and a place on the page."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location(
        "results_page", ROOT / "bench" / "results_page.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_page_is_the_generators_output():
    page = _generator()
    assert page.PAGE.read_text() == page.render(), (
        "docs/results.md is stale: run python bench/results_page.py"
    )


def test_every_result_file_has_one_numbered_command():
    page = _generator()
    made_by = page.commands(page.COMMANDS.read_text())
    assert page.result_stems() <= set(made_by), sorted(page.result_stems() - set(made_by))
    numbers = sorted(number for number, _ in made_by.values())
    assert numbers == list(range(1, len(numbers) + 1)), (
        "bench/commands.sh numbers its commands 1..N"
    )


def test_every_command_writes_the_file_its_header_names():
    """The header `# N. -> FILE` and the command under it agree: the command line names the file
    (the loopback probe's path is inside bench/plan_vs_bench.py, which its --probe writes)."""
    page = _generator()
    text = page.COMMANDS.read_text()
    blocks = re.split(r"\n# (?=\d+\. -> )", text)
    writes = {"loopback_probe": "plan_vs_bench.py --probe"}
    for stem, (number, _) in page.commands(text).items():
        block = next(b for b in blocks if b.startswith(f"{number}. -> "))
        body = "\n".join(line for line in block.splitlines()[1:] if not line.startswith("#"))
        assert writes.get(stem, stem) in body, f"command {number} does not write {stem}"
