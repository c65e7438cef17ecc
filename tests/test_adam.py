"""The Adam core on torch's multi-tensor paths (issue 35).

- Same arithmetic as the per-slot loop it replaced: torch's single-tensor AdamW on `float(grad) *
  clip scale`, bit for bit on the CPU, with fp32 and bf16 gradients and bf16 parameters (copy-back).
- The state a checkpoint load creates is the state torch's own AdamW would have made: `step` on the
  CPU for the foreach path (a `step` on the GPU there makes AdamW read it back with `.item()` per
  slot per step), fp32 on the parameter's device for the fused path - whatever the default device
  and dtype at load time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from overlap.config import OptimizerConfig
from overlap.optim import adam as adam_mod
from overlap.optim.adam import MixedPrecisionAdam, Slot


def _adam(seed: int) -> tuple[MixedPrecisionAdam, list[nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    params = [
        nn.Parameter(torch.randn(4, 3, generator=gen, dtype=torch.float32)),
        nn.Parameter(torch.randn(5, generator=gen, dtype=torch.float32)),
    ]
    grads = [torch.randn(p.shape, generator=gen, dtype=torch.float32) for p in params]
    opt = MixedPrecisionAdam(
        [Slot(p, p, g, p, p.dim() > 1) for p, g in zip(params, grads)],
        OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0),
    )
    return opt, params


def _torch_adamw_steps(impl: dict[str, bool]) -> list[torch.Tensor]:
    """The `step` states torch's own AdamW class creates in one step of `_adam`'s parameters with
    torch's `impl` path."""
    opt, _ = _adam(0)
    masters = [s.master.detach().clone().requires_grad_() for s in opt.slots]
    for m, s in zip(masters, opt.slots):
        m.grad = s.grad.clone()
    ref = torch.optim.AdamW(masters, lr=1e-2, **impl)
    ref.step()
    return [ref.state[m]["step"] for m in masters]


