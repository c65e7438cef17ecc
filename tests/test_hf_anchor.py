"""The correctness anchor (issue 16): our Qwen3 / Qwen3-MoE computes what transformers computes, at
every layout.

A tiny random `Qwen3MoeForCausalLM` and `Qwen3ForCausalLM` (fp32, eager attention; weights redrawn
at std 0.2 and norm weights around 1, so that attention, routing and the QK norms do real work - the
default 0.02 init makes every logit nearly 0 and any comparison trivially small) are saved with
`save_pretrained` and loaded into our model:

- logits equal transformers' within atol 1e-4 (fp32; measured max |diff| ~1e-6: only the summation
  order differs; also with norm_topk_prob=false, our model.moe_router_pre_softmax, and with
  decoder_sparse_step=2, our per-layer model.moe_layer_freq [0, 1])
  at one rank, TP2 (+SP), EP2, TP2 x EP2, PP2, TP2 x PP2 and EP2 x PP2, every rank loading only its
  own shards from the files; a tied dense model (tie_word_embeddings=true) at one rank, TP2 (+SP),
  PP2 (the last stage's copy loaded from the embedding's tensor) and TP2 x PP2;
- the gradients of one backward (mean cross-entropy) equal transformers' within atol 1e-5 at one
  rank, read back into our layout through the same name mapping (from transformers' fused in-memory
  expert tensors);
- a Trainer started with `checkpoint.pretrained_checkpoint=<HF folder>` trains at EP2 / PP2 / TP2 x
  EP2 like at one rank (rel 1e-5, as tests/test_training.py), which exercises the Checkpointer hook.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from tests.hf_models import (
    BATCH,
    SEQ,
    VOCAB,
    anchor_batch,
    save_reference_model,
)
from tests.world import run_world

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for kind in ("moe", "dense", "moe_unnormalised", "moe_sparse_step", "dense_tied"):
        folder = tmp_path_factory.mktemp(f"hf_{kind}")
        out[kind] = (folder, save_reference_model(kind, folder))
    return out


def _build(folder: str, layout: dict):
    """This rank's model chunks with their shards loaded from the HF folder, and the parallel
    state."""
    from overlap.config import ConfigContainer
    from overlap.hf.config_json import model_config_from_hf, read_hf_config
    from overlap.hf.load import load_hf_weights
    from overlap.model.gpt import model_chunks
    from overlap.parallel.state import ParallelState

    model = model_config_from_hf(read_hf_config(folder), seq_length=SEQ)
    model.moe_aux_loss_coeff = 0.0  # transformers adds no aux loss without output_router_logits
    for k, v in layout.items():
        setattr(model, k, v)
    cfg = ConfigContainer(model=model)
    res = cfg.finalize(dist.get_world_size())
    ps = ParallelState(res.layout)
    chunks = model_chunks(res.model, ps, res.pipeline, res.overlap, res.precision, res.kernels)
    load_hf_weights(
        res.model, {n: p for c in chunks for n, p in c.named_parameters()}, folder, ps.rank
    )
    return cfg, ps, chunks


def _logits(folder: str, layout: dict) -> torch.Tensor | None:
    """[b, s, vocab] logits of our model on the test batch (vocab shards gathered over TP, a CP
    rank's two chunks of the sequence gathered over CP into position order) on the ranks of the
    last pipeline stage, None on the others. The stages run one after the other: virtual stage v =
    chunk x PP + rank receives the hidden state from its predecessor and sends its own to the
    next."""
    from overlap.parallel.cp_chunks import cp_positions, gathered_positions

    cfg, ps, chunks = _build(folder, layout)
    tokens, _ = anchor_batch()
    tokens = tokens.index_select(1, cp_positions(SEQ, ps.cp_rank, ps.layout.cp))
    m = cfg.resolved.model
    seq = SEQ // ps.layout.cp
    seq = seq // ps.layout.tp if ps.layout.sequence_parallel else seq
    hidden, local = torch.empty((seq, BATCH, m.hidden_size)), None  # [s (local under SP), b, h]
    with torch.no_grad():
        for virtual in range(ps.layout.pp * len(chunks)):
            if virtual % ps.layout.pp != ps.pp_rank:
                continue
            chunk = chunks[virtual // ps.layout.pp]
            if not chunk.stage.pre_process:
                dist.recv(hidden, src=ps.pp_prev, group=ps.pp_group)
            hidden, _ = chunk.stage_body(hidden, tokens)
            if chunk.stage.post_process:
                local = chunk.logits(hidden)  # [s, b, vocab / tp]
            else:
                dist.send(hidden.contiguous(), dst=ps.pp_next, group=ps.pp_group)
                hidden = torch.empty_like(hidden)  # the buffer the next chunk's input arrives in
    if local is None:
        return None
    parts = [torch.empty_like(local) for _ in range(ps.layout.tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.tp_group)
    mine = torch.cat(parts, dim=-1).transpose(0, 1).contiguous()  # [b, s / CP, vocab]
    shares = [torch.empty_like(mine) for _ in range(ps.layout.cp)]
    dist.all_gather(shares, mine, group=ps.cp_group)
    whole = torch.empty(BATCH, SEQ, mine.shape[-1])
    return whole.index_copy_(1, gathered_positions(SEQ, ps.layout.cp), torch.cat(shares, dim=1))


def _grads(folder: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One rank: the lm loss and every parameter's gradient."""
    cfg, ps, (chunk,) = _build(folder, {})
    tokens, labels = anchor_batch()
    loss, _ = chunk(tokens, labels)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in chunk.named_parameters()}


