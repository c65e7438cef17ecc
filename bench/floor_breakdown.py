"""Where a published run's predicted step goes against another layout's, with and without the
fitted per-kernel launch floor (`overlap.plan.compute`): the measurement behind docs/planner.md
'Layout search' (why the search ranks the reference's H100 MoE layouts where it does).

For the published row and each alternative it prints the step, its components (compute, bubble,
the stretch of overlapped compute, exposed communication by kind), the step and the compute at a
zero launch floor (the same efficiency), the per-layer forward pieces both ways, and the peak
memory:

    PYTHONPATH=src python bench/floor_breakdown.py \
        "Qwen3-30B-A3B 16xH100 BF16 HybridEP, EP overlap on" "-mb 2" \
        "-tp 4 -mb 8 model.recompute_granularity=selective \
         model.recompute_modules=[layernorm,moe_act]"

An alternative is the row's command line with its harness flags replaced (`-tp 4 -mb 8`) and its
overrides (`key=value`) added.
"""

from __future__ import annotations

import logging
import sys

from overlap.harness import resolve_run
from overlap.plan.compute import microbatch_compute
from overlap.plan.hardware import Cluster, builtin_cluster, with_efficiency
from overlap.plan.predict import predict
from overlap.plan.validate import ROWS


def alternative(words: list[str], change: list[str]) -> list[str]:
    """The row's words with `change`'s flags replacing the row's and its overrides appended (the
    harness takes its flags before the overrides)."""
    flags = [w for w in words if "=" not in w]
    named = [w for w in change if "=" not in w]
    for name, value in zip(named[::2], named[1::2]):
        if name in flags:
            flags[flags.index(name) + 1] = value
        else:
            flags += [name, value]
    overrides = [w for w in words if "=" in w] + [w for w in change if "=" in w]
    return flags + overrides


def show(label: str, words: list[str], cluster: Cluster) -> None:
    """One layout's prediction at the cluster's fit and at a zero floor: what the floor adds is
    the difference, everything else held."""
    job = resolve_run(words, [])
    cfg, layout = job.cfg, job.resolution.layout
    bare = with_efficiency(cluster, cluster.efficiency.value, "no launch floor", 0.0)
    p, p0 = (predict(label, [], cfg, layout, c) for c in (cluster, bare))
    t = p.times
    exposed = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in t.exposed_s.items())
    print(
        f"== {label}: TP{layout.tp} PP{layout.pp} VP{layout.vpp} EP{layout.ep} "
        f"mb{cfg.train.micro_batch_size} ({p.microbatches} micro-batches)"
    )
    print(
        f"  step {p.step_ms:.0f} ms (no floor {p0.step_ms:.0f}), peak "
        f"{p.peak_mem_bytes / 2**30:.1f} GiB: compute {t.compute_s * 1e3:.0f} (no floor "
        f"{p0.times.compute_s * 1e3:.0f}), bubble {t.bubble_s * 1e3:.0f}, stretch "
        f"{t.slowdown_s * 1e3:.0f}, exposed {exposed}"
    )
    c, c0 = (microbatch_compute(cfg, layout, x) for x in (cluster, bare))
    for piece in ("attention_fwd_s", "moe_fwd_s", "dense_mlp_fwd_s", "moe_recompute_s"):
        if getattr(c0, piece):
            print(
                f"  {piece}: {getattr(c, piece) * 1e3:.3f} ms a layer "
                f"(no floor {getattr(c0, piece) * 1e3:.3f})"
            )


def main(name: str, changes: list[str]) -> None:
    """The published row `name` on its own cluster, then each alternative layout."""
    logging.getLogger("overlap").setLevel(logging.ERROR)
    row = next(r for r in ROWS if r.name == name)
    cluster = builtin_cluster(row.gpu, row.precision, None)
    show("published", row.args(), cluster)
    for change in changes:
        show(change, alternative(row.args(), change.split()), cluster)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
