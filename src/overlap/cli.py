"""Command line: `overlap explain | run | bench | plan | preprocess | convert` with the reference
harness flags plus `section.field=value` overrides.

Flags follow Megatron-Bridge's `run_script.py` (see `overlap.harness`: recipe, then flags, then
overrides, so an override beats a flag, said aloud). Overrides may come anywhere among the flags, as
with the reference (whatever argparse does not know is an override there). A user mistake exits with
status 2 and a one-paragraph message, no traceback: also a flag given twice with different values,
and an unknown flag (with the one it was probably meant to be). SIGTERM / SIGHUP / Ctrl-C end a
command with one line and exit 128 + the signal number (143, 129, 130).
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import logging
import os
import signal
import sys
from collections import Counter

from overlap.errors import ConfigError, NoSpaceError, ProgramError, RankFailure
from overlap.harness import add_harness_flags, describe_layout, launch_env_inputs, prepare
from overlap.launch.env import compute_launch_env, format_launch_env

log = logging.getLogger("overlap")

__all__ = ["add_harness_flags", "main", "prepare"]


class _UsageError(Exception):
    pass


class _StoreOnce(argparse._StoreAction):
    """A flag given twice with different values is an error naming both (argparse lets the last one
    win, silently); the same value twice is harmless. Aliases count as one flag (-ms 2 --max_steps
    3)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None:
            given = namespace.__dict__.setdefault("_flags_given", {})
            earlier = given.get(self.dest)
            if earlier is not None and earlier[1] != values:
                raise argparse.ArgumentError(
                    self,
                    f"given twice with different values ({earlier[0]} {earlier[2]} and "
                    f"{option_string} {_typed(values)}); keep the one you mean",
                )
            given[self.dest] = (option_string, values, _typed(values))
        super().__call__(parser, namespace, values, option_string)


def _typed(value) -> str:
    return "true" if value is True else "false" if value is False else str(value)


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as exit 2 with our message style (no traceback)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _looks_like_override(token: str) -> bool:
    return not token.startswith("-") and "=" in token


def _merge_overrides(args: argparse.Namespace, extras: list[str], words: list[str]) -> list[str]:
    """Overrides may be mixed with the flags, as with the reference harness (its overrides are
    whatever argparse does not know): the ones argparse left over join the positional ones, in
    command-line order. Returns the rest."""
    stray = [t for t in extras if not _looks_like_override(t)]
    late = [t for t in extras if _looks_like_override(t)]
    if late and hasattr(args, "overrides"):
        pool = Counter(list(args.overrides) + late)
        ordered = []
        for token in words:
            if pool[token] > 0:
                pool[token] -= 1
                ordered.append(token)
        args.overrides = ordered
    elif late:
        stray = extras
    return stray


def _unrecognized(
    stray: list[str],
    parser: argparse.ArgumentParser | None,
    others: dict[str, argparse.ArgumentParser] | None = None,
) -> str:
    """argparse's message for unknown words, with the flag each one was probably meant to be (in
    this command, or the other command that has it)."""
    options = sorted(parser._option_string_actions) if parser is not None else []
    hints = []

    def norm(opt: str) -> str:
        return opt[:2] + opt[2:].replace("-", "_") if opt.startswith("--") else opt

    for token in stray:
        name = token.split("=", 1)[0]
        if name.startswith("-") and options:
            same = [o for o in options if norm(o) == norm(name)]
            close = same or difflib.get_close_matches(name, options, n=2, cutoff=0.75)
            if close:
                hints.append(f"{name}: did you mean {' or '.join(close)}?")
                continue
            for command, other in (others or {}).items():
                if other is not parser:
                    found = [o for o in other._option_string_actions if norm(o) == norm(name)]
                    if found:
                        hints.append(f"{found[0]} is a flag of `overlap {command}`")
                        break
        elif "." in token and "=" not in token and not token.startswith("-"):
            hints.append(f"{token}: an override is section.field=value")
    message = f"unrecognized arguments: {' '.join(stray)}"
    return message + (f" ({'; '.join(hints)})" if hints else "")


def _launched_rank() -> bool:
    """This process is a rank started by our own local launcher (overlap.launch.local)."""
    return "RANK" in os.environ and os.environ.get("OVERLAP_LAUNCHED") == "1"