LAYOUTS = {
    "1": (1, {}),
    "tp2_sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "ep2": (2, dict(expert_model_parallel_size=2)),
    "tp2_ep2": (
        4,
        dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
    ),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "tp2_pp2": (
        4,
        dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2),
    ),
    "ep2_pp2": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2)),
    # context parallelism: the KV ring, and the experts over CP (EP2 carved from CP2)
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2_ep2": (2, dict(context_parallel_size=2, expert_model_parallel_size=2)),
    "cp2_a2a": (2, dict(context_parallel_size=2, cp_comm_type="a2a")),
    "cp2_tp2": (
        4,
        dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    ),
}


@pytest.mark.parametrize(
    "kind,name",
    [("moe", n) for n in LAYOUTS]
    + [("dense", n) for n in ("1", "tp2_sp", "pp2", "cp2")]
    + [("moe_unnormalised", n) for n in ("1", "ep2")]
    + [("moe_sparse_step", n) for n in ("1", "ep2", "pp2")]
    + [("dense_tied", n) for n in ("1", "tp2_sp", "pp2", "tp2_pp2")],
)
def test_logits_match_transformers(hf_models, kind, name):
    folder, ref = hf_models[kind]
    world, layout = LAYOUTS[name]
    results = run_world(world, _logits, str(folder), layout)
    last_stage = [got for got in results if got is not None]
    assert len(last_stage) == world // layout.get("pipeline_model_parallel_size", 1)
    for got in last_stage:
        diff = (got - ref["logits"]).abs().max().item()
        assert diff < 1e-4, f"{kind} at {name}: max |logits - transformers| = {diff:.3g}"


@pytest.mark.parametrize(
    "kind", ["moe", "dense", "moe_unnormalised", "moe_sparse_step", "dense_tied"]
)
def test_gradients_match_transformers(hf_models, kind):
    from overlap.hf.config_json import model_config_from_hf, read_hf_config
    from overlap.hf.load import DictSource, read_shard
    from overlap.hf.names import mappings

    folder, ref = hf_models[kind]
    loss, grads = run_world(1, _grads, str(folder))[0]
    assert loss == pytest.approx(ref["loss"], rel=1e-6)
    cfg = model_config_from_hf(read_hf_config(folder), seq_length=SEQ)
    source = DictSource(ref["grads"])  # transformers' in-memory names: fused experts
    for m in mappings(cfg):
        theirs = read_shard(m, source, cfg, None)
        diff = (grads[m.ours] - theirs).abs().max().item()
        assert diff < 1e-5, f"{m.ours}: max |grad - transformers| = {diff:.3g}"


def _train(folder: str, layout: list[str]) -> list[float]:
    from overlap.hf.config_json import apply_pretrained
    from overlap.parallel.state import ParallelState
    from overlap.training.trainer import Trainer
    from tests.configs import tiny_config

    # The tiny recipe's own shape: the run takes the checkpoint's from its config.json (finalize)
    cfg = tiny_config(True, "fp32", 2, layout + [f"checkpoint.pretrained_checkpoint={folder}"], 2)
    res = cfg.finalize(dist.get_world_size(), pretrained=apply_pretrained)
    return [r.lm_loss for r in Trainer(cfg, ParallelState(res.layout)).train().records]


