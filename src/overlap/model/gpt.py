"""The Qwen3-style GPT model: token embedding, pre-norm transformer layers (dense MLP or MoE), final
norm, LM head.

Tensors between layers are [seq, batch, hidden]; under sequence parallelism every TP rank holds its
1/tp slice of the sequence between the TP regions. Parameter names are the same in every parallel
layout, which is what lets `init_weights` give every layout the reference model's weights: under
pipeline parallelism a model chunk (`Stage`) holds a range of layers registered under their global
numbers (`layers.5.` on whichever rank holds layer 5), the embedding only on the first virtual
stage, the final norm and output layer only on the last.

What the model runs overlapped (the TP slots of each linear, the shared expert under the
all-to-alls, the deferred output-layer wgrad) comes from the resolved overlap plan it is built with
(`cfg.resolved.overlap`), never from the model section's switches, which keep only what was
typed; its parameters' dtype, likewise, from the resolved precision (`cfg.resolved.precision`),
and which kernels run (attention, fusions, MoE permutation, experts' GEMM, token dispatcher) from
the resolved kernels (`cfg.resolved.kernels`), decided once for the run's device; whether the
sequence is split over TP from the layout it runs on (`ps.layout.sequence_parallel`, off at TP 1
whatever the model section says).
Its weight gradients go through the model's `WeightGradStore` (`wgrad_store`, handed to every layer
it builds; the chunks of one rank share one), which the schedules switch to delaying and drain
(delay_wgrad_compute, overlapped p2p): a store per run, not per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from overlap.config.recompute import layer_chunks, selective_modules
from overlap.layers.attention import SelfAttention
from overlap.layers.cross_entropy import cross_entropy
from overlap.layers.init import init_model_params
from overlap.layers.mlp import MLP
from overlap.layers.norm import RMSNorm
from overlap.layers.recompute import maybe_checkpoint
from overlap.layers.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    params_dtype,
)
from overlap.layers.wgrad_store import WeightGradStore
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder

if TYPE_CHECKING:
    from overlap.config.comm_overlap import OverlapPlan
    from overlap.config.mixed_precision import Precision
    from overlap.kernels import Kernels
    from overlap.layout import PipelineLayout


class TransformerLayer(nn.Module):
    """x -> x + attn(norm(x)) -> h + mlp(norm(h)), where mlp is a dense MLP or an MoE layer.

    The two halves are separate methods (`attention_block`, `mlp_block`) so that schedules can run
    them apart; `forward` is simply one after the other and returns (hidden, aux_loss or None).
    `wgrad_store`: the model's store its linears' weight gradients go through.
    """

    def __init__(
        self,
        config,
        ps: ParallelState,
        layer_number: int,
        overlap: OverlapPlan,
        precision: Precision,
        kernels: Kernels,
        wgrad_store: WeightGradStore,
    ) -> None:
        super().__init__()
        dtype = params_dtype(precision)
        sp = ps.layout.sequence_parallel
        self.layer_number = layer_number
        self.is_moe = config.is_moe_layer(layer_number)
        recompute = selective_modules(config)
        self.recompute_norm = "layernorm" in recompute
        self.recompute_mlp = ("moe" if self.is_moe else "mlp") in recompute
        norm = dict(
            hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
            sequence_parallel=sp,
            params_dtype=dtype,
            device=ps.device,
            fusion=kernels.rms_norm_fusion,
        )
        self.input_layernorm = RMSNorm(**norm)
        self.self_attention = SelfAttention(
            config, ps, layer_number, overlap, precision, kernels, wgrad_store
        )
        self.pre_mlp_layernorm = RMSNorm(**norm)
        if self.is_moe:
            # only MoE models need (and import) the MoE package
            from overlap.layers.moe.moe_layer import MoELayer

            self.mlp = MoELayer(config, ps, layer_number, overlap, precision, kernels, wgrad_store)
        else:
            self.mlp = MLP(config, ps, overlap, precision, kernels, wgrad_store=wgrad_store)

    def attention_block(self, x: torch.Tensor) -> torch.Tensor:
        """Residual + self-attention of the input-normalised hidden state."""
        normed = maybe_checkpoint(self.recompute_norm, self.input_layernorm, x)
        return x + self.self_attention(normed)

    def mlp_block(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Residual + MLP/MoE of the pre-MLP-normalised hidden state; also returns the MoE aux loss
        (None if dense)."""
        normed = maybe_checkpoint(self.recompute_norm, self.pre_mlp_layernorm, x)
        out, aux_loss = maybe_checkpoint(self.recompute_mlp, self.mlp, normed)
        return x + out, aux_loss

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.mlp_block(self.attention_block(x))


