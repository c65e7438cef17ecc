"""`section.field=value` overrides (the Hydra-style tail of a harness command line).

omegaconf parses each value with YAML rules (numbers, booleans, null, lists); we then check it
against the dataclass field's type, so a typo or a wrong type is a clear error naming the key, never
a silently ignored setting.
"""

from __future__ import annotations

import copy
import difflib
import functools
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from overlap.config.aliases import ALIASES, rank_rule, spellings
from overlap.config.checkpoint import CheckpointConfig
from overlap.config.comm_overlap import CommOverlapConfig
from overlap.config.container import ConfigContainer
from overlap.config.field_docs import field_docs
from overlap.config.logger import LoggerConfig
from overlap.config.mixed_precision import MixedPrecisionConfig, get_mixed_precision_config
from overlap.config.model import ModelConfig, comma_list
from overlap.config.refusals import MOVED, NOT_CARRIED, refusal_rows
from overlap.config.training import (
    DatasetConfig,
    DDPConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainConfig,
)
from overlap.errors import ConfigError

_SECTIONS = [f.name for f in fields(ConfigContainer) if not f.name.startswith("_")]
# the dataclass of each section an override sets a field of, in `--list-keys` order
SECTION_CLASSES: dict[str, type] = {
    "model": ModelConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "ddp": DDPConfig,
    "tokenizer": TokenizerConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "dataset": DatasetConfig,
    "mixed_precision": MixedPrecisionConfig,
    "comm_overlap": CommOverlapConfig,
}


def _alias_hint(home_section: str, home_name: str) -> Any:
    """An alias's type: its home's, or None (an alias's None means "not set")."""
    return _hints(SECTION_CLASSES[home_section])[home_name] | None


def _alias_names(section: str) -> list[str]:
    """The fields of `section` that are aliases of another section's knob (`ALIASES`)."""
    return [a.partition(".")[2] for a in ALIASES if a.partition(".")[0] == section]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config dataclass's resolved field types (resolving them parses annotations: once per
    class, not once per override - the planner's layout search resolves hundreds of command
    lines)."""
    return typing.get_type_hints(cls)


def parse_value(key: str, raw: str) -> Any:
    parsed = _parsed(raw)
    if isinstance(parsed, Exception):
        raise ConfigError(
            key,
            raw,
            f"the value cannot be parsed ({parsed.__class__.__name__}).",
            "write it as YAML: 3, 0.5, true, null, name or [a,b] (quote strings with odd "
            "characters).",
        ) from None
    return copy.deepcopy(parsed)  # a list or mapping stays the caller's own


@functools.lru_cache(maxsize=4096)
def _parsed(raw: str) -> Any:
    """`raw` read as YAML (OmegaConf's dotlist rules), or the exception that refused it: parsed once
    per distinct text (the planner's layout search resolves the same overrides hundreds of
    times)."""
    try:
        parsed = OmegaConf.create({"v": None})
        parsed.merge_with_dotlist([f"v={raw}"])
        value = parsed["v"]
    except (OmegaConfBaseException, yaml.YAMLError, ValueError) as exc:
        return exc
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against the type hint `hint`, converting int -> float where natural."""
    if hint is Any:
        return value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(key, value, option)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(
            key, value, f"expected {_hint_name(hint)}.", f"give a value of type {_hint_name(hint)}."
        )
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        if isinstance(value, str):
            value = comma_list(value)
        if not isinstance(value, list):
            raise ConfigError(key, value, "expected a list.", "write it as [a,b] or a,b.")
        return [_coerce(key, v, item) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "expected a mapping.", "write it as {a: 1}.")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    elif is_dataclass(hint):
        if isinstance(value, hint):
            return value
    raise ConfigError(
        key, value, f"expected {_hint_name(hint)}.", f"give a value of type {_hint_name(hint)}."
    )


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_hint_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def _unknown(key: str, name: str, choices: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, choices, n=3)
    hint = f"did you mean {', '.join(close)}?" if close else f"valid names: {', '.join(choices)}."
    return ConfigError(key, name, "unknown configuration key.", hint)


def apply_override(cfg: ConfigContainer, item: str) -> tuple[str, Any]:
    """Apply one override; return (key, value) so later flags can detect a contradiction with it."""
    if "=" not in item or item.startswith(("+", "~")):
        raise ConfigError(
            "override",
            item,
            "overrides have the form section.field=value (Hydra's +, ++ and ~ prefixes are not "
            "supported).",
            "write e.g. model.num_layers=4.",
        )
    key, raw = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    section = parts[0]
    if section not in _SECTIONS:
        raise _unknown(key, section, _SECTIONS)
    value = parse_value(key, raw)
    if section == "env_vars":
        if len(parts) != 2:
            raise ConfigError(
                key, raw, "environment overrides name one variable.", "write env_vars.NAME=value."
            )
        cfg.env_vars[parts[1]] = str(value)
        return key, str(value)
    if section == "mixed_precision" and len(parts) == 1:
        if not isinstance(value, str) and value is not None:
            raise ConfigError(
                key, value, "expected a preset name.", "use bf16_mixed, fp16_mixed or fp32."
            )
        cfg.mixed_precision = None if value is None else get_mixed_precision_config(value)
        return key, value
    if len(parts) != 2:
        raise ConfigError(
            key, raw, "overrides address one field of one section.", "write section.field=value."
        )
    if section == "comm_overlap" and cfg.comm_overlap is None:
        cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=None)
    if section == "mixed_precision":
        if cfg.mixed_precision is None:
            cfg.mixed_precision = MixedPrecisionConfig()
        elif isinstance(cfg.mixed_precision, str):
            cfg.mixed_precision = get_mixed_precision_config(cfg.mixed_precision)
    target = getattr(cfg, section)
    hints = _hints(type(target))
    names = [f.name for f in fields(target)]
    home = ALIASES.get(key)
    if home is not None:  # Bridge's other spelling: typed like its home, kept on this section
        home_section, _, home_name = home.partition(".")
        hints = {parts[1]: _alias_hint(home_section, home_name)}
        names.append(parts[1])
    if key in MOVED:
        raise ConfigError(
            key,
            value,
            f"this setting is {MOVED[key]} (Megatron-Bridge's name).",
            f"write {MOVED[key]}={raw}.",
        )
    if key in NOT_CARRIED:
        raise ConfigError(
            key, value, f"Bridge's switch is not carried: {NOT_CARRIED[key]}.", "drop it."
        )
    if parts[1] not in names:
        raise _unknown(key, parts[1], names + _alias_names(section))
    value = _coerce(key, value, hints[parts[1]])
    setattr(target, parts[1], value)
    return key, value


