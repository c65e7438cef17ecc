"""What the training runtime can run today: a valid configuration that needs an unbuilt feature
stops here, loudly.

`overlap explain` accepts every configuration the reference accepts; `overlap run` refuses, with a
clear error, the ones whose runtime is not built yet (never a silent fallback, never a faked
result). The refusals are one rule table (`overlap.errors.broken_rules`), each rule here alone:
the configuration's own rules are `ConfigContainer.finalize`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

from overlap.config.container import ConfigContainer
from overlap.errors import ConfigError, NotBuiltError, Rule, broken_rules, check_rules
from overlap.layers.moe.moe_layer import unbuilt_dispatch
from overlap.layout.prerequisites import keeps_sent_outputs


def check_runtime_support(cfg: ConfigContainer, gpu: bool = False) -> None:
    """`overlap run`: refuse, before any rank starts, the first thing the runtime cannot train
    yet."""
    refusals = runtime_refusals(cfg, gpu)
    if refusals:
        raise refusals[0]


def runtime_refusals(cfg: ConfigContainer, gpu: bool = False) -> list[ConfigError]:
    """Everything in a valid configuration that `overlap run` would refuse (explain lists them, run
    raises). The overlap switches are the resolved plan's (`cfg.resolved.overlap`), the precision
    the resolved one (`cfg.resolved.precision`), the parallel sizes and sequence parallelism the
    resolved layout's (`cfg.resolved.layout`), the token dispatcher the resolved one
    (`cfg.resolved.kernels`)."""
    d = cfg.ddp
    check_rules(
        [
            (
                "ddp.impl",
                d.impl,
                d.impl in ("overlap", "torch_ddp", "fsdp2"),
                "unknown data-parallel implementation.",
                "use overlap, torch_ddp or fsdp2.",
            )
        ]
    )
    return broken_rules(_peer_rules(cfg, gpu)) + broken_rules(_unbuilt_rules(cfg), NotBuiltError)


def _peer_rules(cfg: ConfigContainer, gpu: bool) -> Iterator[Rule]:
    """What the PyTorch peers (the comparison runtimes) cannot run."""
    m, d, p, ck, t = cfg.resolved.model, cfg.ddp, cfg.resolved.precision, cfg.checkpoint, cfg.train
    tp = cfg.resolved.layout.tp
    cpu_comparison = not (
        m.is_moe
        or tp > 1
        or p.bf16
        or p.fp16
        or cfg.resolved.overlap.use_distributed_optimizer
        or p.fp8_param_gather
        or gpu
    )
    yield (
        "ddp.impl",
        d.impl,
        d.impl == "overlap" or cpu_comparison,
        "the PyTorch peers are the CPU data-parallel comparison: dense, tensor-parallel-free fp32 "
        "models, their own optimizer and sharding (no distributed optimizer / fp8 gather settings "
        "of ours).",
        "use -g cpu -mr dense_tiny -tp 1 -c fp32 with the default ddp settings, or "
        "ddp.impl=overlap.",
    )
    plain = not (
        ck.save
        or ck.load
        or ck.pretrained_checkpoint
        or t.exit_signal_handler
        or t.exit_duration_in_mins is not None
        or d.check_for_nan_in_grad
    )
    for ours, field, value in (
        (d.impl == "overlap", "ddp.impl", d.impl),
        (m.tensor_parallel_impl != "dtensor", "model.tensor_parallel_impl", "dtensor"),
    ):
        yield (
            field,
            value,
            ours or plain,
            "Checkpoints, the exit handlers and the NaN check in the PyTorch peers (they are "
            "speed comparisons; their parameters are torch's own objects)",
            "drop the checkpoint.* / train.exit_* / ddp.check_for_nan_in_grad settings for the "
            f"peer, or use {field}=overlap.",
            NotBuiltError,
        )
    yield (
        "model.tensor_parallel_impl",
        "dtensor",
        m.tensor_parallel_impl != "dtensor" or tp > 1,
        "the DTensor peer replaces the tensor-parallel communication, and at "
        "tensor_model_parallel_size=1 there is none: it would train our model unchanged and "
        "compare nothing.",
        "use -tp 2 or more, or model.tensor_parallel_impl=overlap.",
    )


def _unbuilt_rules(cfg: ConfigContainer) -> list[Rule]:
    """What the runtime does not build (NotBuiltErrors: `why` says what)."""
    m, d, o, p = cfg.resolved.model, cfg.ddp, cfg.resolved.overlap, cfg.resolved.precision
    layout, k = cfg.resolved.layout, cfg.resolved.kernels
    tied, moe, pp = m.share_embeddings_and_output_weights, m.is_moe, layout.pp
    torch_pp = m.pipeline_impl == "torch_pipelining"
    dtensor = m.tensor_parallel_impl == "dtensor"
    return [
        (
            "ddp.use_megatron_fsdp",
            True,
            not o.use_megatron_fsdp,
            "Megatron-FSDP (the state its sharding strategy names kept 1 / DP a rank, gathered "
            "layer by layer; `overlap plan` prices it)",
            "set ddp.use_megatron_fsdp=false: ddp.use_distributed_optimizer=true shards the "
            "optimizer state.",
        ),
        (
            "model.deallocate_pipeline_outputs",
            True,
            not (
                m.deallocate_pipeline_outputs
                and keeps_sent_outputs(pp, o.overlap_moe_expert_parallel_comm)
            ),
            "Releasing sent pipeline outputs under EP overlap (the merged steps keep each layer "
            "piece's output for its own backward)",
            "set model.deallocate_pipeline_outputs=false with EP overlap under -pp.",
        ),
        (
            "model.pipeline_impl",
            m.pipeline_impl,
            not (torch_pp and (moe or pp == 1)),
            "The torch.distributed.pipelining peer for MoE models (their aux losses) or without "
            "pipeline parallelism",
            "use it with a dense model and -pp 2 or more, or model.pipeline_impl=overlap.",
        ),
        (
            "model.tensor_parallel_impl",
            m.tensor_parallel_impl,
            not (dtensor and moe),
            "The PyTorch-native (DTensor) TP peer for MoE models (its plan covers the dense "
            "layers' attention and MLP linears, not the router, routed experts or shared experts)",
            "use it with a dense model (-mr dense_tiny), or model.tensor_parallel_impl=overlap.",
        ),
        (
            "model.tp_comm_overlap",
            True,
            not (dtensor and o.tp_comm_overlap),
            "TP communication overlap in the DTensor peer (parallelize_module runs each collective "
            "whole before or after its GEMM; PyTorch's async TP is a torch.compile pass on CUDA "
            "symmetric memory)",
            "set comm_overlap.tp_comm_overlap=false to run the peer, or "
            "model.tensor_parallel_impl=overlap.",
        ),
        (
            "model.deallocate_pipeline_outputs",
            True,
            not (m.deallocate_pipeline_outputs and torch_pp),
            "Releasing sent pipeline activations in the torch.distributed.pipelining peer (its "
            "schedule keeps the outputs; the release is ours)",
            "set model.deallocate_pipeline_outputs=false for the peer, or "
            "model.pipeline_impl=overlap.",
        ),
        (
            "model.context_parallel_size",
            layout.cp,
            layout.cp <= 1 or (m.pipeline_impl, m.tensor_parallel_impl, d.impl) == ("overlap",) * 3,
            "Context parallelism in the PyTorch peers (torch.distributed.pipelining, DTensor TP, "
            "torch DDP / FSDP2 do not cut the sequence or reduce over DP x CP)",
            "use -cp 1 with a peer, or model.pipeline_impl=overlap, "
            "model.tensor_parallel_impl=overlap and ddp.impl=overlap.",
        ),
        (
            "model.expert_tensor_parallel_size",
            layout.etp,
            layout.etp <= 1,
            "Expert tensor parallelism",
            "use -et 1.",
        ),
        *unbuilt_dispatch(m, k),
        (
            "mixed_precision.fp8_param_gather",
            True,
            not p.fp8_param_gather or o.use_distributed_optimizer,
            "FP8 parameter gather without the distributed optimizer (only its parameter all-gather "
            "is quantised)",
            "set ddp.use_distributed_optimizer=true and optimizer.use_distributed_optimizer=true, "
            "or mixed_precision.fp8_param_gather=false.",
        ),
        (
            "model.cuda_graph_impl",
            m.cuda_graph_impl,
            m.cuda_graph_impl == "none",
            "CUDA-graph capture",
            "use --cuda_graph_impl none.",
        ),
        (
            "model.mtp_num_layers",
            m.mtp_num_layers,
            not m.mtp_num_layers,
            "Multi-token prediction (the MTP layers, and an 'm' in pipeline_model_parallel_layout)",
            "set model.mtp_num_layers=null and drop the m's from the layout.",
        ),
        (
            "model.defer_embedding_wgrad_compute",
            True,
            not (o.defer_embedding_wgrad_compute and torch_pp),
            "Deferred output-layer wgrad outside our pipeline schedule (the "
            "torch.distributed.pipelining peer)",
            "set comm_overlap.defer_embedding_wgrad_compute=false, or use "
            "model.pipeline_impl=overlap.",
        ),
        (
            "model.gradient_accumulation_fusion",
            True,
            not m.gradient_accumulation_fusion,
            "Fused gradient accumulation (a Transformer Engine kernel)",
            "set model.gradient_accumulation_fusion=false.",
        ),
        (
            "model.add_bias_linear",
            True,
            not (m.add_bias_linear or m.add_qkv_bias),
            "Linear biases",
            "set model.add_bias_linear=false and model.add_qkv_bias=false.",
        ),
        (
            "model.sequence_parallel",
            False,
            not (moe and layout.tp > 1 and not layout.sequence_parallel),
            "MoE with tensor parallelism but without sequence parallelism (every TP rank would "
            "route the same tokens and count the expert gradients TP times)",
            "set model.sequence_parallel=true (-tp sets it for you).",
        ),
        (
            "model.gated_linear_unit",
            False,
            not moe or m.gated_linear_unit,
            "Non-gated (GELU) routed experts",
            "use gated_linear_unit=true (SwiGLU experts) for MoE models.",
        ),
        # Tied weights (`overlap.model.gpt`): one parameter whose two gradient shares must meet in
        # one backward
        (
            "model.share_embeddings_and_output_weights",
            True,
            not (tied and pp > 1 and torch_pp),
            "Tied embedding and output weights in the torch.distributed.pipelining peer",
            "use model.pipeline_impl=overlap with a tied model.",
        ),
        # (EP overlap and the deferred output wgrad: at PP 1 the two uses are one parameter on one
        # rank; the copy's path under them with a pipeline is not built either)
        (
            "model.share_embeddings_and_output_weights",
            True,
            not (tied and o.overlap_moe_expert_parallel_comm),
            "Tied embedding and output weights under EP overlap (its schedule runs the output "
            "layer's and the embedding's backward as separate pieces, so data parallelism would "
            "see the first share as the gradient)",
            "set comm_overlap.overlap_moe_expert_parallel_comm=false, or use an untied model.",
        ),
        (
            "model.defer_embedding_wgrad_compute",
            True,
            not (tied and o.defer_embedding_wgrad_compute),
            "Deferring a tied output layer's weight gradient (it is the embedding's too)",
            "set comm_overlap.defer_embedding_wgrad_compute=false.",
        ),
        (
            "model.share_embeddings_and_output_weights",
            True,
            not tied or d.impl == "overlap",
            "Tied embedding and output weights with the PyTorch data-parallel peer "
            f"ddp.impl={d.impl}",
            "use ddp.impl=overlap with a tied model.",
        ),
        (
            "ddp.average_in_collective",
            True,
            not d.average_in_collective,
            "Averaging inside the collective (gradients are summed; the loss carries 1 / "
            "(micro-batches x DP))",
            "set ddp.average_in_collective=false.",
        ),
    ]
