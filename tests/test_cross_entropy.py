"""The chunked cross-entropy (`overlap.layers.cross_entropy`) equals torch's on one rank, across
chunk boundaries (a chunk a few rows wide, the last one short), for fp32 logits (whose gradient is
made in place, no buffer) and bf16 logits (an fp32 buffer per chunk, the statistics in fp32). The
vocabulary-parallel form is tested against torch in tests/test_model_tp.py."""

import pytest
import torch
import torch.nn.functional as F

from overlap.layers import cross_entropy as ce


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("chunk_rows", [1, 3, 64], ids=["row", "short-last", "one-chunk"])
def test_chunked_cross_entropy_is_torchs(monkeypatch, dtype, tol, chunk_rows):
    vocab = 37
    monkeypatch.setattr(ce, "CHUNK_BYTES", 4 * vocab * chunk_rows)
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(2, 5, vocab, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (2, 5), generator=gen)
    weights = torch.rand(2, 5, generator=gen)
    loss = ce.cross_entropy(logits, labels)
    (loss * weights).sum().backward()
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 5)
    (ref * weights).sum().backward()
    assert loss.dtype == torch.float32 and logits.grad.dtype == dtype
    torch.testing.assert_close(loss, ref, rtol=tol, atol=tol)
    # bf16: the gradient is rounded once, from the fp32 softmax
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=tol, atol=tol)
