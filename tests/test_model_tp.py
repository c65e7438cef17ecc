"""Numerical tests of the tensor-parallel layers and the dense GPT model.

Same model, data and seed in every layout: TP=2 with and without sequence parallelism must match the
single-process reference (run_world(1, ...)), recompute must not change a bit, and the
vocab-parallel cross-entropy must equal F.cross_entropy. All TP=2 model runs happen in one call to
the shared 2-rank world, all references in one call to the 1-rank world; the tests compare the
cached results.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlap.config.mixed_precision import Precision
from overlap.config.model import ModelConfig
from overlap.layers.attention import SelfAttention
from overlap.layers.cross_entropy import cross_entropy
from overlap.layers.init import init_model_params
from overlap.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
)
from overlap.layout import ParallelLayout
from overlap.model import GPTModel
from overlap.parallel import comm
from overlap.parallel.state import ParallelState
from tests.configs import bare_kernels, bare_plan
from tests.world import run_world

# fp32, different reduction order (TP splits GEMM reductions and sums partials over ranks):
# agreement to a few ulps of the accumulated values, far below any real bug (a wrong shard or a
# missing reduction is off by O(1)).
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-4
# bf16 has an 8-bit mantissa (~4e-3 relative per rounding) and TP rounds the row-parallel partial
# sums to bf16 before adding them, which the reference never does. The loss (fp32 cross-entropy of
# bf16 logits) must agree to 1e-3 relative (measured 1.3e-4); each gradient is compared by its
# relative error in norm, 5e-2 (worst measured 1.8e-2).
BF16_LOSS_RTOL = 1e-3
BF16_GRAD_REL_NORM = 5e-2

BATCH = 2
# init std 0.1 (not 0.02) so attention is far from uniform and a head/shard mix-up shows in the
# numbers.
TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=32,
    qk_layernorm=True,
    init_method_std=0.1,
)

CASES_TP2 = {
    "sp": dict(sequence_parallel=True),
    "no_sp": dict(sequence_parallel=False),
    "selective": dict(
        sequence_parallel=True,
        recompute_granularity="selective",
        recompute_modules=["core_attn", "mlp", "layernorm"],
    ),
    "full_uniform": dict(
        sequence_parallel=True,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    ),
    "full_block": dict(
        sequence_parallel=True,
        recompute_granularity="full",
        recompute_method="block",
        recompute_num_layers=1,
    ),
    "bf16": dict(sequence_parallel=True, params_dtype="bfloat16"),
}
CASES_REF = {"ref": {}, "ref_bf16": dict(params_dtype="bfloat16")}


# --------------------------------------------------------------------------------------------------
# Rank-side helpers (module-level so the world can run them)
# --------------------------------------------------------------------------------------------------


def _state(sequence_parallel: bool = False) -> ParallelState:
    world = dist.get_world_size()
    return ParallelState(
        ParallelLayout(world_size=world, tp=world, sequence_parallel=sequence_parallel)
    )


def _full_grad(param: torch.nn.Parameter, ps: ParallelState) -> torch.Tensor:
    """The gradient of the logical (unsharded) parameter, identical on every rank."""
    grad = param.grad.detach().float().clone()
    if ps.layout.sequence_parallel and getattr(param, "sequence_parallel", False):
        comm.all_reduce(grad, ps.tp_group, "test").wait()
    shard = getattr(param, "shard", None)
    if shard is not None:
        assert shard.count == ps.layout.tp
        grad = (
            comm.all_gather(grad.movedim(shard.dim, 0), ps.tp_group, "test")
            .wait()
            .movedim(0, shard.dim)
        )
    return grad


def _run_model(ps: ParallelState, overrides: dict) -> dict:
    config = ModelConfig(**TINY, tensor_model_parallel_size=ps.layout.tp, **overrides)
    model = GPTModel(config, ps, bare_plan(), Precision.of(config), bare_kernels(config))
    model.init_weights(1234)
    gen = torch.Generator().manual_seed(7)  # the same tokens on every rank and in every layout
    data = torch.randint(0, config.vocab_size, (BATCH, config.seq_length + 1), generator=gen)
    loss, aux_loss = model(data[:, :-1], data[:, 1:])
    (loss + aux_loss).backward()
    grads = {name: _full_grad(p, ps) for name, p in model.named_parameters()}
    return {
        "loss": loss.item(),
        "aux": aux_loss.item(),
        "loss_dtype": str(loss.dtype),
        "grads": grads,
    }


def _run_cases(cases: dict) -> dict:
    """Each case on a layout with the sequence parallelism its overrides type (the model reads the
    layout's, as finalize would resolve it)."""
    return {
        name: _run_model(_state(overrides.get("sequence_parallel", False)), overrides)
        for name, overrides in cases.items()
    }


def _cross_entropy_check() -> tuple[float, float]:
    """Max |difference| of the per-token loss and of the logits gradient vs F.cross_entropy on the
    full logits."""
    ps = _state()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 3, 256, generator=gen) * 4
    labels = torch.randint(0, 256, (8, 3), generator=gen)
    weights = torch.rand(8, 3, generator=gen)  # a non-uniform upstream gradient
    full = logits.clone().requires_grad_()
    expected = F.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="none").view(8, 3)
    (expected * weights).sum().backward()
    shard = logits.chunk(ps.layout.tp, dim=-1)[ps.tp_rank].clone().requires_grad_()
    loss = cross_entropy(shard, labels, ps.tp_group, ps.tp_rank * shard.shape[-1])
    (loss * weights).sum().backward()
    grad = comm.all_gather(shard.grad.movedim(-1, 0), ps.tp_group, "test").wait().movedim(0, -1)
    return (loss - expected).abs().max().item(), (grad - full.grad).abs().max().item()


