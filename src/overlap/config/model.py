"""ModelConfig: the model section, Megatron-Bridge's flat surface over two parts.

The network itself is `TransformerArchitecture` (`architecture.py`), whose fields ModelConfig
inherits, so `model.hidden_size=...` and `ModelConfig(hidden_size=...)` work as in Bridge. The
fields declared here say how a run lays the network out and computes it: parallel layout,
pipeline, kernels and fusions, MoE dispatch and routing, recompute, CUDA graphs and the overlap
fields that the resolution in `comm_overlap.py` reads. Megatron's precision copies (`model.bf16`,
`model.fp16`, `model.params_dtype`) are aliases of the mixed-precision section's fields.

Field names and meanings follow Megatron-Core's TransformerConfig, which our users already speak.
Bridge's direct spellings of comm_overlap's switches (`model.tp_comm_overlap`,
`model.delay_wgrad_compute`, ...) are not declared here: they are aliases
(`overlap.config.aliases`), accepted as keywords, attributes and overrides and kept as typed
(`None`: not set), which the resolution reads below comm_overlap's value and never overwrites. The
resolved values live only in the frozen `cfg.resolved.overlap` (`OverlapPlan`), which the model
build, the training loop, DDP, the optimizer and the planner read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from overlap.config.aliases import aliased
from overlap.config.architecture import TransformerArchitecture
from overlap.config.refusals import unbuilt
from overlap.errors import NotBuiltError, Rule, check_rules

# Selective recompute's modules, as Megatron-Core accepts them; those of architectures the runtime
# does not build are refused by name (`overlap.config.refusals`), the rest run (layers/recompute.py)
RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)
CUDA_GRAPH_SCOPES = (
    "full_iteration",
    "attn",
    "mlp",
    "moe",
    "moe_router",
    "moe_preprocess",
    "mamba",
)


# The implementations `model.pipeline_impl` / `model.tensor_parallel_impl` name: ours and the
# PyTorch peer measured against it. The runtime's tables (`pipeline.runner.IMPLEMENTATIONS`,
# `model.tensor_parallel_impl.IMPLEMENTATIONS`) hold one entry per name (tests/test_peers.py).
PIPELINE_IMPLS = ("overlap", "torch_pipelining")
TENSOR_PARALLEL_IMPLS = ("overlap", "dtensor")
# the router's load balancing built here (Megatron's seq_aux_loss and sinkhorn are not)
LOAD_BALANCING_TYPES = ("aux_loss", "none")
PAGED_STASH_POOL = 1.10  # Megatron's default paged-stash GPU pool, x the average routed rows


def comma_list(text: str) -> list[str]:
    """A list field written as `a,b` (an override, a harness flag, a recipe's string): its items,
    stripped, empty ones dropped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def expert_rank_capacity(num_tokens: int, topk: int, ep_size: int, factor: float) -> int:
    """Rows of one block of the sync-free dispatch (`moe_expert_rank_capacity_factor`): at most this
    many of a rank's `num_tokens` x `topk` routed pairs go to one EP peer's experts before the step
    is re-run dropless, ceil(T x k / EP x factor). Here, below every layer that sizes the blocks
    (the dispatcher, the activation and memory models, the dry run)."""
    return math.ceil(num_tokens * topk / ep_size * factor)


@aliased("model")
@dataclass
class ModelConfig(TransformerArchitecture):
    """The model section: the network (inherited) and how a run lays it out and computes it."""

    # --- parallel layout ---
    tensor_model_parallel_size: int = 1  # TP: ranks each layer's linears are split over (-tp)
    pipeline_model_parallel_size: int = 1  # PP: pipeline stages (-pp)
    # VPP: model chunks per pipeline rank (-vp); None: one
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1  # CP: ranks the sequence is split over (-cp)
    # CP's attention exchange (Megatron's TransformerConfig.cp_comm_type): p2p (KV ring) |
    # all_gather | a2a (heads <-> sequence) | a2a+p2p (refused by the runtime); None: p2p at CP > 1
    cp_comm_type: str | None = None
    # a2a+p2p's [a2a size, p2p size] (Megatron's name; product = CP)
    hierarchical_context_parallel_sizes: list[int] | None = None
    # p2p: the next KV block's transfer in flight under this block's attention (ours: Megatron
    # always overlaps; false runs the same ring serialised, the benchmark's baseline); None: on
    cp_comm_overlap: bool | None = None
    expert_model_parallel_size: int = 1  # EP: ranks the routed experts are split over (-ep)
    # ETP: TP inside each expert (refused by the runtime above 1)
    expert_tensor_parallel_size: int = 1
    # activations outside the TP linears sharded over TP along the sequence
    sequence_parallel: bool = False
    # "overlap" (ours) | "dtensor" (the PyTorch-native peer: DTensor plans)
    tensor_parallel_impl: str = "overlap"
    # --- pipeline (Megatron-Core / Bridge names) ---
    num_layers_in_first_pipeline_stage: int | None = None  # layers on the first stage; None: even
    # layers on the last stage; None: an even split
    num_layers_in_last_pipeline_stage: int | None = None
    # The embedding / loss counts as one layer when the layers are divided evenly over the pipeline
    account_for_embedding_in_pipeline_split: bool = False
    # the loss counts as one layer when the layers are divided
    account_for_loss_in_pipeline_split: bool = False
    # Every stage spelt out (Megatron's grammar, e.g. "Et*3|(tt|)*29,m|L", or a list of lists of
    # layer names); its stage count decides VPP. See overlap.layout.pipeline.
    pipeline_model_parallel_layout: str | list[list[str]] | None = None
    # micro-batches per group in the interleaved schedule; None: PP (depth-first)
    microbatch_group_size_per_vp_stage: int | None = None
    # free a sent activation's storage once the send completed
    deallocate_pipeline_outputs: bool = False
    pipeline_impl: str = "overlap"  # "overlap" (ours) | "torch_pipelining" (the PyTorch peer)
    # --- kernels and fusions ---
    # The attention product's kernel (Megatron's AttnBackend names): auto | flash | fused | unfused
    # | local; see overlap.kernels.attention for what each runs here and auto's rule.
    attention_backend: str = "auto"
    # Transformer Engine's fused wgrad accumulation (refused by the runtime)
    gradient_accumulation_fusion: bool = False
    # Elementwise chains compiled by torch.compile (overlap.kernels.fusion); None: on for CUDA, off
    # on the CPU. The norm's switch is ours (Megatron fuses norms inside Transformer Engine).
    rms_norm_fusion: bool | None = None  # compile RMSNorm; None: on for CUDA, off on the CPU
    apply_rope_fusion: bool | None = None  # compile RoPE; None: on for CUDA, off on the CPU
    # compile SwiGLU and the MoE row weighting; None: on for CUDA, off on the CPU
    bias_activation_fusion: bool | None = None
    # --- MoE dispatch and routing (training behaviour: how tokens reach the experts) ---
    # "alltoall" | "flex" ("allgather" is the reference's, not built)
    moe_token_dispatcher_type: str = "alltoall"
    # "torch" (ours, runs everywhere) | "deepep" | "hybridep"
    moe_flex_dispatcher_backend: str | None = None
    # True: vectorised permutation; False: straightforward per-expert loop; None: the loop on CPU,
    # fused on CUDA (kernels/moe_permute.py: the loop synchronises the host per expert on a GPU)
    moe_permute_fusion: bool | None = None
    moe_aux_loss_coeff: float = 0.0  # weight of the router's load-balancing loss (0: none)
    moe_router_load_balancing_type: str = "aux_loss"  # "aux_loss" | "none"
    # Benchmarking only (Bridge's perf recipes): routing from random logits, so the experts get
    # balanced loads whatever the router learnt; its gradient passes straight through to the real
    # logits.
    moe_router_force_load_balancing: bool = False
    # None: dropless; else each expert keeps <= ceil(T*k/E*factor)
    moe_expert_capacity_factor: float | None = None
    # pad every expert to its capacity: static shapes, no counts
    moe_pad_expert_input_to_capacity: bool = False
    # past capacity, keep the highest weights ("probs") or earliest tokens
    moe_token_drop_policy: str = "probs"
    # None: off; else sync-free dropless dispatch: fixed blocks of ceil(T*k/EP*factor) rows per EP
    # peer, a step that overflows one is re-run dropless (layers/moe/rank_capacity.py)
    moe_expert_rank_capacity_factor: float | None = None
    # with the sync-free dispatch, Megatron's paged stash: the experts' activations kept for the
    # backward in pages of the rows routed, not the padded blocks (not built: `overlap run` refuses
    # it; the planner prices it as the reference runs it)
    moe_paged_stash: bool = False
    # the stash's GPU pool x the average routed rows (negative: x the actual maximum, Megatron's)
    moe_paged_stash_buffer_size_factor_cuda: float = PAGED_STASH_POOL
    # --- recompute (activation checkpointing) ---
    recompute_granularity: str | None = None  # None | "selective" | "full"
    recompute_method: str | None = None  # None | "uniform" | "block" (with full)
    # with full recompute: layers per chunk (uniform) or recomputed (block)
    recompute_num_layers: int | None = None
    # with selective: a subset of RECOMPUTE_MODULES (None: ["core_attn"])
    recompute_modules: list[str] | None = None
    # --- CUDA graphs (a compatibility surface: the runtime does not capture graphs) ---
    cuda_graph_impl: str = "none"  # "none" | "local" | "transformer_engine"
    # modules a scoped CUDA graph would cover (compatibility surface)
    cuda_graph_scope: list[str] | None = None
    # --- overlap fields: inputs finalize reads and keeps as typed (resolved: cfg.resolved.overlap;
    # the direct spellings of comm_overlap's switches are aliases: overlap.config.aliases)
    # Megatron-Core's per-direction TP-overlap switches (ModelParallelConfig names and defaults);
    # they narrow the per-GEMM plan, see overlap.kernels.tp_overlap.effective_tp_plan.
    tp_comm_overlap_ag: bool = True  # AG -> GEMM slots: qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad
    tp_comm_overlap_rs: bool = True  # GEMM -> RS slots: proj_fprop, fc2_fprop
    tp_comm_bulk_dgrad: bool = True  # qkv_dgrad, fc1_dgrad: input all-gather under the dgrad GEMM
    # qkv_wgrad, fc1_wgrad: dgrad reduce-scatter under the wgrad GEMM
    tp_comm_bulk_wgrad: bool = True
    # qkv/fc1 dgrad reduce-scatter chunked with the dgrad GEMM instead
    tp_comm_overlap_rs_dgrad: bool = False
    tp_comm_overlap_disable_qkv: bool = False  # no overlap in the QKV linear
    tp_comm_overlap_disable_fc1: bool = False  # no overlap in the FC1 linear
    # the shared expert computes under the dispatch/combine all-to-all; None: off (logged; an
    # input, the resolved value is cfg.resolved.overlap's)
    moe_shared_expert_overlap: bool | None = None

    # --- checks of this section alone (ConfigContainer.finalize runs them once resolved) ---------
    def validate(self) -> None:
        """Every rule that needs only the model's own fields, in a fixed order (the first broken
        one is the error): the network's first (`TransformerArchitecture.validate`), then how it
        is run; the rules that need the layout or other sections are the container's."""
        super().validate()
        check_rules(self._run_rules())

    def _run_rules(self) -> Iterator[Rule]:
        """How the network is run, as rule rows read lazily (a row may rely on those before it)."""
        yield (
            "model.pipeline_impl",
            self.pipeline_impl,
            self.pipeline_impl in PIPELINE_IMPLS,
            "unknown pipeline implementation.",
            "use overlap (ours) or torch_pipelining (the PyTorch peer).",
        )
        yield (
            "model.tensor_parallel_impl",
            self.tensor_parallel_impl,
            self.tensor_parallel_impl in TENSOR_PARALLEL_IMPLS,
            "unknown tensor-parallel implementation.",
            "use overlap (ours) or dtensor (the PyTorch-native peer).",
        )
        if self.is_moe:
            yield from self._routing_rules()
        yield (
            "model.moe_token_dispatcher_type",
            self.moe_token_dispatcher_type,
            self.moe_token_dispatcher_type in ("alltoall", "flex", "allgather"),
            "unknown token dispatcher.",
            "use alltoall or flex.",
        )
        yield from self._recompute_rules()
        yield from self._cuda_graph_rules()
        yield from self._range_rules()

    def _routing_rules(self) -> Iterator[Rule]:
        factor, rank_factor = self.moe_expert_capacity_factor, self.moe_expert_rank_capacity_factor
        yield (
            "model.moe_router_load_balancing_type",
            self.moe_router_load_balancing_type,
            self.moe_router_load_balancing_type in LOAD_BALANCING_TYPES,
            "This load-balancing type",
            "use aux_loss or none.",
            NotBuiltError,
        )
        yield (
            "model.moe_expert_capacity_factor",
            factor,
            factor is None or factor > 0,
            "an expert capacity factor must be > 0.",
            "use e.g. 1.0 (null: dropless, no capacity).",
        )
        yield (
            "model.moe_pad_expert_input_to_capacity",
            True,
            not self.moe_pad_expert_input_to_capacity or factor is not None,
            "padding to the expert capacity needs a capacity.",
            "also set model.moe_expert_capacity_factor (e.g. 1.0), or drop the padding.",
        )
        yield (
            "model.moe_expert_rank_capacity_factor",
            rank_factor,
            rank_factor is None or rank_factor > 0,
            "an expert-rank capacity factor must be > 0.",
            "use e.g. 1.5 (null: the all-to-all reads the split sizes on the host).",
        )
        yield (
            "model.moe_expert_rank_capacity_factor",
            rank_factor,
            rank_factor is None or factor is None,
            "it trains the dropless model (a step that overflows its blocks is re-run dropless), "
            f"while model.moe_expert_capacity_factor={factor} drops the rows past each expert's "
            "capacity: the two contracts exclude each other.",
            "drop one of them (null): the expert-rank factor for exact results without a host "
            "read of split sizes, the expert factor to drop tokens.",
        )
        yield (
            "model.moe_paged_stash",
            True,
            not self.moe_paged_stash or rank_factor is not None,
            "the paged stash keeps the sync-free dispatch's rows; without "
            "moe_expert_rank_capacity_factor there are none to page (Megatron's rule).",
            "also set model.moe_expert_rank_capacity_factor (e.g. 1.5), or drop the paged stash.",
        )
        stash = self.moe_paged_stash_buffer_size_factor_cuda
        yield (
            "model.moe_paged_stash_buffer_size_factor_cuda",
            stash,
            math.isfinite(stash)
            and stash != 0
            and (self.moe_paged_stash or stash == PAGED_STASH_POOL),
            "it sizes the paged stash's GPU pool (x the average routed rows; negative: x the "
            "actual maximum), so it is finite, not 0, and set only with model.moe_paged_stash.",
            "use e.g. 1.2 with model.moe_paged_stash=true, or drop it.",
        )
        yield (
            "model.moe_token_drop_policy",
            self.moe_token_drop_policy,
            self.moe_token_drop_policy in ("probs", "position"),
            "unknown token drop policy.",
            "use probs or position.",
        )

    def _recompute_rules(self) -> Iterator[Rule]:
        granularity, method = self.recompute_granularity, self.recompute_method
        count, full = self.recompute_num_layers, granularity == "full"
        yield (
            "model.recompute_granularity",
            granularity,
            granularity in (None, "selective", "full"),
            "unknown granularity.",
            "use selective, full, or null.",
        )
        yield (
            "model.recompute_method",
            method,
            not full or method in ("uniform", "block"),
            "full recompute needs a method.",
            "set recompute_method to uniform or block.",
        )
        yield (
            "model.recompute_num_layers",
            count,
            not full or (count and count >= 1),
            "full recompute needs a layer count.",
            "set recompute_num_layers (e.g. -rl 1).",
        )
        yield (
            "model.recompute_method",
            method,
            full or (method is None and count is None),
            "recompute_method / recompute_num_layers only apply to recompute_granularity=full.",
            "set recompute_granularity=full, or clear them.",
        )
        field, modules = "model.recompute_modules", self.recompute_modules or []
        unbuilt_one = next((name for name in modules if unbuilt(field, name)), None)
        yield (
            field,
            modules,
            unbuilt_one is None,
            unbuilt(field, unbuilt_one),
            f"drop {unbuilt_one} from recompute_modules.",
            NotBuiltError,
        )
        bad = [x for x in modules if x not in RECOMPUTE_MODULES]
        built = [x for x in RECOMPUTE_MODULES if not unbuilt(field, x)]
        yield field, modules, not bad, f"unknown module(s) {bad}.", f"use a subset of {built}."
        selective = modules if granularity == "selective" else []
        yield (
            field,
            modules,
            "moe_act" not in selective or self.is_moe,
            "moe_act recomputes the routed experts' activation function, and this model has no "
            "experts.",
            "drop moe_act (a dense MLP recomputes with 'mlp').",
        )
        yield (
            field,
            modules,
            "shared_experts" not in selective
            or (self.is_moe and self.moe_shared_expert_intermediate_size),
            "shared_experts recomputes the MoE layers' shared expert, and this model has none.",
            "drop shared_experts, or set model.moe_shared_expert_intermediate_size.",
        )
        reroutes = full or (granularity == "selective" and "moe" in modules)
        yield (
            "model.moe_router_force_load_balancing",
            True,
            not (self.is_moe and self.moe_router_force_load_balancing and reroutes),
            "forced load balancing draws new random logits at every router call, and this "
            f"recompute ({granularity}) calls the router again in backward, which would route the "
            "recomputed tokens differently from the forward.",
            "drop the recompute of the MoE layers (full, or selective 'moe'), or the forced "
            "balancing.",
        )

    @property
    def graph_scope(self) -> tuple[str, ...]:
        """`cuda_graph_scope` as module names however it was given (a list, or the comma string a
        Python recipe may assign): the one reading of the field, which its rules here, the EP
        overlap's rules and the planner's graphed pieces share."""
        scope = self.cuda_graph_scope or []
        return tuple(comma_list(scope) if isinstance(scope, str) else scope)

    def _cuda_graph_rules(self) -> Iterator[Rule]:
        impl, field, value = self.cuda_graph_impl, "model.cuda_graph_scope", self.cuda_graph_scope
        scope = self.graph_scope
        bad = [s for s in scope if s not in CUDA_GRAPH_SCOPES + ("full",)]
        yield (
            "model.cuda_graph_impl",
            impl,
            impl in ("none", "local", "transformer_engine"),
            "unknown CUDA-graph implementation.",
            "use none, local or transformer_engine.",
        )
        yield (
            field,
            value,
            not bad,
            f"unknown scope(s) {bad}.",
            f"use a subset of {list(CUDA_GRAPH_SCOPES)}.",
        )
        yield (
            field,
            value,
            impl != "local" or not scope or set(scope) == {"full_iteration"},
            "cuda_graph_impl=local only captures full iterations; scoped graphs need "
            "transformer_engine.",
            "use --cuda_graph_scope full_iteration or the TE impl.",
        )
        yield (
            field,
            value,
            "full_iteration" not in scope or impl != "transformer_engine",
            "full_iteration graphs are not captured by the transformer_engine impl.",
            "use --cuda_graph_impl local for full_iteration.",
        )

    def _range_rules(self) -> Iterator[Rule]:
        """Values the type check lets through but the run cannot use (NaN fails each rule, and a
        float rule also refuses infinity); the network's own are `TransformerArchitecture`'s."""
        fin = math.isfinite
        aux, factor = self.moe_aux_loss_coeff, self.moe_expert_capacity_factor
        rank_factor, rl = self.moe_expert_rank_capacity_factor, self.recompute_num_layers
        yield (
            "model.moe_aux_loss_coeff",
            aux,
            fin(aux) and aux >= 0,
            "the auxiliary-loss coefficient must be >= 0 (0: none).",
            "use e.g. model.moe_aux_loss_coeff=1e-3.",
        )
        yield (
            "model.moe_expert_capacity_factor",
            factor,
            factor is None or fin(factor),
            "an expert capacity factor must be finite.",
            "use e.g. 1.0 (null: dropless, no capacity).",
        )
        yield (
            "model.moe_expert_rank_capacity_factor",
            rank_factor,
            rank_factor is None or fin(rank_factor),
            "an expert-rank capacity factor must be finite.",
            "use e.g. 1.5 (null: the all-to-all reads the split sizes on the host).",
        )
        yield (
            "model.recompute_num_layers",
            rl,
            rl is None or rl <= self.num_layers,
            f"it cannot exceed num_layers ({self.num_layers}).",
            f"use -rl between 1 and {self.num_layers}.",
        )
