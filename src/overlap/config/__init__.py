"""Configuration: Megatron-Bridge-compatible dataclasses, overlap resolution with logged decisions
(the recipes built on it are `overlap.recipes`)."""

from overlap.config.architecture import TransformerArchitecture
from overlap.config.comm_overlap import CommOverlapConfig
from overlap.config.container import ConfigContainer, Resolution
from overlap.config.flex_dispatcher import apply_flex_dispatcher_backend
from overlap.config.mixed_precision import MixedPrecisionConfig, get_mixed_precision_config
from overlap.config.model import ModelConfig

# the 19 userbuffers_* presets, star-importable
from overlap.config.tp_overlap import *  # noqa: F403
from overlap.config.tp_overlap import (
    BulkOverlapCfg,
    PipelineOverlapCfg,
    RingExchangeOverlapCfg,
    TransformerLayerTPOverlapCfg,
)
from overlap.config.training import (
    DDPConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainConfig,
)

__all__ = [
    "BulkOverlapCfg",
    "CommOverlapConfig",
    "ConfigContainer",
    "DDPConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineOverlapCfg",
    "Resolution",
    "RingExchangeOverlapCfg",
    "SchedulerConfig",
    "TokenizerConfig",
    "TrainConfig",
    "TransformerArchitecture",
    "TransformerLayerTPOverlapCfg",
    "apply_flex_dispatcher_backend",
    "get_mixed_precision_config",
]