def _interrupt(signum: int, frame) -> None:
    from overlap.launch.local import Interrupted

    raise Interrupted(signum)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("overlap")
    except PackageNotFoundError:  # running from a source tree that was not installed
        from overlap import __version__

        return __version__


def cmd_explain(args: argparse.Namespace) -> int:
    if args.list_recipes:
        from overlap.recipes.models import RECIPES

        print("\n".join(f"-m {r.family} -mr {r.name:<16} {r.summary}" for r in RECIPES.values()))
        return 0
    if args.list_keys:
        from overlap.config.overrides import list_override_keys

        print("\n".join(list_override_keys()))
        return 0
    from overlap.training.runtime_refusals import runtime_refusals

    job = prepare(args, describe_target=True)
    env = compute_launch_env(
        launch_env_inputs(job.resolution, args.gpu), job.cfg.env_vars, os.environ
    )
    refusals = runtime_refusals(job.cfg, gpu=args.gpu != "cpu")
    lay, stages = job.resolution.layout, job.resolution.pipeline
    # the JSON's vpp in Megatron's spelling: as typed (None: no virtual pipeline), or the layout's
    typed_vpp = job.cfg.model.virtual_pipeline_model_parallel_size
    memory = _memory_estimate(job, args, refusals)
    if args.json:
        doc = {
            "recipe": args.model_recipe_name,
            "world_size": args.num_gpus,
            "gpu": args.gpu,
            "layout": {
                "tp": lay.tp,
                "pp": lay.pp,
                "cp": lay.cp,
                "dp": lay.dp,
                "ep": lay.ep,
                "etp": lay.etp,
                "edp": lay.edp,
                "vpp": lay.vpp if lay.vpp > 1 else typed_vpp,
            },
            # [pp rank][chunk] -> what that model chunk holds ("Ett": embedding + 2 layers)
            "pipeline_stages": [[s.symbols for s in stages.rank_stages(r)] for r in range(lay.pp)],
            **job.resolution.decisions.to_json(),
            "launch_env": [
                {"name": e.name, "value": e.value, "source": e.source, "reason": e.reason}
                for e in env
            ],
            "memory_per_rank": memory,
            "run_refuses": [
                {"field": r.field, "value": str(r.value), "why": r.why, "fix": r.fix}
                for r in refusals
            ],
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"recipe {args.model_recipe_name} on {args.num_gpus} x {args.gpu}")
    print(f"\nParallel layout: {describe_layout(job.resolution)}")
    if lay.pp > 1:  # which layers each rank's chunks hold (chunk 0 first; E embedding, L loss)
        print("  " + "\n  ".join(stages.table()))
    print("\n" + job.resolution.decisions.format_sections())
    print("\nLaunch environment:\n" + format_launch_env(env))
    print(
        f"\nMemory at the peak of the rank that needs the most (the memory model, "
        f"overlap.perf.memory_model; the dry run measures it): {memory['summary']}"
    )
    print("\n".join(memory["table"]))
    if memory["fit"]:
        print(f"  fit: {memory['fit']}")
    if refusals:
        print(
            "\nValid configuration, but `overlap run` will refuse it today:\n"
            + "\n".join(f"  {r.field}={r.value!r}: {r.why} Fix: {r.fix}" for r in refusals)
        )
    return 0


def _memory_estimate(job, args: argparse.Namespace, refusals: list) -> dict:
    """The memory model's peak for the rank that needs the most (`overlap.perf.memory_model`), by
    component, and whether it fits the -g GPU; for -g cpu also what `run` would refuse on this
    host."""
    from overlap.launch.resources import check_local_launch
    from overlap.perf.memory_model import fit, rank_memory

    cpu = args.gpu == "cpu"
    cfg, layout = job.cfg, job.resolution.layout
    est = rank_memory(cfg, layout, cpu=cpu)
    verdict = None if cpu else fit(cfg, layout, args.gpu)
    if cpu:
        try:
            check_local_launch(cfg, layout, args.num_gpus, recipe=args.model_recipe_name, est=est)
        except ConfigError as exc:
            refusals.append(exc)
    return {
        "summary": est.describe(),
        "table": est.table(),
        "fit": verdict.describe() if verdict else None,
        "fits": verdict.fits if verdict else None,
        "device_bytes": verdict.device_bytes if verdict else None,
        "reserve_bytes": verdict.reserve_bytes if verdict else None,
        "total_bytes": est.total,
        "pp_rank": est.pp_rank,
        "params": est.params,
        **{f"{name}_bytes": n for name, n in _component_keys(est)},
        "blocks": [
            {"block": b.name, "ours": b.ours, "megatron": b.megatron, "kept": b.kept}
            for b in est.blocks
        ],
    }