def apply_overrides(cfg: ConfigContainer, items: list[str]) -> dict[str, Any]:
    """Apply overrides in order (a later one for the same key wins); return {key: value} of what
    they set. The command line refuses such repeats first (`check_override_repeats`)."""
    return dict(apply_override(cfg, item) for item in items)


def check_override_repeats(items: list[str]) -> None:
    """A command line's overrides: the same key twice is an error naming both (the reference lets
    the last one win, silently), and so is a `mixed_precision=PRESET` after a
    `mixed_precision.FIELD=...`: the preset replaces the whole section and would drop the field."""
    seen: dict[str, str] = {}
    for item in items:
        key = item.split("=", 1)[0].strip()
        if key in seen:
            raise ConfigError(
                key,
                item.split("=", 1)[1] if "=" in item else item,
                f"this key is given twice ({seen[key]} and {item}); one of them would be silently "
                "dropped.",
                "keep only the one you mean.",
            )
        if key == "mixed_precision":
            fields_before = [v for k, v in seen.items() if k.startswith("mixed_precision.")]
            if fields_before:
                raise ConfigError(
                    key,
                    item.split("=", 1)[1],
                    "the preset replaces the whole mixed_precision section, dropping the earlier "
                    f"{fields_before[0]}.",
                    "put mixed_precision=PRESET before the mixed_precision.FIELD overrides that "
                    "refine it.",
                )
        seen[key] = item


def override_key_rows() -> list[tuple[str, str, str, str]]:
    """(key, type, default, description) for every `section.field` an override can set; the
    description is the field's comment in its dataclass (`overlap.config.field_docs`)."""
    rows = []
    for section, cls in SECTION_CLASSES.items():
        hints = _hints(cls)
        docs = field_docs(cls)
        for f in fields(cls):
            if f.name.startswith("_"):
                continue
            default = (
                repr(f.default)
                if f.default is not MISSING
                else "(required)"
                if f.default_factory is MISSING
                else repr(f.default_factory())
            )
            doc = docs.get(f.name, "")
            aliases = spellings(f"{section}.{f.name}")[1:]
            if aliases:
                doc += f" (alias: {', '.join(aliases)})"
            rows.append((f"{section}.{f.name}", _hint_name(hints[f.name]), default, doc))
        for name in _alias_names(section):
            home_section, _, home_name = ALIASES[f"{section}.{name}"].partition(".")
            home_cls = SECTION_CLASSES[home_section]
            rows.append(
                (
                    f"{section}.{name}",
                    _hint_name(_alias_hint(home_section, home_name)),
                    "None",
                    f"{rank_rule(f'{section}.{name}')}: {field_docs(home_cls).get(home_name, '')}",
                )
            )
    rows.append(
        (
            "mixed_precision",
            "preset name",
            "bf16_mixed | fp16_mixed | fp32",
            "a preset that replaces the whole section",
        )
    )
    rows.append(("env_vars.NAME", "str", "", "an environment variable for the workers"))
    rows += [(key, "refused", "", why) for key, why in refusal_rows()]
    return rows


def list_override_keys() -> list[str]:
    """Every `section.field` an override can set, with its type, default and description
    (`overlap explain --list-keys`)."""
    rows = override_key_rows()
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    return [
        f"{k:<{width[0]}}  {t:<{width[1]}}  {d:<{width[2]}}  {doc}".rstrip()
        for k, t, d, doc in rows
    ]
