"""`overlap preprocess` as a user runs it (in-process through `overlap.cli.main`): all files or
none, the `--tokenizer` spelling, and the end-of-document token on by default (`--no-append-eod` to
leave it out).

The tokenizer is tests/word_tokenizer.py's word-level one, as in tests/test_data.py (its
`tokenizer_config.json` names `<|endoftext|>` as EOS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from overlap.cli import main
from overlap.data.indexed import IndexedDataset
from tests.word_tokenizer import save_word_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_word_tokenizer(tmp_path_factory.mktemp("tok"))


TEXTS = ["the cat sat on the mat", "a dog ran", "the red bird flew over the house and then slept."]


def _corpus(folder: Path, lines: list[str]) -> Path:
    path = folder / "corpus.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _good(folder: Path) -> Path:
    return _corpus(folder, [json.dumps({"text": t, "title": t.split()[1]}) for t in TEXTS])


def _run(
    source: Path, prefix: Path, tokenizer: Path, *extra: str, keys: tuple[str, ...] = ("text",)
) -> int:
    return main(
        [
            "preprocess",
            "--input",
            str(source),
            "--json-keys",
            *keys,
            "--tokenizer-model",
            str(tokenizer),
            "--output-prefix",
            str(prefix),
            *extra,
        ]
    )


def _documents(prefix: Path) -> list[list[int]]:
    data = IndexedDataset(prefix)
    return [data.document(i).tolist() for i in range(len(data))]


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "bad,flag,why",
    [
        (json.dumps({"id": 2}), "--json-keys='text'", "line 2 has no string"),
        ("{not json", "--input=", "line 2 is not JSON"),
        ("[1, 2]", "--input=", "line 2 is a JSON list, not an object"),
    ],
)
def test_a_bad_line_leaves_no_output_files(tmp_path, tokenizer_dir, capsys, bad, flag, why):
    source = _corpus(
        tmp_path, [json.dumps({"text": TEXTS[0]}), bad, json.dumps({"text": TEXTS[1]})]
    )
    assert _run(source, tmp_path / "P", tokenizer_dir) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"overlap: error: {flag}") and why in err and "Traceback" not in err, err
    assert _files(tmp_path) == ["corpus.jsonl"]  # no .bin without .idx, no temporary file


def test_a_failed_rerun_keeps_the_earlier_dataset(tmp_path, tokenizer_dir, capsys):
    """Both keys' datasets from a good run stay byte for byte when a rerun under the same prefix
    fails on line 3 (the first key's files were complete by then: all or nothing, not per key)."""
    assert _run(_good(tmp_path), tmp_path / "P", tokenizer_dir, keys=("text", "title")) == 0
    before = {
        name: (tmp_path / name).read_bytes() for name in _files(tmp_path) if name.startswith("P_")
    }
    assert sorted(before) == [
        "P_text_document.bin",
        "P_text_document.idx",
        "P_title_document.bin",
        "P_title_document.idx",
    ]
    lines = [json.dumps({"text": t, "title": "x"}) for t in TEXTS[:2]] + [
        json.dumps({"text": TEXTS[2]})
    ]
    assert (
        _run(_corpus(tmp_path, lines), tmp_path / "P", tokenizer_dir, keys=("text", "title")) == 2
    )
    assert "line 3 has no string field 'title'" in capsys.readouterr().err
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert _files(tmp_path) == sorted([*before, "corpus.jsonl"])


def test_an_interrupt_leaves_no_output_files(tmp_path, tokenizer_dir, monkeypatch):
    from overlap.data import tokenizer
    from overlap.data.preprocess import preprocess

    encode, calls = tokenizer.HFTokenizer.encode, []

    def interrupted(self, text: str) -> list[int]:
        calls.append(text)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return encode(self, text)

    monkeypatch.setattr(tokenizer.HFTokenizer, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        preprocess(str(_good(tmp_path)), ["text"], str(tokenizer_dir), str(tmp_path / "P"))
    assert _files(tmp_path) == ["corpus.jsonl"]


def test_tokenizer_is_the_same_flag_as_tokenizer_model(tmp_path, tokenizer_dir, capsys):
    source = _good(tmp_path)
    assert _run(source, tmp_path / "A", tokenizer_dir) == 0
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(source),
                "--tokenizer",
                str(tokenizer_dir),
                "--output-prefix",
                str(tmp_path / "B"),
            ]
        )
        == 0
    )
    for suffix in (".bin", ".idx"):
        ours, theirs = (tmp_path / f"{p}_text_document{suffix}" for p in "BA")
        assert ours.read_bytes() == theirs.read_bytes()
    capsys.readouterr()
    assert (
        main(
            [
                "preprocess",
                "--input",
                str(source),
                "--tokenizer",
                str(tokenizer_dir),
                "--tokenizer-model",
                str(tmp_path),
                "--output-prefix",
                str(tmp_path / "C"),
            ]
        )
        == 2
    )
    assert "given twice with different values" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,eod", [((), True), (("--append-eod",), True), (("--no-append-eod",), False)]
)
def test_documents_end_with_eod_by_default(tmp_path, tokenizer_dir, capsys, flags, eod):
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    end = tok.token_to_id("<|endoftext|>")
    expected = [tok.encode(t, add_special_tokens=False).ids + ([end] if eod else []) for t in TEXTS]
    assert all(end not in doc[:-1] for doc in expected) and end is not None
    assert _run(_good(tmp_path), tmp_path / "P", tokenizer_dir, *flags) == 0
    assert _documents(tmp_path / "P_text_document") == expected
    # the concatenation GPT samples are cut from
    stream = (tmp_path / "P_text_document.bin").read_bytes()
    assert stream == b"".join(int(i).to_bytes(2, "little") for doc in expected for i in doc)
    assert f"3 documents, {sum(map(len, expected))} tokens" in capsys.readouterr().out


def test_help_says_eod_is_on_and_why(capsys):
    with pytest.raises(SystemExit):
        main(["preprocess", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--append-eod, --no-append-eod" in help_text
    assert (
        "on by default, unlike Megatron's preprocess_data.py, because GPT samples span document"
        in help_text
    )


def test_a_key_given_twice_is_one_dataset(tmp_path, tokenizer_dir):
    assert _run(_good(tmp_path), tmp_path / "P", tokenizer_dir, keys=("text", "text")) == 0
    assert len(_documents(tmp_path / "P_text_document")) == len(TEXTS)


def test_a_full_disk_is_one_line_and_leaves_no_file(tmp_path, tokenizer_dir, capsys):
    from tests.small_disk import small_disk

    source = _corpus(tmp_path, [json.dumps({"text": t}) for t in TEXTS * 4000])
    with small_disk(tmp_path / "disk", "64k") as disk:
        code = _run(source, disk / "corpus", tokenizer_dir)
        left = _files(disk)
    err = capsys.readouterr().err
    assert code == 1 and left == [], (code, left, err[-2000:])
    assert err.startswith("overlap: error: no space left on device: writing ")
    assert len(err.strip().splitlines()) == 1 and "bytes free in" in err
