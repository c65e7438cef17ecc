"""The elementwise chains (`overlap.layers.fused.Chain`) and their fusions
(`overlap.kernels.fusion`): each chain against the plain expression it implements under autograd,
forward and backward; each chain compiled by torch.compile (inductor, whose CPU backend compiles C++
with g++) against itself eager; what each keeps for backward (only what its backward needs); the
compiled graphs hold no op that syncs the host; a tiny MoE model trained with every fusion on
against every fusion off; the switches' decisions, the toolchain check and the bound on compiled
variants.

Tolerances (inputs of unit scale): the chain and the autograd reference both compute in fp32 inside
and round once, in a different order: fp32 within rtol 1e-5 / atol 1e-5, bf16 within rtol 2e-2 /
atol 2e-2 (two bf16 ulps: e.g. the reference's backward rounds silu's gradient to bf16 before the
product, the chain does not). Compiled against eager, the same. The model: losses and grad norms
over three steps within rtol 1e-5 in fp32, 5e-3 in bf16 (seen: 2e-7 and 7e-4).

Compiling takes seconds per graph on a CPU, so each function is compiled once per dtype here and the
model test reuses the on-disk graph cache.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func
from torch.autograd.graph import saved_tensors_hooks
from torch.fx.node import map_arg

from overlap.errors import ConfigError
from overlap.kernels import fusion
from overlap.kernels.fusion import FUSIONS, fusion_on
from overlap.layers import fused
from overlap.layers.mlp import SWIGLU
from overlap.layers.norm import RMS_NORM
from overlap.layers.rotary import APPLY_ROPE, rotate_half
from overlap.parallel.state import ParallelState
from overlap.perf.host_syncs import sync_reason
from overlap.training.trainer import Trainer
from tests.configs import tiny_config
from tests.world import run_world

ALL_ON = [f"model.{field}=true" for field in FUSIONS]
ALL_OFF = [f"model.{field}=false" for field in FUSIONS]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _rms_norm_ref(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope_ref(x, cos, sin):
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def _swiglu_ref(gate, up, probs):
    if probs is None:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float() * probs.unsqueeze(-1)).to(gate.dtype)


# name -> (chain, the plain expression under autograd, the argument positions it saves)
CHAINS = {
    "rms_norm": (RMS_NORM, _rms_norm_ref),
    "apply_rope": (APPLY_ROPE, _rope_ref),
    "swiglu": (SWIGLU, _swiglu_ref),
    "weighted_swiglu": (SWIGLU, _swiglu_ref),
}


def _inputs(name: str, rows: int, dtype: torch.dtype) -> tuple[tuple, tuple[int, ...]]:
    """(arguments, indices of the differentiable ones) for chain `name` at `rows` rows, seeded."""
    g = torch.Generator().manual_seed(rows)

    def t(*shape, dt=dtype, grad=True):
        return torch.randn(*shape, generator=g, dtype=dt).requires_grad_(grad)

    if name == "rms_norm":
        return (t(rows, 2, 48), t(48), 1e-6), (0, 1)
    if name == "apply_rope":
        angles = torch.rand(rows, 1, 1, 16, generator=g) * 6
        return (t(rows, 2, 4, 16), angles.cos(), angles.sin()), (0,)
    if name == "swiglu":
        return (t(rows, 40), t(rows, 40), None), (0, 1)
    return (t(rows, 40), t(rows, 40), torch.rand(rows, generator=g).requires_grad_()), (0, 1, 2)


def _fwd_bwd(fn, args, diff):
    args = tuple(
        a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    )
    out = fn(*args)
    grad_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, [args[i] for i in diff], grad_out)
    return out, grads


def _check_close(got, want, dtype):
    (out, grads), (ref, ref_grads) = got, want
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])
    for g, w in zip(grads, ref_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, **TOL[dtype])


@pytest.mark.parametrize("name", list(CHAINS))
def test_each_chain_is_its_plain_expression_eager_and_compiled(name):
    chain, reference = CHAINS[name]
    counters.clear()
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (24, 37):  # two sizes, one graph: the row dimension is dynamic
            args, diff = _inputs(name, rows, dtype)
            eager = _fwd_bwd(lambda *a, c=chain: c(False, *a), args, diff)
            _check_close(eager, _fwd_bwd(reference, args, diff), dtype)
            _check_close(_fwd_bwd(lambda *a, c=chain: c(True, *a), args, diff), eager, dtype)
    assert not counters["graph_break"]
    # forward and backward, one graph each per dtype, whatever the row count
    assert counters["stats"]["unique_graphs"] <= 4


def _saved(name: str) -> tuple[list[torch.Tensor], tuple]:
    """What the chain's node keeps for backward (packed by autograd), and the arguments."""
    chain, _reference = CHAINS[name]
    args, _diff = _inputs(name, 8, torch.bfloat16)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        chain(False, *args)
    return saved, args


