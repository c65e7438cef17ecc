"""Local-shard initialisation (`overlap.layers.init`): a rank's draw is its slice of the unsharded
draw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlap.layers import init
from overlap.layers.init import init_model_params, mark_shard


def _module(
    shape: tuple[int, ...],
    dim: int | None,
    index: int = 0,
    count: int = 1,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    m = nn.Module()
    m.w = nn.Parameter(torch.empty(shape, dtype=dtype))
    if dim is not None:
        mark_shard(m.w, dim, index, count)
    init_model_params(m, seed=7, std=0.02)
    return m


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_every_shard_is_its_slice_of_the_whole(dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init, "_HOST_ELEMENTS", 16)  # several host groups per shard
    full = (4, 6, 8)
    whole = _module(full, dim).w
    for count in (2, 4 if full[dim] % 4 == 0 else 2):
        local = list(full)
        local[dim] //= count
        for index in range(count):
            part = _module(tuple(local), dim, index, count).w
            assert torch.equal(part, whole.chunk(count, dim)[index]), (dim, count, index)


def test_unsharded_params_draw_by_dim0_rows_and_cast() -> None:
    """No shard: dim-0 slices, as a dim-0 shard of one; the parameter's dtype is a cast of the fp32
    draw."""
    assert torch.equal(_module((6, 5), None).w, _module((6, 5), 0).w)
    assert torch.equal(
        _module((6, 5), None, dtype=torch.bfloat16).w, _module((6, 5), None).w.bfloat16()
    )
    # the dim is part of the definition
    assert not torch.equal(_module((6, 5), None).w, _module((6, 5), 1).w)
