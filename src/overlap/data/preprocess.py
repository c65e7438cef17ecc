"""`overlap preprocess`: a JSON-lines corpus -> Megatron indexed dataset files, one document per line and key.

Outputs `<output-prefix>_<key>_document.bin/.idx` (the reference's names), token ids in the smallest dtype that holds
the vocabulary (uint16 below 65500 tokens, else int32), each document followed by the end-of-document token with
`--append-eod` (what GPT pretraining wants: documents are concatenated into samples). A progress bar on a terminal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from overlap.errors import ConfigError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preprocess", help="tokenize a JSON-lines corpus into Megatron .bin/.idx files")
    p.add_argument("--input", required=True, help="JSON lines, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="the fields to tokenize (one dataset each)")
    p.add_argument("--tokenizer-type", default="HuggingFaceTokenizer", choices=("HuggingFaceTokenizer",))
    p.add_argument("--tokenizer-model", required=True, help="a tokenizer.json or its folder")
    p.add_argument("--output-prefix", required=True, help="write <prefix>_<key>_document.bin/.idx")
    p.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document token")
    p.set_defaults(func=cmd_preprocess)


def preprocess(input_path: str, keys: list[str], tokenizer_model: str, output_prefix: str, append_eod: bool,
               progress: bool = False) -> dict[str, dict[str, int]]:
    """Tokenize; return per key {documents, tokens} and write the files."""
    from overlap.data.indexed import IndexedDatasetWriter, optimal_dtype
    from overlap.data.tokenizer import HFTokenizer
    source = Path(input_path)
    if not source.is_file():
        raise ConfigError("--input", input_path, "the corpus file does not exist.", "give a JSON-lines file.")
    tok = HFTokenizer(tokenizer_model, field="--tokenizer-model")
    folder = Path(output_prefix).expanduser().parent
    if not folder.is_dir():
        raise ConfigError("--output-prefix", output_prefix, f"the folder {folder} does not exist.",
                          f"create it first (mkdir -p {folder}).")
    writers = {key: IndexedDatasetWriter(f"{output_prefix}_{key}_document", optimal_dtype(tok.vocab_size))
               for key in keys}
    counts = {key: {"documents": 0, "tokens": 0} for key in keys}
    total = source.stat().st_size
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("tokenizing", total=total)
    try:
        with open(source, "rb") as f:
            for number, line in enumerate(f, 1):
                if bar is not None:
                    bar.update(task, advance=len(line))
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError("--input", input_path, f"line {number} is not JSON ({exc.msg}).",
                                      "give one JSON object per line.") from None
                for key in keys:
                    if key not in doc or not isinstance(doc[key], str):
                        raise ConfigError("--json-keys", key, f"line {number} has no string field {key!r}.",
                                          f"name fields every line has (line {number} has {sorted(doc)}).")
                    ids = tok.encode(doc[key]) + ([tok.eod] if append_eod else [])
                    writers[key].add_document(ids)
                    counts[key]["documents"] += 1
                    counts[key]["tokens"] += len(ids)
    finally:
        if bar is not None:
            bar.stop()
    for w in writers.values():
        w.finalize()
    return counts


def cmd_preprocess(args: argparse.Namespace) -> int:
    import sys

    counts = preprocess(args.input, args.json_keys, args.tokenizer_model, args.output_prefix, args.append_eod,
                        progress=sys.stderr.isatty())
    for key, c in counts.items():
        print(f"{args.output_prefix}_{key}_document: {c['documents']} documents, {c['tokens']} tokens")
    return 0
