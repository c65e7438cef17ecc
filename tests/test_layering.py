"""Data flows one way through the packages: each may import only from the packages below it, never from above (no
arrows up, so no import cycles between packages). A new package must take its place in LAYERS."""

import ast
from pathlib import Path

SRC = Path(__file__).parent.parent / "src" / "overlap"

# Lowest first: config (and the data readers it validates with) -> launch -> parallel -> layers / model -> data
# parallelism, HF weights -> pipeline schedules -> training -> the harness -> perf / plan -> the commands.
LAYERS = ("errors", "data", "config", "launch", "parallel", "profiling", "layers", "optim", "model", "data_parallel",
          "hf", "pipeline", "training", "harness", "perf", "plan", "convert", "commands", "cli")


def _package(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _imported_packages(path: Path) -> set[str]:
    """Top-level `overlap` packages `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "overlap":
            names = [f"overlap.{a.name}" for a in node.names  # from overlap import plan (not __version__)
                     if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file()]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out |= {n.split(".")[1] for n in names if n.startswith("overlap.")}
    return out


def test_every_package_has_a_layer():
    packages = {_package(p) for p in SRC.rglob("*.py")} - {"__init__", "__main__"}
    assert packages <= set(LAYERS), f"place {sorted(packages - set(LAYERS))} in LAYERS"


def test_no_package_imports_from_a_package_above_it():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        pkg = _package(path)
        if pkg not in rank:
            continue
        for dep in _imported_packages(path) - {pkg}:
            if rank.get(dep, len(LAYERS)) > rank[pkg]:
                upward.append(f"{path.relative_to(SRC)} imports overlap.{dep}")
    assert not upward, "arrows up: " + "; ".join(upward)