def _linear_pair_check() -> float:
    """Column(gather_output) -> Row(input_is_parallel=False) vs the same two dense GEMMs; max
    |difference| over the output and the input gradient."""
    ps = _state()
    col = ColumnParallelLinear(16, 24, ps, sequence_parallel=False, gather_output=True, bias=True)
    row = RowParallelLinear(24, 8, ps, sequence_parallel=False, input_is_parallel=False, bias=True)
    init_model_params(col, 5, 0.1)
    init_model_params(row, 6, 0.1)
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    y = row(col(x))
    y.square().sum().backward()
    w1, b1, w2 = (_full_value(p, ps) for p in (col.weight, col.bias, row.weight))
    ref_x = x.detach().clone().requires_grad_()
    ref_y = F.linear(F.linear(ref_x, w1, b1), w2, row.bias.detach())
    ref_y.square().sum().backward()
    return max((y - ref_y).abs().max().item(), (x.grad - ref_x.grad).abs().max().item())


def _full_value(param: torch.nn.Parameter, ps: ParallelState) -> torch.Tensor:
    """The full value (not gradient) of a sharded parameter."""
    shard = param.shard
    return (
        comm.all_gather(param.detach().movedim(shard.dim, 0), ps.tp_group, "test")
        .wait()
        .movedim(0, shard.dim)
    )


def _attention_error() -> str:
    ps = _state()
    config = ModelConfig(**{**TINY, "num_query_groups": 1})
    try:
        SelfAttention(config, ps, 0, bare_plan(), Precision.of(config), bare_kernels(config))
    except ValueError as err:  # the config's split rule refuses it at finalize
        return str(err)
    return ""


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2() -> dict:
    ranks = run_world(2, _run_cases, CASES_TP2)
    for name in CASES_TP2:  # lm_loss is documented as identical on every TP rank
        assert ranks[0][name]["loss"] == ranks[1][name]["loss"], name
    return ranks[0]


@pytest.fixture(scope="module")
def ref() -> dict:
    return run_world(1, _run_cases, CASES_REF)[0]


def _assert_grads_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}", **tol)


