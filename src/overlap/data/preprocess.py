"""`overlap preprocess`: a JSON-lines corpus -> Megatron indexed dataset files, one document per
line and key.

Outputs `<output-prefix>_<key>_document.bin/.idx` (the reference's names), token ids in the smallest
dtype that holds the vocabulary (uint16 below 65500 tokens, else int32). A progress bar on a
terminal.

Each document ends with the end-of-document token by default (`--no-append-eod` leaves it out).
Megatron's tools/preprocess_data.py defaults to off (--append-eod opts in), but a GPT sample is cut
from the concatenated documents (gpt_dataset: across document boundaries), and without EOD the model
never sees where one document ends and the next, unrelated one begins. Megatron's own GPT data
examples pass --append-eod; forgetting it silently trains on run-together documents, so here it is
the default.

The files are written under temporary names beside the output and renamed only when every line is
tokenized: a bad line (not JSON, a missing key) or an interrupt leaves no `.bin` without its `.idx`,
and an older dataset under the same prefix stays as it was.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from overlap.errors import ConfigError
from overlap.files import fresh_name, is_no_space, no_space

EOD_HELP = (
    "end every document with the tokenizer's end-of-document token; on by default, unlike "
    "Megatron's preprocess_data.py, because GPT samples span document boundaries and EOD marks "
    "them (--no-append-eod leaves it out)"
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess", help="tokenize a JSON-lines corpus into Megatron .bin/.idx files"
    )
    p.add_argument("--input", required=True, help="JSON lines, one document per line")
    p.add_argument(
        "--json-keys", nargs="+", default=["text"], help="the fields to tokenize (one dataset each)"
    )
    p.add_argument(
        "--tokenizer-type", default="HuggingFaceTokenizer", choices=("HuggingFaceTokenizer",)
    )
    p.add_argument(
        "--tokenizer-model",
        "--tokenizer",
        dest="tokenizer_model",
        required=True,
        help="a tokenizer.json or its folder (--tokenizer is the same flag)",
    )
    p.add_argument("--output-prefix", required=True, help="write <prefix>_<key>_document.bin/.idx")
    p.add_argument(
        "--append-eod", action=argparse.BooleanOptionalAction, default=True, help=EOD_HELP
    )
    p.set_defaults(func=cmd_preprocess)


def preprocess(
    input_path: str,
    keys: list[str],
    tokenizer_model: str,
    output_prefix: str,
    append_eod: bool = True,
    progress: bool = False,
) -> dict[str, dict[str, int]]:
    """Tokenize; return per key {documents, tokens} and write the files (all of them, or none: see
    the module)."""
    from overlap.data.indexed import IndexedDatasetWriter, optimal_dtype
    from overlap.data.tokenizer import HFTokenizer

    source = Path(input_path)
    if not source.is_file():
        raise ConfigError(
            "--input", input_path, "the corpus file does not exist.", "give a JSON-lines file."
        )
    tok = HFTokenizer(tokenizer_model, field="--tokenizer-model")
    folder = Path(output_prefix).expanduser().parent
    if not folder.is_dir():
        raise ConfigError(
            "--output-prefix",
            output_prefix,
            f"the folder {folder} does not exist.",
            f"create it first (mkdir -p {folder}).",
        )
    keys = list(dict.fromkeys(keys))  # a key given twice is one dataset (not its documents twice)
    finals = {key: Path(f"{output_prefix}_{key}_document").expanduser() for key in keys}
    # fresh hidden names beside the outputs (nothing planted there can redirect the writes), each
    # renamed onto its output only when everything is written
    temps = {key: fresh_name(final) for key, final in finals.items()}
    writers: dict[str, IndexedDatasetWriter] = {}
    counts = {key: {"documents": 0, "tokens": 0} for key in keys}
    total = source.stat().st_size
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=True)
        bar.start()
        task = bar.add_task("tokenizing", total=total)
    try:
        for key in keys:
            writers[key] = IndexedDatasetWriter(temps[key], optimal_dtype(tok.vocab_size))
        with open(source, "rb") as f:
            for number, line in enumerate(f, 1):
                if bar is not None:
                    bar.update(task, advance=len(line))
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(
                        "--input",
                        input_path,
                        f"line {number} is not JSON ({exc.msg}).",
                        "give one JSON object per line.",
                    ) from None
                if not isinstance(doc, dict):
                    raise ConfigError(
                        "--input",
                        input_path,
                        f"line {number} is a JSON {type(doc).__name__}, not an object.",
                        'give one JSON object per line ({"text": "..."}).',
                    )
                for key in keys:
                    if key not in doc or not isinstance(doc[key], str):
                        raise ConfigError(
                            "--json-keys",
                            key,
                            f"line {number} has no string field {key!r}.",
                            f"name fields every line has (line {number} has {sorted(doc)}).",
                        )
                    ids = tok.encode(doc[key]) + ([tok.eod] if append_eod else [])
                    writers[key].add_document(ids)
                    counts[key]["documents"] += 1
                    counts[key]["tokens"] += len(ids)
        for w in writers.values():
            w.finalize()
        for key in keys:
            for suffix in (".bin", ".idx"):
                os.replace(f"{temps[key]}{suffix}", f"{finals[key]}{suffix}")
    except BaseException as exc:
        for key, w in writers.items():
            try:
                w.bin.close()  # on a full disk closing flushes, and fails again
            except OSError:
                pass
            for suffix in (".bin", ".idx"):
                Path(f"{temps[key]}{suffix}").unlink(missing_ok=True)
        if isinstance(exc, OSError) and is_no_space(exc):
            raise no_space(
                folder,
                f"writing {', '.join(f'{f}.bin/.idx' for f in finals.values())} failed",
                "nothing was written (the partial files were removed) and an earlier dataset "
                "under that prefix is as it was.",
            ) from None
        raise
    finally:
        if bar is not None:
            bar.stop()
    return counts


def cmd_preprocess(args: argparse.Namespace) -> int:
    import sys

    counts = preprocess(
        args.input,
        args.json_keys,
        args.tokenizer_model,
        args.output_prefix,
        args.append_eod,
        progress=sys.stderr.isatty(),
    )
    for key, c in counts.items():
        print(
            f"{args.output_prefix}_{key}_document: {c['documents']} documents, {c['tokens']} tokens"
        )
    return 0