def test_each_chain_keeps_only_what_its_backward_needs():
    """RMSNorm: its input, its weight and one fp32 rstd per row; RoPE: only its tables; SwiGLU: its
    two inputs (and the row weights): never an fp32 copy of an activation or an intermediate."""
    saved, (x, weight, _eps) = _saved("rms_norm")
    assert saved[0] is x and saved[1] is weight
    assert saved[2].dtype == torch.float32 and saved[2].shape == (*x.shape[:-1], 1)
    assert len(saved) == 3
    saved, (x, cos, sin) = _saved("apply_rope")
    assert saved == [cos, sin]
    saved, (gate, up, _probs) = _saved("swiglu")
    assert saved[0] is gate and saved[1] is up and len(saved) == 2
    saved, (gate, up, probs) = _saved("weighted_swiglu")
    assert saved == [gate, up, probs]


def _graph_ops(fn, args) -> list[tuple[torch._ops.OpOverload, tuple, dict]]:
    """Every aten op of `fn`'s graph as AOTAutograd traces it, with fake arguments."""
    ops = []

    def collect(gm: torch.fx.GraphModule, _inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                value = lambda n: n.meta.get("val")  # noqa: E731 - the node's fake tensor
                ops.append((node.target, map_arg(node.args, value), map_arg(node.kwargs, value)))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=collect, bw_compiler=collect)
    with torch.no_grad():
        torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)(*args)
    return ops


@pytest.mark.parametrize("name", list(CHAINS))
def test_the_compiled_graphs_hold_no_host_sync(name):
    """Each of the chain's two functions is one graph (fullgraph: a data-dependent size would break
    it), and no op of either would make the host wait for the GPU (`host_syncs.sync_reason`)."""
    chain, _reference = CHAINS[name]
    args, _diff = _inputs(name, 24, torch.bfloat16)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    out, *extras = chain.forward(*args)
    constants = tuple(
        a for i, a in enumerate(args) if i not in chain.saves and not isinstance(a, torch.Tensor)
    )
    saved = (*(args[i] for i in chain.saves), *extras, *constants)
    ops = _graph_ops(chain.forward, args) + _graph_ops(
        chain.backward, (torch.ones_like(out), *saved)
    )
    assert len({op for op, _a, _k in ops}) >= 2
    assert [str(op) for op, a, k in ops if sync_reason(op, a, k)] == []


def _train(overrides: list[str], steps: int, precision: str) -> tuple[list, list, dict, int]:
    """Losses and grad norms of `steps` steps of the tiny model (an MoE layer, then a dense one),
    and the dynamo counters."""
    counters.clear()
    cfg = tiny_config(True, precision, 2, overrides + ["model.moe_layer_freq=[1,0]"], steps)
    trainer = Trainer(cfg, ParallelState(cfg.finalize(dist.get_world_size()).layout))
    records = trainer.train().records
    return (
        [r.lm_loss for r in records],
        [r.grad_norm for r in records],
        dict(counters["graph_break"]),
        counters["stats"]["unique_graphs"],
    )


@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-5), ("bf16_mixed", 5e-3)])
def test_a_tiny_model_trains_the_same_with_every_fusion_on_and_off(precision, rtol):
    off_losses, off_norms, _breaks, off_graphs = run_world(1, _train, ALL_OFF, 3, precision)[0]
    on_losses, on_norms, breaks, graphs = run_world(1, _train, ALL_ON, 3, precision)[0]
    assert off_graphs == 0, "fusion off compiles nothing"
    # forward and backward of rms_norm (hidden and the QK heads' shapes), RoPE (queries and
    # keys), SwiGLU (dense and weighted in the experts); the routing changes the experts' row
    # counts every step without a recompile per count
    assert not breaks and 0 < graphs <= 2 * 7
    torch.testing.assert_close(on_losses, off_losses, rtol=rtol, atol=0)
    torch.testing.assert_close(on_norms, off_norms, rtol=rtol, atol=0)


# --- the switches ---------------------------------------------------------------------------------
def _model_decisions(cfg, **kw) -> dict:
    res = cfg.finalize(1, **kw)
    rows = res.decisions.sections["model"]
    return {d.field: d for d in rows if d.field.removeprefix("model.") in FUSIONS}, res


