"""finalize decides the network on a copy of the model section: `cfg.model` keeps what was typed,
`cfg.resolved.model` is the model that runs (the NullTokenizer's or the Hugging Face tokenizer's
vocabulary, a pretrained folder's architecture), and every reader after finalize takes it from
there."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

from tests.configs import TINY, tiny_config
from tests.world import run_world

SRC = Path(__file__).parent.parent / "src" / "overlap"

# The functions outside config/ that read the typed model section (`cfg.model`, `config.model`,
# `<x>.cfg.model`), each for a reason; every other reader runs after finalize and reads
# `cfg.resolved.model` (or `job.resolution.model`). config/ itself is finalize and the sections.
TYPED_READERS = {
    # building the configuration from the command line, before finalize
    ("harness.py", "_apply_perf_recipe"): "the perf recipe's rows, before finalize",
    ("harness.py", "_apply_recipe_rules"): "the recipe's layout-dependent EP, before finalize",
    ("harness.py", "_apply_flags"): "the flags write the typed section, before finalize",
    ("recipes/perf.py", "_ep_overlap_layout"): "a perf recipe's skips, asked before finalize",
    ("recipes/perf.py", "_pp"): "a perf recipe's skips, asked before finalize",
    # explain's JSON says the virtual pipeline in Megatron's spelling: as typed (None: none)
    ("cli.py", "cmd_explain"): "the typed -vp, deliberately",
}


def _typed_model_reads() -> set[tuple[str, str]]:
    """(module, top-level function) of every `.model` read on a name `cfg`/`config` or on a
    `.cfg` attribute, outside config/ (module level: function "")."""
    found = set()
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("config/"):
            continue
        tree = ast.parse(path.read_text())
        for top in tree.body:
            name = getattr(top, "name", "") if isinstance(top, ast.FunctionDef) else ""
            for node in ast.walk(top):
                if not (isinstance(node, ast.Attribute) and node.attr == "model"):
                    continue
                owner = node.value
                if (isinstance(owner, ast.Name) and owner.id in ("cfg", "config")) or (
                    isinstance(owner, ast.Attribute) and owner.attr == "cfg"
                ):
                    found.add((rel, name))
    return found


def test_only_the_pre_finalize_code_reads_the_typed_model_section():
    assert _typed_model_reads() == set(TYPED_READERS)


def test_the_null_tokenizers_vocabulary_runs_and_the_section_keeps_what_was_typed():
    cfg = tiny_config(False, "fp32", 1, ["tokenizer.vocab_size=512"], 1)
    typed = copy.deepcopy(cfg.model)
    res = cfg.finalize(1)
    assert cfg.model == typed and typed.vocab_size == TINY["vocab_size"] != 512
    assert res.model.vocab_size == 512
    assert cfg.to_dict()["model"]["vocab_size"] == 512  # run_config.yaml: the model that ran
    rows, loss = run_world(1, _train_one_step, cfg)[0]
    assert rows == 512 and loss > 0


def _train_one_step(cfg) -> tuple[int, float]:
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer

    trainer = Trainer(cfg, ParallelState(cfg.resolved.layout))
    loss = trainer.train().records[-1].lm_loss
    return trainer.model.embedding.weight.shape[0], loss


def test_the_memory_estimate_counts_the_decided_vocabulary():
    from overlap.launch.resources import estimate_memory

    cfg = tiny_config(False, "fp32", 1, ["tokenizer.vocab_size=65536"], 1)
    res = cfg.finalize(1)
    typed = tiny_config(False, "fp32", 1, [], 1)
    grown = (
        estimate_memory(cfg, res.layout).params
        - estimate_memory(typed, typed.finalize(1).layout).params
    )
    # the decided rows of the embedding and of the (untied) output layer
    assert grown == 2 * (65536 - TINY["vocab_size"]) * TINY["hidden_size"]
