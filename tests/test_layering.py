"""Data flows one way through the packages: each may import only from the packages below it, never
from above (no arrows up, so no import cycles between packages). A new package must take its place
in LAYERS.

Inside `parallel/` the modules have an order of their own (PARALLEL), and only named modules may
use what torch.distributed offers to communicate or to build groups (DIST_RULES): collectives and
point-to-point operations go through `parallel/comm.py` alone, so every transfer is traced,
recorded for the NCCL replay and subject to the comm modes and the modelled link."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "overlap"

# Lowest first: config (and below it: the decision table every rule records in, `decisions`; the
# data readers config validates with; kernels/: the capability probes and kernel-choice rules, which
# record their own rows and which the layers apply, so below both; and layout/: the parallel sizes
# and pipeline stages that finalize builds and the runtime reads) -> the recipes (built of config's
# sections) -> launch -> parallel -> layers / model -> data parallelism, HF weights -> pipeline
# schedules -> training -> the harness -> perf / plan -> the commands.
LAYERS = (
    "errors",
    "files",
    "decisions",
    "data",
    "kernels",
    "layout",
    "config",
    "recipes",
    "launch",
    "parallel",
    "profiling",
    "layers",
    "optim",
    "model",
    "data_parallel",
    "hf",
    "pipeline",
    "training",
    "harness",
    "perf",
    "plan",
    "convert",
    "commands",
    "cli",
)


def _package(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _imported_packages(path: Path) -> set[str]:
    """Top-level `overlap` packages `path` imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "overlap":
            names = [
                f"overlap.{a.name}"
                for a in node.names  # from overlap import plan (not __version__)
                if (SRC / a.name).is_dir() or (SRC / f"{a.name}.py").is_file()
            ]
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


def test_the_layers_run_the_resolved_kernels_and_apply_no_kernel_rule():
    """The kernel rules (`overlap.kernels`' modules) are applied once, by the resolution
    (`overlap.kernels.choices`, called by finalize); the layers and the model run the `Kernels` it
    holds and import no rule that could decide again."""
    rules = [
        f"{path.relative_to(SRC)} imports {node.module}"
        for pkg in ("layers", "model")
        for path in sorted((SRC / pkg).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("overlap.kernels.")
    ]
    assert not rules, "decided again at run time: " + "; ".join(rules)


# parallel/'s modules, lowest first: which tokens a context-parallel rank holds (pure arithmetic),
# the runtime's own CUDA streams, the tracer and the program recorder, the modelled link, the
# groups, the collectives, the ring exchange built on them, the parallel state, and the teardown.
PARALLEL = (
    "cp_chunks",
    "run_local",
    "streams",
    "trace",
    "program",
    "link_model",
    "groups",
    "comm",
    "ring",
    "state",
    "teardown",
)

# torch.distributed names (functions, P2POp) by what they do, and the only modules (paths under
# src/overlap) that may use them, called or passed on. A world is also started or ended by the
# commands that own a private one: `overlap convert`'s one-rank world, the calibration probe's, the
# dry run's fake backend.
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "send_object_list",
    "recv_object_list",
)
GROUP_BUILDERS = (
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "init_device_mesh",
)
WORLD = ("init_process_group", "destroy_process_group")
DIST_RULES = {
    COLLECTIVES: {"parallel/comm.py"},
    GROUP_BUILDERS: {"parallel/groups.py"},
    WORLD: {
        "parallel/groups.py",
        "parallel/teardown.py",
        "convert.py",
        "plan/calibrate.py",
        "perf/dry_run.py",
    },
}


def _parallel_imports(tree: ast.AST) -> set[str]:
    """The `overlap.parallel` modules a module imports (from overlap.parallel import comm; from
    overlap.parallel.comm import X; import overlap.parallel.comm)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            if module == "overlap.parallel":
                out |= {a.name for a in node.names}
            elif module.startswith("overlap.parallel."):
                out.add(module.split(".")[2])
        elif isinstance(node, ast.Import):
            out |= {
                a.name.split(".")[2] for a in node.names if a.name.startswith("overlap.parallel.")
            }
    return out


def _parallel_violations(module: str, source: str) -> list[str]:
    """Imports of parallel/`module` from parallel/ modules above it (or not placed in PARALLEL)."""
    rank = {name: i for i, name in enumerate(PARALLEL)}
    return [
        f"parallel/{module}.py imports overlap.parallel.{dep}"
        for dep in sorted(_parallel_imports(ast.parse(source)) - {module})
        if rank.get(dep, len(PARALLEL)) > rank[module]
    ]


def _dist_names(source: str) -> set[str]:
    """The torch.distributed names (of any submodule) a module uses: `dist.X` for any alias of
    torch.distributed, `torch.distributed.X`, and `from torch.distributed[.sub] import X`."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # local names bound to torch.distributed or one of its submodules
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {
                a.asname for a in node.names if a.asname and a.name.startswith("torch.distributed")
            }
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("torch.distributed"):
                used |= {a.name for a in node.names}
            elif node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.add(node.attr)
        elif ast.unparse(node.value).startswith("torch.distributed"):
            used.add(node.attr)
    return used


def _dist_violations(path: str, source: str) -> list[str]:
    """The torch.distributed names `path` (under src/overlap) uses that DIST_RULES keeps to other
    modules."""
    used = _dist_names(source)
    return [
        f"{path} uses torch.distributed.{name} (only {', '.join(sorted(allowed))} may)"
        for names, allowed in DIST_RULES.items()
        if path not in allowed
        for name in sorted(used & set(names))
    ]


def test_every_parallel_module_has_a_place():
    modules = {p.stem for p in (SRC / "parallel").glob("*.py")} - {"__init__"}
    assert modules == set(PARALLEL), f"place {sorted(modules - set(PARALLEL))} in PARALLEL"


def test_no_parallel_module_imports_from_one_above_it():
    upward = [
        v
        for name in PARALLEL
        for v in _parallel_violations(name, (SRC / "parallel" / f"{name}.py").read_text())
    ]
    assert not upward, "arrows up: " + "; ".join(upward)


def test_only_the_named_modules_use_torch_distributed_to_communicate_or_build_groups():
    found = [
        v
        for path in sorted(SRC.rglob("*.py"))
        for v in _dist_violations(path.relative_to(SRC).as_posix(), path.read_text())
    ]
    assert not found, "; ".join(found)
    for allowed in DIST_RULES.values():  # every rule names real modules: a rename cannot void it
        assert all((SRC / p).is_file() for p in allowed), sorted(allowed)


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(t)",
        "import torch.distributed as d\nop = d.isend",
        "import torch\ntorch.distributed.barrier()",
        "from torch import distributed\ndistributed.batch_isend_irecv([])",
        "from torch.distributed import all_to_all_single",
        "from torch.distributed.device_mesh import init_device_mesh",
        "import torch.distributed as dist\ndist.new_group([0, 1])",
    ],
)
def test_the_rule_catches_a_module_that_communicates_itself(source):
    assert _dist_violations("layers/mlp.py", source)


def test_the_rule_lets_any_module_ask_about_groups():
    source = "import torch.distributed as dist\nx = dist.get_rank(dist.group.WORLD)"
    assert not _dist_violations("layers/mlp.py", source)


def test_the_order_catches_an_arrow_up_inside_parallel():
    assert _parallel_violations("comm", "from overlap.parallel import ring")
    assert _parallel_violations("link_model", "from overlap.parallel.comm import p2p")
    assert _parallel_violations("groups", "import overlap.parallel.teardown")
    assert not _parallel_violations("ring", "from overlap.parallel import comm")
