"""ConfigContainer: every section of a run, and `finalize(world_size)`, which resolves it in a fixed order.

Order (documented, tested): tokenizer -> pretrained architecture (a Hugging Face
`checkpoint.pretrained_checkpoint`'s config.json) -> mixed precision -> data-parallel size -> data (the tokenizer's
padded vocabulary, the dataset files) -> comm overlap -> validation -> checkpoint -> logger -> flex dispatcher
backend -> attention backend. `finalize` snapshots what the user asked for on its first call and re-resolves from that
snapshot on every call, so calling it twice gives the same result (edits made after the first call are not seen:
build a new container instead).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Sequence

import torch

from overlap.config.attention import resolve_attention_backend
from overlap.config.checkpoint import CheckpointConfig, resolve_checkpoint
from overlap.config.comm_overlap import CommOverlapConfig, OverlapPlan, resolve_comm_overlap
from overlap.config.decisions import DEFAULT, MODEL_CONFIG, RULE, USER, Decision, DecisionLog
from overlap.config.flex_dispatcher import probe_device, validate_flex_dispatcher_backend
from overlap.config.mixed_precision import (MixedPrecisionConfig, get_mixed_precision_config,
                                            resolve_loss_scaling)
from overlap.config.model import DTYPES, ModelConfig
from overlap.config.fusion import resolve_elementwise_fusion
from overlap.config.moe_permute import resolve_moe_permute_fusion
from overlap.config.training import (DDPConfig, DatasetConfig, OptimizerConfig, SchedulerConfig, TokenizerConfig,
                                     TrainConfig)
from overlap.errors import ConfigError, NotBuiltError
from overlap.config.layout import ParallelLayout
from overlap.config.logger import LoggerConfig, resolve_logger
from overlap.config.pipeline_layout import LAYOUT_FIELD, parse_layout, resolve_pipeline_layout

_log = logging.getLogger("overlap.config")
# Selective recompute's modules, as Megatron-Core accepts them; those of architectures the runtime
# does not build are refused by name (`_validate_recompute`), the rest run (layers/recompute.py)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                     "shared_experts")
UNBUILT_RECOMPUTE = {
    "mla_up_proj": "Multi-latent attention (MLA), whose up projection mla_up_proj recomputes,",
    "gdn_norm_out": "The gated delta net (gdn_norm_out recomputes its output norm)",
    "gdp_in_proj": "The gated delta product (gdp_in_proj recomputes its input projection)",
    "gdp_qkv": "The gated delta product (gdp_qkv recomputes its convolution and QKV)",
    "mhc": "Hyper-connections (mhc recomputes their activations)"}
CUDA_GRAPH_SCOPES = ("full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")


def _check_moe_layer_freq(m: ModelConfig) -> None:
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError("model.moe_layer_freq", freq, f"a per-layer pattern has one entry per layer "
                              f"({m.num_layers}), each 1 (MoE) or 0 (dense).",
                              f"give {m.num_layers} entries of 0/1, or an int k for every k-th layer.")
        if not any(freq):
            raise ConfigError("model.moe_layer_freq", freq, "no layer is MoE, yet num_moe_experts is set.",
                              "mark at least one layer 1, or drop num_moe_experts for a dense model.")
    elif freq < 1:
        raise ConfigError("model.moe_layer_freq", freq, "it must be >= 1.",
                          "use 1 for all-MoE layers, k for every k-th layer, or a per-layer 0/1 list.")


def _hf_checkpoint_vocab(path: str | None) -> int | None:
    """The vocabulary size in a Hugging Face folder's config.json (None: not an HF folder, or no such field)."""
    import json
    from pathlib import Path

    if not path or not (Path(path) / "config.json").is_file():
        return None
    try:
        value = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None  # the checkpoint loader reports an unreadable config.json, naming it
    return value if isinstance(value, int) else None


