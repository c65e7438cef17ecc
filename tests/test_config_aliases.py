"""Bridge's second spellings are aliases of one declared field (`overlap.config.aliases`): accepted
as keywords, attributes and overrides, kept as typed through copies, ranked once, and named in the
errors and the key listing as the user typed them."""

from __future__ import annotations

import copy
import pickle

import pytest

from overlap.config import CommOverlapConfig, ConfigContainer, DDPConfig, ModelConfig
from overlap.config.aliases import ALIASES, Request, request, spellings
from overlap.config.overrides import apply_override, override_key_rows
from overlap.errors import ConfigError


def test_an_alias_is_kept_as_typed_through_copies_and_compared():
    m = ModelConfig(tp_comm_overlap=True)
    m.delay_wgrad_compute = False
    for other in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert (other.tp_comm_overlap, other.delay_wgrad_compute) == (True, False)
        assert other.overlap_p2p_comm is None  # not set
        assert other == m
    assert ModelConfig() != m
    assert ModelConfig(tp_comm_overlap=None) == ModelConfig()
    with pytest.raises(AttributeError, match="tp_comm_overlapp"):
        _ = m.tp_comm_overlapp


def test_the_home_beats_its_alias_and_the_request_names_the_spelling():
    co = CommOverlapConfig(tp_comm_overlap=None, overlap_grad_reduce=False)
    sections = {"comm_overlap": co, "ddp": DDPConfig(overlap_grad_reduce=True)}
    assert request(sections, "comm_overlap.overlap_grad_reduce") == Request(
        False, "comm_overlap.overlap_grad_reduce"
    )
    co.overlap_grad_reduce = None
    got = request(sections, "comm_overlap.overlap_grad_reduce")
    assert got == Request(True, "ddp.overlap_grad_reduce") and not got.on_home


def test_either_distributed_optimizer_spelling_turns_it_on():
    cfg = ConfigContainer()
    sections = {"ddp": cfg.ddp, "optimizer": cfg.optimizer}
    assert request(sections, "ddp.use_distributed_optimizer").value is False
    cfg.optimizer.use_distributed_optimizer = True
    assert request(sections, "ddp.use_distributed_optimizer") == Request(
        True, "optimizer.use_distributed_optimizer"
    )


def test_overrides_take_an_alias_typed_like_its_home():
    cfg = ConfigContainer()
    assert apply_override(cfg, "ddp.bucket_size=5000") == ("ddp.bucket_size", 5000)
    assert cfg.ddp.bucket_size == 5000 and cfg.to_dict()["ddp"]["bucket_size"] == 5000
    with pytest.raises(ConfigError, match="expected"):
        apply_override(cfg, "model.delay_wgrad_compute=maybe")
    with pytest.raises(ConfigError, match="did you mean.*overlap_grad_reduce"):
        apply_override(cfg, "ddp.overlap_grad_reduc=true")


def test_every_spelling_is_listed_once_and_names_the_other():
    rows = {key: doc for key, _type, _default, doc in override_key_rows()}
    for alias, home in ALIASES.items():
        assert spellings(alias) == spellings(home) and spellings(alias)[0] == home
        assert f"alias of {home}" in rows[alias]
        assert alias in rows[home]
    keys = [row[0] for row in override_key_rows()]
    assert len(keys) == len(set(keys))


def test_the_null_tokenizers_vocabulary_beats_the_models():
    cfg = ConfigContainer(model=ModelConfig(vocab_size=4096))
    sections = {"model": cfg.model, "tokenizer": cfg.tokenizer}
    assert request(sections, "model.vocab_size") == Request(4096, "model.vocab_size")
    apply_override(cfg, "tokenizer.vocab_size=1024")
    assert request(sections, "model.vocab_size") == Request(1024, "tokenizer.vocab_size")
    typed = copy.deepcopy(cfg.model)
    res = cfg.finalize(1)
    # the model that runs has the tokenizer's vocabulary; the section keeps what was typed
    assert (res.model.vocab_size, cfg.tokenizer.vocab_size) == (1024, 1024)
    assert cfg.model == typed and cfg.model.vocab_size == 4096
    assert cfg.to_dict()["model"]["vocab_size"] == 1024  # run_config.yaml: the model that ran


def test_a_preset_owns_the_precision_and_without_one_the_aliases_stand():
    """Megatron's precision copies are aliases of the mixed-precision section: a preset owns them
    whatever its value (None included); without one the alias typed first in rank order counts."""
    cfg = ConfigContainer(mixed_precision="fp16_mixed")
    apply_override(cfg, "optimizer.loss_scale=1024")
    res = cfg.finalize(1)
    assert res.precision.loss_scale is None  # the preset's: dynamic scaling
    assert cfg.optimizer.loss_scale == 1024  # kept as typed, never written
    cfg = ConfigContainer(mixed_precision=None)
    apply_override(cfg, "optimizer.loss_scale=1024")
    cfg.optimizer.fp16 = True
    cfg.model.params_dtype = "float16"
    sections = {"mixed_precision": None, "model": cfg.model, "optimizer": cfg.optimizer}
    assert request(sections, "model.fp16") == Request(True, "optimizer.fp16")
    cfg.model.fp16 = False
    assert request(sections, "model.fp16") == Request(False, "model.fp16")  # the model's first
    cfg.model.fp16 = None
    p = cfg.finalize(1).precision
    assert (p.fp16, p.params_dtype, p.loss_scale) == (True, "float16", 1024)
