"""One MoE layer run alone, at a layout or as the single-process reference, shared by the MoE test
files: its configuration, a rank's routing with empty ranks and experts, and the check that a
parallel layout gives the reference's outputs and gradients (`TOL`: fp32, 1e-5)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.config.mixed_precision import Precision
from overlap.config.model import ModelConfig
from overlap.layers.init import init_model_params
from overlap.layers.moe import MoELayer
from overlap.layout import ParallelLayout
from overlap.parallel.state import ParallelState
from tests.configs import bare_kernels, bare_plan, moe_layer_model
from tests.world import run_world

SEQ, BATCH, HIDDEN = 8, 2, 32
TOL = dict(atol=1e-5, rtol=1e-5)
INIT_STD = 0.2  # large enough that outputs are O(1), so an absolute tolerance means something


def moe_config(num_experts: int = 8, tp: int = 1, ep: int = 1, **overrides) -> ModelConfig:
    fields = dict(
        num_moe_experts=num_experts,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
    )
    return moe_layer_model(**{**fields, **overrides})


def bare_moe_layer(cfg: ModelConfig, ps, overlap=None) -> MoELayer:
    """One MoE layer (layer 0) of `cfg` on `ps`, built without a finalized run: the overlap plan
    given (none by default), the precision and kernels its fields ask for."""
    plan = bare_plan() if overlap is None else overlap
    return MoELayer(cfg, ps, 0, plan, Precision.of(cfg), bare_kernels(cfg))


def rank_routing(rank: int, num_experts: int, num_local_experts: int):
    """Rank r's tokens; rank 1 has none, and nobody routes to the last EP rank's experts (zero-size
    splits)."""
    num_tokens = [6, 0, 5, 7][rank]
    g = torch.Generator().manual_seed(7 + rank)
    allowed = num_experts - num_local_experts
    topk_idx = torch.rand(num_tokens, allowed, generator=g).argsort(dim=1)[:, :2]
    return (
        torch.randn(num_tokens, HIDDEN, generator=g),
        topk_idx,
        torch.rand(num_tokens, 2, generator=g),
    )


def force_experts_0_and_1(layer: MoELayer) -> None:
    """With positive inputs, positive router rows 0 and 1 and negative others, every token picks
    experts 0 and 1."""
    with torch.no_grad():
        w = layer.router.weight
        w.abs_()
        w[2:].neg_()


def layer_batch(seed: int, positive: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The full [s, b, h] input of one micro-batch and the output gradient its loss uses."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.rand(SEQ, BATCH, HIDDEN, generator=g) + 0.1
        if positive
        else torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    )
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def moe_layer_run(
    tp: int, ep: int, cfg_overrides: dict, seeds: list[int], uneven: bool = False
) -> dict:
    """Forward + backward of one MoE layer; this rank processes its data-parallel share of `seeds`
    (all of them in the single-process reference), under sequence parallel only its TP slice of each
    sequence."""
    cfg = moe_config(tp=tp, ep=ep, **cfg_overrides)
    world = dist.get_world_size()
    ps = ParallelState(
        ParallelLayout(world_size=world, tp=tp, ep=ep, sequence_parallel=cfg.sequence_parallel)
    )
    layer = bare_moe_layer(cfg, ps)
    init_model_params(layer, seed=1234, std=INIT_STD)
    if uneven:
        force_experts_0_and_1(layer)
    outs = []
    for seed in seeds[ps.dp_rank :: ps.layout.dp]:
        x, dy = (t.chunk(tp)[ps.tp_rank] for t in layer_batch(seed, positive=uneven))
        x.requires_grad_()
        y, aux = layer(x)
        ((y * dy).sum() + aux).backward()
        outs.append((y.detach(), aux.detach(), x.grad))
    grads = {}
    for name, p in layer.named_parameters():
        shard = getattr(p, "shard", None)
        grads[name] = (p.grad, None if shard is None else (shard.dim, shard.index, shard.count))
    return {"dp_rank": ps.dp_rank, "tp_rank": ps.tp_rank, "outs": outs, "grads": grads}


def full_grads(results: list[dict]) -> dict[str, torch.Tensor]:
    """Logical full gradients: shards are reassembled along their dim, each the sum over the ranks
    holding it (expert-data-parallel replicas, or TP ranks that saw different tokens); replicated
    parameters sum over all."""
    full = {}
    for name, (_, shard) in results[0]["grads"].items():
        if shard is None:
            full[name] = sum(r["grads"][name][0] for r in results)
            continue
        dim, _, count = shard
        full[name] = torch.cat(
            [
                sum(r["grads"][name][0] for r in results if r["grads"][name][1][1] == i)
                for i in range(count)
            ],
            dim=dim,
        )
    return full


def check_against_reference(
    world: int,
    tp: int,
    ep: int,
    cfg_overrides: dict,
    uneven: bool = False,
    reference_overrides: dict | None = None,
) -> None:
    """The layer in the layout against the single-process reference layer, built with
    `reference_overrides` (None: the same `cfg_overrides`)."""
    seeds = [100 + d for d in range(world // tp)]
    ref_cfg = cfg_overrides if reference_overrides is None else reference_overrides
    ref = run_world(1, moe_layer_run, 1, 1, ref_cfg, seeds, uneven)[0]
    par = run_world(world, moe_layer_run, tp, ep, cfg_overrides, seeds, uneven)
    for r in par:
        ((y, aux, dx),) = r["outs"]
        ref_y, ref_aux, ref_dx = ref["outs"][r["dp_rank"]]
        torch.testing.assert_close(y, ref_y.chunk(tp)[r["tp_rank"]], **TOL)
        torch.testing.assert_close(aux, ref_aux, **TOL)
        torch.testing.assert_close(dx, ref_dx.chunk(tp)[r["tp_rank"]], **TOL)
    ref_grads, par_grads = full_grads([ref]), full_grads(par)
    assert ref_grads.keys() == par_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(
            par_grads[name], g, **TOL, msg=lambda m, name=name: f"{name}: {m}"
        )


def none_mode_step(**overrides) -> tuple[int, ...]:
    """One forward + backward of an EP2 MoE layer with no communication at all (`overrides`: model
    fields); the output's shape."""
    from overlap.parallel import comm

    ps = ParallelState(ParallelLayout(world_size=2, ep=2))
    cfg = moe_config(num_experts=4, ep=2, **overrides)
    layer = bare_moe_layer(cfg, ps)
    init_model_params(layer, seed=0, std=INIT_STD)
    x = layer_batch(100 + dist.get_rank(), positive=False)[0].requires_grad_()
    with comm.using(comm.CommSession("none")):
        y, aux = layer(x)
        (y.sum() + aux).backward()
    return tuple(y.shape)
