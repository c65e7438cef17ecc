"""Recipes: named, ready-to-run configurations (`-m FAMILY -mr NAME`), declared as data in
`models.yaml` beside this module (what each is, and why, is said there beside its fields).

A recipe is its sections as ConfigContainer takes them; `build(num_gpus)` makes a fresh container
of them for a run of `num_gpus` ranks: `{per_gpu: k}` values scaled, and EP = gcd(ranks per
pipeline stage, `max_ep`) for the recipes with experts (PP = 1 here; the harness re-derives it per
pipeline stage once the flags and overrides have chosen the layout).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from overlap.config.comm_overlap import CommOverlapConfig
from overlap.config.container import ConfigContainer
from overlap.config.model import ModelConfig
from overlap.config.training import DDPConfig, OptimizerConfig, SchedulerConfig, TrainConfig
from overlap.errors import ConfigError

# The sections a recipe may set, and the dataclass each is built as (mixed_precision: a preset name)
SECTIONS = {
    "model": ModelConfig,
    "train": TrainConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "ddp": DDPConfig,
    "comm_overlap": CommOverlapConfig,
    "mixed_precision": str,
}


@dataclass(frozen=True)
class Recipe:
    family: str
    name: str
    summary: str
    # section -> its fields (mixed_precision -> a preset name), as models.yaml writes them
    sections: Mapping[str, Any]
    # EP = gcd(ranks per pipeline stage, max_ep) unless the user sets it: experts are carved out of
    # each stage's ranks, so the rule must see the layout the flags and overrides chose (None: the
    # recipe has no EP rule).
    max_ep: int | None = None

    def ep_for(self, ranks_per_stage: int) -> int:
        return math.gcd(ranks_per_stage, self.max_ep or 1)

    def build(self, num_gpus: int) -> ConfigContainer:
        """A fresh container of this recipe for `num_gpus` ranks (builds share nothing)."""
        kwargs: dict[str, Any] = {}
        for section, values in self.sections.items():
            if section == "mixed_precision":
                kwargs[section] = values
                continue
            fields = {k: _scaled(v, num_gpus) for k, v in copy.deepcopy(values).items()}
            if section == "model" and self.max_ep is not None:
                fields["expert_model_parallel_size"] = self.ep_for(num_gpus)
            kwargs[section] = SECTIONS[section](**fields)
        return ConfigContainer(**kwargs)


def _scaled(value: Any, num_gpus: int) -> Any:
    """`{per_gpu: k}` -> k * num_gpus; any other value as written."""
    if isinstance(value, dict) and set(value) == {"per_gpu"}:
        return value["per_gpu"] * num_gpus
    return value


def _merged(base: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """`own` over `base`, section by section and field by field."""
    out = copy.deepcopy(dict(base))
    for key, value in own.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _load(text: str) -> dict[str, Recipe]:
    """The recipes of models.yaml, each with its `base` chain merged in."""
    data = yaml.safe_load(text)
    entries = {**data.get("bases", {}), **data["recipes"]}

    def resolved(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
        if name in seen:
            raise ValueError(f"recipes: base cycle {' -> '.join((*seen, name))}")
        entry = dict(entries[name])
        base = entry.pop("base", None)
        return _merged(resolved(base, (*seen, name)), entry) if base else entry

    out = {}
    for name in data["recipes"]:
        entry = resolved(name)
        family, summary, max_ep = (
            entry.pop("family"),
            entry.pop("summary"),
            entry.pop("max_ep", None),
        )
        unknown = set(entry) - set(SECTIONS)
        if unknown:
            raise ValueError(f"recipe {name}: unknown sections {sorted(unknown)}")
        out[name] = Recipe(family, name, summary, entry, max_ep)
    return out


RECIPES: dict[str, Recipe] = _load(
    resources.files("overlap.recipes").joinpath("models.yaml").read_text()
)


def get_recipe(family: str, name: str) -> Recipe:
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ConfigError(
            "-mr/--model_recipe_name",
            name,
            "unknown recipe.",
            f"use one of: {', '.join(RECIPES)} (overlap explain --list-recipes).",
        )
    if recipe.family != family:
        raise ConfigError(
            "-m/--model_family_name",
            family,
            f"recipe {name} belongs to family '{recipe.family}'.",
            f"use -m {recipe.family}.",
        )
    return recipe