@pytest.mark.parametrize("impl", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_loaded_step_is_what_torch_creates(impl, monkeypatch):
    """Default dtype float64 tells the two rules apart on the CPU (foreach: the default scalar
    dtype, fused: fp32); default device meta stands in for CUDA: a `step` created on the default
    device lands there."""
    monkeypatch.setattr(adam_mod, "multi_tensor_impl", lambda params: impl)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        ran, trained = _adam(0)
        ran.step(1e-2, grad_norm=4.0)  # the first step creates the state
        torch_made = _torch_adamw_steps(impl)
        loaded, params = _adam(0)
        with torch.no_grad():  # the checkpoint's weights (an fp32 parameter is its own master)
            for p, q in zip(params, trained):
                p.copy_(q)
        states = {
            s.param: {
                k: v.view(s.param.shape) for k, v in ran.export_slot(s).items() if k != "master"
            }
            for s in ran.slots
        }
        with torch.device("meta"):
            loaded.import_param_states(
                {lp: states[rs.param] for lp, rs in zip(params, ran.slots)}, step=1
            )
    finally:
        torch.set_default_dtype(saved)
    for a, b, t in zip(ran.slots, loaded.slots, torch_made):
        ours, got = ran.state[a.master]["step"], loaded.state[b.master]["step"]
        for want in (t, ours):
            assert (got.device, got.dtype, float(got)) == (want.device, want.dtype, float(want))
    for a, b in zip(
        ran.slots, loaded.slots
    ):  # the next step's gradients (the step clipped its own in place)
        a.grad.copy_(b.grad)
    ran.step(1e-2, grad_norm=4.0)
    loaded.step(1e-2, grad_norm=4.0)  # the loaded state continues exactly as the one torch made
    assert all(torch.equal(a.master, b.master) for a, b in zip(ran.slots, loaded.slots))
    assert loaded.steps_taken() == ran.steps_taken() == 2


def test_loaded_moments_live_on_the_masters_device():
    """A checkpoint's states are read into host memory (three fp32 copies of every parameter on
    the device would be a resume's spike): the import puts each slot's moments on its master's
    device, here meta standing in for CUDA, and never keeps the host tensors."""
    params = [
        nn.Parameter(torch.empty(4, 3, device="meta")),
        nn.Parameter(torch.empty(5, device="meta")),
    ]
    opt = MixedPrecisionAdam(
        [Slot(p, p, torch.empty_like(p), p, p.dim() > 1) for p in params], OptimizerConfig(lr=1e-2)
    )
    host = {
        p: {k: torch.full(p.shape, 1.0) for k in ("master", "exp_avg", "exp_avg_sq")}
        for p in params
    }
    opt.import_param_states(host, step=3)
    for slot in opt.slots:
        state = opt.state[slot.master]
        assert state["exp_avg"].device == state["exp_avg_sq"].device == slot.master.device
        assert state["exp_avg"].shape == slot.master.shape


@pytest.mark.parametrize(
    "grad_dtype,param_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
    ids=["fp32", "bf16_grads", "bf16_params"],
)
def test_multi_tensor_step_is_the_single_tensor_loop(grad_dtype, param_dtype):
    gen = torch.Generator().manual_seed(1)
    shapes = [(4, 3), (5,), (2, 2)]
    params = [nn.Parameter(torch.randn(s, generator=gen).to(param_dtype)) for s in shapes]
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=grad_dtype)
    opt = MixedPrecisionAdam.for_params(params, cfg)
    # the per-slot loop's reference
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW(
        [
            {"params": [m for m in masters if m.dim() > 1], "weight_decay": 0.1},
            {"params": [m for m in masters if m.dim() <= 1], "weight_decay": 0.0},
        ],
        lr=1e-2,
        eps=cfg.adam_eps,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        foreach=False,
    )
    scale = min(1.0, 1.0 / (4.0 + 1e-6))
    for _ in range(3):
        # a step's reduced gradients, as a backward leaves them in the buffers
        for p in params:
            p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        reduced = [p.main_grad.clone() for p in params]
        opt.step(1e-2, grad_norm=4.0)  # scale 1 / 4
        for m, g in zip(masters, reduced):
            m.grad = g.float() * scale
        ref.step()
        # fp32 gradients are clipped in place (no copy); low-precision ones are widened first
        want = [g * scale if grad_dtype == torch.float32 else g for g in reduced]
        assert all(torch.equal(p.main_grad, w) for p, w in zip(params, want))
    assert all(torch.equal(s.master, m) for s, m in zip(opt.slots, masters))
    assert all(torch.equal(p, m.to(param_dtype)) for p, m in zip(params, masters))


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _clipped_step(impl: dict[str, bool], monkeypatch) -> tuple[list[str], list[torch.Tensor]]:
    """One clipped step (scale 1/4) of fp32 parameters with torch's `impl` path: (the aten ops the
    step ran, the updated parameters)."""
    monkeypatch.setattr(adam_mod, "multi_tensor_impl", lambda params: impl)
    gen = torch.Generator().manual_seed(3)
    params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(4, 3), (5,)]]
    for p in params:
        p.main_grad = torch.randn(p.shape, generator=gen)
    opt = MixedPrecisionAdam.for_params(params, OptimizerConfig(lr=1e-2, clip_grad=1.0))
    with _Ops() as ops:
        opt.step(1e-2, grad_norm=4.0)
    return ops.names, [p.detach().clone() for p in params]


def test_clipping_makes_no_copy_of_fp32_gradients(monkeypatch):
    """Issue 47 item 11: with clip x unscale != 1 the fp32 gradients were multiplied into new
    tensors every step (an fp32 copy of every owned gradient shard). The foreach path scales them in
    place; fused AdamW takes the factor as its `grad_scale` (torch's CPU fused kernel stands in for
    CUDA's here) and runs no scaling op of ours at all; both give the same update."""
    foreach_ops, foreach = _clipped_step({"foreach": True}, monkeypatch)
    fused_ops, fused = _clipped_step({"fused": True}, monkeypatch)
    assert "aten._foreach_mul.Scalar" not in foreach_ops  # the out-of-place multiply
    assert "aten._foreach_mul_.Scalar" in foreach_ops
    assert not any(name.startswith("aten._foreach_mul") for name in fused_ops)
    assert not any("empty" in name for name in foreach_ops + fused_ops)
    for a, b in zip(foreach, fused):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
