"""The layout search's shortcut (`overlap.plan.search._probe`): a group of layouts sharing TP, CP,
PP, split and EP is tried once, at its least memory-hungry point under full recompute, and dropped
unpriced where that does not fit. The search is only right if no other member of a dropped group
fits: a larger micro-batch or a deeper interleave never needs less memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap.plan.hardware import builtin_cluster
from overlap.plan.search import (
    FULL,
    SearchResult,
    _groups,
    _probe,
    _resolve,
    _Space,
    candidate_layouts,
)

# clusters small enough for the probe to drop groups (28 of 31 and 18 of 39 groups)
CASES = {
    "Llama3-70B 16xH100": "-m llama -mr llama3_70b -g h100 -ng 16 -c bf16".split(),
    "Llama3-70B 32xH100": "-m llama -mr llama3_70b -g h100 -ng 32 -c bf16".split(),
}


@pytest.mark.parametrize("words", CASES.values(), ids=CASES.keys())
def test_a_group_the_probe_rules_out_has_no_member_that_fits(words):
    base = _resolve(words)
    cluster = builtin_cluster("h100", "bf16", 8)
    space = _Space(words, [], cluster, SearchResult([], words, [], cluster))
    gpus = base.resolution.layout.world_size
    dropped = checked = 0
    for group in _groups(candidate_layouts(base.cfg, gpus, 8)):
        if _probe(space, group) is not False:
            continue
        dropped += 1
        for layout in group:
            job = space.resolve(replace(layout, recompute=FULL), count=False)
            if job is None:
                continue
            checked += 1
            margin, peak = space.margin(job)
            assert margin < 0, (
                f"{layout.describe()} fits ({peak.total / 2**30:.1f} GiB) in a group the probe "
                f"dropped at {group[0].describe()}"
            )
    assert dropped and checked > dropped  # the shortcut is exercised, past the probed layouts
