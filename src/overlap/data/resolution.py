"""What a run's data decides at finalize, recorded in the decision table's "data" section: the
vocabulary a Hugging Face tokenizer gives the model (padded as Megatron pads it, or a pretrained
folder's own embedding rows) and, per file of the dataset blend, what the training split holds
(checked now, not at the first step). `ConfigContainer.finalize` calls both."""

from __future__ import annotations

import math
from typing import Any

from overlap.data.gpt_dataset import parse_blend, split_ranges
from overlap.data.indexed import IndexedDataset
from overlap.data.tokenizer import HFTokenizer, padded_vocab_size
from overlap.decisions import DEFAULT, RULE, USER, DecisionLog
from overlap.errors import check_rules


def tokenizer_vocab(
    tokenizer_model: str, divisible_by: int, tp: int, hf_vocab: int | None, decisions: DecisionLog
) -> int:
    """The model's vocabulary under the Hugging Face tokenizer `tokenizer_model`: its tokens padded
    to a multiple of `divisible_by` x `tp` (model.make_vocab_size_divisible_by, as Megatron), or a
    pretrained folder's `hf_vocab` embedding rows, which must hold every token."""
    hf = HFTokenizer(tokenizer_model)
    check_rules(
        [
            (
                "model.make_vocab_size_divisible_by",
                divisible_by,
                divisible_by >= 1,
                "it must be positive.",
                "use 128 (Megatron's default).",
            ),
            (
                "tokenizer.tokenizer_model",
                tokenizer_model,
                hf_vocab is None or hf_vocab >= hf.vocab_size,
                f"this tokenizer has {hf.vocab_size} tokens, but the pretrained "
                f"checkpoint's embedding has {hf_vocab} rows (its config.json): larger "
                "token ids have no embedding.",
                "use the checkpoint's own tokenizer.",
            ),
        ]
    )
    tokens = f"the tokenizer's {hf.vocab_size} tokens"
    if hf_vocab is not None:
        # A released checkpoint's embedding has its own (already padded) rows: Qwen3's 151936 for
        # the tokenizer's 151669 tokens. Padding the tokenizer's count again would not match its
        # weights.
        vocab = hf_vocab
        why = f"the pretrained checkpoint's vocabulary (its config.json), which holds {tokens}"
    else:
        vocab = padded_vocab_size(hf.vocab_size, divisible_by, tp)
        why = (
            f"{tokens} padded to a multiple of make_vocab_size_divisible_by x TP = "
            f"{divisible_by} x {tp}"
        )
    decisions.record_in(
        "data", "model.vocab_size", None, vocab, RULE, f"{why}; end of document = token {hf.eod}"
    )
    return vocab


def record_blend(
    blend: list[Any] | str | None, split: str, seed: int, vocab_size: int, decisions: DecisionLog
) -> None:
    """The dataset blend's files (dataset.blend, split, random_seed), opened now: each file's
    share of the training split; none set is mock data, said with the loss it cannot beat."""
    if blend is None:
        decisions.record_in(
            "data",
            "dataset.blend",
            None,
            None,
            DEFAULT,
            "not set: mock data (random tokens from the seed; the loss cannot fall below "
            f"ln(vocab) = {math.log(vocab_size):.2f})",
        )
        return
    prefixes, weights = parse_blend(blend)
    share = sum(weights)
    for prefix, weight in zip(prefixes, weights):
        files = IndexedDataset(prefix)
        start, end = split_ranges(split, len(files))[0]
        tokens = int(files.lengths[start:end].sum())
        decisions.record_in(
            "data",
            "dataset.blend",
            prefix,
            prefix,
            USER,
            f"weight {weight / share:.3f}: {end - start} of {len(files)} documents in the "
            f"training split ({split}), {tokens:,} tokens ({files.dtype.name}); shuffled "
            f"with seed {seed}",
        )
