"""A word-level Hugging Face tokenizer trained on a small grammar's sentences, with
`<|endoftext|>` as its EOS (named in its `tokenizer_config.json`): the tokenizer of the data and
preprocess tests."""

from __future__ import annotations

import json
import random
from pathlib import Path


def corpus(n: int, seed: int = 0) -> list[str]:
    """Sentences from a small grammar (the file-format, padding and layout tests' data; the learning
    test reads real text, `stdlib_corpus`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        subject = (
            f"{rng.choice(['the', 'a'])} {rng.choice(['small', 'big', 'red'])} "
            f"{rng.choice(['cat', 'dog', 'bird'])}"
        )
        verb = rng.choice(["sat", "ran", "flew"])
        place = f"{rng.choice(['on', 'under', 'over'])} the {rng.choice(['mat', 'tree', 'house'])}"
        out.append(f"{subject} {verb} {place} and then slept.")
    return out


def save_word_tokenizer(folder: Path) -> Path:
    """Train the tokenizer on 200 `corpus` sentences and save it (`tokenizer.json`,
    `tokenizer_config.json`) into `folder`; returns `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        corpus(200), trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"])
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder
