"""TransformerArchitecture: what the network is, and nothing about how a run trains it.

The rule for a field: it belongs here when it changes the parameters (their shapes, how many there
are, how they are initialised) or what a token's forward pass computes from them on one rank, in
exact arithmetic. How the work is split over ranks (TP, PP, EP, ...), which kernels run it,
precision, recompute, CUDA graphs and communication overlap change none of that, so they are
`ModelConfig`'s other sections. So are the MoE routing policies that act on a batch of tokens rather
than on one token: capacity and token dropping, load balancing and the auxiliary loss are training
behaviour, while the experts' count, width, top-k and combine weighting are the network.

`ModelConfig` inherits these fields (Megatron-Bridge's flat `model.hidden_size=...` surface stays);
`ModelConfig.architecture` is the plain copy for code that should only see the network. The sizes
derived from the architecture alone (head_dim, ffn_size, is_moe_layer, ...) are properties here.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields

from overlap.errors import Rule, check_rules


def moe_layer_freq_for(moe: list[bool]) -> int | list[int]:
    """The moe_layer_freq that makes exactly the layers flagged in `moe` MoE: an int k where one
    does, else the per-layer list."""
    n = len(moe)
    for k in range(1, n + 1):
        if moe == [i % k == 0 for i in range(n)]:
            return k
    return [int(flag) for flag in moe]


@dataclass
class TransformerArchitecture:
    """The network: what its parameters are and what its forward pass computes (see the module
    docstring for the rule that puts a field here)."""

    # --- transformer dimensions ---
    num_layers: int = 2  # transformer layers
    hidden_size: int = 256  # width of the residual stream
    num_attention_heads: int = 4  # query heads per layer
    num_query_groups: int | None = None  # KV heads (GQA); None: = num_attention_heads
    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    ffn_hidden_size: int | None = None  # dense MLP width; None: 4 * hidden_size
    vocab_size: int = 32000  # embedding rows (a tokenizer or pretrained checkpoint replaces it)
    # a real tokenizer's vocabulary is padded to a multiple of this x TP
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 256  # tokens per sequence
    layernorm_epsilon: float = 1e-6  # epsilon of every RMSNorm
    rotary_base: float = 10000.0  # RoPE base frequency
    qk_layernorm: bool = False  # RMSNorm on each head's queries and keys
    gated_linear_unit: bool = True  # a gated MLP (SwiGLU) instead of GELU
    add_bias_linear: bool = False  # biases in the linear layers (refused by the runtime)
    add_qkv_bias: bool = False  # biases in the QKV projection only (refused by the runtime)
    init_method_std: float = 0.02  # standard deviation of the normal weight initialisation
    # the output layer reuses the input embedding's weight
    share_embeddings_and_output_weights: bool = False
    # --- mixture of experts: the experts and how their outputs combine ---
    num_moe_experts: int | None = None  # routed experts per MoE layer; None: a dense model
    moe_router_topk: int = 2  # experts each token is routed to
    # False (Megatron's default, Qwen3-30B-A3B's norm_topk_prob=true): the combine weights are a
    # softmax over the k chosen logits (they sum to 1). True (norm_topk_prob=false): the softmax
    # over all experts, taken at the k chosen ones (they sum to less than 1).
    moe_router_pre_softmax: bool = False
    moe_ffn_hidden_size: int | None = None  # routed expert width; None: ffn_hidden_size
    moe_shared_expert_intermediate_size: int | None = None  # shared expert width; None: none
    # Megatron's two forms: an int k (layers 0, k, 2k, ... are MoE; 1: all) or one entry per layer,
    # 1 MoE / 0 dense (e.g. [0, 1, 0, 1]: what a Qwen3-MoE config.json with decoder_sparse_step=2 or
    # mlp_only_layers describes).
    moe_layer_freq: int | list[int] = 1
    # --- multi-token prediction ---
    # multi-token prediction layers (refused by the runtime; None or 0: none)
    mtp_num_layers: int | None = None

    # --- derived sizes ---
    @property
    def architecture(self) -> TransformerArchitecture:
        """The network alone: a copy of the architecture fields (lists copied too), without any
        parallel layout, kernel, precision or overlap setting of a subclass such as ModelConfig."""
        return TransformerArchitecture(
            **{
                f.name: copy.deepcopy(getattr(self, f.name))
                for f in fields(TransformerArchitecture)
            }
        )

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
        """Layer numbers count from 0; with moe_layer_freq k, layers 0, k, 2k, ... are MoE (k=1:
        all); with a list, the layers whose entry is 1."""
        if not self.is_moe:
            return False
        if isinstance(self.moe_layer_freq, list):
            return bool(self.moe_layer_freq[layer_number])
        return layer_number % self.moe_layer_freq == 0

    @property
    def moe_layer_pattern(self) -> int | list[int]:
        """moe_layer_freq in its shortest form: the int k when every k-th layer from 0 is MoE, else
        the list (so that [1, 0, 1, 0] and 2 compare as the same model)."""
        return moe_layer_freq_for([self.is_moe_layer(i) for i in range(self.num_layers)])

    # --- checks of the network alone ---
    def check_sizes(self) -> None:
        """Every size positive, before any later stage computes with one (the data decisions
        quote ln(vocab_size), the layout divides by head counts): ConfigContainer.finalize runs
        it first."""
        sizes = {
            name: getattr(self, name)
            for name in (
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "vocab_size",
                "seq_length",
                "kv_channels",
                "ffn_hidden_size",
                "num_query_groups",
                "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size",
            )
        }
        check_rules(
            (f"model.{k}", v, v is None or v >= 1, "it must be positive.", f"set model.{k} >= 1.")
            for k, v in sizes.items()
        )

    def validate(self) -> None:
        """The rules that need only the architecture, in a fixed order (the first broken one is the
        error); the sizes are positive (`check_sizes`). Divisibility by the parallel sizes is the
        container's (it needs the layout)."""
        check_rules(self._network_rules())

    def _network_rules(self) -> Iterator[Rule]:
        """The experts' rules (a MoE model's), then the values the type check lets through but
        the network cannot use (NaN fails each rule, and a float rule also refuses infinity)."""
        freq, n, experts = self.moe_layer_freq, self.num_layers, self.num_moe_experts
        listed = isinstance(freq, list)
        if self.is_moe:
            yield (
                "model.num_moe_experts",
                experts,
                experts >= 1,
                "a MoE model needs experts.",
                "set num_moe_experts >= 1, or null for a dense model.",
            )
            yield (
                "model.moe_router_topk",
                self.moe_router_topk,
                1 <= self.moe_router_topk <= experts,
                f"top-k must be between 1 and num_moe_experts ({experts}).",
                "choose a smaller moe_router_topk.",
            )
            yield (
                "model.moe_layer_freq",
                freq,
                not listed or (len(freq) == n and all(v in (0, 1) for v in freq)),
                f"a per-layer pattern has one entry per layer ({n}), each 1 (MoE) or 0 (dense).",
                f"give {n} entries of 0/1, or an int k for every k-th layer.",
            )
            yield (
                "model.moe_layer_freq",
                freq,
                not listed or any(freq),
                "no layer is MoE, yet num_moe_experts is set.",
                "mark at least one layer 1, or drop num_moe_experts for a dense model.",
            )
            yield (
                "model.moe_layer_freq",
                freq,
                listed or freq >= 1,
                "it must be >= 1.",
                "use 1 for all-MoE layers, k for every k-th layer, or a per-layer 0/1 list.",
            )
        fin = math.isfinite
        eps, std, mtp = self.layernorm_epsilon, self.init_method_std, self.mtp_num_layers
        yield (
            "model.layernorm_epsilon",
            eps,
            fin(eps) and eps > 0,
            "the norm epsilon must be > 0.",
            "use e.g. model.layernorm_epsilon=1e-6.",
        )
        yield (
            "model.rotary_base",
            self.rotary_base,
            fin(self.rotary_base) and self.rotary_base > 1,
            "the rotary base must be > 1.",
            "use e.g. model.rotary_base=10000.",
        )
        yield (
            "model.kv_channels" if self.kv_channels else "model.hidden_size",
            self.kv_channels or self.hidden_size,
            self.head_dim % 2 == 0,
            "rotary embeddings rotate pairs of channels, so the head dim must be even (it is "
            f"{self.head_dim}{'' if self.kv_channels else ' = hidden_size / num_attention_heads'})"
            ".",
            "use an even kv_channels (head dim), e.g. 64 or 128.",
        )
        yield (
            "model.init_method_std",
            std,
            fin(std) and std >= 0,
            "the initialisation standard deviation must be >= 0.",
            "use e.g. model.init_method_std=0.02.",
        )
        yield (
            "model.mtp_num_layers",
            mtp,
            mtp is None or mtp >= 0,
            "a layer count must be >= 0.",
            "set model.mtp_num_layers=null.",
        )
