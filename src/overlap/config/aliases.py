"""Bridge's second spellings of a knob: one table, one home per knob, precedence decided once.

Megatron-Bridge lets a user set an overlap switch in two places (`comm_overlap.tp_comm_overlap` and
`model.tp_comm_overlap`, `comm_overlap.overlap_grad_reduce` and `ddp.overlap_grad_reduce`, ...).
Here each knob is declared once, on its home section; the other spelling is an alias, listed in
`ALIASES`. An aliased section (`aliased`) takes the alias like a field -
`ModelConfig(tp_comm_overlap=True)`, `cfg.model.tp_comm_overlap = True`, the override
`model.tp_comm_overlap=true` - and keeps the request as typed, so after finalize it still says what
the user (or a recipe) wrote. `request` reads every spelling of a knob in rank order (the home's
first: comm_overlap's value beats the direct spelling, as the resolution always did) and returns the
value that counts with the spelling it was typed under, so a decision or an error names what the
user wrote. Two knobs rank otherwise, as Bridge does: the distributed optimizer is on when either
spelling is true (`ANY_TRUE`), and the NullTokenizer's `tokenizer.vocab_size` beats
`model.vocab_size` (`ALIAS_FIRST`; finalize sets the home, which the runtime reads; the
distributed optimizer's value is the plan's, `cfg.resolved.overlap.use_distributed_optimizer`).
Megatron's copies of the precision fields (`model.bf16`, `ddp.grad_reduce_in_fp32`,
`optimizer.loss_scale`, ...) are aliases of the mixed-precision section, the one place a preset
sets them: a preset owns them whatever its value (`OWNING_SECTIONS`), and without one the alias's
value stands; finalize decides `cfg.resolved.precision`, which the runtime reads.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# alias spelling -> its home (section.field); the home's value, when set, beats the alias's
ALIASES: dict[str, str] = {
    "model.tp_comm_overlap": "comm_overlap.tp_comm_overlap",
    "model.tp_comm_overlap_cfg": "comm_overlap.tp_comm_overlap_cfg",
    "model.tp_comm_bootstrap_backend": "comm_overlap.tp_comm_bootstrap_backend",
    "model.overlap_p2p_comm": "comm_overlap.overlap_p2p_comm",
    "model.batch_p2p_comm": "comm_overlap.batch_p2p_comm",
    "model.defer_embedding_wgrad_compute": "comm_overlap.defer_embedding_wgrad_compute",
    "model.wgrad_deferral_limit": "comm_overlap.wgrad_deferral_limit",
    "model.overlap_moe_expert_parallel_comm": "comm_overlap.overlap_moe_expert_parallel_comm",
    "model.delay_wgrad_compute": "comm_overlap.delay_wgrad_compute",
    "ddp.overlap_grad_reduce": "comm_overlap.overlap_grad_reduce",
    "ddp.overlap_param_gather": "comm_overlap.overlap_param_gather",
    "ddp.align_param_gather": "comm_overlap.align_param_gather",
    "ddp.bucket_size": "comm_overlap.bucket_size",
    "optimizer.overlap_param_gather_with_optimizer_step": (
        "comm_overlap.overlap_param_gather_with_optimizer_step"
    ),
    "optimizer.use_distributed_optimizer": "ddp.use_distributed_optimizer",
    "tokenizer.vocab_size": "model.vocab_size",
    # Megatron's copies of the mixed-precision fields on the model, DDP and optimizer configs
    "model.bf16": "mixed_precision.bf16",
    "optimizer.bf16": "mixed_precision.bf16",
    "model.fp16": "mixed_precision.fp16",
    "optimizer.fp16": "mixed_precision.fp16",
    "model.params_dtype": "mixed_precision.params_dtype",
    "ddp.grad_reduce_in_fp32": "mixed_precision.grad_reduce_in_fp32",
    "ddp.fp8_param_gather": "mixed_precision.fp8_param_gather",
    "optimizer.loss_scale": "mixed_precision.loss_scale",
    "optimizer.initial_loss_scale": "mixed_precision.initial_loss_scale",
    "optimizer.min_loss_scale": "mixed_precision.min_loss_scale",
    "optimizer.loss_scale_window": "mixed_precision.loss_scale_window",
    "optimizer.hysteresis": "mixed_precision.hysteresis",
}
# Knobs whose spellings are kept in sync by "either true turns it on" (Megatron-Bridge's rule for
# the distributed optimizer) instead of the home's value beating the alias's.
ANY_TRUE = frozenset({"ddp.use_distributed_optimizer"})
# Knobs whose alias, when set, beats the home: the NullTokenizer's vocabulary (--vocab_size) sizes
# the embedding whatever the recipe's model.vocab_size says.
ALIAS_FIRST = frozenset({"model.vocab_size"})
# Home sections that, when present, own their knobs whatever the value (None included): a
# mixed-precision preset decides every precision field; without one (the section is None) the
# aliases' values stand.
OWNING_SECTIONS = frozenset({"mixed_precision"})
_HOMES = frozenset(ALIASES.values())


@dataclass(frozen=True)
class Request:
    """What a knob's spellings ask for: the value that counts and the spelling it was typed under
    (None: no spelling was set)."""

    value: Any
    spelling: str | None

    @property
    def on_home(self) -> bool:
        """Set under the home spelling of an aliased knob (comm_overlap's, for an overlap
        switch)."""
        return self.spelling in _HOMES


def spellings(key: str) -> tuple[str, ...]:
    """Every spelling of the knob `key` names, home first, then its aliases in rank order; empty
    when `key` is not an aliased knob."""
    home = ALIASES.get(key, key)
    aliases = tuple(a for a, h in ALIASES.items() if h == home)
    return (home, *aliases) if aliases else ()


def request(sections: Mapping[str, Any], key: str) -> Request:
    """The value of the first spelling of `key` that is set (not None; true for an `ANY_TRUE`
    knob), in rank order (the home first, the alias first for an `ALIAS_FIRST` knob), read from
    `sections` (section name -> section object; None: the section is not set); a knob without
    aliases is read where `key` says. A home in an `OWNING_SECTIONS` section that is set counts
    whatever its value."""
    home = ALIASES.get(key, key)
    any_true = home in ANY_TRUE
    order = spellings(key) or (key,)
    for spelling in order[1:] + order[:1] if home in ALIAS_FIRST else order:
        section, _, name = spelling.partition(".")
        if sections[section] is None:
            continue
        value = getattr(sections[section], name)
        if spelling == home and section in OWNING_SECTIONS:
            return Request(value, spelling)
        if value if any_true else value is not None:
            return Request(value, spelling)
    return Request(False if any_true else None, None)


def rank_rule(alias: str) -> str:
    """How the alias `alias` ranks against its home, in words (for `--list-keys`)."""
    home = ALIASES[alias]
    if home in ANY_TRUE:
        return f"alias of {home} (either true turns it on)"
    if home in ALIAS_FIRST:
        return f"alias of {home} (which it beats when set)"
    if home.partition(".")[0] in OWNING_SECTIONS:
        return f"alias of {home} (a mixed-precision preset, when set, owns it)"
    return f"alias of {home} (which beats it when both are set)"


def aliased(section: str):
    """Class decorator for the dataclass of `section`: its alias spellings (`ALIASES`) are accepted
    as keyword arguments and attributes, kept as typed in a request store beside the fields (None
    when not set), never declared as fields."""
    names = frozenset(a.partition(".")[2] for a in ALIASES if a.partition(".")[0] == section)

    def wrap(cls: type) -> type:
        init = cls.__init__
        declared = {f.name for f in fields(cls)}
        if declared & names:
            raise TypeError(f"{cls.__name__} declares its aliases {sorted(declared & names)}")

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            typed = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            init(self, *args, **kwargs)
            for name, value in typed.items():
                setattr(self, name, value)

        def __setattr__(self, name: str, value: Any) -> None:
            if name in names:
                self.__dict__.setdefault("_alias_requests", {})[name] = value
            else:
                object.__setattr__(self, name, value)

        def __getattr__(self, name: str) -> Any:  # only reached when no field or attribute is
            if name in names:
                return self.__dict__.get("_alias_requests", {}).get(name)
            raise AttributeError(f"{cls.__name__!r} object has no attribute {name!r}")

        fields_equal = cls.__eq__

        def __eq__(self, other: object) -> bool:  # the aliases as typed count, as fields did
            same = fields_equal(self, other)
            if same is not True:
                return same
            return _set_aliases(self) == _set_aliases(other)

        cls.__init__ = __init__
        cls.__setattr__ = __setattr__
        cls.__getattr__ = __getattr__
        cls.__eq__ = __eq__
        return cls

    return wrap


def typed_aliases(section: Any) -> dict[str, Any]:
    """The alias spellings set on `section`, by field name, as typed (for its plain form)."""
    return dict(getattr(section, "__dict__", {}).get("_alias_requests", {}))


def _set_aliases(section: Any) -> dict[str, Any]:
    """The alias spellings set to a value (None is the same as not set)."""
    return {k: v for k, v in typed_aliases(section).items() if v is not None}
