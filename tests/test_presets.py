"""The presets (model recipes and Bridge's perf recipes, `overlap/recipes/*.yaml`; the userbuffers
TP-overlap presets and the mixed-precision presets, `overlap/config/presets/*.yaml`) are data; this
holds every preset to what it built when it was code: the fields each recipe sets at several GPU
counts (those different from a default container), every perf recipe's layout, settings, skip
rules, environment and not-carried list, every TP-overlap preset's per-GEMM dataclasses and every
mixed-precision preset's fields, against `presets_snapshot.json` (written from the code presets
before they became files). A preset changed on purpose updates the snapshot with it (`python
tests/test_presets.py`), so the change shows in review."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from overlap.config.container import ConfigContainer
from overlap.config.mixed_precision import MIXED_PRECISION_PRESETS
from overlap.config.tp_overlap import TP_OVERLAP_PRESETS
from overlap.recipes.models import RECIPES
from overlap.recipes.perf import PERF_RECIPES, Setting

SNAPSHOT = Path(__file__).with_name("presets_snapshot.json")
GPU_COUNTS = (1, 2, 16, 256)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def presets() -> dict:
    """Every preset as plain data."""
    default = _flat(ConfigContainer().to_dict())
    recipes = {}
    for name, r in RECIPES.items():
        configs = {}
        for ng in GPU_COUNTS:
            got = _flat(r.build(ng).to_dict())
            configs[str(ng)] = {k: v for k, v in got.items() if default.get(k, got) != v} | {
                k: "<absent>" for k in default if k not in got
            }
        recipes[name] = {"family": r.family, "summary": r.summary, "max_ep": r.max_ep} | {
            "configs": configs
        }
    perf = {
        "/".join(key): [
            {
                "name": r.name,
                "num_gpus": r.num_gpus,
                "layout": [list(x) for x in r.layout],
                "settings": [
                    [s.key, s.value, s.why, s.skip.__name__.lstrip("_") if s.skip else None]
                    for s in (Setting(*s) for s in r.settings)
                ],
                "env": [list(x) for x in r.env],
                "not_carried": [list(x) for x in r.not_carried],
                "hybridep_env": [list(x) for x in r.hybridep_env],
            }
            for r in rs
        ]
        for key, rs in PERF_RECIPES.items()
    }
    # each GEMM's class as well as its fields (a class is more than its method string)
    tp_overlap = {
        name: {
            slot: None if cfg is None else {"class": type(cfg).__name__} | dataclasses.asdict(cfg)
            for slot, cfg in ((f.name, getattr(preset, f.name)) for f in dataclasses.fields(preset))
        }
        for name, preset in TP_OVERLAP_PRESETS.items()
    }
    precision = {name: dataclasses.asdict(mp) for name, mp in MIXED_PRECISION_PRESETS.items()}
    return {
        "recipes": recipes,
        "perf_recipes": perf,
        "tp_overlap": tp_overlap,
        "mixed_precision": precision,
    }


def _dump(data: dict) -> str:
    """One line per preset (and per GPU count), keys sorted: a change reads as a one-line diff."""
    lines = []
    for kind in sorted(data):
        lines.append(f"{json.dumps(kind)}: {{")
        entries = sorted(data[kind].items())
        for i, (name, value) in enumerate(entries):
            comma = "," if i < len(entries) - 1 else ""
            lines.append(f"  {json.dumps(name)}: {json.dumps(value, sort_keys=True)}{comma}")
        lines.append("}," if kind != sorted(data)[-1] else "}")
    return "{\n" + "\n".join(lines) + "\n}\n"


def test_every_preset_builds_what_it_built_as_code():
    # text, not ==: 1 and 1.0, True and 1 are different settings
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(_dump(presets()))
    assert sorted(got) == sorted(want)
    for kind in want:
        assert sorted(got[kind]) == sorted(want[kind]), kind
        for name in want[kind]:
            assert json.dumps(got[kind][name], sort_keys=True) == json.dumps(
                want[kind][name], sort_keys=True
            ), (kind, name)


def test_recipes_keep_their_order():
    """--list-recipes shows them in the order the file declares."""
    assert list(RECIPES) == [
        "qwen3_30b_a3b",
        "qwen3_moe_tiny",
        "dense_tiny",
        "qwen3_235b_a22b",
        "qwen3_8b",
        "llama3_8b",
        "llama3_70b",
    ]


if __name__ == "__main__":
    SNAPSHOT.write_text(_dump(presets()))
    sys.exit(0)
