"""The network's own dataclass (`TransformerArchitecture`) under ModelConfig's flat surface: the
fields are inherited unchanged, `architecture` copies exactly them, the network's rules run on it
alone, and `--list-keys` finds the comments of inherited fields."""

from __future__ import annotations

import inspect
from dataclasses import MISSING, dataclass, fields

import pytest

from overlap.config import ConfigContainer, ModelConfig, TransformerArchitecture
from overlap.config.aliases import spellings
from overlap.config.field_docs import field_docs
from overlap.config.overrides import apply_overrides, list_override_keys
from overlap.errors import ConfigError

ARCH = [f.name for f in fields(TransformerArchitecture)]


def test_each_model_field_has_one_home():
    own = set(inspect.get_annotations(ModelConfig))  # declared on ModelConfig itself
    assert own.isdisjoint(ARCH)  # no architecture field declared again on ModelConfig
    assert own | set(ARCH) == {f.name for f in fields(ModelConfig)}
    assert all(f.default is not MISSING for f in fields(TransformerArchitecture))
    for name in ("moe_aux_loss_coeff", "moe_expert_capacity_factor", "tp_comm_overlap_ag"):
        assert name in own  # training behaviour and overlap are not the network
    # precision is not the network either: model.bf16 is an alias of its home in mixed_precision
    assert "bf16" not in own | set(ARCH)
    assert spellings("mixed_precision.bf16") == (
        "mixed_precision.bf16",
        "model.bf16",
        "optimizer.bf16",
    )


def test_architecture_is_a_plain_copy_of_the_network_fields():
    m = ModelConfig(
        num_layers=4,
        num_moe_experts=4,
        moe_layer_freq=[1, 0, 1, 0],
        tensor_model_parallel_size=2,
        moe_aux_loss_coeff=1e-3,
    )
    arch = m.architecture
    assert type(arch) is TransformerArchitecture
    assert {n: getattr(arch, n) for n in ARCH} == {n: getattr(m, n) for n in ARCH}
    arch.moe_layer_freq[1] = 1  # a copy: the config's list is not shared
    assert m.moe_layer_freq == [1, 0, 1, 0]
    # models that differ only in how a run computes them are the same network
    other = ModelConfig(num_layers=4, num_moe_experts=4, moe_layer_freq=[1, 0, 1, 0])
    assert other != m and other.architecture == m.architecture
    assert m.architecture.architecture == m.architecture
    # the derived sizes are the network's
    assert (arch.head_dim, arch.ffn_size, arch.is_moe_layer(2)) == (m.head_dim, m.ffn_size, True)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"layernorm_epsilon": 0.0}, "model.layernorm_epsilon"),
        ({"kv_channels": 33}, "model.kv_channels"),
        ({"num_moe_experts": 2, "moe_router_topk": 3}, "model.moe_router_topk"),
        ({"num_moe_experts": 2, "moe_layer_freq": [0, 0]}, "model.moe_layer_freq"),
        ({"mtp_num_layers": -1}, "model.mtp_num_layers"),
    ],
)
def test_the_network_rules_run_on_the_architecture_alone(kw, field):
    with pytest.raises(ConfigError) as exc:
        TransformerArchitecture(**kw).validate()
    assert exc.value.field == field
    with pytest.raises(ConfigError) as exc:
        ModelConfig(**kw).validate()  # and first in the model section's rules
    assert exc.value.field == field


def test_check_sizes_names_the_size():
    with pytest.raises(ConfigError) as exc:
        TransformerArchitecture(hidden_size=0).check_sizes()
    assert exc.value.field == "model.hidden_size"
    TransformerArchitecture().check_sizes()


def test_overrides_and_list_keys_reach_inherited_fields():
    cfg = ConfigContainer()
    apply_overrides(cfg, ["model.hidden_size=512", "model.tensor_model_parallel_size=2"])
    assert (cfg.model.hidden_size, cfg.model.tensor_model_parallel_size) == (512, 2)
    docs = field_docs(ModelConfig)
    assert docs["hidden_size"] == "width of the residual stream"
    assert docs["tensor_model_parallel_size"].startswith("TP: ")
    keys = {line.split()[0] for line in list_override_keys()}
    assert {f"model.{f.name}" for f in fields(ModelConfig)} <= keys


def test_field_docs_subclass_comment_wins():
    @dataclass
    class Base:
        a: int = 1  # from the base
        b: int = 2  # the base's b

    @dataclass
    class Child(Base):
        b: int = 3  # the child's b
        c: int = 4  # only in the child

    assert field_docs(Child) == {
        "a": "from the base",
        "b": "the child's b",
        "c": "only in the child",
    }
    assert field_docs(Base) == {"a": "from the base", "b": "the base's b"}
