"""Tensor-parallel communication-overlap plans ("userbuffers presets").

A plan says, for every tensor-parallel GEMM of one transformer layer, how its collective is hidden behind compute:

* ``method="ring_exchange"``: the GEMM is split along the ring and each chunk is exchanged point-to-point;
* ``method="pipeline"``: the GEMM is cut into ``num_splits`` chunks whose reduce-scatter overlaps the next chunk;
* ``method="bulk"``: the whole collective runs concurrently with an independent GEMM;

plus how many SMs (``num_sm``) and which CGA size the communication kernels may use, and whether the layernorm kernels
keep an SM margin for them (``set_sm_margin``).

The class names, field names and order, ``method`` strings and the 19 preset names follow Megatron-Bridge's
``comm_overlap.py`` so that configurations written for it keep working. In our runtime these plans are a compatibility
surface: they are validated and converted to a nested dict with :meth:`TransformerLayerTPOverlapCfg.to_dict`. No
runtime consumes them yet (TP communication overlap is not built; its gate turns the request off with a logged
reason, or fails under strict mode).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from overlap.errors import ConfigError

__all__ = [
    "TPOverlapCfg",
    "PipelineOverlapCfg",
    "RingExchangeOverlapCfg",
    "BulkOverlapCfg",
    "TransformerLayerTPOverlapCfg",
    "userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192",
    "userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192",
    "userbuffers_bf16_b200_h8192_tp2_mbs1_seqlen8192",
    "userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192",
    "userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192",
    "userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192",
    "userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192",
    "userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192",
    "userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora",
    "userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora",
    "userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048",
    "userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048",
    "userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048",
    "userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048",
    "userbuffers_bf16_b200_h12288_tp4_mbs1_seqlen2048",
    "userbuffers_fp8_b200_h12288_tp4_mbs1_seqlen2048",
    "userbuffers_bf16_b200_h6144_tp2_mbs1_seqlen4096",
    "userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096",
    "userbuffers_fp8_b200_h18432_tp8_mbs1_seqlen4096",
    "TP_OVERLAP_PRESETS",
    "get_tp_overlap_preset",
]


# ---------------------------------------------------------------------------------------------------------------------
# Per-GEMM plans
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class TPOverlapCfg:
    """Marker base class of every per-GEMM overlap plan."""


@dataclass
class PipelineOverlapCfg(TPOverlapCfg):
    """Chunked ("pipeline") overlap: the GEMM is cut into ``num_splits`` pieces whose collective overlaps the next one.

    Deliberate difference from Megatron-Bridge: there the ``fp8_buf`` default is the 1-tuple ``(False,)`` (a
    trailing-comma bug). A tuple is truthy, so in FP8 runs every pipeline-method GEMM that does not set ``fp8_buf``
    explicitly would claim an FP8 communication buffer. Ours is the plain ``False``.
    """

    num_sm: int
    cga_size: int
    num_splits: int
    set_sm_margin: bool
    fp8_buf: bool = False  # NOT the reference's truthy `(False,)`; see the class docstring.
    atomic_gemm: bool = False
    method: str = "pipeline"


@dataclass
class RingExchangeOverlapCfg(TPOverlapCfg):
    """Ring-exchange overlap: chunks travel point-to-point around the TP ring while the local chunk is multiplied."""

    aggregate: bool = False
    method: str = "ring_exchange"
    num_sm: int = 1
    cga_size: int = 1
    set_sm_margin: bool = False
    fp8_buf: bool = False
    atomic_gemm: bool = False


@dataclass
class BulkOverlapCfg(TPOverlapCfg):
    """Bulk overlap: the whole collective runs concurrently with an independent GEMM."""

    num_sm: int
    cga_size: int
    set_sm_margin: bool
    method: str = "bulk"


# ---------------------------------------------------------------------------------------------------------------------
# Per-layer plan
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class TransformerLayerTPOverlapCfg:
    """The overlap plan of every TP GEMM of one transformer layer; ``None`` means "no overlap for this GEMM"."""

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

        Example: ``{"qkv_dgrad": {"num_sm": 4, "cga_size": 2, "set_sm_margin": False, "method": "bulk"}, ...}``.
        Only whole-GEMM ``None`` entries are removed; values inside the nested dicts are kept as they are.
        """
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}