def _component_keys(est) -> list[tuple[str, int]]:
    return [
        ("param", est.param_bytes),
        ("grad", est.grad_bytes),
        ("master", est.master_bytes),
        ("moment", est.moment_bytes),
        ("optimizer", est.optimizer_bytes),
        ("buffer", est.buffer_bytes),
        ("activation", est.activation_bytes),
        ("transient", est.transient_bytes),
        ("runtime", est.runtime_bytes),
    ]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="[overlap] %(levelname)s %(message)s", stream=sys.stderr
    )
    parser = _Parser(prog="overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"overlap {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    explain = sub.add_parser(
        "explain", help="resolve the configuration and print every overlap decision"
    )
    add_harness_flags(explain)
    explain.add_argument(
        "--json",
        action="store_true",
        help="print the layout, decisions, no-ops, other settings, launch environment and what run "
        "would refuse as one JSON object",
    )
    explain.add_argument(
        "--list-recipes", action="store_true", help="list the recipes (-m/-mr) and exit"
    )
    explain.add_argument(
        "--list-keys",
        action="store_true",
        help="list every section.field override key with its type and default, and exit",
    )
    explain.set_defaults(func=cmd_explain)
    from overlap.commands import register_commands

    register_commands(sub)
    words = list(sys.argv[1:] if argv is None else argv)
    command = words[0] if words and words[0] in sub.choices else ""
    rank = _launched_rank()
    previous = {}
    if rank:
        _join_launcher()
    # a rank under torchrun keeps torchrun's signal protocol
    elif "RANK" not in os.environ and threading_main():
        # SIGTERM / SIGHUP end the command like Ctrl-C: cleanup runs on the way out, one line, exit
        # 128 + signal.
        previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        args, extras = parser.parse_known_args(words)
        stray = _merge_overrides(args, extras, words)
        if stray:
            raise _UsageError(_unrecognized(stray, sub.choices.get(command), sub.choices))
        args.argv = words
        return args.func(args)
    except _UsageError as exc:
        print(
            f"overlap: error: {exc}\nRun 'overlap {command} --help'.".replace("  ", " "),
            file=sys.stderr,
        )
        return 2
    except ConfigError as exc:
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 2
    except RankFailure as exc:  # a rank under torchrun whose peer died: the cause, no traceback
        print(f"overlap: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except NoSpaceError as exc:  # the disk, not the command: one line, exit 1
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 1
    except ProgramError as exc:  # --nccl-rules found what fails on GPUs: a finding, not a traceback
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP: cleanup ran on the way out
        signum = getattr(exc, "signum", signal.SIGINT)
        if not rank:  # a rank's launcher says it once, for all of them
            what = (
                "interrupted (Ctrl-C)"
                if signum == signal.SIGINT
                else f"stopped by {signal.Signals(signum).name}"
            )
            stopped = "; ranks stopped" if getattr(exc, "ranks_stopped", False) else ""
            print(f"overlap: {what}{stopped}", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _join_launcher() -> None:
    """A rank of our local launcher: end with the launcher even if the parent-death signal was
    missed (the launcher died before the rank could arm it)."""
    parent = os.environ.get("OVERLAP_LAUNCHER_PID")
    if parent and parent.isdigit() and os.getppid() != int(parent):
        sys.exit(1)


def entry() -> None:
    """The `overlap` command (and `python -m overlap.cli`): `main`, then the process's exit, with
    every object frozen out of the garbage collector first (`gc.freeze`). The interpreter's
    teardown then skips its collections over torch's hundreds of thousands of objects, whose
    memory the process is about to hand back anyway: about 0.4 s of every rank's and launcher's
    exit on this project's CPU machine, paid by every command. The rest of the exit is as usual
    (atexit handlers, thread joins, flushes, what reference counting frees). Not in `main`, which
    tests and embedders call in a process that goes on."""
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