def test_trainer_from_hf_folder_at_layouts(hf_models):
    folder = str(hf_models["moe"][0])
    ref = run_world(1, _train, folder, [])[0]
    for world, layout in (
        (2, ["model.expert_model_parallel_size=2"]),
        (2, ["model.pipeline_model_parallel_size=2"]),
        (2, ["model.context_parallel_size=2", "model.expert_model_parallel_size=2"]),
        (
            4,
            [
                "model.tensor_model_parallel_size=2",
                "model.sequence_parallel=true",
                "model.expert_model_parallel_size=2",
            ],
        ),
    ):
        for losses in run_world(world, _train, folder, layout):
            assert losses == pytest.approx(ref, rel=1e-5)


def test_fused_layout_on_disk_imports_like_per_expert(hf_models, tmp_path):
    """transformers-5's fused in-memory tensors written as they are (as Qwen3.5-MoE stores them)
    load the same."""
    from safetensors.torch import save_file

    from overlap.hf.config_json import model_config_from_hf, read_hf_config
    from overlap.hf.load import check_source, read_shard
    from overlap.hf.safetensors_io import SafetensorsReader

    folder, ref = hf_models["moe"]
    assert any(n.endswith("experts.gate_up_proj") for n in ref["state"])
    save_file(
        {n: t.contiguous() for n, t in ref["state"].items()}, str(tmp_path / "model.safetensors")
    )
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    cfg = model_config_from_hf(read_hf_config(folder))
    fused, per_expert = SafetensorsReader(tmp_path), SafetensorsReader(folder)
    for m in check_source(cfg, fused, tmp_path):
        assert torch.equal(read_shard(m, fused, cfg, None), read_shard(m, per_expert, cfg, None)), (
            m.ours
        )


def test_a_pretrained_hf_folder_decides_the_architecture(hf_models, tmp_path):
    """`checkpoint.pretrained_checkpoint=<HF folder>`: every architecture field comes from
    config.json, whatever the recipe or an override said, each change a decision of the checkpoint
    section; our own checkpoints (no config.json) leave the configured model alone."""
    from overlap.errors import ConfigError
    from overlap.hf.config_json import (
        apply_pretrained,
        described_fields,
        model_config_from_hf,
        read_hf_config,
    )
    from tests.configs import tiny_config

    for kind in ("moe", "dense", "moe_sparse_step"):
        folder = hf_models[kind][0]
        theirs = model_config_from_hf(read_hf_config(folder), seq_length=SEQ)
        cfg = tiny_config(
            True, "fp32", 1, [f"checkpoint.pretrained_checkpoint={folder}", "model.num_layers=6"], 1
        )
        decisions = {
            d.field: d
            for d in cfg.finalize(1, pretrained=apply_pretrained).decisions.sections["checkpoint"]
        }
        ran = cfg.resolved.model  # the model that runs; cfg.model keeps what was typed
        for field, attr in described_fields(theirs).items():
            assert getattr(ran, attr) == getattr(theirs, attr), (kind, field)
        assert decisions["model.num_layers"].requested == 6 == cfg.model.num_layers
        assert decisions["model.num_layers"].effective == theirs.num_layers
        assert "config.json" in decisions["model.num_layers"].reason
        assert ran.is_moe == theirs.is_moe
    # a per-layer MoE pattern of the recipe's own length (3 layers) is replaced whole, not read at
    # the new length
    cfg = tiny_config(
        True,
        "fp32",
        3,
        [
            f"checkpoint.pretrained_checkpoint={hf_models['moe_sparse_step'][0]}",
            "model.moe_layer_freq=[1,1,1]",
        ],
        1,
    )
    m = cfg.finalize(1, pretrained=apply_pretrained).model
    assert (m.num_layers, m.moe_layer_freq) == (2, [0, 1])
    assert (cfg.model.num_layers, cfg.model.moe_layer_freq) == (3, [1, 1, 1])  # as typed
    cfg = tiny_config(
        True,
        "fp32",
        1,
        [f"checkpoint.pretrained_checkpoint={hf_models['moe'][0]}", "tokenizer.vocab_size=100000"],
        1,
    )
    with pytest.raises(ConfigError, match="tokenizer.vocab_size"):
        cfg.finalize(1, pretrained=apply_pretrained)
    # a dense recipe takes the MoE checkpoint's router aux-loss coefficient with its experts
    dense = tiny_config(
        False, "fp32", 2, [f"checkpoint.pretrained_checkpoint={hf_models['moe'][0]}"], 1
    )
    m = dense.finalize(1, pretrained=apply_pretrained).model
    assert m.is_moe and m.moe_aux_loss_coeff == theirs_aux(hf_models["moe"][0])
    assert not dense.model.is_moe
    # token dropping on released MoE weights: honoured, and said beside the architecture
    dropping = tiny_config(
        True,
        "fp32",
        2,
        [
            f"checkpoint.pretrained_checkpoint={hf_models['moe'][0]}",
            "model.moe_expert_capacity_factor=1.0",
        ],
        1,
    )
    rows = {
        d.field: d
        for d in dropping.finalize(1, pretrained=apply_pretrained).decisions.sections["checkpoint"]
    }
    assert "dropped" in rows["model.moe_expert_capacity_factor"].reason
    # a path that is not on this machine: the recipe's architecture, said in the checkpoint section
    away = tiny_config(
        True, "fp32", 1, [f"checkpoint.pretrained_checkpoint={tmp_path / 'elsewhere'}"], 1
    )
    rows = away.finalize(1, pretrained=apply_pretrained).decisions.sections["checkpoint"]
    assert any(d.field == "model" and "not on this machine" in d.reason for d in rows)
    cfg = tiny_config(
        True, "fp32", 1, [f"checkpoint.pretrained_checkpoint={tmp_path}", "model.num_layers=6"], 1
    )
    cfg.finalize(1, pretrained=apply_pretrained)
    assert cfg.resolved.model.num_layers == 6 and not any(
        d.field.startswith("model.")
        for d in cfg.finalize(1, pretrained=apply_pretrained).decisions.sections["checkpoint"]
    )