@dataclass(frozen=True)
class Stage:
    """What one model chunk holds: layers [start, end) and whether it embeds (first virtual pipeline
    stage) and/or computes the loss (last)."""

    start: int
    end: int
    pre_process: bool
    post_process: bool


class LayerStack(nn.Module):
    """A run of consecutive layers registered under their global layer numbers (so parameter names
    match every layout); indexed and iterated like a ModuleList, by position within the run."""

    def __init__(self, layers: list[nn.Module], first: int) -> None:
        super().__init__()
        self.first = first
        for i, layer in enumerate(layers):
            self.add_module(str(first + i), layer)

    def __getitem__(self, i: int) -> nn.Module:
        return self._modules[str(self.first + i)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class GPTModel(nn.Module):
    """`forward(tokens [b, s], labels [b, s]) -> (lm_loss, aux_loss)`.

    Every TP rank gets the full micro-batch of tokens (a context-parallel rank its two chunks of
    each sequence, `overlap.parallel.cp_chunks`). lm_loss is the mean per-token cross-entropy of
    the micro-batch's tokens on this rank (fp32, identical on every TP rank; the CP ranks hold equal
    token counts, so the mean over CP of their means is the sequence's mean); aux_loss is the sum
    of the MoE layers' auxiliary losses (a 0-dim fp32 tensor, zero for a dense model). The output
    layer is vocabulary-parallel, its own weight or, with `share_embeddings_and_output_weights`
    (Qwen3 0.6B-4B's `tie_word_embeddings`), the embedding's (or, on the last of several pipeline
    stages, its copy); the loss is computed from the vocab-sharded logits without gathering them.
    `overlap` is the run's resolved overlap plan (what its layers overlap), `precision` its
    resolved precision (the parameters' dtype; `Precision.of(config)` for a bare config),
    `kernels` its resolved kernels (`cfg.resolved.kernels`; a test's bare config takes
    `bare_kernels`, tests/configs.py); `wgrad_store`: the store its weight gradients go through,
    kept as `self.wgrad_store` (None: a new one, this model's).
    """

    def __init__(
        self,
        config,
        ps: ParallelState,
        overlap: OverlapPlan,
        precision: Precision,
        kernels: Kernels,
        stage: Stage | None = None,
        wgrad_store: WeightGradStore | None = None,
    ) -> None:
        super().__init__()
        # The vocabulary and each CP rank's share of the sequence split over TP: config-time split
        # rules (`overlap.layout.resolve.split_rules`); a bare config that breaks them stops at the
        # layers' `divide` guards.
        self.config = config
        self.ps = ps
        self.stage = stage or Stage(0, config.num_layers, True, True)
        self.wgrad_store = WeightGradStore() if wgrad_store is None else wgrad_store
        dtype = params_dtype(precision)
        sp = ps.layout.sequence_parallel
        tied = config.share_embeddings_and_output_weights
        if self.stage.pre_process:
            self.embedding = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, ps, sp, dtype
            )
            if tied and not self.stage.post_process:
                self.embedding.weight.tied_embedding = True
        self.layers = LayerStack(
            [
                TransformerLayer(config, ps, i, overlap, precision, kernels, self.wgrad_store)
                for i in range(self.stage.start, self.stage.end)
            ],
            self.stage.start,
        )
        if self.stage.post_process:
            self.final_layernorm = RMSNorm(
                config.hidden_size,
                config.layernorm_epsilon,
                sp,
                dtype,
                ps.device,
                fusion=kernels.rms_norm_fusion,
            )
            # defer_embedding_wgrad_compute: the output layer's weight gradients go through a store
            # of their own, which the pipeline executor defers to the flush
            # (overlap.pipeline.output_wgrad)
            store = (
                WeightGradStore("bwd.deferred_output_wgrad")
                if overlap.defer_embedding_wgrad_compute
                else self.wgrad_store
            )
            if tied:
                # On the embedding's stage the output layer reads the embedding's own parameter
                # (both are [vocab / tp, h], cut the same way over TP), so its two gradients meet in
                # one autograd accumulation and the grad-ready hook fires once, with their sum. That
                # needs the output layer's share computed in the backward itself: no store
                # (delay_wgrad_compute would deliver it later, after data parallelism took the
                # embedding's share as the whole gradient). EP overlap's pieces and deferred output
                # wgrads are refused with a tied model (`runtime_refusals`).
                store = None
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.vocab_size, ps, sp, params_dtype=dtype, wgrad_store=store
            )
            if tied and self.stage.pre_process:
                self.output_layer.weight = self.embedding.weight
            elif tied:
                # On the last pipeline stage: a copy, drawn, loaded and saved as the embedding
                # (`tied_to`), whose gradient the trainer sums with the embedding's over the
                # pipeline's ends after the DP reduction (Megatron's embedding group), so that both
                # take the same steps.
                self.output_layer.weight.tied_to = "embedding.weight"
                self.output_layer.weight.tied_embedding = True
        self.layer_chunks = layer_chunks(config, len(self.layers))

    def init_weights(self, seed: int) -> None:
        """Give this rank its slice of the layout-independent initial weights (see
        `overlap.layers.init`)."""
        init_model_params(self, seed, self.config.init_method_std)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] -> hidden [s_local, b, h] (this rank's sequence shard under sequence
        parallelism)."""
        return self.embedding(tokens.t())

    def run_layers(
        self, hidden: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This chunk's layers [start, end) (positions in the chunk) on `hidden`; returns the output
        and the sum of their aux losses (None if all dense)."""
        aux_total = None
        for i in range(start, end):
            layer = self.layers[i]
            with recorder().span(f"fwd.layer{layer.layer_number}"):
                hidden, aux = layer(hidden)
            if aux is not None:
                aux_total = aux if aux_total is None else aux_total + aux
        return hidden, aux_total

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer (gathers the sequence under SP): [s, b, vocab/tp]."""
        return self.output_layer(self.final_layernorm(hidden))

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of vocab-sharded logits against labels [b, s]."""
        vocab_start = self.ps.tp_rank * logits.shape[-1]
        return cross_entropy(logits, labels.t(), self.ps.tp_group, vocab_start).mean()

    def lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_from_logits(self.logits(hidden), labels)

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.stage_forward(None, tokens, labels)

    def stage_forward(
        self, hidden: torch.Tensor | None, tokens: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk's part of the model: embed `tokens` (first stage) or continue from the
        received `hidden`, run the layers, and end with (lm_loss, aux_loss) on the last stage or
        (hidden, aux_loss) before it. aux_loss is the sum of this chunk's MoE aux losses (a 0-dim
        fp32 tensor, zero without MoE layers)."""
        hidden, aux_loss = self.stage_body(hidden, tokens)
        if not self.stage.post_process:
            return hidden, aux_loss
        with recorder().span("fwd.lm_loss"):
            loss = self.lm_loss(hidden, labels)
        return loss, aux_loss

    def stage_body(
        self, hidden: torch.Tensor | None, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding (first stage) and this chunk's layers: (hidden, summed aux loss)."""
        if self.stage.pre_process:
            hidden = self.embed(tokens)
        aux_loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start, end, checkpointed in self.layer_chunks:
            hidden, aux = maybe_checkpoint(checkpointed, self.run_layers, hidden, start, end)
            if aux is not None:
                aux_loss = aux_loss + aux
        return hidden, aux_loss


def model_chunks(
    config,
    ps: ParallelState,
    pipeline: PipelineLayout,
    overlap: OverlapPlan,
    precision: Precision,
    kernels: Kernels,
) -> list[GPTModel]:
    """This rank's model chunks: one without pipeline parallelism, VPP of them with a virtual
    pipeline, each holding the layers its virtual stage gets in `pipeline` (the run's resolved
    one, `overlap.layout.pipeline`: an even split, uneven first/last stages, the embedding and
    loss counted as layers, or a layout spelt out); chunks may differ in size. `overlap`,
    `precision`, `kernels`: the run's resolved ones. The chunks share one `WeightGradStore` (the
    pipeline executor's queue spans them)."""
    stages = pipeline.rank_stages(ps.pp_rank)
    store = WeightGradStore()
    return [
        GPTModel(
            config,
            ps,
            overlap,
            precision,
            kernels,
            Stage(s.start, s.end, s.embedding, s.loss),
            store,
        )
        for s in stages
    ]