@pytest.mark.parametrize("case", ["sp", "no_sp"])
def test_tp2_matches_reference(tp2, ref, case):
    got, want = tp2[case], ref["ref"]
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL)
    assert got["aux"] == want["aux"] == 0.0
    assert got["loss_dtype"] == "torch.float32"
    _assert_grads_close(got["grads"], want["grads"], atol=GRAD_ATOL, rtol=GRAD_RTOL)


def test_reference_parameter_names(ref):
    names = set(ref["ref"]["grads"])
    assert {
        "embedding.weight",
        "output_layer.weight",
        "final_layernorm.weight",
        "layers.0.self_attention.linear_qkv.weight",
        "layers.0.self_attention.q_layernorm.weight",
        "layers.1.mlp.linear_fc1.weight",
        "layers.1.mlp.linear_fc2.weight",
    } <= names
    assert ref["ref"]["grads"]["layers.0.mlp.linear_fc1.weight"].shape == (2, 128, 64)


@pytest.mark.parametrize("case", ["selective", "full_uniform", "full_block"])
def test_recompute_is_bit_identical(tp2, case):
    # Recompute replays the same ops on the same inputs, so the numbers must not move at all.
    assert tp2[case]["loss"] == tp2["sp"]["loss"]
    _assert_grads_close(tp2[case]["grads"], tp2["sp"]["grads"], atol=0.0, rtol=0.0)


def test_bf16_tp2_matches_bf16_reference(tp2, ref):
    got, want = tp2["bf16"], ref["ref_bf16"]
    assert got["loss"] == pytest.approx(want["loss"], rel=BF16_LOSS_RTOL)
    # the cross-entropy runs in fp32 whatever the compute dtype
    assert got["loss_dtype"] == "torch.float32"
    for name, g in want["grads"].items():
        rel = (got["grads"][name] - g).norm() / g.norm().clamp_min(1e-12)
        assert rel < BF16_GRAD_REL_NORM, f"{name}: relative error {rel:.3g}"


def test_vocab_parallel_cross_entropy_matches_torch():
    for loss_err, grad_err in run_world(2, _cross_entropy_check):
        assert loss_err < 1e-5 and grad_err < 1e-6


def test_gather_output_and_unsharded_input_paths():
    assert max(run_world(2, _linear_pair_check)) < 1e-5


def test_attention_rejects_groups_not_divisible_by_tp():
    messages = run_world(2, _attention_error)
    assert all("num_query_groups" in m for m in messages)


@pytest.mark.parametrize("delayed", [False, True])
def test_split_fused_linear_matches_the_fused_gemm(delayed):
    """`linear(..., split=True)` (SwiGLU's gate and up as two GEMMs on the fused weight's slices)
    gives what the one fused GEMM cut in halves gives: output, input, weight and bias gradients
    against a float64 run of the fused path within 1e-6 relative (fp32; the two paths sum the input
    gradient in a different order), contiguous outputs, and the weight gradient delayed through
    a WeightGradStore like any other."""
    from overlap.layers.linear_functions import linear
    from overlap.layers.wgrad_store import WeightGradStore

    g = torch.Generator().manual_seed(3)
    x0, w0, b0 = (
        torch.randn(6, 2, 16, generator=g),
        torch.randn(2, 12, 16, generator=g),
        torch.randn(24, generator=g),
    )

    def run(split: bool, dtype: torch.dtype):
        x, w, b = (t.to(dtype).requires_grad_() for t in (x0, w0, b0))
        store = WeightGradStore()
        with store.delaying(delayed and split):
            outs = linear(x, w, b, store, split=True) if split else linear(x, w, b).chunk(2, dim=-1)
            (F.silu(outs[0]) * outs[1]).square().sum().backward()
        assert (w.grad is None) == (delayed and split)
        store.flush()
        return (
            [o.detach() for o in outs],
            [t.grad for t in (x, w, b)],
            all(o.is_contiguous() for o in outs),
        )

    want_out, want_grads, _ = run(False, torch.float64)
    got_out, got_grads, contiguous = run(True, torch.float32)
    assert contiguous
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        torch.testing.assert_close(
            got.double(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item()
        )
