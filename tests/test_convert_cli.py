"""`overlap convert import | export | roundtrip` as a user runs them (in-process through
`overlap.cli.main`).

- roundtrip fails (exit 1, the tensor named) when the export really differs from the source by one
  ulp in one tensor or lacks one: the comparison is not a formality;
- import then export as two commands: transformers loads the exported folder (no missing or
  unexpected keys) and computes bit-identical fp32 logits to the source model's, for a tiny Qwen3
  and Qwen3-MoE, and the files hold exactly the source's per-expert tensor names;
- a sharded `save_pretrained` folder (index + several shards) imports and round-trips bit-exactly;
- a bad --hf / --load / --out / --work is a one-paragraph error naming that flag (not the `overlap
  run` setting the shared loaders name), with exit 2 and no traceback, and leaves no output folder
  behind.
The models are the anchor test's tiny random ones (tests/hf_models.py: hidden 32, 2 layers, 4
experts).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from overlap import convert
from overlap.cli import main
from overlap.errors import CheckpointError
from tests.hf_models import anchor_batch, save_reference_model

transformers = pytest.importorskip("transformers")

EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """kind -> (save_pretrained folder, the source model's fp32 logits on the anchor batch)."""
    out = {}
    for kind in ("moe", "dense", "dense_tied"):
        folder = tmp_path_factory.mktemp(f"hf_{kind}")
        out[kind] = (folder, save_reference_model(kind, folder)["logits"])
    return out


@pytest.fixture(scope="module")
def imported(hf_models, tmp_path_factory) -> Path:
    """The MoE model imported once (a checkpoint base folder), for the tests that damage a copy of
    it."""
    base = tmp_path_factory.mktemp("imported") / "ckpt"
    convert.import_hf(hf_models["moe"][0], base)
    return base


def _names(folder: Path) -> set[str]:
    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


def _one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    """`t` with its first element moved to the next representable float above it."""
    flat = t.flatten().clone()
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=t.dtype))
    return flat.view_as(t)


