"""Tensor-parallel communication-overlap plans ("userbuffers presets"): Bridge's declared surface.

A plan names, for every tensor-parallel GEMM slot of one transformer layer, the method that hides
its collective behind compute (``ring_exchange``, ``pipeline`` with ``num_splits`` chunks, or
``bulk``; what each means and which slot may use which: `overlap.kernels.tp_overlap`), plus how many
SMs (``num_sm``) and which CGA size Transformer Engine's communication kernels may use, and whether
its layernorm kernels keep an SM margin for them (``set_sm_margin``).

The class names, field names and order, ``method`` strings and the 19 preset names follow
Megatron-Bridge's ``comm_overlap.py`` so that configurations written for it keep working; the
presets are data (``presets/tp_overlap.yaml``), each a module attribute under its name.
:meth:`TransformerLayerTPOverlapCfg.to_dict` gives the nested dict Bridge hands to the model
(``model.tp_comm_overlap_cfg``); the resolution (`overlap.config.comm_overlap`) hands that dict to
`overlap.kernels.tp_overlap.effective_tp_plan`, which decides what each slot runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from overlap.errors import ConfigError
from overlap.kernels import BULK, PIPELINE, RING

# the 19 userbuffers_* presets join these once loaded from the presets file
__all__ = [
    "TPOverlapCfg",
    "PipelineOverlapCfg",
    "RingExchangeOverlapCfg",
    "BulkOverlapCfg",
    "TransformerLayerTPOverlapCfg",
    "TP_OVERLAP_PRESETS",
    "get_tp_overlap_preset",
]


# --------------------------------------------------------------------------------------------------
# Per-GEMM plans
# --------------------------------------------------------------------------------------------------


@dataclass
class TPOverlapCfg:
    """Marker base class of every per-GEMM overlap plan."""


@dataclass
class PipelineOverlapCfg(TPOverlapCfg):
    """A GEMM's plan with ``method="pipeline"`` (``num_splits`` chunks; what it runs:
    `overlap.kernels.tp_overlap`).

    Deliberate difference from Megatron-Bridge: there the ``fp8_buf`` default is the 1-tuple
    ``(False,)`` (a trailing-comma bug). A tuple is truthy, so in FP8 runs every pipeline-method
    GEMM that does not set ``fp8_buf`` explicitly would claim an FP8 communication buffer. Ours is
    the plain ``False``.
    """

    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = False  # NOT the reference's truthy `(False,)`; see the class docstring.
    atomic_gemm: bool = False
    method: str = PIPELINE


@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    """A GEMM's plan with ``method="ring_exchange"`` (``aggregate``: two chunks per ring step; what
    it runs: `overlap.kernels.tp_overlap`)."""

    aggregate: bool = False
    method: str = RING
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class BulkOverlapCfg(TPOverlapCfg):
    """A GEMM's plan with ``method="bulk"`` (what it runs: `overlap.kernels.tp_overlap`)."""

    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = BULK


# --------------------------------------------------------------------------------------------------
# Per-layer plan
# --------------------------------------------------------------------------------------------------


@dataclass
class TransformerLayerTPOverlapCfg:
    """The overlap plan of every TP GEMM of one transformer layer. ``None`` leaves the GEMM out of
    the plan (Bridge drops it from the dict): the slot runs its default method
    (`overlap.kernels.tp_overlap`); switch a slot off with Megatron's switches
    (``tp_comm_overlap_ag`` ...)."""

    qkv_dgrad: TPOverlapCfg | None
    qkv_wgrad: TPOverlapCfg | None
    fc1_dgrad: TPOverlapCfg | None
    fc1_wgrad: TPOverlapCfg | None
    qkv_fprop: TPOverlapCfg | None
    proj_dgrad: TPOverlapCfg | None
    fc1_fprop: TPOverlapCfg | None
    fc2_dgrad: TPOverlapCfg | None
    proj_fprop: TPOverlapCfg | None
    fc2_fprop: TPOverlapCfg | None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested-dict form (``dataclasses.asdict``) with the top-level ``None`` entries dropped.

        Example: ``{"qkv_dgrad": {"num_sm": 4, "cga_size": 2, "set_sm_margin": False, "method":
        "bulk"}, ...}``. Only whole-GEMM ``None`` entries are removed; values inside the nested
        dicts are kept as they are.
        """
        return {
            name: value for name, value in dataclasses.asdict(self).items() if value is not None
        }


# --------------------------------------------------------------------------------------------------
# The presets (presets/tp_overlap.yaml)
# --------------------------------------------------------------------------------------------------

# the per-GEMM plan class of each method
_CLASSES: dict[str, type[TPOverlapCfg]] = {
    BULK: BulkOverlapCfg,
    PIPELINE: PipelineOverlapCfg,
    RING: RingExchangeOverlapCfg,
}


def _load(text: str) -> dict[str, TransformerLayerTPOverlapCfg]:
    """The presets of a TP-overlap presets file by name, in the file's order: each slot's entry
    built as the class its ``method`` names (a new object per GEMM: the file's shared entries are
    YAML aliases of one dict)."""
    return {
        name: TransformerLayerTPOverlapCfg(
            **{
                slot: None if entry is None else _CLASSES[entry["method"]](**entry)
                for slot, entry in slots.items()
            }
        )
        for name, slots in yaml.safe_load(text)["presets"].items()
    }


TP_OVERLAP_PRESETS = _load(
    resources.files("overlap.config").joinpath("presets/tp_overlap.yaml").read_text()
)
"""The 19 userbuffers presets by name; each is also a module attribute (and in ``__all__``), so
``from overlap.config.tp_overlap import userbuffers_...`` works as in Bridge."""
globals().update(TP_OVERLAP_PRESETS)
__all__ += list(TP_OVERLAP_PRESETS)


def get_tp_overlap_preset(name: str) -> TransformerLayerTPOverlapCfg:
    """The preset called ``name``; a :class:`~overlap.errors.ConfigError` naming the valid choices
    otherwise.

    The returned object is the shared module-level preset: copy it (``copy.deepcopy``) before
    mutating it.
    """
    try:
        return TP_OVERLAP_PRESETS[name]
    except KeyError:
        raise ConfigError(
            field="comm_overlap.tp_comm_overlap_cfg",
            value=name,
            why="unknown preset name for the tensor-parallel overlap plan.",
            fix="use one of: " + ", ".join(sorted(TP_OVERLAP_PRESETS)),
        ) from None
