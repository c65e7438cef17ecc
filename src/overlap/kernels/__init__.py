"""Which kernel runs, decided from what the machine is: the capability probes (device 0's compute
capability, what torch.compile needs here) and the choice rules for the attention product
(`attention`), the MoE token permutation (`moe_permute`), the experts' GEMMs (`grouped_gemm`) and
the elementwise fusions (`fusion`), and the token dispatcher's flex backends (`flex_backend`,
checked against `device`). The rules sit below `config/`, whose resolution applies each once for
the run's device and records it (`choices`: the decision table's "model" section, and `Kernels` on
`cfg.resolved.kernels`). The kernels themselves are in `layers/`, which run what `Kernels` says
and decide nothing again.

TP overlap's slot rules are here too (`tp_overlap`: which method - ring exchange, pipeline or bulk -
hides each tensor-parallel GEMM's collective), chosen from the requested plan, Megatron's switches
and the shard's size rather than the device; the resolution applies them once
(`overlap.config.comm_overlap`) into `OverlapPlan.tp_slots`. What they decide (`SlotPlan`, and
`LinearPlan`, a linear's three slots) is defined here beside `Kernels`: the layers
(`layers/tp_overlap.py`) run it and import no rule.

The MoE dispatch's rows are here too (`moe_dispatch`: dropless with the split sizes read on the
host, an expert capacity padded or not, or the sync-free static blocks), not a choice but what the
model fields select, said with what it costs; the resolution records them
(`overlap.config.comm_overlap`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ModelFields(Protocol):
    """The model fields the kernel rules read, as the user typed them (`overlap.config`'s
    ModelConfig, which finalize hands in: this package sits below config and names none of its
    types)."""

    attention_backend: str
    seq_length: int
    num_moe_experts: int | None
    gated_linear_unit: bool
    rms_norm_fusion: bool | None
    apply_rope_fusion: bool | None
    bias_activation_fusion: bool | None
    moe_permute_fusion: bool | None
    moe_expert_rank_capacity_factor: float | None
    moe_token_dispatcher_type: str
    moe_flex_dispatcher_backend: str | None

    @property
    def is_moe(self) -> bool: ...


@dataclass(frozen=True)
class Kernels:
    """What runs of every kernel choice, decided once (`cfg.resolved.kernels`; for a model a test
    builds from a bare configuration, tests/configs.py's `bare_kernels`), under the names of the
    model fields that ask for it. The layers read it as it is; what is left to call time is what
    the tensors are (a dry run's fake stand-ins and dispatch modes run the eager functions and the
    experts' loop, a row stride the grouped kernel cannot take falls back to the loop)."""

    attention_backend: str
    """The attention product's kernel: "flash", "fused", "unfused" or "sdpa" (PyTorch's own choice
    among its kernels); `model.attention_backend` asks for it (`attention`)."""
    rms_norm_fusion: bool
    apply_rope_fusion: bool
    bias_activation_fusion: bool
    """Whether each elementwise chain runs compiled (`fusion`)."""
    moe_permute_fusion: bool
    """The fused MoE token permutation, or the per-expert loop (`moe_permute`)."""
    moe_grouped_gemm: bool
    """The routed experts' GEMMs as torch's grouped kernel, or the per-expert loop (`grouped_gemm`;
    Megatron-Core's field name, a choice of the architecture here, not a switch)."""
    moe_token_dispatcher_type: str
    moe_flex_dispatcher_backend: str | None
    """The token dispatcher that runs ("alltoall", "flex" with its backend) after the flex rules
    (`flex_backend`)."""


RING, PIPELINE, BULK = "ring_exchange", "pipeline", "bulk"
"""TP overlap's methods, under Megatron-Bridge's ``method`` strings (`tp_overlap`)."""


@dataclass(frozen=True)
class SlotPlan:
    """How one GEMM slot hides its collective, as decided (`tp_overlap.effective_tp_plan`):
    ``method`` (ring_exchange | pipeline | bulk), ``num_splits`` chunks for pipeline, ``aggregate``
    (ring exchange moves two chunks per step)."""

    method: str
    num_splits: int = 1
    aggregate: bool = False

    def __str__(self) -> str:
        if self.method == PIPELINE:
            return f"pipeline x{self.num_splits}"
        return f"{self.method} (aggregate)" if self.aggregate else self.method


@dataclass(frozen=True)
class LinearPlan:
    """The slots of one TP linear: forward GEMM, input-gradient GEMM, weight-gradient GEMM (None: no
    overlap); what `OverlapPlan.linear` hands the linear's layer to run."""

    fprop: SlotPlan | None
    dgrad: SlotPlan | None
    wgrad: SlotPlan | None
