"""ModelConfig: the transformer / MoE model, its parallel layout, recompute, precision, and the overlap fields that the
resolution in `comm_overlap.py` writes.

Field names and meanings follow Megatron-Core's TransformerConfig, which our users already speak. Overlap fields
default to `None`, meaning "not set by the user": `ConfigContainer.finalize` resolves each of them to a concrete value
and logs who decided and why. Derived sizes (kv_channels, ffn_hidden_size, ...) are filled by `finalize_dims`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Precision flags are set by the mixed-precision stage; params_dtype is a string so overrides stay plain YAML.
DTYPES = ("float32", "bfloat16", "float16")


def moe_layer_freq_for(moe: list[bool]) -> int | list[int]:
    """The moe_layer_freq that makes exactly the layers flagged in `moe` MoE: an int k where one does, else the
    per-layer list."""
    n = len(moe)
    for k in range(1, n + 1):
        if moe == [i % k == 0 for i in range(n)]:
            return k
    return [int(flag) for flag in moe]


@dataclass
class ModelConfig:
    # --- transformer dimensions -----------------------------------------------------------------------------------
    num_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (= num_attention_heads)
    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    ffn_hidden_size: int | None = None  # dense MLP width; None: 4 * hidden_size
    vocab_size: int = 32000
    make_vocab_size_divisible_by: int = 128  # a real tokenizer's vocabulary is padded to a multiple of this x TP
    seq_length: int = 256
    layernorm_epsilon: float = 1e-6
    rotary_base: float = 10000.0
    qk_layernorm: bool = False
    gated_linear_unit: bool = True  # SwiGLU
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    init_method_std: float = 0.02
    share_embeddings_and_output_weights: bool = False
    # The attention product's kernel (Megatron's AttnBackend names): auto | flash | fused | unfused | local; see
    # overlap.config.attention for what each runs here and auto's rule.
    attention_backend: str = "auto"
    gradient_accumulation_fusion: bool = False
    # Elementwise chains compiled by torch.compile (overlap.config.fusion); None: on for CUDA, off
    # on the CPU. The norm's switch is ours (Megatron fuses norms inside Transformer Engine).
    rms_norm_fusion: bool | None = None  # RMSNorm
    apply_rope_fusion: bool | None = None  # RoPE
    bias_activation_fusion: bool | None = None  # SwiGLU and the MoE row weighting
    # --- parallel layout ------------------------------------------------------------------------------------------
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    tensor_parallel_impl: str = "overlap"  # "overlap" (ours) | "dtensor" (the PyTorch-native peer: DTensor plans)
    # --- pipeline (Megatron-Core / Bridge names) ------------------------------------------------------------------
    num_layers_in_first_pipeline_stage: int | None = None  # None: an even split
    num_layers_in_last_pipeline_stage: int | None = None
    # The embedding / loss counts as one layer when the layers are divided evenly over the pipeline
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Every stage spelt out (Megatron's grammar, e.g. "Et*3|(tt|)*29,m|L", or a list of lists of
    # layer names); its stage count decides VPP. See overlap.config.pipeline_layout.
    pipeline_model_parallel_layout: str | list[list[str]] | None = None
    microbatch_group_size_per_vp_stage: int | None = None  # interleaved schedule; None: PP (depth-first)
    deallocate_pipeline_outputs: bool = False  # free a sent activation's storage once the send completed
    pipeline_impl: str = "overlap"  # "overlap" (ours) | "torch_pipelining" (the PyTorch peer)
    # --- mixture of experts ---------------------------------------------------------------------------------------
    num_moe_experts: int | None = None  # None: dense model
    moe_router_topk: int = 2
    # False (Megatron's default, Qwen3-30B-A3B's norm_topk_prob=true): the combine weights are a softmax over the k
    # chosen logits (they sum to 1). True (norm_topk_prob=false): the softmax over all experts, taken at the k
    # chosen ones (they sum to less than 1).
    moe_router_pre_softmax: bool = False
    moe_ffn_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None  # None: no shared expert
    # Megatron's two forms: an int k (layers 0, k, 2k, ... are MoE; 1: all) or one entry per layer, 1 MoE / 0 dense
    # (e.g. [0, 1, 0, 1]: what a Qwen3-MoE config.json with decoder_sparse_step=2 or mlp_only_layers describes).
    moe_layer_freq: int | list[int] = 1
    moe_token_dispatcher_type: str = "alltoall"  # "alltoall" | "flex" ("allgather" is the reference's, not built)
    moe_flex_dispatcher_backend: str | None = None  # "torch" (ours, runs everywhere) | "deepep" | "hybridep"
    moe_shared_expert_overlap: bool | None = None  # None: not set (resolved off, logged)
    # True: vectorised permutation; False: straightforward per-expert loop; None: the loop on CPU, fused on CUDA
    # (config/moe_permute.py: the loop synchronises the host per expert on a GPU)
    moe_permute_fusion: bool | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"  # "aux_loss" | "none"
    # Benchmarking only (Bridge's perf recipes): routing from random logits, so the experts get balanced loads
    # whatever the router learnt; its gradient passes straight through to the real logits.
    moe_router_force_load_balancing: bool = False
    moe_expert_capacity_factor: float | None = None  # None: dropless; else each expert keeps <= ceil(T*k/E*factor)
    moe_pad_expert_input_to_capacity: bool = False  # pad every expert to its capacity: static shapes, no counts
    moe_token_drop_policy: str = "probs"  # past capacity, keep the highest weights ("probs") or earliest tokens
    # --- recompute (activation checkpointing) ---------------------------------------------------------------------
    recompute_granularity: str | None = None  # None | "selective" | "full"
    recompute_method: str | None = None  # None | "uniform" | "block" (with full)
    recompute_num_layers: int | None = None
    # with selective: a subset of overlap.config.container.RECOMPUTE_MODULES (None: ["core_attn"])
    recompute_modules: list[str] | None = None
    # --- CUDA graphs (a compatibility surface: the runtime does not capture graphs) -------------------------------
    cuda_graph_impl: str = "none"  # "none" | "local" | "transformer_engine"
    cuda_graph_scope: list[str] | None = None
    # --- multi-token prediction (compatibility surface) -----------------------------------------------------------
    mtp_num_layers: int | None = None
    # --- precision (written by the mixed-precision stage) ---------------------------------------------------------
    bf16: bool = False
    fp16: bool = False
    params_dtype: str = "float32"
    # --- overlap fields resolved by ConfigContainer.finalize (None: not set by the user) -------------------------
    tp_comm_overlap: bool | None = None
    tp_comm_overlap_cfg: Any = None  # preset name, TransformerLayerTPOverlapCfg, or its dict form after resolution
    tp_comm_bootstrap_backend: str | None = None
    # Megatron-Core's per-direction TP-overlap switches (ModelParallelConfig names and defaults); they narrow the
    # per-GEMM plan, see overlap.config.tp_overlap.effective_tp_plan.
    tp_comm_overlap_ag: bool = True  # AG -> GEMM slots: qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad
    tp_comm_overlap_rs: bool = True  # GEMM -> RS slots: proj_fprop, fc2_fprop
    tp_comm_bulk_dgrad: bool = True  # qkv_dgrad, fc1_dgrad: input all-gather under the dgrad GEMM
    tp_comm_bulk_wgrad: bool = True  # qkv_wgrad, fc1_wgrad: dgrad reduce-scatter under the wgrad GEMM
    tp_comm_overlap_rs_dgrad: bool = False  # qkv/fc1 dgrad reduce-scatter chunked with the dgrad GEMM instead
    tp_comm_overlap_disable_qkv: bool = False  # no overlap in the QKV linear
    tp_comm_overlap_disable_fc1: bool = False  # no overlap in the FC1 linear
    overlap_p2p_comm: bool | None = None
    batch_p2p_comm: bool | None = None
    overlap_moe_expert_parallel_comm: bool | None = None
    delay_wgrad_compute: bool | None = None
    defer_embedding_wgrad_compute: bool | None = None
    wgrad_deferral_limit: int | None = None

    # --- derived values -----------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Layer numbers count from 0; with moe_layer_freq k, layers 0, k, 2k, ... are MoE (k=1: all); with a list,
        the layers whose entry is 1."""
        if not self.is_moe:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer_number])
        return layer_number % self.moe_layer_freq == 0

    @property
    def moe_layer_pattern(self) -> int | list[int]:
        """moe_layer_freq in its shortest form: the int k when every k-th layer from 0 is MoE, else the list (so that
        [1, 0, 1, 0] and 2 compare as the same model)."""
        return moe_layer_freq_for([self.is_moe_layer(i) for i in range(self.num_layers)])
