"""Command line: `overlap explain | run | bench` with the reference harness flags plus `section.field=value` overrides.

Flags follow Megatron-Bridge's `run_script.py` (see `overlap.harness`: recipe, then flags, then overrides, so an
override beats a flag, said aloud). A user mistake exits with status 2 and a one-paragraph message; no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from overlap.errors import ConfigError
from overlap.harness import add_harness_flags, describe_layout, launch_env_inputs, prepare
from overlap.launch.env import compute_launch_env, format_launch_env

log = logging.getLogger("overlap")

__all__ = ["add_harness_flags", "main", "prepare"]


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as exit 2 with our message style (no traceback)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("overlap")
    except PackageNotFoundError:  # running from a source tree that was not installed
        from overlap import __version__

        return __version__


def cmd_explain(args: argparse.Namespace) -> int:
    if args.list_recipes:
        from overlap.config.recipes import RECIPES

        print("\n".join(f"-m {r.family} -mr {r.name:<16} {r.summary}" for r in RECIPES.values()))
        return 0
    if args.list_keys:
        from overlap.config.overrides import list_override_keys

        print("\n".join(list_override_keys()))
        return 0
    from overlap.training.support import runtime_refusals

    job = prepare(args, describe_target=True)
    env = compute_launch_env(launch_env_inputs(job.cfg, job.resolution, args.gpu), job.cfg.env_vars, os.environ)
    refusals = runtime_refusals(job.cfg, gpu=args.gpu != "cpu")
    lay = job.resolution.layout
    if args.json:
        doc = {"recipe": args.model_recipe_name, "world_size": args.num_gpus, "gpu": args.gpu,
               "layout": {"tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp,
                          "edp": lay.edp, "vpp": job.cfg.model.virtual_pipeline_model_parallel_size},
               **job.resolution.decisions.to_json(),
               "launch_env": [{"name": e.name, "value": e.value, "source": e.source, "reason": e.reason} for e in env],
               "run_refuses": [{"field": r.field, "value": str(r.value), "why": r.why, "fix": r.fix}
                               for r in refusals]}
        print(json.dumps(doc, indent=2))
        return 0
    print(f"recipe {args.model_recipe_name} on {args.num_gpus} x {args.gpu}")
    print(f"\nParallel layout: {describe_layout(job.resolution)}")
    print("\n" + job.resolution.decisions.format_sections())
    print("\nLaunch environment:\n" + format_launch_env(env))
    if refusals:
        print("\nValid configuration, but `overlap run` will refuse it today:\n" +
              "\n".join(f"  {r.field}={r.value!r}: {r.why} Fix: {r.fix}" for r in refusals))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="[overlap] %(levelname)s %(message)s", stream=sys.stderr)
    parser = _Parser(prog="overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"overlap {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    explain = sub.add_parser("explain", help="resolve the configuration and print every overlap decision")
    add_harness_flags(explain)
    explain.add_argument("--json", action="store_true",
                         help="print the layout, decisions, no-ops, other settings, launch environment and what run "
                              "would refuse as one JSON object")
    explain.add_argument("--list-recipes", action="store_true", help="list the recipes (-m/-mr) and exit")
    explain.add_argument("--list-keys", action="store_true",
                         help="list every section.field override key with its type and default, and exit")
    explain.set_defaults(func=cmd_explain)
    from overlap.commands import register_commands

    register_commands(sub)
    try:
        args = parser.parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        return args.func(args)
    except _UsageError as exc:
        words = list(sys.argv[1:] if argv is None else argv)
        command = words[0] if words and words[0] in ("explain", "run", "bench") else ""
        print(f"overlap: error: {exc}\nRun 'overlap {command} --help'.".replace("  ", " "), file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: ranks were stopped and cleanup ran on the way out
        print(f"overlap: interrupted ({exc or 'Ctrl-C'}); ranks stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
