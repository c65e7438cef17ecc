"""Megatron's indexed dataset: token ids in `<prefix>.bin`, their index in `<prefix>.idx`, byte for
byte the reference's layout (Megatron-Core `datasets/indexed_dataset.py`), so files written here are
read by Megatron's reader and the other way round.

`.idx`, little-endian: magic `MMIDIDX\\x00\\x00` (9 bytes), version `<Q` = 1, dtype code `<B`,
sequence count S `<Q`, document count D `<Q` (a 34-byte header), then sequence lengths int32[S],
sequence byte offsets into `.bin` int64[S], document indices int64[D] (starting with 0; each
finished document appends the number of sequences so far). We write one sequence per document (no
sentence splitting), so the document indices are 0..S.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from overlap.errors import ConfigError
from overlap.files import create_exclusive

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's choice: uint16 below 65500 tokens, else int32 (the Qwen vocabulary, 151936, needs
    int32)."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Append documents (token id sequences) to `<prefix>.bin`; `finalize()` writes
    `<prefix>.idx`."""

    def __init__(self, prefix: str | Path, dtype: type) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        # new files only (O_EXCL, no link followed): the caller gives fresh names
        self.bin = create_exclusive(f"{self.prefix}.bin", binary=True)
        self.lengths: list[int] = []
        self.doc_index: list[int] = [0]

    def add_document(self, tokens) -> None:
        array = np.asarray(tokens, dtype=self.dtype)
        self.bin.write(array.tobytes(order="C"))
        self.lengths.append(array.size)
        self.doc_index.append(len(self.lengths))

    def finalize(self) -> None:
        self.bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        with create_exclusive(f"{self.prefix}.idx", binary=True) as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype.type]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.doc_index)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.doc_index, dtype=np.int64).tobytes(order="C"))


class IndexedDataset:
    """Read-only view of `<prefix>.bin/.idx` (memory-mapped: only the tokens a sample touches are
    read)."""

    def __init__(self, prefix: str | Path, field: str = "dataset.blend") -> None:
        self.prefix = str(prefix)
        idx, binary = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
        for path in (idx, binary):
            if not path.is_file():
                raise ConfigError(
                    field,
                    self.prefix,
                    f"{path} does not exist.",
                    "give the prefix written by `overlap preprocess` (without .bin/.idx), e.g. "
                    "data/corpus_text_document.",
                )
        raw = idx.read_bytes()
        if len(raw) < 34 or raw[:9] != MAGIC:
            raise ConfigError(
                field,
                self.prefix,
                f"{idx} is not a Megatron indexed-dataset index (bad magic).",
                "rewrite it with `overlap preprocess`.",
            )
        (version,) = struct.unpack_from("<Q", raw, 9)
        (code,) = struct.unpack_from("<B", raw, 17)
        count, docs = struct.unpack_from("<QQ", raw, 18)
        if version != VERSION or code not in CODE_DTYPES:
            raise ConfigError(
                field,
                self.prefix,
                f"{idx}: version {version}, dtype code {code} are not readable here.",
                "rewrite it with `overlap preprocess`.",
            )
        self.dtype = np.dtype(CODE_DTYPES[code])
        need = 34 + count * 4 + count * 8 + docs * 8
        if len(raw) < need:
            raise ConfigError(
                field,
                self.prefix,
                f"{idx} is truncated ({len(raw)} of {need} bytes).",
                "rewrite it with `overlap preprocess`.",
            )
        offset = 34
        self.lengths = np.frombuffer(raw, np.int32, count, offset)
        offset += count * 4
        self.pointers = np.frombuffer(raw, np.int64, count, offset)
        offset += count * 8
        self.doc_index = np.frombuffer(raw, np.int64, docs, offset)
        total = int(self.lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if binary.stat().st_size < total:
            raise ConfigError(
                field,
                self.prefix,
                f"{binary} is truncated ({binary.stat().st_size} of {total} bytes).",
                "rewrite it with `overlap preprocess`.",
            )
        self.tokens = (
            np.memmap(binary, dtype=self.dtype, mode="r") if total else np.zeros(0, self.dtype)
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, i: int, start: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [start, start + length) of sequence i."""
        first = int(self.pointers[i]) // self.dtype.itemsize + start
        n = int(self.lengths[i]) - start if length is None else length
        return np.asarray(self.tokens[first : first + n])
