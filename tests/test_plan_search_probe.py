"""The layout search's shortcut (`overlap.plan.search._probe`): a group of layouts sharing TP, CP,
PP, split and EP is tried once, at its least memory-hungry point under full recompute, without and
(DP x CP > 1) with Megatron-FSDP, and dropped unpriced where neither fits, or started at
Megatron-FSDP where only that does. The search is only right if no other member of such a group
fits without what its probe needed: a larger micro-batch or a deeper interleave never needs less
memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from overlap.plan.hardware import builtin_cluster
from overlap.plan.search import (
    FSDP_ONLY,
    FULL,
    SearchResult,
    _groups,
    _probe,
    _resolve,
    _Space,
    candidate_layouts,
    dp_of,
)

# clusters small enough for the probe to drop groups or to start them at Megatron-FSDP
# (21 groups dropped, 7 started at Megatron-FSDP of 31; 18 started at Megatron-FSDP of 39)
CASES = {
    "Llama3-70B 16xH100": "-m llama -mr llama3_70b -g h100 -ng 16 -c bf16".split(),
    "Llama3-70B 32xH100": "-m llama -mr llama3_70b -g h100 -ng 32 -c bf16".split(),
}


@pytest.mark.parametrize("words", CASES.values(), ids=CASES.keys())
def test_a_group_the_probe_rules_out_has_no_member_that_fits(words):
    """A group dropped (None) has no member that fits under full recompute and Megatron-FSDP; a
    group started at Megatron-FSDP (`FSDP_ONLY`) has none that fits without it."""
    base = _resolve(words)
    cluster = builtin_cluster("h100", "bf16", 8)
    space = _Space(words, [], cluster, SearchResult([], words, [], cluster))
    gpus = base.resolution.layout.world_size
    seen = {None: 0, FSDP_ONLY: 0}
    checked = 0
    for group in _groups(candidate_layouts(base.cfg, gpus, 8)):
        start = _probe(space, group, gpus)
        if start not in seen:
            continue
        seen[start] += 1
        for layout in group:
            fsdp = start is None and dp_of(layout, gpus) > 1
            job = space.resolve(replace(layout, recompute=FULL, fsdp=fsdp), count=False)
            if job is None:
                continue
            checked += 1
            margin, peak = space.margin(job)
            assert margin < 0, (
                f"{layout.describe()} fits ({peak.total / 2**30:.1f} GiB, Megatron-FSDP {fsdp}) "
                f"in a group the probe started at {start} from {group[0].describe()}"
            )
    # the shortcut is exercised, past the probed layouts
    assert seen[FSDP_ONLY] and checked > sum(seen.values())