def plain_value(value: Any) -> Any:
    """A configuration value as YAML and JSON can hold it (dataclasses to mappings without their private fields,
    anything exotic to its text)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_value(getattr(value, f.name)) for f in fields(value) if not f.name.startswith("_")}
    if isinstance(value, dict):
        return {str(k): plain_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclass(frozen=True)
class Resolution:
    """What finalize decided, frozen: the parallel layout, every overlap switch as a plain value
    (what the runtime reads) and the decision log (who decided each value, and why)."""

    world_size: int
    layout: ParallelLayout
    overlap: OverlapPlan
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
    _requested: "ConfigContainer | None" = field(default=None, repr=False, compare=False)
    _resolution: Resolution | None = field(default=None, repr=False, compare=False)

    @property
    def resolved(self) -> Resolution:
        """The last `finalize`'s result: what the runtime reads (the overlap plan, the layout)."""
        if self._resolution is None:
            raise ConfigError("config", "not finalized", "the runtime reads the resolved run, "
                              "which finalize produces.", "call cfg.finalize(world_size) first.")
        return self._resolution

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain data (Bridge's name): a checkpoint's run_config.yaml, a W&B run's config."""
        return plain_value(self)

    def finalize(self, world_size: int, device=probe_device, require_libraries: bool = True,
                 command_line: Sequence[Decision] = (), on_cuda: bool | None = None) -> Resolution:
        """Resolve for `world_size` ranks. `device` says which GPU the flex-dispatcher rules check (this machine's by
        default; `explain` passes the target named by -g), `require_libraries` whether kernel libraries must be
        importable here, `command_line` the harness's own decisions (flags beaten by overrides), logged first,
        `on_cuda` whether the ranks compute on CUDA (the attention and MoE permutation rules; None: whether CUDA is
        available here)."""
        if world_size < 1:
            raise ConfigError("-ng/--num_gpus", world_size, "a run needs at least one rank.", "use -ng 1 or more.")
        if self._requested is None:
            self._requested = copy.deepcopy(self)
        fresh = copy.deepcopy(self._requested)
        for f in fields(self):
            if f.name not in ("_requested", "_resolution"):
                setattr(self, f.name, getattr(fresh, f.name))
        self._resolution = None

        strict = bool(self.comm_overlap and self.comm_overlap.strict)
        log = DecisionLog(strict)
        for decision in command_line:
            log.record_command_line(decision)
        self._apply_tokenizer()
        self._apply_pretrained(log)
        self._check_sizes()
        self._apply_mixed_precision(log)
        layout = self._layout(world_size, log)
        self._apply_pipeline_layout(layout, log)
        self._apply_data(layout, log)
        if self.comm_overlap is not None:
            self.comm_overlap.data_parallel_size = layout.dp
        plan = resolve_comm_overlap(self.comm_overlap, self.model, self.ddp, self.optimizer,
                                    layout.dp, log)
        self._validate(layout)
        self._covered_recompute(log)
        resolve_checkpoint(self.checkpoint, log, self.scheduler)
        resolve_logger(self.logger, self.checkpoint.save, log, require_libraries)
        validate_flex_dispatcher_backend(self.model, log, device, require_libraries)
        on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
        resolve_attention_backend(self.model, log, on_cuda)
        resolve_moe_permute_fusion(self.model, log, on_cuda)
        resolve_elementwise_fusion(self.model, log, on_cuda, require_libraries)
        self._resolution = Resolution(world_size, layout, plan, log)
        return self._resolution

    # --- stages ------------------------------------------------------------------------------------------------
    def _apply_tokenizer(self) -> None:
        tok = self.tokenizer
        if tok.tokenizer_type not in ("NullTokenizer", "HuggingFaceTokenizer"):
            if tok.tokenizer_type == "SentencePieceTokenizer":
                raise NotBuiltError("tokenizer.tokenizer_type", tok.tokenizer_type, "The SentencePiece tokenizer",
                                    "use tokenizer.tokenizer_type=HuggingFaceTokenizer with a tokenizer.json.")
            raise ConfigError("tokenizer.tokenizer_type", tok.tokenizer_type, "unknown tokenizer type.",
                              "use NullTokenizer or HuggingFaceTokenizer.")
        if tok.tokenizer_type == "HuggingFaceTokenizer":
            if not tok.tokenizer_model:
                raise ConfigError("tokenizer.tokenizer_model", tok.tokenizer_model, "HuggingFaceTokenizer reads a "
                                  "tokenizer.json.", "set --tokenizer_model PATH (a tokenizer.json or its folder).")
            if tok.vocab_size is not None:
                raise ConfigError("tokenizer.vocab_size", tok.vocab_size, "the vocabulary comes from the "
                                  "tokenizer; vocab_size is the NullTokenizer's.", "drop --vocab_size.")
        elif tok.tokenizer_model:
            raise ConfigError("tokenizer.tokenizer_model", tok.tokenizer_model, "the NullTokenizer reads no file.",
                              "set --tokenizer_type HuggingFaceTokenizer, or drop --tokenizer_model.")
        if tok.vocab_size is not None:
            self.model.vocab_size = tok.vocab_size

    def _apply_pretrained(self, log: DecisionLog) -> None:
        """A Hugging Face folder as `checkpoint.pretrained_checkpoint` decides the architecture, as Bridge builds its
        model provider from the HF config: every field config.json describes (`hf_config.ARCH_FIELDS`, and
        `MOE_FIELDS` for a Qwen3-MoE) is taken from it, and each value that differs from the recipe's is a decision
        of the checkpoint section (start-up log and `overlap explain`; the harness refuses one that beats the user's
        own override or flag, `harness.check_pretrained_overrides`). A recipe without experts also takes the
        checkpoint's router aux-loss coefficient. A field config.json has that this runtime cannot honour is refused
        there (`model_config_from_hf`)."""
        from pathlib import Path

        from overlap.config.hf_config import (ARCH_FIELDS, MOE_FIELDS, PRETRAINED, model_config_from_hf,
                                              read_hf_config)

        path = self.checkpoint.pretrained_checkpoint
        if not isinstance(path, str) or not path.strip():
            return  # unset (an empty path is refused by resolve_checkpoint)
        if not (Path(path) / "config.json").is_file():
            if not Path(path).exists():  # `explain` for another machine's path: say what it cannot show
                log.record_in("checkpoint", "model", None, "the recipe's architecture", RULE,
                              f"{path} is not on this machine, so its config.json (which decides the architecture "
                              "of a run from a Hugging Face folder) was not read here")
            return  # one of our checkpoints (its run configuration is checked when it loads)
        m, theirs = self.model, model_config_from_hf(read_hf_config(path), seq_length=self.model.seq_length)
        if self.tokenizer.vocab_size is not None and self.tokenizer.vocab_size > theirs.vocab_size:
            raise ConfigError("tokenizer.vocab_size", self.tokenizer.vocab_size, f"the pretrained checkpoint {path} "
                              f"has {theirs.vocab_size} embedding rows: larger token ids have no embedding.",
                              f"drop --vocab_size (the model takes {theirs.vocab_size} from config.json), or use "
                              "the checkpoint's tokenizer.")
        fields = {**ARCH_FIELDS, **(MOE_FIELDS if theirs.is_moe else {})}
        if theirs.is_moe and not m.is_moe:
            fields["moe_aux_loss_coeff"] = "moe_aux_loss_coeff"
        before = {name: getattr(m, attr) for name, attr in fields.items()}  # all read before any is changed
        for name, attr in fields.items():
            value = getattr(theirs, attr)
            if before[name] != value:
                setattr(m, name, getattr(theirs, name))
                log.record_in("checkpoint", f"model.{name}", before[name], value, RULE, f"{PRETRAINED} ({path})")
        # Training choices that route the released weights' tokens otherwise than the model was trained (transformers
        # drops no token and routes by the scores): honoured, and said beside the architecture
        for name, on, what in (("moe_expert_capacity_factor", m.moe_expert_capacity_factor is not None,
                                "tokens beyond each expert's capacity are dropped"),
                               ("moe_router_force_load_balancing", bool(m.moe_router_force_load_balancing),
                                "routing ignores the router's scores (a benchmark setting)")):
            if theirs.is_moe and on:
                value = getattr(m, name)
                log.record_in("checkpoint", f"model.{name}", value, value, USER,
                              f"{what}: the pretrained MoE is trained differently from how it was released")
                _log.warning("model.%s=%s with pretrained weights: %s", name, value, what)

    def _apply_data(self, layout: ParallelLayout, log: DecisionLog) -> None:
        """The tokenizer's vocabulary (padded as Megatron pads it) and the dataset's files, checked now."""
        tok, data, m = self.tokenizer, self.dataset, self.model
        if tok.tokenizer_type == "HuggingFaceTokenizer":
            from overlap.data.tokenizer import HFTokenizer, padded_vocab_size

            hf = HFTokenizer(tok.tokenizer_model)
            if m.make_vocab_size_divisible_by < 1:
                raise ConfigError("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by,
                                  "it must be positive.", "use 128 (Megatron's default).")
            hf_vocab = _hf_checkpoint_vocab(self.checkpoint.pretrained_checkpoint)
            if hf_vocab is not None and hf_vocab < hf.vocab_size:
                raise ConfigError("tokenizer.tokenizer_model", tok.tokenizer_model, f"this tokenizer has "
                                  f"{hf.vocab_size} tokens, but the pretrained checkpoint's embedding has "
                                  f"{hf_vocab} rows (its config.json): larger token ids have no embedding.",
                                  "use the checkpoint's own tokenizer.")
            if hf_vocab is not None:
                # A released checkpoint's embedding has its own (already padded) rows: Qwen3's 151936 for the
                # tokenizer's 151669 tokens. Padding the tokenizer's count again would not match its weights.
                m.vocab_size = hf_vocab
                log.record_in("data", "model.vocab_size", None, m.vocab_size, RULE,
                              f"the pretrained checkpoint's vocabulary (its config.json), which holds the "
                              f"tokenizer's {hf.vocab_size} tokens; end of document = token {hf.eod}")
            else:
                m.vocab_size = padded_vocab_size(hf.vocab_size, m.make_vocab_size_divisible_by, layout.tp)
                log.record_in("data", "model.vocab_size", None, m.vocab_size, RULE,
                              f"the tokenizer's {hf.vocab_size} tokens padded to a multiple of "
                              f"make_vocab_size_divisible_by x TP = {m.make_vocab_size_divisible_by} x {layout.tp}; "
                              f"end of document = token {hf.eod}")
        if data.blend is None:
            log.record_in("data", "dataset.blend", None, None, DEFAULT,
                          "not set: mock data (random tokens from the seed; the loss cannot fall below "
                          f"ln(vocab) = {math.log(m.vocab_size):.2f})")
            return
        from overlap.data.gpt_dataset import parse_blend, split_ranges
        from overlap.data.indexed import IndexedDataset

        prefixes, weights = parse_blend(data.blend)
        share = sum(weights)
        for prefix, weight in zip(prefixes, weights):
            files = IndexedDataset(prefix)
            start, end = split_ranges(data.split, len(files))[0]
            tokens = int(files.lengths[start:end].sum())
            log.record_in("data", "dataset.blend", prefix, prefix, USER,
                          f"weight {weight / share:.3f}: {end - start} of {len(files)} documents in the training "
                          f"split ({data.split}), {tokens:,} tokens ({files.dtype.name}); shuffled with seed "
                          f"{data.random_seed}")

    def _apply_mixed_precision(self, log: DecisionLog) -> None:
        mp = self.mixed_precision
        if isinstance(mp, str):
            mp = self.mixed_precision = get_mixed_precision_config(mp)
        if mp is None:
            # No preset: the model's own precision flags stand; DDP precision fields default off.
            self.ddp.grad_reduce_in_fp32 = bool(self.ddp.grad_reduce_in_fp32)
            self.ddp.fp8_param_gather = bool(self.ddp.fp8_param_gather)
            self.optimizer.bf16, self.optimizer.fp16 = self.model.bf16, self.model.fp16
        else:
            mp.finalize()
            mp.setup(self.model, self.ddp, self.optimizer, log)
        resolve_loss_scaling(self.optimizer, mp, log)

    def _layout(self, world_size: int, log: DecisionLog) -> ParallelLayout:
        m = self.model
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "expert_tensor_parallel_size"):
            if getattr(m, name) < 1:
                raise ConfigError(f"model.{name}", getattr(m, name), "parallel sizes are at least 1.",
                                  f"set model.{name} to 1 or more.")
        block = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        if world_size % block:
            raise ConfigError("-ng/--num_gpus", world_size,
                              f"the world size must be a multiple of TP x PP x CP = {m.tensor_model_parallel_size} x "
                              f"{m.pipeline_model_parallel_size} x {m.context_parallel_size} = {block}.",
                              f"use a multiple of {block} ranks, or smaller -tp/-pp/-cp.")
        if m.sequence_parallel and m.tensor_model_parallel_size == 1:
            m.sequence_parallel = log.record("model.sequence_parallel", True, False, RULE,
                                             "TP=1: there is no tensor-parallel group to shard the sequence over",
                                             fix="use -tp 2 or more, or drop sequence_parallel.")
        dp = world_size // block
        ep_block = m.expert_model_parallel_size * m.expert_tensor_parallel_size
        if (m.tensor_model_parallel_size * m.context_parallel_size * dp) % ep_block:
            raise ConfigError("model.expert_model_parallel_size", m.expert_model_parallel_size,
                              f"EP x ETP = {ep_block} must divide TP x CP x DP = "
                              f"{m.tensor_model_parallel_size * m.context_parallel_size * dp} (experts are carved out "
                              "of the data-parallel ranks of each pipeline stage).",
                              "choose -ep so that it divides the ranks per pipeline stage.")
        return ParallelLayout(world_size=world_size, tp=m.tensor_model_parallel_size,
                              pp=m.pipeline_model_parallel_size, cp=m.context_parallel_size,
                              ep=m.expert_model_parallel_size, etp=m.expert_tensor_parallel_size)

    def _apply_pipeline_layout(self, layout: ParallelLayout, log: DecisionLog) -> None:
        """A pipeline_model_parallel_layout decides VPP (its stages / PP), as Megatron-Core derives
        it; the layout every stage gets (whichever field decided it) is logged for `explain`."""
        m = self.model
        spec = m.pipeline_model_parallel_layout
        if spec is not None:
            found = len(parse_layout(spec, layout.pp)) // layout.pp
            if found > 1 and layout.pp == 1:
                raise ConfigError(LAYOUT_FIELD, spec,
                                  f"{found} stages need pipeline parallelism (a virtual "
                                  f"pipeline of {found} chunks needs PP >= 2).",
                                  "use -pp with stages = PP x VPP, or one stage for -pp 1.")
            if m.virtual_pipeline_model_parallel_size is None and found > 1:
                m.virtual_pipeline_model_parallel_size = found
                log.record_in("pipeline", "model.virtual_pipeline_model_parallel_size", None, found,
                              RULE, f"the layout's stages / PP = {found * layout.pp} / {layout.pp}")
        vpp = m.virtual_pipeline_model_parallel_size
        if vpp is not None and (vpp < 1 or layout.pp == 1):
            raise ConfigError("model.virtual_pipeline_model_parallel_size", vpp,
                              "a virtual pipeline needs pipeline_model_parallel_size > 1 and "
                              "a size >= 1.", "use -vp None, or -pp 2 or more.")
        resolved = resolve_pipeline_layout(m, layout.pp)
        if layout.pp > 1 or spec is not None:
            by = {"even split": DEFAULT,
                  "pipeline_model_parallel_layout": MODEL_CONFIG}.get(resolved.source, RULE)
            log.record_in("pipeline", LAYOUT_FIELD, spec, resolved.as_string(), by,
                          resolved.describe())

    def _check_sizes(self) -> None:
        """Every model size positive, before any later stage computes with one (the data decisions quote
        ln(vocab_size), the layout divides by head counts)."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length", "kv_channels",
                     "ffn_hidden_size", "num_query_groups", "moe_ffn_hidden_size",
                     "moe_shared_expert_intermediate_size"):
            value = getattr(self.model, name)
            if value is not None and value < 1:
                raise ConfigError(f"model.{name}", value, "it must be positive.", f"set model.{name} >= 1.")

    def _validate(self, layout: ParallelLayout) -> None:
        m, t = self.model, self.train
        tp = layout.tp

        def divides(field_name: str, value: int, by: int, by_name: str, fix: str) -> None:
            if value % by:
                raise ConfigError(field_name, value, f"it must be divisible by {by_name} ({by}).", fix)

        if m.kv_channels is None:
            divides("model.hidden_size", m.hidden_size, m.num_attention_heads, "num_attention_heads",
                    "pick hidden_size as a multiple of the head count, or set kv_channels.")
        divides("model.num_attention_heads", m.num_attention_heads, tp, "tensor_model_parallel_size",
                "use a -tp that divides the head count.")
        divides("model.num_attention_heads", m.num_attention_heads, m.query_groups, "num_query_groups",
                "use num_query_groups that divides num_attention_heads.")
        divides("model.num_query_groups", m.query_groups, tp, "tensor_model_parallel_size",
                "use a -tp that divides num_query_groups.")
        divides("model.ffn_hidden_size", m.ffn_size, tp, "tensor_model_parallel_size", "use a -tp that divides it.")
        divides("model.vocab_size", m.vocab_size, tp, "tensor_model_parallel_size",
                "use a vocabulary size divisible by -tp (e.g. --vocab_size rounded up).")
        if m.sequence_parallel:
            divides("model.seq_length", m.seq_length, tp, "tensor_model_parallel_size (sequence parallel)",
                    "use -sl divisible by -tp.")
        if m.pipeline_impl not in ("overlap", "torch_pipelining"):
            raise ConfigError("model.pipeline_impl", m.pipeline_impl, "unknown pipeline implementation.",
                              "use overlap (ours) or torch_pipelining (the PyTorch peer).")
        if m.tensor_parallel_impl not in ("overlap", "dtensor"):
            raise ConfigError("model.tensor_parallel_impl", m.tensor_parallel_impl,
                              "unknown tensor-parallel implementation.",
                              "use overlap (ours) or dtensor (the PyTorch-native peer).")
        if m.is_moe:
            if m.num_moe_experts < 1:
                raise ConfigError("model.num_moe_experts", m.num_moe_experts, "a MoE model needs experts.",
                                  "set num_moe_experts >= 1, or null for a dense model.")
            divides("model.num_moe_experts", m.num_moe_experts, layout.ep, "expert_model_parallel_size",
                    "use -ep that divides the expert count.")
            if not 1 <= m.moe_router_topk <= m.num_moe_experts:
                raise ConfigError("model.moe_router_topk", m.moe_router_topk,
                                  f"top-k must be between 1 and num_moe_experts ({m.num_moe_experts}).",
                                  "choose a smaller moe_router_topk.")
            if tp > 1 and layout.ep > 1 and not m.sequence_parallel:
                raise ConfigError("model.sequence_parallel", False,
                                  "when using expert parallelism and tensor parallelism, sequence parallelism must "
                                  "be used (as Megatron-Core requires).",
                                  "set model.sequence_parallel=true (-tp sets it for you).")
            if m.moe_router_load_balancing_type not in ("aux_loss", "none"):
                raise NotBuiltError("model.moe_router_load_balancing_type", m.moe_router_load_balancing_type,
                                    "This load-balancing type", "use aux_loss or none.")
            _check_moe_layer_freq(m)
            if m.moe_expert_capacity_factor is not None and not m.moe_expert_capacity_factor > 0:
                raise ConfigError("model.moe_expert_capacity_factor", m.moe_expert_capacity_factor,
                                  "an expert capacity factor must be > 0.",
                                  "use e.g. 1.0 (null: dropless, no capacity).")
            if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
                raise ConfigError("model.moe_pad_expert_input_to_capacity", True,
                                  "padding to the expert capacity needs a capacity.",
                                  "also set model.moe_expert_capacity_factor (e.g. 1.0), or drop the padding.")
            if m.moe_token_drop_policy not in ("probs", "position"):
                raise ConfigError("model.moe_token_drop_policy", m.moe_token_drop_policy,
                                  "unknown token drop policy.", "use probs or position.")
        elif layout.ep > 1:
            raise ConfigError("model.expert_model_parallel_size", layout.ep, "a dense model has no experts to shard.",
                              "use -ep 1 or a MoE recipe.")
        if m.moe_token_dispatcher_type not in ("alltoall", "flex", "allgather"):
            raise ConfigError("model.moe_token_dispatcher_type", m.moe_token_dispatcher_type,
                              "unknown token dispatcher.", "use alltoall or flex.")
        if m.params_dtype not in DTYPES:
            raise ConfigError("model.params_dtype", m.params_dtype, "unknown dtype.", f"use one of {DTYPES}.")
        self._validate_recompute()
        self._validate_cuda_graph()
        if t.micro_batch_size < 1:
            raise ConfigError("train.micro_batch_size", t.micro_batch_size, "a micro-batch holds at least one sequence.",
                              "use -mb 1 or more.")
        if t.global_batch_size < 1:
            raise ConfigError("train.global_batch_size", t.global_batch_size, "a step needs at least one sequence.",
                              f"use -gb {t.micro_batch_size * layout.dp} or a multiple of it.")
        if t.global_batch_size % (t.micro_batch_size * layout.dp):
            raise ConfigError("train.global_batch_size", t.global_batch_size,
                              f"it must be a multiple of micro_batch_size x data-parallel size = "
                              f"{t.micro_batch_size} x {layout.dp}.", "adjust -gb or -mb.")
        self._validate_pipeline_schedule(layout)
        if m.overlap_moe_expert_parallel_comm and t.global_batch_size // (t.micro_batch_size * layout.dp) < 2:
            raise ConfigError("train.global_batch_size", t.global_batch_size,
                              "EP overlap interleaves the forward of one micro-batch with the backward of another, so "
                              f"each data-parallel rank needs at least 2 micro-batches per step (it has "
                              f"{t.global_batch_size // (t.micro_batch_size * layout.dp)}).",
                              f"use -gb >= {2 * t.micro_batch_size * layout.dp} or a smaller -mb.")
        o, sc = self.optimizer, self.scheduler
        if o.optimizer != "adam":
            raise NotBuiltError("optimizer.optimizer", o.optimizer, "This optimizer", "use optimizer.optimizer=adam.")
        if sc.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError("scheduler.lr_decay_style", sc.lr_decay_style, "unknown decay style.",
                              "use cosine, linear or constant.")
        if not t.comm_timeout_s > 0:
            raise ConfigError("train.comm_timeout_s", t.comm_timeout_s, "a timeout must be positive.",
                              "set train.comm_timeout_s to a number of seconds, e.g. 300.")
        if (m.bf16, m.fp16) != (m.params_dtype == "bfloat16", m.params_dtype == "float16"):
            raise ConfigError("model.params_dtype", m.params_dtype,
                              f"it contradicts model.bf16={m.bf16} / model.fp16={m.fp16}.",
                              "set precision with -c or mixed_precision=bf16_mixed|fp16_mixed|fp32, not piecemeal.")
        if t.train_iters < 1:
            raise ConfigError("train.train_iters", t.train_iters, "a run needs at least one step.", "use -ms 1 or more.")
        self._validate_ranges(layout)

    def _validate_pipeline_schedule(self, layout: ParallelLayout) -> None:
        """The interleaved schedule's rules (Megatron-Core): micro-batches come in groups of
        `microbatch_group_size_per_vp_stage` (default PP) per virtual stage, a group size in [PP, micro-batches],
        and a micro-batch count divisible by PP so every group is whole."""
        m, t = self.model, self.train
        group = m.microbatch_group_size_per_vp_stage
        if group is not None and (layout.pp == 1 or not m.virtual_pipeline_model_parallel_size):
            raise ConfigError("model.microbatch_group_size_per_vp_stage", group,
                              "it shapes the interleaved (virtual pipeline) schedule only.",
                              "use it with -pp 2+ and -vp 2+, or drop it.")
        vpp = m.virtual_pipeline_model_parallel_size or 1
        if layout.pp == 1 or vpp == 1:
            return
        micro = t.global_batch_size // (t.micro_batch_size * layout.dp)
        group = group or layout.pp
        if not layout.pp <= group <= micro:
            raise ConfigError("model.microbatch_group_size_per_vp_stage", group,
                              f"the interleaved schedule needs PP ({layout.pp}) <= group size <= micro-batches per "
                              f"step ({micro}).", f"use -gb >= {layout.pp * t.micro_batch_size * layout.dp} or a "
                              "group size in that range.")
        if micro % layout.pp:
            raise ConfigError("train.global_batch_size", t.global_batch_size,
                              f"the interleaved schedule needs the micro-batches per step ({micro} = global batch / "
                              f"(micro batch x DP)) to be a multiple of PP ({layout.pp}).",
                              f"use -gb as a multiple of {layout.pp * t.micro_batch_size * layout.dp}.")

    def _validate_ranges(self, layout: ParallelLayout) -> None:
        """Values the type check lets through but the run cannot use (or would silently clamp): one table, checked
        in order; NaN fails every rule, and a float rule also refuses infinity."""
        o, sc, t, m = self.optimizer, self.scheduler, self.train, self.model
        n = t.train_iters
        start, end = t.eval_time_start_step, t.eval_time_end_step
        fin = math.isfinite
        tp = layout.tp
        shared = m.moe_shared_expert_intermediate_size
        rules: list[tuple[str, Any, bool, str, str]] = [
            # (field, value, ok, why, fix)
            ("optimizer.lr", o.lr, fin(o.lr) and o.lr >= 0, "the learning rate must be a finite number >= 0.",
             "use e.g. optimizer.lr=3e-4."),
            ("optimizer.min_lr", o.min_lr, fin(o.min_lr) and 0 <= o.min_lr <= o.lr,
             f"the decay floor must be between 0 and optimizer.lr ({o.lr:g}).",
             f"use optimizer.min_lr <= {o.lr:g}, e.g. a tenth of it."),
            ("optimizer.adam_beta1", o.adam_beta1, 0 <= o.adam_beta1 < 1, "Adam's beta1 must be in [0, 1).",
             "use e.g. optimizer.adam_beta1=0.9."),
            ("optimizer.adam_beta2", o.adam_beta2, 0 <= o.adam_beta2 < 1, "Adam's beta2 must be in [0, 1).",
             "use e.g. optimizer.adam_beta2=0.95."),
            ("optimizer.adam_eps", o.adam_eps, fin(o.adam_eps) and o.adam_eps > 0, "Adam's epsilon must be > 0.",
             "use e.g. optimizer.adam_eps=1e-8."),
            ("optimizer.weight_decay", o.weight_decay, fin(o.weight_decay) and o.weight_decay >= 0,
             "weight decay must be >= 0 (0: none).", "use e.g. optimizer.weight_decay=0.1, or 0."),
            ("optimizer.clip_grad", o.clip_grad, fin(o.clip_grad) and o.clip_grad >= 0,
             "the gradient-norm clip must be >= 0 (0: no clipping).", "use e.g. optimizer.clip_grad=1.0, or 0."),
            ("scheduler.lr_warmup_iters", sc.lr_warmup_iters, sc.lr_warmup_iters >= 0,
             "warm-up iterations must be >= 0 (0: no warm-up).", "use e.g. scheduler.lr_warmup_iters=0."),
            ("scheduler.lr_decay_iters", sc.lr_decay_iters, sc.lr_decay_iters is None or sc.lr_decay_iters >= 1,
             "decay iterations must be >= 1 (null: train_iters).", "use scheduler.lr_decay_iters=null."),
            ("train.skip_first_percent_time", t.skip_first_percent_time,
             0 <= t.skip_first_percent_time < 1,
             "the skipped share of the steps is a fraction in [0, 1) (0.1 skips the first 10%), not a percentage.",
             "use e.g. --skip_first_percent_time 0.1."),
            ("train.eval_time_start_step", start, start is None or 0 <= start < n,
             f"the steady-state window starts at a 0-based step index in [0, train_iters={n}).",
             f"use --eval_time_start_step between 0 and {n - 1}, or raise -ms."),
            ("train.eval_time_end_step", end, end is None or 1 <= end <= n,
             f"the steady-state window ends (exclusive) at a step in [1, train_iters={n}].",
             f"use --eval_time_end_step between 1 and {n}, or raise -ms."),
            ("train.eval_time_end_step", end, start is None or end is None or start < end,
             f"the window end must come after its start (--eval_time_start_step {start}); an empty window would "
             "silently fall back to the whole run, warm-up included.",
             f"use --eval_time_end_step {(start or 0) + 1} or more."),
            ("train.seed", t.seed, 0 <= t.seed < 2**63, "the seed must be in [0, 2^63).", "use e.g. train.seed=1234."),
            ("train.comm_timeout_s", t.comm_timeout_s, fin(t.comm_timeout_s) and t.comm_timeout_s <= 7 * 86400,
             "a timeout must be a finite number of seconds (at most a week).",
             "set train.comm_timeout_s to a number of seconds, e.g. 300."),
            ("model.layernorm_epsilon", m.layernorm_epsilon, fin(m.layernorm_epsilon) and m.layernorm_epsilon > 0,
             "the norm epsilon must be > 0.", "use e.g. model.layernorm_epsilon=1e-6."),
            ("model.rotary_base", m.rotary_base, fin(m.rotary_base) and m.rotary_base > 1,
             "the rotary base must be > 1.", "use e.g. model.rotary_base=10000."),
            ("model.kv_channels" if m.kv_channels else "model.hidden_size", m.kv_channels or m.hidden_size,
             m.head_dim % 2 == 0, f"rotary embeddings rotate pairs of channels, so the head dim must be even (it is "
             f"{m.head_dim}{'' if m.kv_channels else ' = hidden_size / num_attention_heads'}).",
             "use an even kv_channels (head dim), e.g. 64 or 128."),
            ("model.moe_shared_expert_intermediate_size", shared, not m.is_moe or not shared or shared % tp == 0,
             f"the shared expert is split over tensor parallelism, so its width must be divisible by "
             f"tensor_model_parallel_size ({tp}).", "use a multiple of -tp."),
            ("model.init_method_std", m.init_method_std, fin(m.init_method_std) and m.init_method_std >= 0,
             "the initialisation standard deviation must be >= 0.", "use e.g. model.init_method_std=0.02."),
            ("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff, fin(m.moe_aux_loss_coeff) and m.moe_aux_loss_coeff >= 0,
             "the auxiliary-loss coefficient must be >= 0 (0: none).", "use e.g. model.moe_aux_loss_coeff=1e-3."),
            ("model.moe_expert_capacity_factor", m.moe_expert_capacity_factor,
             m.moe_expert_capacity_factor is None or fin(m.moe_expert_capacity_factor),
             "an expert capacity factor must be finite.", "use e.g. 1.0 (null: dropless, no capacity)."),
            ("model.recompute_num_layers", m.recompute_num_layers,
             m.recompute_num_layers is None or m.recompute_num_layers <= m.num_layers,
             f"it cannot exceed num_layers ({m.num_layers}).", f"use -rl between 1 and {m.num_layers}."),
            ("model.mtp_num_layers", m.mtp_num_layers, m.mtp_num_layers is None or m.mtp_num_layers >= 0,
             "a layer count must be >= 0.", "set model.mtp_num_layers=null."),
            ("model.wgrad_deferral_limit", m.wgrad_deferral_limit,
             m.wgrad_deferral_limit is None or m.wgrad_deferral_limit >= -1,
             "the deferral limit is -1 (automatic) or a count >= 0.", "use -1."),
        ]
        for name, value, ok, why, fix in rules:
            if not ok:
                raise ConfigError(name, value, why, fix)

    def _validate_recompute(self) -> None:
        m = self.model
        if m.recompute_granularity not in (None, "selective", "full"):
            raise ConfigError("model.recompute_granularity", m.recompute_granularity, "unknown granularity.",
                              "use selective, full, or null.")
        if m.recompute_granularity == "full":
            if m.recompute_method not in ("uniform", "block"):
                raise ConfigError("model.recompute_method", m.recompute_method,
                                  "full recompute needs a method.", "set recompute_method to uniform or block.")
            if not m.recompute_num_layers or m.recompute_num_layers < 1:
                raise ConfigError("model.recompute_num_layers", m.recompute_num_layers,
                                  "full recompute needs a layer count.", "set recompute_num_layers (e.g. -rl 1).")
        elif m.recompute_method is not None or m.recompute_num_layers is not None:
            raise ConfigError("model.recompute_method", m.recompute_method,
                              "recompute_method / recompute_num_layers only apply to recompute_granularity=full.",
                              "set recompute_granularity=full, or clear them.")
        modules = m.recompute_modules or []
        field = "model.recompute_modules"
        for name in modules:
            if name in UNBUILT_RECOMPUTE:
                raise NotBuiltError(field, modules, UNBUILT_RECOMPUTE[name],
                                    f"drop {name} from recompute_modules.")
        bad = [x for x in modules if x not in RECOMPUTE_MODULES]
        if bad:
            built = [x for x in RECOMPUTE_MODULES if x not in UNBUILT_RECOMPUTE]
            raise ConfigError(field, modules, f"unknown module(s) {bad}.",
                              f"use a subset of {built}.")
        selective = modules if m.recompute_granularity == "selective" else []
        if "moe_act" in selective and not m.is_moe:
            raise ConfigError(field, modules, "moe_act recomputes the routed experts' activation "
                              "function, and this model has no experts.",
                              "drop moe_act (a dense MLP recomputes with 'mlp').")
        shared = m.is_moe and m.moe_shared_expert_intermediate_size
        if "shared_experts" in selective and not shared:
            raise ConfigError(field, modules, "shared_experts recomputes the MoE layers' shared "
                              "expert, and this model has none.",
                              "drop shared_experts, or set "
                              "model.moe_shared_expert_intermediate_size.")
        if "shared_experts" in selective and m.moe_shared_expert_overlap:
            raise ConfigError(field, modules, "shared_experts recompute cannot work with "
                              "moe_shared_expert_overlap (Megatron-Core's rule: the overlap runs "
                              "the shared expert in two halves around the all-to-alls).",
                              "drop shared_experts from recompute_modules, or set "
                              "moe_shared_expert_overlap=false.")
        reroutes = m.recompute_granularity == "full" or (
            m.recompute_granularity == "selective" and "moe" in (m.recompute_modules or ()))
        if m.is_moe and m.moe_router_force_load_balancing and reroutes:
            raise ConfigError("model.moe_router_force_load_balancing", True,
                              "forced load balancing draws new random logits at every router call, and this recompute "
                              f"({m.recompute_granularity}) calls the router again in backward, which would route "
                              "the recomputed tokens differently from the forward.",
                              "drop the recompute of the MoE layers (full, or selective 'moe'), or the forced "
                              "balancing.")

    def _covered_recompute(self, log: DecisionLog) -> None:
        """Modules without selective granularity do nothing (said, not ignored). 'moe' recomputes
        whole MoE layers, which holds what 'moe_act' and 'shared_experts' would recompute of them:
        said as a no-op rather than run twice (a recompute inside a recompute keeps its input
        alive)."""
        m = self.model
        selective = m.recompute_granularity == "selective"
        if m.recompute_modules and not selective:
            log.noop("model.recompute_modules", m.recompute_modules,
                     "recompute_modules only apply to recompute_granularity=selective (it is "
                     f"{m.recompute_granularity})",
                     "set model.recompute_granularity=selective, or clear recompute_modules.")
        modules = (m.recompute_modules or []) if selective else []
        for part in ("moe_act", "shared_experts"):
            if part in modules and "moe" in modules:
                log.noop("model.recompute_modules", m.recompute_modules,
                         f"'moe' recomputes whole MoE layers, '{part}' included",
                         f"drop {part} (or moe) from recompute_modules.")

    def _validate_cuda_graph(self) -> None:
        m = self.model
        if m.cuda_graph_impl not in ("none", "local", "transformer_engine"):
            raise ConfigError("model.cuda_graph_impl", m.cuda_graph_impl, "unknown CUDA-graph implementation.",
                              "use none, local or transformer_engine.")
        scope = m.cuda_graph_scope or []
        scope = scope.split(",") if isinstance(scope, str) else scope
        bad = [s for s in scope if s not in CUDA_GRAPH_SCOPES + ("full",)]
        if bad:
            raise ConfigError("model.cuda_graph_scope", m.cuda_graph_scope, f"unknown scope(s) {bad}.",
                              f"use a subset of {list(CUDA_GRAPH_SCOPES)}.")
        if m.cuda_graph_impl == "local" and scope and set(scope) != {"full_iteration"}:
            raise ConfigError("model.cuda_graph_scope", m.cuda_graph_scope,
                              "cuda_graph_impl=local only captures full iterations; scoped graphs need "
                              "transformer_engine.", "use --cuda_graph_scope full_iteration or the TE impl.")
        if "full_iteration" in scope and m.cuda_graph_impl == "transformer_engine":
            raise ConfigError("model.cuda_graph_scope", m.cuda_graph_scope,
                              "full_iteration graphs are not captured by the transformer_engine impl.",
                              "use --cuda_graph_impl local for full_iteration.")
