"""The parallel layout: the sizes of every parallel dimension and whether sequence parallelism runs
(`ParallelLayout`, dims.py), and which layers each pipeline stage holds (`PipelineLayout`,
pipeline.py).

Geometry, not configuration: `ConfigContainer.finalize` builds both once from the model's fields,
and the runtime (process groups, model build, schedules, the memory estimate, the planner) reads
the sizes from here under one vocabulary (`layout.tp`, `layout.pp`, ...), the way torchtitan reads
`ParallelDims`. It sits below `config/` and imports only the error types."""

from overlap.layout.dims import ParallelLayout
from overlap.layout.pipeline import PipelineLayout, StageLayers, resolve_pipeline_layout

__all__ = ["ParallelLayout", "PipelineLayout", "StageLayers", "resolve_pipeline_layout"]
