"""The parallel layout: the sizes of every parallel dimension and whether sequence parallelism runs
(`ParallelLayout`, dims.py), which layers each pipeline stage holds (`PipelineLayout`,
pipeline.py), both built from the model's fields with the splits' divisibility rules (resolve.py),
and what a layout must be for a feature to run (prerequisites.py: the predicates the rules, the
planner and the runtime share).

Geometry, not configuration: `ConfigContainer.finalize` builds both once from the model's fields,
and the runtime (process groups, model build, schedules, the memory estimate, the planner) reads
the sizes from here under one vocabulary (`layout.tp`, `layout.pp`, ...), the way torchtitan reads
`ParallelDims`. It sits below `config/` and imports only the error types and the decision table."""

from overlap.layout.dims import ParallelLayout
from overlap.layout.pipeline import PipelineLayout, StageLayers, resolve_pipeline_layout

__all__ = ["ParallelLayout", "PipelineLayout", "StageLayers", "resolve_pipeline_layout"]
