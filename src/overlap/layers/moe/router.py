"""Top-k router with the Switch-style load-balancing auxiliary loss.

Routing follows Qwen3-MoE: the k experts with the largest logits win. Their combine weights are a
softmax over just those k logits, so they sum to 1 per token (`norm_topk_prob=True`, Megatron's
default), or, with `moe_router_pre_softmax` (`norm_topk_prob=False`), the softmax over all experts
taken at the k winners. The aux loss needs the full softmax.
Everything runs in fp32 whatever the parameter dtype, because a routing decision flipped by rounding
changes which expert sees a token, a discontinuity no tolerance covers.

`moe_router_force_load_balancing` (a benchmark mode, as in Bridge's perf recipes) routes by
standard-normal logits instead of the real ones, so the experts' loads are balanced up to sampling
noise and a measurement is not skewed by an untrained router; the gradient passes straight through
to the real logits, so every parameter still receives one. The draws come from the router's own
generator, seeded from the layer and the rank's share of the tokens (data parallel rank, and the
tensor-parallel rank under sequence parallel; TP ranks without it route the same tokens and draw the
same logits), never from the global RNG: the same run draws the same logits whatever the schedule's
order. The generator is not part of a checkpoint (a resumed run draws from the start again): this
mode measures, it does not train a model anyone keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from overlap.config.mixed_precision import Precision
from overlap.config.model import LOAD_BALANCING_TYPES, ModelConfig
from overlap.layers.moe.permute import count_per_expert
from overlap.layers.tensor_parallel import params_dtype
from overlap.parallel import comm
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity, times `grad_scale`.

    Every rank of the group computes the same loss from the summed statistics and back-propagates
    it, so each rank owes gradient only to its own contribution: the identity. Summing those
    per-rank router grads over TP (the trainer does it for `sequence_parallel` parameters) then
    gives the gradient of the full-batch loss. Over context parallelism the router's gradients are
    summed over DP x CP under a 1 / (DP x CP) loss scale, which suits the CP ranks' own token means
    but would divide this full-sequence loss by CP: `grad_scale` = CP puts it back.
    """

    @staticmethod
    def forward(
        ctx, stats: torch.Tensor, group: ProcessGroup, grad_scale: float = 1.0
    ) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        return comm.all_reduce(stats.clone(), group, "moe_aux").wait()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad * ctx.grad_scale if ctx.grad_scale != 1.0 else grad, None, None


class _RandomLogits(torch.autograd.Function):
    """Standard-normal values in place of `logits`, whose gradient passes straight through
    (identity)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.randn(
            logits.shape, generator=generator, dtype=logits.dtype, device=logits.device
        )

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Fp32Logits(torch.autograd.Function):
    """`x @ weight^T` taken in fp32 from inputs in their own dtype, keeping those inputs for
    backward (Megatron-Core's router gating linear): `F.linear(x.float(), weight.float())` would
    keep the fp32 copy of x, twice the bytes of the bf16 hidden states it comes from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad = grad.float()
        d_x = (grad @ weight.float()).to(x.dtype)
        d_weight = (grad.t() @ x.float()).to(weight.dtype)
        return d_x, d_weight


class TopKRouter(nn.Module):
    """Scores every token against every expert; returns (topk_idx [T, k], topk_weights [T, k] fp32,
    aux_loss)."""

    def __init__(
        self, config: ModelConfig, ps: ParallelState, precision: Precision, layer_number: int = 1
    ) -> None:
        super().__init__()
        # the model's routing rule refuses another type at finalize (a NotBuiltError); only a
        # router built from a bare config reaches this guard
        if config.moe_router_load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(
                f"load balancing {config.moe_router_load_balancing_type!r} is not one of "
                f"{LOAD_BALANCING_TYPES}"
            )
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.pre_softmax = config.moe_router_pre_softmax
        self.aux_loss_coeff = (
            config.moe_aux_loss_coeff
            if config.moe_router_load_balancing_type == "aux_loss"
            else 0.0
        )
        # Under sequence parallel each TP rank routes only its slice of the sequence, under context
        # parallelism each CP rank its chunks; the aux-loss statistics must still describe the
        # whole micro-batch, so they are summed over those ranks (Megatron's tp-cp group).
        sp = ps.layout.sequence_parallel
        if ps.layout.cp > 1:
            self.stats_group = ps.tp_cp_group if sp else ps.cp_group
        else:
            self.stats_group = ps.tp_group if sp else None
        self.stats_grad_scale = float(ps.layout.cp)
        # Filled by init_model_params; replicated on every rank (routing must agree wherever a token
        # goes).
        self.weight = nn.Parameter(
            torch.empty(
                config.num_moe_experts,
                config.hidden_size,
                dtype=params_dtype(precision),
                device=ps.device,
            )
        )
        self.weight.sequence_parallel = True
        # Forced load balancing: the seed of the random logits' generator, made on the logits'
        # device at first use.
        self.random_seed: int | None = None
        self.random_logits: torch.Generator | None = None
        if config.moe_router_force_load_balancing:
            sp_rank = ps.tp_rank if sp else 0
            seq_rank = ps.cp_rank * ps.layout.tp + sp_rank  # which tokens of the sequence
            self.random_seed = (layer_number * 1_000_003 + ps.dp_rank) * 1009 + seq_rank

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with recorder().span("moe.router"):
            tokens = hidden.reshape(-1, hidden.shape[-1])
            logits = _Fp32Logits.apply(tokens, self.weight)
            if self.random_seed is not None:
                # meta (a dry run's stand-in for CUDA) has no generator, and its draws no values
                if self.random_logits is None and logits.device.type != "meta":
                    self.random_logits = torch.Generator(logits.device).manual_seed(
                        self.random_seed
                    )
                logits = _RandomLogits.apply(logits, self.random_logits)
            if self.pre_softmax:  # softmax is monotonic: the same winners as the logits' top-k
                topk_weights, topk_idx = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
            else:
                top_logits, topk_idx = logits.topk(self.topk, dim=-1)
                topk_weights = torch.softmax(top_logits, dim=-1)
            if not self.aux_loss_coeff:
                return topk_idx, topk_weights, logits.new_zeros(())
            stats = self._load_statistics(logits, topk_idx)
        return topk_idx, topk_weights, self._aux_loss(stats)

    def _load_statistics(self, logits: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
        """[prob sum per expert (E), routed pairs per expert (E), token count (1)] of this rank's
        tokens, in one vector so that one collective carries them all; only the prob sums carry
        gradient."""
        probs = torch.softmax(logits, dim=-1)
        counts = count_per_expert(topk_idx, self.num_experts).to(probs.dtype)
        return torch.cat([probs.sum(dim=0), counts, probs.new_full((1,), float(probs.shape[0]))])

    def _aux_loss(self, stats: torch.Tensor) -> torch.Tensor:
        """coeff * E * sum_e f_e * P_e, with f_e the share of routed (token, expert) pairs that went
        to e and P_e the mean router probability of e, both over the full micro-batch."""
        if self.stats_group is not None:
            stats = _SumOverGroup.apply(stats, self.stats_group, self.stats_grad_scale)
        prob_sums, counts, num_tokens = stats.split([self.num_experts, self.num_experts, 1])
        f = counts / (num_tokens * self.topk)
        p = prob_sums / num_tokens
        return self.aux_loss_coeff * self.num_experts * (f * p).sum()
