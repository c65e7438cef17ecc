"""A PNG timeline of one iteration: per rank, a compute lane and one lane per communication kind.

The compute lane shows when the compute thread was busy (spans minus blocking waits) and when it sat
in a wait; each communication lane shows the ops from launch to completion, split into the part
hidden behind compute and the part exposed. It is the picture of the numbers in the exposure table.
matplotlib is a dependency of the package, but it is imported only here, when a picture is asked for
(a broken or stripped install still gets its Chrome trace).
"""

from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO
from pathlib import Path

from overlap.files import write_replace
from overlap.profiling.collector import IterationTrace, RankTrace
from overlap.profiling.exposed import busy_intervals, comm_interval, subtract, union

COLORS = {"busy": "#4c9a2a", "wait": "#d62728", "hidden": "#1f77b4", "exposed": "#ff7f0e"}


class MissingPlotting(ImportError):
    """matplotlib is not installed: the timeline cannot be drawn (the Chrome trace still can)."""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingPlotting(
            "the timeline PNG needs matplotlib, which cannot be imported here (it is a dependency "
            f"of overlap: pip install 'matplotlib>=3.8'; {exc}); the Chrome trace JSON needs "
            "nothing"
        ) from exc
    return plt


def _pick(trace: RankTrace, iteration: int | None) -> IterationTrace | None:
    if not trace.iterations:
        return None
    if iteration is None:
        return trace.iterations[-1]
    return next((it for it in trace.iterations if it.iteration == iteration), None)


def _lanes(it: IterationTrace) -> list[tuple[str, list[tuple[list, str]]]]:
    """[(lane label, [(intervals, color key)])] for one rank's iteration, compute lane first."""
    busy = busy_intervals(it.spans, it.comm)
    waits = union(
        (e.t_wait_start, e.t_wait_end)
        for e in it.comm
        if e.t_wait_start is not None and e.t_wait_end is not None
    )
    lanes = [("compute", [(busy, "busy"), (waits, "wait")])]
    for kind in sorted({e.kind for e in it.comm}):
        occupied = union(
            iv
            for iv in map(comm_interval, (e for e in it.comm if e.kind == kind))
            if iv is not None
        )
        exposed = subtract(occupied, busy)
        lanes.append((kind, [(subtract(occupied, exposed), "hidden"), (exposed, "exposed")]))
    return lanes


def plot_timeline(
    traces: Sequence[RankTrace], path: Path, iteration: int | None = None, title: str = ""
) -> None:
    """Draw `iteration` (default: the last one) of every rank into `path`."""
    plt = _pyplot()
    picked = [(t.rank, _pick(t, iteration)) for t in sorted(traces, key=lambda t: t.rank)]
    picked = [(rank, it) for rank, it in picked if it is not None]
    if not picked:
        raise ValueError("no iteration to draw")
    rows = [(f"rank {rank} {label}", bars) for rank, it in picked for label, bars in _lanes(it)]
    origin = (
        min(iv[0] for _, bars in rows for ivs, _ in bars for iv in ivs)
        if any(ivs for _, bars in rows for ivs, _ in bars)
        else 0.0
    )
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.5))
    for y, (_, bars) in enumerate(rows):
        for intervals, key in bars:
            ax.broken_barh(
                [((s - origin) * 1e3, (e - s) * 1e3) for s, e in intervals],
                (y - 0.35, 0.7),
                facecolors=COLORS[key],
            )
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the iteration's first event")
    shown = picked[0][1].iteration + 1
    ax.set_title(title or f"iteration {shown}")
    ax.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()],
        labels=["compute busy", "compute waiting", "comm hidden", "comm exposed"],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.6 / (0.45 * len(rows) + 1.5) - 0.08),
        ncol=4,
        fontsize="small",
    )
    fig.tight_layout()
    with BytesIO() as png:
        fig.savefig(png, format="png", dpi=110)
        write_replace(path, png.getvalue())
    plt.close(fig)
