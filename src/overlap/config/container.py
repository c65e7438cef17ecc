"""ConfigContainer: every section of a run, and `finalize(world_size)`, which resolves it in a fixed
order.

Order (documented in docs/configuration.md, tested): tokenizer -> pretrained architecture (a
Hugging Face `checkpoint.pretrained_checkpoint`'s config.json) -> model size checks -> mixed
precision -> parallel layout -> pipeline layout (the virtual pipeline size) -> data (the
tokenizer's padded vocabulary, the dataset files) -> comm overlap -> validation -> recompute
coverage -> checkpoint -> logger -> kernels (flex dispatcher backend, attention backend, MoE
permutation fusion, grouped GEMM, elementwise fusions). `finalize` snapshots what the user asked
for on its first call and re-resolves from that snapshot on every call, so calling it twice gives
the same result (edits made after the first call are not seen: build a new container instead).
The sections stay as typed: what finalize decides about the network (the vocabulary, a pretrained
folder's architecture) goes onto a copy of the model section, `Resolution.model`, which every
later stage checks and the runtime reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

from overlap.config.aliases import request, typed_aliases
from overlap.config.checkpoint import CheckpointConfig, resolve_checkpoint
from overlap.config.comm_overlap import CommOverlapConfig, OverlapPlan, resolve_comm_overlap
from overlap.config.logger import LoggerConfig, resolve_logger
from overlap.config.mixed_precision import (
    MixedPrecisionConfig,
    Precision,
    get_mixed_precision_config,
    resolve_precision,
)
from overlap.config.model import ModelConfig
from overlap.config.refusals import one_of
from overlap.config.training import (
    DatasetConfig,
    DDPConfig,
    OptimizerConfig,
    SchedulerConfig,
    TokenizerConfig,
    TrainConfig,
)
from overlap.data.resolution import record_blend, tokenizer_vocab
from overlap.decisions import RULE, Decision, DecisionLog
from overlap.errors import ConfigError, Rule, check_rules
from overlap.kernels import Kernels
from overlap.kernels.choices import resolve_kernels
from overlap.kernels.device import probe_device
from overlap.kernels.flex_backend import validate_flex_dispatcher_backend
from overlap.layout import ParallelLayout, PipelineLayout
from overlap.layout.resolve import resolve_layout, split_rules

# Takes the architecture from a Hugging Face folder: (model, folder, tokenizer.vocab_size, log) ->
# the folder's vocabulary (`overlap.hf.config_json.apply_pretrained`).
ApplyPretrained = Callable[[ModelConfig, str, int | None, DecisionLog], int]


def plain_value(value: Any) -> Any:
    """A configuration value as YAML and JSON can hold it (dataclasses to mappings without their
    private fields, with the alias spellings set on them as typed; anything exotic to its
    text)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: plain_value(getattr(value, f.name))
            for f in fields(value)
            if not f.name.startswith("_")
        } | {name: plain_value(v) for name, v in typed_aliases(value).items()}
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class Resolution:
    """What finalize decided, frozen: the model that runs (the typed model section with what
    finalize decided about the network: the NullTokenizer's or the Hugging Face tokenizer's
    vocabulary, a pretrained folder's architecture), the parallel layout (its virtual pipeline
    included), which layers each pipeline stage holds, every overlap switch as a plain value, the
    precision and the kernels (the token dispatcher included) - what the runtime reads - and the
    decision log (who decided each value, and why). The container's `model` keeps what was typed:
    every reader after finalize takes the network from here."""

    world_size: int
    model: ModelConfig
    layout: ParallelLayout
    pipeline: PipelineLayout
    overlap: OverlapPlan
    precision: Precision
    kernels: Kernels
    decisions: DecisionLog


