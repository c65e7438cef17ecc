"""`tokenizer.tokenizer_type=HuggingFaceTokenizer`: a `tokenizer.json` (or a folder holding one)
through the `tokenizers` library, the end-of-document id from the folder's `tokenizer_config.json`
(its `eos_token`) or the usual names, and Megatron's vocabulary padding."""

from __future__ import annotations

import json
import math
from pathlib import Path

from overlap.errors import ConfigError

EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")


class HFTokenizer:
    def __init__(self, path: str | Path, field: str = "tokenizer.tokenizer_model") -> None:
        from tokenizers import Tokenizer

        path = Path(path).expanduser()
        folder = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(
                field,
                str(path),
                f"{file} does not exist.",
                "give a tokenizer.json file or the folder of a Hugging Face tokenizer.",
            )
        try:
            self.tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises its own exception types for unreadable files
            raise ConfigError(
                field,
                str(file),
                f"the tokenizer cannot be read ({exc}).",
                "give a tokenizer.json written by the tokenizers library.",
            ) from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eod = self._eod(folder, field, str(path))

    def _eod(self, folder: Path, field: str, shown: str) -> int:
        names: list[str] = []
        config = folder / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except (OSError, ValueError, AttributeError):
                raise ConfigError(
                    field,
                    str(config),
                    "tokenizer_config.json is not a readable JSON object.",
                    "fix or remove the file (the end-of-document token is then found by name).",
                ) from None
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.append(eos)
        for name in [*names, *EOD_NAMES]:
            token = self.tok.token_to_id(name)
            if token is not None:
                return token
        raise ConfigError(
            field,
            shown,
            "no end-of-document token found (no eos_token in tokenizer_config.json and "
            f"none of {', '.join(EOD_NAMES)} in the vocabulary).",
            "use a tokenizer with an end-of-text token, or add one.",
        )

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the embedding rows are rounded up to a multiple of divisible_by x TP, so
    every TP shard of the vocabulary has the same size (and a GEMM-friendly one)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab / multiple) * multiple)