# ---------------------------------------------------------------------------------------------------------------------
# Private constructors keeping the preset table readable
# ---------------------------------------------------------------------------------------------------------------------


def _bulk(num_sm: int, cga_size: int = 2) -> BulkOverlapCfg:
    """Bulk plan; every preset's bulk entry runs without an SM margin."""
    return BulkOverlapCfg(num_sm=num_sm, cga_size=cga_size, set_sm_margin=False)


def _pipe(num_sm: int, cga_size: int = 2, num_splits: int = 4, *, fp8_buf: bool = False) -> PipelineOverlapCfg:
    """Pipeline plan; every preset's pipeline entry keeps an SM margin."""
    return PipelineOverlapCfg(
        num_sm=num_sm, cga_size=cga_size, num_splits=num_splits, set_sm_margin=True, fp8_buf=fp8_buf
    )


def _ring(
    *, margin: bool = False, aggregate: bool = False, fp8_buf: bool = False, cga_size: int = 1
) -> RingExchangeOverlapCfg:
    """Ring-exchange plan with the defaults except what is named."""
    return RingExchangeOverlapCfg(aggregate=aggregate, set_sm_margin=margin, fp8_buf=fp8_buf, cga_size=cga_size)


def _layer(
    qkv_dgrad: TPOverlapCfg | None,
    qkv_wgrad: TPOverlapCfg | None,
    fc1_dgrad: TPOverlapCfg | None,
    fc1_wgrad: TPOverlapCfg | None,
    proj_fprop: TPOverlapCfg | None,
    fc2_fprop: TPOverlapCfg | None,
    *,
    middle: dict[str, bool] | None = None,
) -> TransformerLayerTPOverlapCfg:
    """One layer plan in the column order of the reference table.

    The four "middle" GEMMs (qkv_fprop, proj_dgrad, fc1_fprop, fc2_dgrad) are ring exchange in every preset; ``middle``
    holds the keyword arguments of :func:`_ring` for them (plain defaults when omitted). Each GEMM gets its own object.
    """
    ring_kwargs = middle or {}
    return TransformerLayerTPOverlapCfg(
        qkv_dgrad=qkv_dgrad,
        qkv_wgrad=qkv_wgrad,
        fc1_dgrad=fc1_dgrad,
        fc1_wgrad=fc1_wgrad,
        qkv_fprop=_ring(**ring_kwargs),
        proj_dgrad=_ring(**ring_kwargs),
        fc1_fprop=_ring(**ring_kwargs),
        fc2_dgrad=_ring(**ring_kwargs),
        proj_fprop=proj_fprop,
        fc2_fprop=fc2_fprop,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Presets. Columns: qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad, proj_fprop, fc2_fprop.
# ---------------------------------------------------------------------------------------------------------------------

# Llama 70B
userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192 = _layer(
    _bulk(4), _bulk(24), _bulk(2), _bulk(4), _pipe(24), _pipe(16)
)
userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 = _layer(
    _bulk(4), _bulk(24), _bulk(2), _bulk(4), _ring(margin=True), _ring(margin=True)
)
userbuffers_bf16_b200_h8192_tp2_mbs1_seqlen8192 = _layer(
    _bulk(16), _bulk(24), _bulk(2), _bulk(4), _pipe(32), _pipe(16)
)
userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192 = _layer(
    _bulk(4), _bulk(24), _bulk(2), _bulk(4), _ring(margin=True), _ring(margin=True)
)

# Llama 405B
userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192 = _layer(
    _bulk(2), _bulk(24), _bulk(2), _bulk(2), _pipe(24), _pipe(8)
)
userbuffers_fp8_h100_h16384_tp8_cp2_mbs1_seqlen8192 = _layer(
    _bulk(2), _bulk(24), _bulk(2), _bulk(2), _ring(margin=True), _ring(margin=True)
)
userbuffers_bf16_b200_h16384_tp4_cp2_mbs1_seqlen8192 = _layer(
    _bulk(8), _bulk(24), _bulk(2), _bulk(2), _pipe(32), _pipe(8)
)
userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192 = _layer(
    _bulk(8), _bulk(32), _bulk(2), _bulk(8), _ring(margin=True), _ring(margin=True)
)

# Llama 70B LoRA (no weight-gradient overlap: the base weights are frozen)
userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora = _layer(
    _bulk(2),
    None,
    _pipe(16, fp8_buf=True),
    None,
    _ring(cga_size=2, margin=True, fp8_buf=True),
    _ring(cga_size=2, margin=True, fp8_buf=True),
    middle={"margin": True},
)

# Llama 405B LoRA
userbuffers_fp8_h100_h16384_tp4_mbs1_seqlen2048_lora = _layer(
    _bulk(2),
    None,
    _pipe(16, fp8_buf=True),
    None,
    _pipe(32, fp8_buf=True),
    _pipe(16, fp8_buf=True),
    middle={"aggregate": True},
)

# GPT-3 20B
userbuffers_bf16_h100_h6144_tp2_mbs2_seqlen2048 = _layer(
    _bulk(8), _bulk(16), _bulk(4), _bulk(16), _pipe(16), _pipe(24)
)
userbuffers_fp8_h100_h6144_tp2_mbs2_seqlen2048 = _layer(
    _bulk(8), _bulk(16), _bulk(4), _bulk(16), _pipe(16, fp8_buf=True), _pipe(24, fp8_buf=True)
)

# GPT-3 175B
userbuffers_bf16_h100_h12288_tp4_mbs1_seqlen2048 = _layer(
    _bulk(4), _bulk(4), _bulk(2), _bulk(4), _pipe(24), _ring(margin=True)
)
userbuffers_fp8_h100_h12288_tp4_mbs1_seqlen2048 = _layer(
    _bulk(4), _bulk(4), _bulk(2), _bulk(4), _ring(margin=True), _ring(margin=True)
)
userbuffers_bf16_b200_h12288_tp4_mbs1_seqlen2048 = _layer(
    _bulk(4), _bulk(16), _bulk(2), _bulk(8), _ring(margin=True), _ring(margin=True)
)
userbuffers_fp8_b200_h12288_tp4_mbs1_seqlen2048 = _layer(
    _bulk(4), _bulk(16), _bulk(2), _bulk(8), _ring(margin=True), _ring(margin=True)
)

# Nemotron 15B
userbuffers_bf16_b200_h6144_tp2_mbs1_seqlen4096 = _layer(
    _bulk(8), _bulk(32), _bulk(2), _bulk(8), _ring(margin=True), _ring(margin=True)
)

# Nemotron 340B
userbuffers_bf16_b200_h18432_tp8_mbs1_seqlen4096 = _layer(
    _bulk(8), _bulk(32), _bulk(2), _bulk(8), _ring(margin=True), _pipe(24)
)
userbuffers_fp8_b200_h18432_tp8_mbs1_seqlen4096 = _layer(
    _bulk(8), _bulk(32), _bulk(2), _bulk(8), _ring(margin=True), _ring(margin=True)
)


TP_OVERLAP_PRESETS: dict[str, TransformerLayerTPOverlapCfg] = {
    name: globals()[name] for name in __all__ if name.startswith("userbuffers_")
}


def get_tp_overlap_preset(name: str) -> TransformerLayerTPOverlapCfg:
    """The preset called ``name``; a :class:`~overlap.errors.ConfigError` naming the valid choices otherwise.

    The returned object is the shared module-level preset: copy it (``copy.deepcopy``) before mutating it.
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