def test_unset_the_fusions_are_off_on_the_cpu_and_on_for_cuda(monkeypatch):
    rows, _res = _model_decisions(tiny_config(True, "bf16_mixed", 1, [], 1), on_cuda=False)
    assert {f: d.effective for f, d in rows.items()} == {f"model.{f}": False for f in FUSIONS}
    assert all("CPU: eager" in d.reason for d in rows.values())
    monkeypatch.setattr(fusion, "compile_unavailable", lambda device_type: None)
    rows, res = _model_decisions(tiny_config(True, "bf16_mixed", 1, [], 1), on_cuda=True)
    assert all(d.effective and "CUDA: compiled" in d.reason for d in rows.values())
    assert "model.apply_rope_fusion" in res.decisions.format_sections()
    assert fusion_on(None, "cuda")[0] and fusion_on(True, "cpu")[0]
    assert not fusion_on(None, "cpu")[0] and not fusion_on(False, "cuda")[0]


def test_a_fusion_that_cannot_take_effect_is_a_noop_switch(monkeypatch, caplog):
    monkeypatch.setattr(fusion, "compile_unavailable", lambda device_type: "inductor needs Triton")
    with caplog.at_level(logging.WARNING, "overlap.config"):
        cfg = tiny_config(True, "bf16_mixed", 1, ["model.apply_rope_fusion=true"], 1)
        rows, res = _model_decisions(cfg, on_cuda=True)
    assert rows["model.apply_rope_fusion"].effective is False
    assert [n.field for n in res.decisions.noops] == ["model.apply_rope_fusion"]
    assert "inductor needs Triton" in caplog.text
    assert res.kernels.apply_rope_fusion is False  # what the layers run: eager
    # described for another machine (`explain -g h100` here): this machine's Triton is not its
    rows, res = _model_decisions(cfg, on_cuda=True, require_libraries=False)
    assert rows["model.apply_rope_fusion"].effective is True and not res.decisions.noops
    strict = tiny_config(
        True, "bf16_mixed", 1, ["model.apply_rope_fusion=true", "comm_overlap.strict=true"], 1
    )
    with pytest.raises(ConfigError, match="apply_rope_fusion"):
        strict.finalize(1, on_cuda=True)


def test_bias_activation_fusion_on_a_dense_gelu_model_has_nothing_to_fuse():
    cfg = tiny_config(
        False, "fp32", 1, ["model.gated_linear_unit=false", "model.bias_activation_fusion=true"], 1
    )
    rows, res = _model_decisions(cfg, on_cuda=False)
    assert rows["model.bias_activation_fusion"].effective is False
    assert "GELU" in res.decisions.noops[0].why


def test_under_a_dispatch_mode_the_eager_function_runs():
    """The host-sync recorder and the dry run watch the eager ops; dynamo cannot trace under their
    modes."""
    from overlap.perf.host_syncs import HostSyncRecorder

    x = torch.randn(4, 8)
    assert fused.compiling(True, x)
    with HostSyncRecorder():
        assert not fused.compiling(True, x)
        torch.testing.assert_close(SWIGLU(True, x, x, None), F.silu(x) * x)


def test_the_toolchain_triton_needs_is_checked_before_choosing_compiled(monkeypatch):
    """Triton builds its launcher with a host C compiler against Python's headers at the first
    kernel: without either, the CUDA default falls back at start-up with the reason."""
    monkeypatch.setattr(fusion.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert "C compiler" in fusion._triton_toolchain_missing()
    monkeypatch.setattr(fusion.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(fusion.sysconfig, "get_paths", lambda: {"include": "/nonexistent"})
    assert "Python.h" in fusion._triton_toolchain_missing()


def test_small_calls_run_eager_and_variants_past_the_limit_run_eager_with_a_warning(
    monkeypatch, caplog
):
    """Fewer than two rows (dynamo would specialise sizes 0 and 1 into graphs of their own) run
    eager; once a function has compiled torch's recompile limit of shape variants, a new one runs
    eager and says so, instead of fullgraph's error mid-run."""
    calls = []
    monkeypatch.setattr(fused, "compiled", lambda fn: calls.append(fn) or fn)
    monkeypatch.setattr(fused, "_variant_limit", lambda: 2)
    monkeypatch.setattr(fused, "_variants", {})

    def double(x):
        return x * 2

    fused.run(double, True, torch.ones(1, 4))
    assert calls == []
    with caplog.at_level(logging.WARNING, "overlap"):
        for width in (4, 5, 6):
            fused.run(double, True, torch.ones(3, width))
        fused.run(double, True, torch.ones(9, 4))  # a known variant: more rows, no new one
    assert len(calls) == 3 and "recompile limit" in caplog.text
