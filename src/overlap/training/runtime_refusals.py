"""What the training runtime can run today: a valid configuration that needs an unbuilt feature
stops here, loudly.

`overlap explain` accepts every configuration the reference accepts; `overlap run` refuses, with a
clear error, the ones whose runtime is not built yet (never a silent fallback, never a faked
result).
"""

from __future__ import annotations

from overlap.config.container import ConfigContainer
from overlap.errors import ConfigError, NotBuiltError


def check_runtime_support(cfg: ConfigContainer, gpu: bool = False) -> None:
    """`overlap run`: refuse, before any rank starts, the first thing the runtime cannot train
    yet."""
    refusals = runtime_refusals(cfg, gpu)
    if refusals:
        raise refusals[0]


def runtime_refusals(cfg: ConfigContainer, gpu: bool = False) -> list[ConfigError]:
    """Everything in a valid configuration that `overlap run` would refuse (explain lists them, run
    raises). The overlap switches are the resolved plan's (`cfg.resolved.overlap`), the precision
    and the token dispatcher the resolved ones (`cfg.resolved.precision`, `.kernels`)."""
    m, d, o, p = cfg.model, cfg.ddp, cfg.resolved.overlap, cfg.resolved.precision
    k = cfg.resolved.kernels
    tied = m.share_embeddings_and_output_weights
    checks = [
        (
            m.pipeline_model_parallel_size > 1
            and o.overlap_moe_expert_parallel_comm
            and m.deallocate_pipeline_outputs,
            "model.deallocate_pipeline_outputs",
            True,
            "Releasing sent pipeline outputs under EP overlap (the merged steps keep each layer "
            "piece's output for its own backward)",
            "set model.deallocate_pipeline_outputs=false with EP overlap under -pp.",
        ),
        (
            m.pipeline_impl == "torch_pipelining"
            and (m.is_moe or m.pipeline_model_parallel_size == 1),
            "model.pipeline_impl",
            m.pipeline_impl,
            "The torch.distributed.pipelining peer for MoE models (their aux losses) or without "
            "pipeline parallelism",
            "use it with a dense model and -pp 2 or more, or model.pipeline_impl=overlap.",
        ),
        (
            m.tensor_parallel_impl == "dtensor" and m.is_moe,
            "model.tensor_parallel_impl",
            m.tensor_parallel_impl,
            "The PyTorch-native (DTensor) TP peer for MoE models (its plan covers the dense "
            "layers' attention and MLP linears, not the router, routed experts or shared experts)",
            "use it with a dense model (-mr dense_tiny), or model.tensor_parallel_impl=overlap.",
        ),
        (
            m.tensor_parallel_impl == "dtensor" and o.tp_comm_overlap,
            "model.tp_comm_overlap",
            True,
            "TP communication overlap in the DTensor peer (parallelize_module runs each collective "
            "whole before or after its GEMM; PyTorch's async TP is a torch.compile pass on CUDA "
            "symmetric memory)",
            "set comm_overlap.tp_comm_overlap=false to run the peer, or "
            "model.tensor_parallel_impl=overlap.",
        ),
        (
            m.deallocate_pipeline_outputs and m.pipeline_impl == "torch_pipelining",
            "model.deallocate_pipeline_outputs",
            True,
            "Releasing sent pipeline activations in the torch.distributed.pipelining peer (its "
            "schedule keeps the outputs; the release is ours)",
            "set model.deallocate_pipeline_outputs=false for the peer, or "
            "model.pipeline_impl=overlap.",
        ),
        (
            m.context_parallel_size > 1
            and (
                m.pipeline_impl != "overlap"
                or m.tensor_parallel_impl != "overlap"
                or d.impl != "overlap"
            ),
            "model.context_parallel_size",
            m.context_parallel_size,
            "Context parallelism in the PyTorch peers (torch.distributed.pipelining, DTensor TP, "
            "torch DDP / FSDP2 do not cut the sequence or reduce over DP x CP)",
            "use -cp 1 with a peer, or model.pipeline_impl=overlap, "
            "model.tensor_parallel_impl=overlap and ddp.impl=overlap.",
        ),
        (
            m.expert_tensor_parallel_size > 1,
            "model.expert_tensor_parallel_size",
            m.expert_tensor_parallel_size,
            "Expert tensor parallelism",
            "use -et 1.",
        ),
        (
            m.is_moe and k.moe_token_dispatcher_type == "allgather",
            "model.moe_token_dispatcher_type",
            "allgather",
            "The all-gather token dispatcher",
            "use model.moe_token_dispatcher_type=alltoall or flex.",
        ),
        (
            m.is_moe
            and k.moe_token_dispatcher_type == "flex"
            and k.moe_flex_dispatcher_backend in ("deepep", "hybridep"),
            "model.moe_flex_dispatcher_backend",
            k.moe_flex_dispatcher_backend,
            "Dispatch through DeepEP kernels",
            "use moe_flex_dispatcher_backend=torch.",
        ),
        (
            p.fp8_param_gather and not d.use_distributed_optimizer,
            "mixed_precision.fp8_param_gather",
            True,
            "FP8 parameter gather without the distributed optimizer (only its parameter all-gather "
            "is quantised)",
            "set ddp.use_distributed_optimizer=true and optimizer.use_distributed_optimizer=true, "
            "or mixed_precision.fp8_param_gather=false.",
        ),
        (
            m.cuda_graph_impl != "none",
            "model.cuda_graph_impl",
            m.cuda_graph_impl,
            "CUDA-graph capture",
            "use --cuda_graph_impl none.",
        ),
        (
            bool(m.mtp_num_layers),
            "model.mtp_num_layers",
            m.mtp_num_layers,
            "Multi-token prediction (the MTP layers, and an 'm' in pipeline_model_parallel_layout)",
            "set model.mtp_num_layers=null and drop the m's from the layout.",
        ),
        (
            o.defer_embedding_wgrad_compute and m.pipeline_impl == "torch_pipelining",
            "model.defer_embedding_wgrad_compute",
            True,
            "Deferred output-layer wgrad outside our pipeline schedule (the "
            "torch.distributed.pipelining peer)",
            "set comm_overlap.defer_embedding_wgrad_compute=false, or use "
            "model.pipeline_impl=overlap.",
        ),
        (
            m.gradient_accumulation_fusion,
            "model.gradient_accumulation_fusion",
            True,
            "Fused gradient accumulation (a Transformer Engine kernel)",
            "set model.gradient_accumulation_fusion=false.",
        ),
        (
            m.add_bias_linear or m.add_qkv_bias,
            "model.add_bias_linear",
            True,
            "Linear biases",
            "set model.add_bias_linear=false and model.add_qkv_bias=false.",
        ),
        (
            m.is_moe and m.tensor_model_parallel_size > 1 and not m.sequence_parallel,
            "model.sequence_parallel",
            False,
            "MoE with tensor parallelism but without sequence parallelism (every TP rank would "
            "route the same tokens and count the expert gradients TP times)",
            "set model.sequence_parallel=true (-tp sets it for you).",
        ),
        (
            m.is_moe and not m.gated_linear_unit,
            "model.gated_linear_unit",
            False,
            "Non-gated (GELU) routed experts",
            "use gated_linear_unit=true (SwiGLU experts) for MoE models.",
        ),
        # Tied weights (`overlap.model.gpt`): one parameter whose two gradient shares must meet in
        # one backward
        (
            tied and m.pipeline_model_parallel_size > 1 and m.pipeline_impl == "torch_pipelining",
            "model.share_embeddings_and_output_weights",
            True,
            "Tied embedding and output weights in the torch.distributed.pipelining peer",
            "use model.pipeline_impl=overlap with a tied model.",
        ),
        # (EP overlap and the deferred output wgrad: at PP 1 the two uses are one parameter on one
        # rank; the copy's path under them with a pipeline is not built either)
        (
            tied and o.overlap_moe_expert_parallel_comm,
            "model.share_embeddings_and_output_weights",
            True,
            "Tied embedding and output weights under EP overlap (its schedule runs the output "
            "layer's and the embedding's backward as separate pieces, so data parallelism would "
            "see the first share as the gradient)",
            "set comm_overlap.overlap_moe_expert_parallel_comm=false, or use an untied model.",
        ),
        (
            tied and o.defer_embedding_wgrad_compute,
            "model.defer_embedding_wgrad_compute",
            True,
            "Deferring a tied output layer's weight gradient (it is the embedding's too)",
            "set comm_overlap.defer_embedding_wgrad_compute=false.",
        ),
        (
            tied and d.impl != "overlap",
            "model.share_embeddings_and_output_weights",
            True,
            "Tied embedding and output weights with the PyTorch data-parallel peer "
            f"ddp.impl={d.impl}",
            "use ddp.impl=overlap with a tied model.",
        ),
        (
            d.average_in_collective,
            "ddp.average_in_collective",
            True,
            "Averaging inside the collective (gradients are summed; the loss carries 1 / "
            "(micro-batches x DP))",
            "set ddp.average_in_collective=false.",
        ),
    ]
    if d.impl not in ("overlap", "torch_ddp", "fsdp2"):
        raise ConfigError(
            "ddp.impl",
            d.impl,
            "unknown data-parallel implementation.",
            "use overlap, torch_ddp or fsdp2.",
        )
    out: list[ConfigError] = []
    if d.impl != "overlap" and (
        m.is_moe
        or m.tensor_model_parallel_size > 1
        or p.bf16
        or p.fp16
        or d.use_distributed_optimizer
        or p.fp8_param_gather
        or gpu
    ):
        out.append(
            ConfigError(
                "ddp.impl",
                d.impl,
                "the PyTorch peers are the CPU data-parallel comparison: dense, "
                "tensor-parallel-free fp32 models, their own optimizer and sharding (no "
                "distributed optimizer / fp8 gather settings of ours).",
                "use -g cpu -mr dense_tiny -tp 1 -c fp32 with the default ddp settings, or "
                "ddp.impl=overlap.",
            )
        )
    ck, t = cfg.checkpoint, cfg.train
    uses_checkpoints = bool(ck.save or ck.load or ck.pretrained_checkpoint)
    for peer, field, value in (
        (d.impl != "overlap", "ddp.impl", d.impl),
        (m.tensor_parallel_impl == "dtensor", "model.tensor_parallel_impl", "dtensor"),
    ):
        if peer and (
            uses_checkpoints
            or t.exit_signal_handler
            or t.exit_duration_in_mins is not None
            or d.check_for_nan_in_grad
        ):
            out.append(
                NotBuiltError(
                    field,
                    value,
                    "Checkpoints, the exit handlers and the NaN check in the PyTorch peers (they "
                    "are speed comparisons; their parameters are torch's own objects)",
                    "drop the checkpoint.* / train.exit_* / ddp.check_for_nan_in_grad settings "
                    f"for the peer, or use {field}=overlap.",
                )
            )
    if m.tensor_parallel_impl == "dtensor" and m.tensor_model_parallel_size == 1:
        out.append(
            ConfigError(
                "model.tensor_parallel_impl",
                "dtensor",
                "the DTensor peer replaces the tensor-parallel communication, and at "
                "tensor_model_parallel_size=1 there is none: it would train our model unchanged "
                "and compare nothing.",
                "use -tp 2 or more, or model.tensor_parallel_impl=overlap.",
            )
        )
    return out + [
        NotBuiltError(field, value, what, fix)
        for failed, field, value, what, fix in checks
        if failed
    ]