def _reference_bits(folder: Path, name: str) -> torch.Tensor:
    """The source file's tensor `name` as its float32 bit patterns (int64, so that differences do
    not wrap)."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name).view(torch.int32).long()


@pytest.mark.parametrize(
    "name,change", [(EXPERT, "ulp"), ("model.norm.weight", "ulp"), (EXPERT, "drop")]
)
def test_roundtrip_fails_and_names_the_tensor_that_differs(
    hf_models, tmp_path, monkeypatch, capsys, name, change
):
    folder, _ = hf_models["moe"]
    original = convert.write_sharded

    def damaged(target: Path, tensors: dict[str, torch.Tensor], *args, **kwargs) -> list[str]:
        tensors = dict(tensors)
        if change == "drop":
            del tensors[name]
        else:
            tensors[name] = _one_ulp_up(tensors[name])
            bits = (tensors[name].view(torch.int32).long() - _reference_bits(folder, name)).abs()
            assert bits.sum().item() == 1  # exactly one element, one ulp apart
        return original(target, tensors, *args, **kwargs)

    monkeypatch.setattr(convert, "write_sharded", damaged)
    assert main(["convert", "roundtrip", "--hf", str(folder), "--work", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1 difference(s)" in out and "bit-identical" not in out
    expected = f"{name}: values differ" if change == "ulp" else f"only in {folder}: {name}"
    assert expected in out


@pytest.mark.parametrize("kind", ["dense", "moe", "dense_tied"])
def test_import_then_export_commands_give_transformers_the_same_logits(
    hf_models, tmp_path, capsys, kind
):
    folder, logits = hf_models[kind]
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    assert main(["convert", "import", "--hf", str(folder), "--out", str(ckpt)]) == 0
    assert main(["convert", "export", "--load", str(ckpt), "--hf", str(exported)]) == 0
    assert f"exported {ckpt} -> {exported}" in capsys.readouterr().out
    assert _names(exported) == _names(folder)  # per-expert names, as save_pretrained wrote them
    if kind == "moe":
        assert EXPERT in _names(exported) and not any("gate_up_proj" in n for n in _names(exported))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if kind == "moe" else "Qwen3ForCausalLM")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        got = model(input_ids=anchor_batch()[0]).logits
    assert torch.equal(got, logits)


def test_sharded_folder_imports_and_roundtrips_bit_exact(hf_models, tmp_path, capsys):
    source, logits = hf_models["moe"]
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(source).save_pretrained(
        sharded, max_shard_size="20KB"
    )
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (sharded / "model.safetensors").exists() and len(set(index.values())) >= 3
    assert (
        main(["convert", "roundtrip", "--hf", str(sharded), "--work", str(tmp_path / "work")]) == 0
    )
    assert f"all {len(index)} tensors bit-identical" in capsys.readouterr().out
    # every shard's tensors went through the checkpoint
    assert _names(tmp_path / "work" / "hf") == set(index)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "work" / "hf", attn_implementation="eager"
    )
    with torch.no_grad():
        assert torch.equal(model(input_ids=anchor_batch()[0]).logits, logits)


def _corrupt_index(ckpt: Path) -> None:
    (ckpt / "iter_0000000" / ".metadata").write_bytes(b"garbage")


def _drop_shard(ckpt: Path) -> None:
    for shard in (ckpt / "iter_0000000").glob("*.distcp"):
        shard.unlink()


def _later_iteration(ckpt: Path) -> None:
    shutil.copytree(ckpt / "iter_0000000", ckpt / "iter_0000005")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5\n")


# (argv with {hf} the MoE folder, {ckpt} a damaged copy of its import, {tmp} a scratch folder; the
# damage; the flag the error must name; its value)
BAD = {
    "missing --hf (import)": (
        ["import", "--hf", "{tmp}/absent", "--out", "{tmp}/out"],
        None,
        "--hf",
        "{tmp}/absent",
    ),
    "missing --hf (roundtrip)": (
        ["roundtrip", "--hf", "{tmp}/absent"],
        None,
        "--hf",
        "{tmp}/absent",
    ),
    "--hf without weights": (
        ["import", "--hf", "{tmp}/config_only", "--out", "{tmp}/out"],
        None,
        "--hf",
        "{tmp}/config_only",
    ),
    "missing --load": (
        ["export", "--load", "{tmp}/absent", "--hf", "{tmp}/out"],
        None,
        "--load",
        "{tmp}/absent",
    ),
    "corrupt --load index": (
        ["export", "--load", "{ckpt}", "--hf", "{tmp}/out"],
        _corrupt_index,
        "--load",
        "{ckpt}/iter_0000000/.metadata",
    ),
    "--load shard missing": (
        ["export", "--load", "{ckpt}", "--hf", "{tmp}/out"],
        _drop_shard,
        "--load",
        "{ckpt}/iter_0000000/__0_0.distcp",
    ),
    "--out is a file": (
        ["import", "--hf", "{hf}", "--out", "{tmp}/file"],
        None,
        "--out",
        "{tmp}/file",
    ),
    "--out under a file": (
        ["import", "--hf", "{hf}", "--out", "{tmp}/file/out"],
        None,
        "--out",
        "{tmp}/file/out",
    ),
    "--out holds a run": (
        ["import", "--hf", "{hf}", "--out", "{ckpt}"],
        _later_iteration,
        "--out",
        "{ckpt}",
    ),
    "export --hf is a file": (
        ["export", "--load", "{ckpt}", "--hf", "{tmp}/file"],
        None,
        "--hf",
        "{tmp}/file",
    ),
    "export --hf holds weights": (
        ["export", "--load", "{ckpt}", "--hf", "{hf}"],
        None,
        "--hf",
        "{hf}",
    ),
    "--work is a file": (
        ["roundtrip", "--hf", "{hf}", "--work", "{tmp}/file"],
        None,
        "--work",
        "{tmp}/file",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_paths_name_the_flag(hf_models, imported, tmp_path, capsys, case):
    words, damage, flag, value = BAD[case]
    hf = hf_models["moe"][0]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(imported, ckpt)
    (tmp_path / "file").write_text("not a folder\n")
    (tmp_path / "config_only").mkdir()
    shutil.copy(hf / "config.json", tmp_path / "config_only")
    if damage is not None:
        damage(ckpt)
    before = sorted(p.name for p in hf.iterdir())

    def fill(word: str) -> str:
        return word.format(hf=hf, ckpt=ckpt, tmp=tmp_path)

    assert main(["convert", *map(fill, words)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"overlap: error: {flag}=") and "Fix:" in err and "Traceback" not in err
    ), err
    assert fill(value) in err
    for setting in ("checkpoint.pretrained_checkpoint", "checkpoint.load", "checkpoint.save"):
        assert setting not in err
    assert not (tmp_path / "out").exists()  # a failed command leaves no output folder behind
    assert sorted(p.name for p in hf.iterdir()) == before


def test_flag_errors_renames_only_the_named_settings() -> None:
    with pytest.raises(CheckpointError) as err:
        with convert.flag_errors("--hf", "checkpoint.pretrained_checkpoint"):
            raise CheckpointError("checkpoint.pretrained_checkpoint", "/x", "why.", "fix.")
    assert (err.value.field, err.value.value, err.value.why, err.value.fix) == (
        "--hf",
        "/x",
        "why.",
        "fix.",
    )
    with pytest.raises(CheckpointError) as err:
        with convert.flag_errors("--hf", "checkpoint.pretrained_checkpoint"):
            raise CheckpointError("checkpoint.load", "/y", "why.", "fix.")
    assert err.value.field == "checkpoint.load"


def test_a_tied_folder_roundtrips_and_a_stray_lm_head_must_be_the_embedding(
    hf_models, tmp_path, capsys
):
    """tie_word_embeddings=true: no lm_head tensor of its own, in and out. A folder that also stores
    the LM head (some tied checkpoints do) round-trips when that copy is the embedding bit for bit,
    and fails naming it when not."""
    from safetensors.torch import load_file, save_file

    source, _logits = hf_models["dense_tied"]
    assert "lm_head.weight" not in _names(source)
    assert main(["convert", "roundtrip", "--hf", str(source)]) == 0
    tensors = load_file(str(source / "model.safetensors"))
    for name, head in (
        ("copy", tensors["model.embed_tokens.weight"].clone()),
        ("other", _one_ulp_up(tensors["model.embed_tokens.weight"])),
    ):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copy(source / "config.json", folder / "config.json")
        save_file({**tensors, "lm_head.weight": head}, str(folder / "model.safetensors"))
        capsys.readouterr()
        code = main(["convert", "roundtrip", "--hf", str(folder)])
        out = capsys.readouterr()
        assert code == (0 if name == "copy" else 1), out
        assert (name == "other") == (
            "lm_head.weight is not the tied embedding" in out.out + out.err
        )


def test_export_to_a_full_disk_is_one_line_and_leaves_no_file(imported, tmp_path, capsys):
    from tests.small_disk import small_disk

    with small_disk(tmp_path / "disk", "64k") as disk:
        code = main(["convert", "export", "--load", str(imported), "--hf", str(disk / "hf")])
        left = sorted(p.name for p in (disk / "hf").iterdir())
    err = capsys.readouterr().err
    assert code == 1 and left == [], (code, left, err[-2000:])
    assert err.startswith("overlap: error: no space left on device: --hf ")
    assert len(err.strip().splitlines()) == 1 and "no file of the export is left" in err