def theirs_aux(folder) -> float:
    from overlap.hf.config_json import model_config_from_hf, read_hf_config

    return model_config_from_hf(read_hf_config(folder)).moe_aux_loss_coeff


def test_the_command_line_cannot_contradict_a_pretrained_checkpoint(hf_models, tmp_path, capsys):
    """An override (or flag) of a field config.json decides is refused naming both values; so is a
    tokenizer with more tokens than the checkpoint's embedding rows."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from overlap.cli import main

    folder = hf_models["moe"][0]
    base = [
        "explain",
        "-m",
        "qwen",
        "-mr",
        "qwen3_moe_tiny",
        "-g",
        "cpu",
        "-ng",
        "1",
        f"checkpoint.pretrained_checkpoint={folder}",
    ]
    assert main(base) == 0
    capsys.readouterr()
    assert main(base + ["model.num_layers=4"]) == 2
    err = capsys.readouterr().err
    assert "model.num_layers=4" in err and "config.json has 2" in err and "Traceback" not in err
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words = [f"w{i}" for i in range(VOCAB + 50)]
    tok.train_from_iterator(
        [" ".join(words)], trainers.WordLevelTrainer(special_tokens=["<unk>", "<|endoftext|>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    assert (
        main(
            base
            + [
                "--tokenizer_type",
                "HuggingFaceTokenizer",
                "--tokenizer_model",
                str(tmp_path / "tokenizer.json"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "tokenizer.tokenizer_model" in err and f"{VOCAB} rows" in err


def test_configured_model_must_match_config_json(hf_models):
    from overlap.errors import ConfigError
    from overlap.hf.config_json import check_model_matches, model_config_from_hf, read_hf_config

    folder, _ = hf_models["moe"]
    hf = read_hf_config(folder)
    model = model_config_from_hf(hf, seq_length=SEQ)
    check_model_matches(model, hf, folder)
    model.kv_channels = 8
    with pytest.raises(ConfigError, match=r"model.kv_channels=8.*kv_channels=16"):
        check_model_matches(model, hf, folder)


def test_roundtrip_command_is_bit_exact(hf_models, tmp_path, capsys):
    from overlap.cli import main

    folder, _ = hf_models["moe"]
    assert main(["convert", "roundtrip", "--hf", str(folder), "--work", str(tmp_path)]) == 0
    assert "bit-identical" in capsys.readouterr().out
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["num_experts"] == 4 and exported["head_dim"] == 16
