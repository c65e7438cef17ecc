"""Communication kind families: the prefix of a collective's kind (`ep_dispatch` -> `ep`).
Torch-free, so the launcher and the benchmark harness can validate a family name before any rank
starts."""

from __future__ import annotations

from overlap.errors import ConfigError

# tp: tensor/sequence parallel; ep: expert-parallel all-to-alls and split sizes; dp / edp:
# data-parallel (dense / expert) gradient reduce, parameter gather, loss and norm sums; pp: pipeline
# p2p; cp: context-parallel attention (the KV ring cp_kv and its gradients cp_dkv, cp_ag, cp_a2a);
# mp: model-parallel norm sums; moe: the router's aux-loss statistics; ctl: run control (every
# rank agreeing to stop for a checkpoint).
FAMILIES = ("tp", "ep", "dp", "edp", "pp", "cp", "mp", "moe", "ctl")


def family(kind: str) -> str:
    return kind.split("_", 1)[0]


def parse_families(field: str, value: str, text: str) -> tuple[str, ...]:
    """ "ep+dp" / "ep,dp" (as `text`) -> ("ep", "dp"), every name known; a ConfigError naming
    `field` otherwise."""
    names = tuple(n.strip().lower() for n in text.replace("+", ",").split(","))
    unknown = [n for n in names if n not in FAMILIES]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(
            field,
            value,
            f"families must be distinct names from {', '.join(FAMILIES)} (a kind's prefix: "
            "dp does not cover edp).",
            "e.g. ep, or ep+dp.",
        )
    return names