@dataclass
class ConfigContainer:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    mixed_precision: MixedPrecisionConfig | str | None = None
    comm_overlap: CommOverlapConfig | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    _requested: ConfigContainer | None = field(default=None, repr=False, compare=False)
    _resolution: Resolution | None = field(default=None, repr=False, compare=False)

    @property
    def resolved(self) -> Resolution:
        """The last `finalize`'s result: what the runtime reads (the overlap plan, the layout).
        Reading it before finalize is a bug in the caller, not a user mistake."""
        if self._resolution is None:
            raise RuntimeError(
                "cfg.resolved before cfg.finalize(world_size): the runtime reads the resolved run, "
                "which finalize produces"
            )
        return self._resolution

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain data (Bridge's name): a checkpoint's run_config.yaml, a W&B run's
        config. The sections hold what was asked (their overlap switches and kernels as typed);
        once finalized, `model` is the model that ran (`Resolution.model`: the typed section with
        the vocabulary and a pretrained folder's architecture finalize decided), `overlap_plan`
        adds every overlap switch as resolved and `kernels` the kernels, fusions and token
        dispatcher that run."""
        out = plain_value(self)
        if self._resolution is not None:
            out["model"] = plain_value(self._resolution.model)
            out["overlap_plan"] = plain_value(self._resolution.overlap)
            out["kernels"] = plain_value(self._resolution.kernels)
        return out

    def finalize(
        self,
        world_size: int,
        device=probe_device,
        require_libraries: bool = True,
        command_line: Sequence[Decision] = (),
        on_cuda: bool | None = None,
        pretrained: ApplyPretrained | None = None,
    ) -> Resolution:
        """Resolve for `world_size` ranks. `device` says which GPU the flex-dispatcher rules check
        (this machine's by default; `explain` passes the target named by -g), `require_libraries`
        whether kernel libraries must be importable here, `command_line` the harness's own decisions
        (flags beaten by overrides), logged first, `on_cuda` whether the ranks compute on CUDA (the
        attention and MoE permutation rules; None: whether CUDA is available here), `pretrained`
        what takes the architecture from a Hugging Face folder as `checkpoint.pretrained_checkpoint`
        (`overlap.hf.config_json.apply_pretrained`: the mapping of config.json lives with hf/,
        above config, so a caller that runs from such a folder hands it in)."""
        if world_size < 1:
            raise ConfigError(
                "-ng/--num_gpus", world_size, "a run needs at least one rank.", "use -ng 1 or more."
            )
        if self._requested is None:  # the first: the sections are what was asked
            self._requested = copy.deepcopy(self)
        else:  # again: from what was first asked, as a copy (never the snapshot itself)
            fresh = copy.deepcopy(self._requested)
            for f in fields(self):
                if f.name not in ("_requested", "_resolution"):
                    setattr(self, f.name, getattr(fresh, f.name))
        self._resolution = None
        model = copy.deepcopy(self.model)  # what finalize decides about the network goes here

        strict = bool(self.comm_overlap and self.comm_overlap.strict)
        log = DecisionLog(strict)
        for decision in command_line:
            log.record_command_line(decision)
        self._apply_tokenizer(model)
        pretrained_vocab = self._apply_pretrained(model, log, pretrained)
        model.check_sizes()
        precision = self._apply_mixed_precision(model, log)
        layout, pipeline = resolve_layout(model, world_size, log)
        self._apply_data(model, layout, log, pretrained_vocab)
        plan = resolve_comm_overlap(
            self.comm_overlap, model, self.ddp, self.optimizer, precision, layout, log
        )
        self._validate(model, layout, plan)
        self._covered_recompute(model, log)
        resolve_checkpoint(self.checkpoint, log, self.scheduler)
        resolve_logger(self.logger, self.checkpoint.save, log)
        on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
        dispatcher = validate_flex_dispatcher_backend(model, log, device, require_libraries)
        kernels = resolve_kernels(
            model, precision.params_dtype, log, on_cuda, device, dispatcher, require_libraries
        )
        self._resolution = Resolution(
            world_size, model, layout, pipeline, plan, precision, kernels, log
        )
        return self._resolution

    # --- stages -----------------------------------------------------------------------------------
    def _apply_tokenizer(self, model: ModelConfig) -> None:
        """The tokenizer's own rules, and the NullTokenizer's vocabulary (tokenizer.vocab_size, an
        alias that beats the recipe's model.vocab_size) onto `model`, the one that runs."""
        tok = self.tokenizer
        hf = tok.tokenizer_type == "HuggingFaceTokenizer"
        check_rules(
            [
                one_of(
                    "tokenizer.tokenizer_type",
                    tok.tokenizer_type,
                    ("NullTokenizer", "HuggingFaceTokenizer"),
                    "unknown tokenizer type.",
                    "use NullTokenizer or HuggingFaceTokenizer.",
                    "use tokenizer.tokenizer_type=HuggingFaceTokenizer with a tokenizer.json.",
                ),
                (
                    "tokenizer.tokenizer_model",
                    tok.tokenizer_model,
                    not hf or tok.tokenizer_model,
                    "HuggingFaceTokenizer reads a tokenizer.json.",
                    "set --tokenizer_model PATH (a tokenizer.json or its folder).",
                ),
                (
                    "tokenizer.vocab_size",
                    tok.vocab_size,
                    not hf or tok.vocab_size is None,
                    "the vocabulary comes from the tokenizer; vocab_size is the NullTokenizer's.",
                    "drop --vocab_size.",
                ),
                (
                    "tokenizer.tokenizer_model",
                    tok.tokenizer_model,
                    hf or not tok.tokenizer_model,
                    "the NullTokenizer reads no file.",
                    "set --tokenizer_type HuggingFaceTokenizer, or drop --tokenizer_model.",
                ),
            ]
        )
        model.vocab_size = request({"model": model, "tokenizer": tok}, "model.vocab_size").value

    def _apply_pretrained(
        self, model: ModelConfig, log: DecisionLog, read: ApplyPretrained | None
    ) -> int | None:
        """A Hugging Face folder as `checkpoint.pretrained_checkpoint` decides the architecture of
        `model`, the one that runs (`read`: `overlap.hf.config_json.apply_pretrained`). Returns the
        folder's vocabulary (its embedding rows), None when the run is not from a Hugging Face
        folder."""
        from pathlib import Path

        path = self.checkpoint.pretrained_checkpoint
        if not isinstance(path, str) or not path.strip():
            return None  # unset (an empty path is refused by resolve_checkpoint)
        if not (Path(path) / "config.json").is_file():
            # `explain` for another machine's path: say what it cannot show
            if not Path(path).exists():
                log.record_in(
                    "checkpoint",
                    "model",
                    None,
                    "the recipe's architecture",
                    RULE,
                    f"{path} is not on this machine, so its config.json (which decides the "
                    "architecture of a run from a Hugging Face folder) was not read here",
                )
            return None  # one of our checkpoints (its run configuration is checked when it loads)
        if read is None:
            raise RuntimeError(
                f"finalize of a run from the Hugging Face folder {path} without the step that "
                "applies its config.json: pass pretrained=overlap.hf.config_json.apply_pretrained"
            )
        return read(model, path, self.tokenizer.vocab_size, log)

    def _apply_data(
        self, m: ModelConfig, layout: ParallelLayout, log: DecisionLog, hf_vocab: int | None
    ) -> None:
        """A Hugging Face tokenizer's vocabulary onto `m`, the model that runs, and the dataset's
        files, checked now (`overlap.data.resolution`)."""
        tok, data = self.tokenizer, self.dataset
        if tok.tokenizer_type == "HuggingFaceTokenizer":
            m.vocab_size = tokenizer_vocab(
                tok.tokenizer_model, m.make_vocab_size_divisible_by, layout.tp, hf_vocab, log
            )
        record_blend(data.blend, data.split, data.random_seed, m.vocab_size, log)

    def _apply_mixed_precision(self, model: ModelConfig, log: DecisionLog) -> Precision:
        """The run's precision: the preset's values, or without one the aliases' as typed
        (`mixed_precision.resolve_precision`); nothing is written back onto the sections."""
        mp = self.mixed_precision
        if isinstance(mp, str):
            mp = get_mixed_precision_config(mp)  # the preset's values; the section keeps its name
        sections = dict(mixed_precision=mp, model=model, ddp=self.ddp, optimizer=self.optimizer)
        return resolve_precision(mp, sections, log)

    def _validate(self, model: ModelConfig, layout: ParallelLayout, plan: OverlapPlan) -> None:
        """Each section's own rules, then those across sections (the first broken one is the
        error); `model` is the one that runs."""
        check_rules(split_rules(model, layout))
        model.validate()
        check_rules(self._cross_section_rules(model, layout, plan))
        self.optimizer.validate()
        self.scheduler.validate()
        self.train.validate()

    def _cross_section_rules(
        self, m: ModelConfig, layout: ParallelLayout, plan: OverlapPlan
    ) -> Iterator[Rule]:
        """The rules across sections, read lazily in order (a row may rely on those before it: the
        micro-batch count on a valid batch). The model's rules that involve an overlap switch judge
        its resolved value (the plan's), not the spelling the model section holds."""
        t, pp, ep, dp = self.train, layout.pp, layout.ep, layout.dp
        modules = m.recompute_modules
        selective = m.recompute_granularity == "selective"
        typed_dp = self.comm_overlap.data_parallel_size if self.comm_overlap else None
        yield (
            "comm_overlap.data_parallel_size",
            typed_dp,
            typed_dp is None or typed_dp == dp,
            f"the data-parallel size follows from the layout (DP = {dp} here; Bridge fills the "
            "field in itself), so it is not a setting.",
            "drop it (-ng, -tp, -pp and -cp decide DP).",
        )
        yield (
            "model.wgrad_deferral_limit",
            plan.wgrad_deferral_limit,
            plan.wgrad_deferral_limit >= -1,
            "the deferral limit is -1 (automatic) or a count >= 0.",
            "use -1.",
        )
        yield (
            "model.recompute_modules",
            modules,
            not (
                selective and "shared_experts" in (modules or ()) and plan.moe_shared_expert_overlap
            ),
            "shared_experts recompute cannot work with moe_shared_expert_overlap "
            "(Megatron-Core's rule: the overlap runs the shared expert in two halves around "
            "the all-to-alls).",
            "drop shared_experts from recompute_modules, or set moe_shared_expert_overlap=false.",
        )
        # experts are sharded over expert parallelism: a dense model has none to shard
        yield (
            "model.expert_model_parallel_size",
            ep,
            m.is_moe or ep == 1,
            "a dense model has no experts to shard.",
            "use -ep 1 or a MoE recipe.",
        )
        yield (
            "model.num_moe_experts",
            m.num_moe_experts,
            not m.is_moe or m.num_moe_experts % ep == 0,
            f"it must be divisible by expert_model_parallel_size ({ep}).",
            "use -ep that divides the expert count.",
        )
        yield (
            "model.sequence_parallel",
            False,
            layout.tp == 1 or ep == 1 or layout.sequence_parallel,
            "when using expert parallelism and tensor parallelism, sequence parallelism must "
            "be used (as Megatron-Core requires).",
            "set model.sequence_parallel=true (-tp sets it for you).",
        )
        # a global batch of whole micro-batches on every data-parallel rank
        mb, gb = t.micro_batch_size, t.global_batch_size
        yield (
            "train.micro_batch_size",
            mb,
            mb >= 1,
            "a micro-batch holds at least one sequence.",
            "use -mb 1 or more.",
        )
        yield (
            "train.global_batch_size",
            gb,
            gb >= 1,
            "a step needs at least one sequence.",
            f"use -gb {mb * dp} or a multiple of it.",
        )
        yield (
            "train.global_batch_size",
            gb,
            gb % (mb * dp) == 0,
            f"it must be a multiple of micro_batch_size x data-parallel size = {mb} x {dp}.",
            "adjust -gb or -mb.",
        )
        # The interleaved schedule (Megatron-Core): micro-batches come in groups of
        # `microbatch_group_size_per_vp_stage` (default PP) per virtual stage, a group size in [PP,
        # micro-batches], and a micro-batch count divisible by PP so every group is whole.
        micro, vpp = gb // (mb * dp), layout.vpp
        group = m.microbatch_group_size_per_vp_stage
        # a virtual pipeline: -vp set (1 included, as Megatron's not-None), or the layout's stages
        virtual = m.virtual_pipeline_model_parallel_size is not None or vpp > 1
        yield (
            "model.microbatch_group_size_per_vp_stage",
            group,
            group is None or (pp > 1 and virtual),
            "it shapes the interleaved (virtual pipeline) schedule only.",
            "use it with -pp 2+ and -vp 2+, or drop it.",
        )
        interleaved = pp > 1 and vpp > 1
        group = group or pp
        yield (
            "model.microbatch_group_size_per_vp_stage",
            group,
            not interleaved or pp <= group <= micro,
            f"the interleaved schedule needs PP ({pp}) <= group size <= micro-batches per step "
            f"({micro}).",
            f"use -gb >= {pp * mb * dp} or a group size in that range.",
        )
        yield (
            "train.global_batch_size",
            gb,
            not interleaved or micro % pp == 0,
            f"the interleaved schedule needs the micro-batches per step ({micro} = global batch / "
            f"(micro batch x DP)) to be a multiple of PP ({pp}).",
            f"use -gb as a multiple of {pp * mb * dp}.",
        )
        yield (
            "train.global_batch_size",
            gb,
            not plan.overlap_moe_expert_parallel_comm or micro >= 2,
            "EP overlap interleaves the forward of one micro-batch with the backward of another, "
            f"so each data-parallel rank needs at least 2 micro-batches per step (it has {micro}).",
            f"use -gb >= {2 * mb * dp} or a smaller -mb.",
        )

    def _covered_recompute(self, m: ModelConfig, log: DecisionLog) -> None:
        """Modules without selective granularity do nothing (said, not ignored). 'moe' recomputes
        whole MoE layers, which holds what 'moe_act' and 'shared_experts' would recompute of them:
        said as a no-op rather than run twice (a recompute inside a recompute keeps its input
        alive)."""
        selective = m.recompute_granularity == "selective"
        if m.recompute_modules and not selective:
            log.noop(
                "model.recompute_modules",
                m.recompute_modules,
                "recompute_modules only apply to recompute_granularity=selective (it is "
                f"{m.recompute_granularity})",
                "set model.recompute_granularity=selective, or clear recompute_modules.",
            )
        modules = (m.recompute_modules or []) if selective else []
        for part in ("moe_act", "shared_experts"):
            if part in modules and "moe" in modules:
                log.noop(
                    "model.recompute_modules",
                    m.recompute_modules,
                    f"'moe' recomputes whole MoE layers, '{part}' included",
                    f"drop {part} (or moe) from recompute_modules.",
                )
