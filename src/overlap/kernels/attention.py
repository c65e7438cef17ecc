"""`model.attention_backend`: which kernel computes the attention product, Megatron-Core's field and
values.

Megatron's `AttnBackend`: `flash` and `fused` are Transformer Engine's kernels, `unfused` and
`local` Megatron's own matmul-softmax-matmul, `auto` lets the runtime choose. Here the kernels are
PyTorch's:
- `flash`: `scaled_dot_product_attention` restricted to its flash kernel (CUDA and CPU);
- `fused`: SDPA restricted to its memory-efficient and cuDNN kernels (CUDA only: PyTorch has neither
  on CPU);
- `unfused` (and `local`, the same thing under Megatron's other name): our own scaled `q k^T`,
  causal mask, softmax in fp32, `p v` - two batched GEMMs that keep the `[s, s]` scores;
- `auto`: SDPA with PyTorch's own choice, except on CPU in bf16 at sequences up to `UNFUSED_MAX_SEQ`
  where it is `unfused`. PyTorch's CPU flash kernel's backward is the slow half there: in the model
  at hidden 512, sequence 256, the unfused product made the whole bf16 step 13-15% faster
  (`bench/hf_compute_bench.py --attention-backends auto,flash`, results in
  `bench/results/hf_compute.md`), while in fp32 the two are within noise and at long sequences flash
  wins by 2x and more (the scores grow with s^2). fp16 on CPU stays on flash: its unfused GEMMs are
  slower still.

The resolution decides once for the device the run uses, in its precision at its sequence length
(`choices`): one decision (requested, effective kernel, why), and the kernel kept as
`Kernels.attention_backend`, which the layer runs (a dry run's stand-in tensors take the
fused kernels' memory, `overlap.layers.attention.fused_attention_on_meta`).
"""

from __future__ import annotations

from typing import Any

from overlap.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
UNFUSED_MAX_SEQ = 512


def check_attention_backend(backend: Any) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            "model.attention_backend",
            backend,
            "unknown attention backend.",
            f"use one of {', '.join(ATTENTION_BACKENDS)} (Megatron-Core's AttnBackend names).",
        )


def attention_kernel(
    backend: str, on_cuda: bool, params_dtype: str, seq_length: int
) -> tuple[str, str]:
    """The kernel `backend` runs on this device, and why: "flash", "fused", "unfused", or "sdpa"
    (PyTorch's own choice among its SDPA kernels)."""
    check_attention_backend(backend)
    if backend == "local":
        return (
            "unfused",
            "Megatron's local core attention is the unfused one: matmul, softmax in fp32, matmul",
        )
    if backend == "fused" and not on_cuda:
        raise ConfigError(
            "model.attention_backend",
            backend,
            "the fused (memory-efficient / cuDNN) SDPA kernels exist only on CUDA; this run is on "
            "CPU.",
            "use model.attention_backend=auto, flash or unfused.",
        )
    if backend != "auto":
        return backend, "as asked"
    if on_cuda:
        return (
            "sdpa",
            "CUDA: PyTorch's scaled_dot_product_attention picks among flash, memory-efficient and "
            "cuDNN",
        )
    if params_dtype == "bfloat16" and seq_length <= UNFUSED_MAX_SEQ:
        return "unfused", (
            f"CPU, bf16, sequence {seq_length} <= {UNFUSED_MAX_SEQ}: PyTorch's CPU flash kernel's "
            "backward is slower than two batched GEMMs there (bench/results/hf_compute.md)"
        )
    return "sdpa", (
        f"CPU, {params_dtype}, sequence {seq_length}: PyTorch's scaled_dot_product_attention "
        "(its flash kernel)"
    )
