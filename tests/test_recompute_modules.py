"""Selective recompute's modules beyond the layer-level ones: `moe_act` keeps the numbers bit for
bit and keeps less activation memory, `shared_experts` keeps the numbers, and the modules of
unbuilt architectures are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from overlap.config import ConfigContainer, ModelConfig
from overlap.config.mixed_precision import Precision
from overlap.errors import ConfigError, NotBuiltError
from overlap.layout import ParallelLayout
from overlap.model.gpt import GPTModel
from overlap.parallel.state import ParallelState
from tests.configs import bare_kernels, bare_plan
from tests.world import run_world

MOE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=16,
    qk_layernorm=True,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_aux_loss_coeff=1e-2,
    init_method_std=0.1,
)
BATCH = 2


class _Allocations(TorchDispatchMode):
    """Every storage an operation creates, held weakly: after the forward, the live ones are what
    the autograd graph (and the caller) keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.storages.setdefault(
                    storage._cdata, (StorageWeakRef(storage), storage.nbytes())
                )
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def _step(
    modules: list[str] | None, shared: int | None = None
) -> tuple[float, dict[str, torch.Tensor], int]:
    """One forward + backward of the tiny MoE model on one rank: (loss, gradients, bytes the
    forward left alive)."""
    fields = dict(MOE, moe_shared_expert_intermediate_size=shared)
    if modules:
        fields.update(recompute_granularity="selective", recompute_modules=modules)
    ps = ParallelState(ParallelLayout(world_size=dist.get_world_size()))
    config = ModelConfig(**fields)
    model = GPTModel(config, ps, bare_plan(), Precision.of(config), bare_kernels(config))
    model.init_weights(1234)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, MOE["vocab_size"], (BATCH, MOE["seq_length"]), generator=gen)
    labels = torch.randint(0, MOE["vocab_size"], (BATCH, MOE["seq_length"]), generator=gen)
    with _Allocations() as seen:
        loss, aux = model(tokens, labels)
        total = loss + aux
    kept = seen.live_bytes()
    total.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, kept


def _compare(modules: list[str], shared: int | None = None):
    return _step(None, shared), _step(modules, shared)


def test_moe_act_keeps_the_numbers_and_less_memory():
    """Loss and every gradient bit-identical (the recomputation repeats the forward's
    operations); the forward keeps at least the SwiGLU's output less: rows x ffn x 4 bytes per MoE
    layer, rows = the micro-batch's tokens x top-k (all experts local on one rank); its
    intermediates are never kept (the `SWIGLU` chain keeps only its inputs)."""
    (loss, grads, kept), (loss_r, grads_r, kept_r) = run_world(1, _compare, ["moe_act"])[0]
    assert loss_r == loss
    assert grads_r.keys() == grads.keys()
    for name in grads:
        assert torch.equal(grads_r[name], grads[name]), name
    rows = BATCH * MOE["seq_length"] * MOE["moe_router_topk"]
    saved = rows * MOE["moe_ffn_hidden_size"] * 4 * MOE["num_layers"]
    assert kept - kept_r >= saved, (kept, kept_r, saved)


def test_shared_experts_recompute_keeps_the_numbers():
    (loss, grads, kept), (loss_r, grads_r, kept_r) = run_world(1, _compare, ["shared_experts"], 48)[
        0
    ]
    assert loss_r == loss and kept_r < kept
    for name in grads:
        assert torch.equal(grads_r[name], grads[name]), name


def _finalize(**model) -> ConfigContainer:
    cfg = ConfigContainer(model=ModelConfig(**{**MOE, **model}))
    cfg.finalize(1)
    return cfg


@pytest.mark.parametrize(
    "modules, extra, error, words",
    [
        (["mla_up_proj"], {}, NotBuiltError, "Multi-latent attention"),
        (["core_attn", "gdn_norm_out"], {}, NotBuiltError, "gated delta net"),
        (["shared_experts"], {}, ConfigError, "has none"),
        (
            ["shared_experts"],
            dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=True),
            ConfigError,
            "moe_shared_expert_overlap",
        ),
        (["moe_act"], dict(num_moe_experts=None), ConfigError, "no experts"),
        (["core_attn", "bogus"], {}, ConfigError, "unknown module"),
    ],
)
def test_what_cannot_be_built_is_refused_by_name(modules, extra, error, words):
    with pytest.raises(error) as err:
        _finalize(recompute_granularity="selective", recompute_modules=modules, **extra)
    assert err.value.field == "model.recompute_modules" and words in str(err.value)


def test_the_full_reference_list_resolves_where_the_model_has_it():
    cfg = _finalize(
        recompute_granularity="selective",
        moe_shared_expert_intermediate_size=32,
        recompute_modules=["core_attn", "moe_act", "layernorm", "mlp", "shared_experts"],
    )
    assert cfg.model.recompute_modules == [
        "core_attn",
        "moe_act",
        "layernorm",
        "mlp",
        "shared_experts",
    ]
    res = ConfigContainer(
        model=ModelConfig(
            **MOE, recompute_granularity="selective", recompute_modules=["moe", "moe_act"]
        )
    ).finalize(1)
    # 'moe' covers 'moe_act'
    assert [n.field for n in res.decisions.noops] == ["model.recompute_modules"]


def test_modules_without_selective_granularity_are_said_to_do_nothing():
    """Megatron reads recompute_modules only under selective granularity: a list set without it
    is a no-op the decision table says, not a setting silently ignored."""
    for granularity in (None, "full"):
        extra = dict(recompute_method="uniform", recompute_num_layers=1) if granularity else {}
        res = ConfigContainer(
            model=ModelConfig(
                **MOE, recompute_granularity=granularity, recompute_modules=["moe_act"], **extra
            )
        ).finalize(1)
        assert [n.field for n in res.decisions.noops] == ["model.recompute_modules"], granularity


def test_moe_act_under_ep2_overlap_and_delayed_wgrad_matches_the_plain_loop():
    """The merged EP-overlap schedule with delayed weight gradients (the experts' fc2 wgrad then
    reads the recomputed activation later) against the plain loop without recompute: same losses
    and gradients (rel 1e-6, the tolerance of the EP-overlap tests)."""
    from tests.ep_overlap_runs import run_ep_step

    recompute = dict(
        recompute_granularity="selective",
        recompute_modules=["moe_act", "shared_experts"],
        moe_shared_expert_intermediate_size=32,
    )
    plain = run_world(
        2, run_ep_step, False, False, {"ep": 2}, {"moe_shared_expert_intermediate_size": 32}
    )
    merged = run_world(2, run_ep_step, True, True, {"ep": 2}, recompute)
    for (l_off, g_off, _, _), (l_on, g_on, _, _) in zip(plain, merged):
        assert l_on == pytest.approx(l_off, rel=1e-6)
        assert g_on.keys() == g_off.keys()
        for name in g_off:
            torch.testing.assert_close(g_on[name], g_off[name], rtol=1e-6, atol=1e-6, msg=name)
