"""`model.attention_backend`: the unfused kernel computes what SDPA computes, the rule picks the
kernel it documents, bad values are refused by name, and the choice is a decision in the "model"
section.

Tolerances: fp32, the same product summed in another order (two GEMMs and a softmax vs SDPA's
blocked online softmax): 1e-5 absolute on O(1) outputs and gradients (measured ~1e-6). bf16: both
round the probabilities to bf16 before `p v` at different points; 2e-2 absolute (measured 1.6e-2 at
worst over [1, 8, 256, 64], one bf16 ulp at 2-4).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlap.config import ConfigContainer
from overlap.config.mixed_precision import Precision
from overlap.config.model import ModelConfig
from overlap.errors import ConfigError
from overlap.kernels.attention import UNFUSED_MAX_SEQ, attention_kernel
from overlap.layers.attention import unfused_attention
from overlap.layout import ParallelLayout
from overlap.model import GPTModel
from overlap.parallel.state import ParallelState
from tests.configs import bare_kernels, bare_plan
from tests.world import run_world

FP32_ATOL = 1e-5
BF16_ATOL = 2e-2


def _qkv(heads: int, groups: int, seq: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, n, seq, 16, generator=gen).to(dtype).requires_grad_()
        for n in (heads, groups, groups)
    ]


@pytest.mark.parametrize("heads,groups", [(4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("seq", [1, 7, 64])
def test_unfused_equals_sdpa_fp32(heads: int, groups: int, seq: int) -> None:
    ours, ref = _qkv(heads, groups, seq, torch.float32), _qkv(heads, groups, seq, torch.float32)
    out = unfused_attention(*ours)
    expected = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=FP32_ATOL, rtol=0)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    out.backward(upstream)
    expected.backward(upstream)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, atol=FP32_ATOL, rtol=0)


def test_unfused_equals_sdpa_bf16() -> None:
    ours = _qkv(8, 4, 128, torch.bfloat16)
    out = unfused_attention(*ours)
    expected = F.scaled_dot_product_attention(*ours, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected.float()).abs().max().item() < BF16_ATOL


def test_unfused_is_causal() -> None:
    """A later key or value never reaches an earlier query: changing the last position changes only
    the last row."""
    q, k, v = (t.detach() for t in _qkv(4, 2, 10, torch.float32))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1] += 5.0
    v2[:, :, -1] -= 3.0
    a, b = unfused_attention(q, k, v), unfused_attention(q, k2, v2)
    assert torch.equal(a[:, :, :-1], b[:, :, :-1])
    assert not torch.allclose(a[:, :, -1], b[:, :, -1])


@pytest.mark.parametrize(
    "backend,on_cuda,dtype,seq,kernel",
    [
        ("auto", False, "bfloat16", 256, "unfused"),
        ("auto", False, "bfloat16", UNFUSED_MAX_SEQ, "unfused"),
        ("auto", False, "bfloat16", UNFUSED_MAX_SEQ + 1, "sdpa"),
        ("auto", False, "float32", 256, "sdpa"),
        ("auto", False, "float16", 256, "sdpa"),
        ("auto", True, "bfloat16", 256, "sdpa"),
        ("flash", False, "bfloat16", 256, "flash"),
        ("flash", True, "float32", 4096, "flash"),
        ("fused", True, "bfloat16", 4096, "fused"),
        ("unfused", True, "float32", 4096, "unfused"),
        ("local", False, "float32", 256, "unfused"),
    ],
)
def test_kernel_rule(backend: str, on_cuda: bool, dtype: str, seq: int, kernel: str) -> None:
    assert attention_kernel(backend, on_cuda, dtype, seq)[0] == kernel


def test_fused_on_cpu_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        attention_kernel("fused", False, "float32", 256)
    assert err.value.field == "model.attention_backend" and "CUDA" in str(err.value)


def test_unknown_backend_is_refused_at_finalize() -> None:
    cfg = ConfigContainer(model=ModelConfig(attention_backend="triton"))
    with pytest.raises(ConfigError) as err:
        cfg.finalize(1, device=lambda: None)
    assert err.value.field == "model.attention_backend" and "triton" in str(err.value)
    assert "unfused" in str(err.value)


@pytest.mark.parametrize(
    "backend,requested,effective",
    [("auto", None, "unfused"), ("flash", "flash", "flash"), ("local", "local", "local")],
)
def test_decision_in_model_section(backend: str, requested, effective) -> None:
    cfg = ConfigContainer(
        model=ModelConfig(attention_backend=backend, seq_length=256), mixed_precision="bf16_mixed"
    )
    res = cfg.finalize(1, device=lambda: None)
    (decision,) = [
        d for d in res.decisions.sections["model"] if d.field == "model.attention_backend"
    ]
    assert (decision.requested, decision.effective) == (requested, effective)
    if backend == "local":
        assert "unfused" in decision.reason
    assert "Model decisions" in res.decisions.format_sections()


def _model_backends(backends: list[str]) -> dict[str, dict]:
    """The tiny dense model's loss and gradients with each backend, same weights and tokens (rank
    side)."""
    ps = ParallelState(ParallelLayout(world_size=1))
    out = {}
    for backend in backends:
        config = ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=128,
            vocab_size=256,
            seq_length=32,
            qk_layernorm=True,
            init_method_std=0.1,
            attention_backend=backend,
            recompute_granularity="selective",
            recompute_modules=["core_attn"],
        )
        model = GPTModel(config, ps, bare_plan(), Precision.of(config), bare_kernels(config))
        model.init_weights(1234)
        data = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(7))
        loss, _ = model(data[:, :-1], data[:, 1:])
        loss.backward()
        out[backend] = {
            "loss": loss.item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        }
    return out


def test_model_backends_agree() -> None:
    """The whole model (selective recompute of the core attention included) trains the same through
    each kernel."""
    (res,) = run_world(1, _model_backends, ["flash", "unfused", "auto"])
    ref = res["flash"]
    for backend in ("unfused", "auto"):
        assert res[backend]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        for name, grad in res[backend]["grads"].items():
            torch.testing.assert_close(
                grad, ref["grads"][name], atol=FP32_ATOL, rtol=1e-4, msg=name
            )


def test_a_bare_models_kernels_refuse_an_unknown_backend() -> None:
    with pytest.raises(ConfigError) as err:
        bare_kernels(ModelConfig(attention_backend="xformers"))
    assert err.value.field == "model.attention_backend" and "xformers" in str(err.value)


@pytest.mark.parametrize("on_cuda, kernel", [(False, "unfused"), (True, "sdpa")])
def test_the_resolution_holds_the_kernel_the_layers_run(on_cuda: bool, kernel: str) -> None:
    """Decided once, for the run's device: `cfg.resolved.kernels` holds the kernel the layers run
    (`SelfAttention.attend` reads nothing else), and the model keeps what was asked."""
    cfg = ConfigContainer(
        model=ModelConfig(attention_backend="auto", seq_length=256), mixed_precision="bf16_mixed"
    )
    res = cfg.finalize(1, device=lambda: None, on_cuda=on_cuda)
    assert res.kernels.attention_backend == kernel and cfg.model.attention_backend == "auto"


def test_explain_names_the_kernel_per_target(capsys) -> None:
    """`explain` resolves for the target -g names: CPU bf16 at the tiny recipe's sequence is
    unfused, an H100 runs SDPA's own choice, and fused on CPU exits 2 with the field named (no
    traceback)."""
    from overlap.cli import main

    base = ["explain", "-m", "qwen", "-mr", "qwen3_moe_tiny", "-ng", "4", "-c", "bf16"]
    assert main([*base, "-g", "cpu"]) == 0
    out = capsys.readouterr().out
    assert any(
        line.startswith("model.attention_backend") and " unfused " in line
        for line in out.splitlines()
    )
    assert main([*base, "-g", "h100"]) == 0
    out = capsys.readouterr().out
    assert any(
        line.startswith("model.attention_backend") and " sdpa " in line for line in out.splitlines()
    )
    assert main([*base, "-g", "cpu", "model.attention_backend=fused"]) == 2
    err = capsys.readouterr().err
    assert "model.attention_backend='fused'" in err and "Traceback" not in err
