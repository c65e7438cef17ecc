"""The pretraining loop, readable top to bottom: build, then for each iteration run the
micro-batches, reduce gradients, clip, step, log.

Data parallelism (`overlap.data_parallel`): the DDP object owns the gradient buffers; told which
micro-batch is the last, it reduces buckets during that backward (overlap_grad_reduce) or all at
`finish_grad_sync()`. The optimizer is the local one or the distributed one (sharded Adam; its
parameter all-gather runs after the step, or is deferred into the next forward with
overlap_param_gather, which is why `train()` ends with `finish_param_sync()`).

Loss bookkeeping: each micro-batch's loss is scaled by 1 / (micro-batches x data-parallel size x
context-parallel size) before backward, so the gradients reduced over DP x CP equal the
single-process gradient of the mean loss over the whole global batch, and the reported lm loss is
that mean (all-reduced over DP x CP for the log only: a CP rank's loss is the mean over its share
of each sequence, the same number of tokens on every CP rank).

Under loss scaling (fp16) the backward's seed also carries the optimizer's loss scale; the
optimizer divides it out, and skips a step whose gradients overflowed (`overlap.optim.loss_scaler`):
the learning-rate schedule then does not advance, as Megatron's.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from overlap.config.container import ConfigContainer
from overlap.data_parallel import DistributedDataParallel, DistributedOptimizer
from overlap.errors import NonFiniteError
from overlap.layers.moe.rank_capacity import StaticDispatchSteps
from overlap.model.gpt import model_chunks
from overlap.model.tensor_parallel_impl import apply_tensor_parallel_impl
from overlap.optim.adam import LocalOptimizer, learning_rate
from overlap.parallel import comm
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.pipeline.output_memory import PipelineMemory
from overlap.pipeline.runner import build_pipeline
from overlap.profiling.sinks import MetricsSink
from overlap.training.data import build_data
from overlap.training.metrics import (
    StepRecord,
    flops_per_token,
    format_iteration,
    peak_memory_mb,
    steady_mean_ms,
    steady_window,
)
from overlap.training.stopping import ExitWatch, NonFiniteCount, check_finite

log = logging.getLogger("overlap.train")


@dataclass
class RunSummary:
    records: list[StepRecord]
    window: tuple[int, int]
    steady_step_ms: float | None  # None: no iteration ran (a resume with nothing left to train)
    peak_memory_mb: float
    comm_ms: dict[str, float] = field(default_factory=dict)
    first_iteration: int = 0  # > 0: resumed from a checkpoint of that iteration
    stopped: str | None = None  # why the run stopped before train_iters (SIGTERM, time limit)
    checkpoint: dict | None = None  # save / load times and sizes (Checkpointer.report)
    # stage outputs alive at once, max over steps (PipelineMemory; PP only)
    pipeline_output_peak_bytes: int = 0
    # sync-free MoE dispatch: the largest factor any block needed over the run, on any rank (None:
    # not that dispatch)
    moe_needed_rank_capacity_factor: float | None = None


def comm_totals(events) -> tuple[dict[str, float], dict[str, int]]:
    """Per-kind communication time (launch to completion, ms) and bytes of one iteration."""
    ms: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    for e in events:
        end = e.t_done if e.t_done is not None else e.t_wait_end
        if end is not None:
            ms[e.kind] += (end - e.t_launch) * 1e3
        nbytes[e.kind] += e.nbytes
    return dict(ms), dict(nbytes)


class Trainer:
    def __init__(self, cfg: ConfigContainer, ps: ParallelState) -> None:
        self.cfg, self.ps = cfg, ps
        torch.manual_seed(cfg.train.seed)
        # This rank's model chunks (one without a virtual pipeline); each has its own gradient
        # buffers and buckets.
        res = cfg.resolved
        self.chunks = model_chunks(
            res.model, ps, res.pipeline, res.overlap, res.precision, res.kernels
        )
        # model.tensor_parallel_impl: our TP layers as built, or the DTensor peer's
        apply_tensor_parallel_impl(self.chunks, ps, res.model)
        for chunk in self.chunks:
            chunk.init_weights(cfg.train.seed)
        self.model = self.chunks[0]  # without pipeline parallelism: the whole model
        # The micro-batch schedule (model.pipeline_impl: ours, PP = 1 included, or torch's
        # pipelining peer), built now: ours creates the pipeline's point-to-point groups
        # (collective; on NCCL each one a communicator). pipeline_memory: live stage-output bytes
        # per step (ours measures them).
        self.pipeline_memory = PipelineMemory()
        self.pipeline = build_pipeline(
            cfg,
            self.chunks,
            ps,
            lambda c, last: self.ddps[c].set_last_micro_batch(last),
            self.pipeline_memory,
        )
        plan, precision = cfg.resolved.overlap, cfg.resolved.precision
        self.ddps = [
            DistributedDataParallel(
                c,
                cfg.ddp,
                plan,
                precision.grad_reduce_in_fp32,
                ps,
            )
            for c in self.chunks
        ]
        self.ddp = self.ddps[0]
        if plan.use_distributed_optimizer:
            self.optimizer = DistributedOptimizer(
                self.chunks, self.ddps, cfg.optimizer, precision, plan, ps
            )
        else:
            params = [p for c in self.chunks for p in c.parameters() if p.requires_grad]
            self.optimizer = LocalOptimizer(params, cfg.optimizer, precision, ps)
        self.data = build_data(cfg)
        # A tied model under pipeline parallelism: the group of each pipeline's two ends (created by
        # every rank) and this rank's end of the tie (the embedding on the first stage, its copy on
        # the last), `overlap.model.gpt` (only what the optimizer reads: the DP-reduced part of the
        # gradient, a 1/DP shard with the distributed optimizer, the same elements on both ends
        # since the tied tensor is a bucket of its own)
        self._tied = None
        if cfg.resolved.model.share_embeddings_and_output_weights and ps.layout.pp > 1:
            group = ps.tied_embedding_group()
            grads = [
                ddp.reduced_grad(p)
                for c, ddp in zip(self.chunks, self.ddps)
                for p in c.parameters()
                if getattr(p, "tied_embedding", False)
            ]
            self._tied = (group, grads) if grads else None
        t = cfg.train
        self.num_micro_batches = t.global_batch_size // (t.micro_batch_size * ps.layout.dp)
        ck = cfg.checkpoint
        # Checkpoints (training/checkpoint.py): loaded now, into the parameters (views into the DDP
        # buffers) and the optimizer built above; `start_iteration` is where a resumed run
        # continues.
        self.checkpointer = None
        if ck.save or ck.load or ck.pretrained_checkpoint:
            # imported only here: torch's distributed checkpointing (and DTensor under it) is
            # nearly half a second of every rank's start-up, which a run without checkpoints
            # does not need
            from overlap.training.checkpoint import Checkpointer

            self.checkpointer = Checkpointer(cfg, ps, self.chunks, self.optimizer)
        self.start_iteration = self.checkpointer.load() if self.checkpointer is not None else 0
        # the sync-free MoE dispatch's per-step handle (None without it), and whether the last
        # step was re-run dropless for an overflow
        self.static_dispatch = StaticDispatchSteps.of(cfg.resolved.model, self.chunks, ps.device)
        self.last_step_reruns = 0

    def train_step(self, iteration: int) -> tuple[float, float]:
        """One optimizer step over the global batch; returns (mean lm loss, grad norm).

        With the sync-free MoE dispatch (`model.moe_expert_rank_capacity_factor`) the blocks'
        overflow count rides the loss and grad-norm reductions (`_reduce`); where any rank
        overflowed, the forward-backward runs again on the dropless path before the optimizer
        applies anything (`overlap.layers.moe.rank_capacity`), and `last_step_reruns` says so."""
        ps = self.ps
        # each CP rank's loss is the mean over its equal share of the tokens
        scale = 1.0 / (self.num_micro_batches * ps.layout.dp_cp)
        grad_scale = scale * self.optimizer.loss_scale  # what the backward is seeded with
        static = self.static_dispatch
        if static is not None:
            static.begin()
        loss_sum = self._forward_backward(iteration, grad_scale)
        loss_sum, local_loss, loss_handle, norm = self._reduce(
            loss_sum, None if static is None else static.overflowed()
        )
        self.last_step_reruns = 0
        if norm is None:  # a block overflowed somewhere: this step is the dropless one's
            static.rerun()
            self.last_step_reruns = 1
            loss_sum = self._forward_backward(iteration, grad_scale)
            loss_sum, local_loss, loss_handle, norm = self._reduce(loss_sum, None)
        # free unless the norm is not finite (training/stopping.py)
        if local_loss is not None and not math.isfinite(norm):
            loss_handle.wait()  # nothing is left in flight when every rank stops here
            check_finite(
                iteration,
                norm,
                local_loss,
                self._named_params(),
                ps.rank,
                self.checkpointer.last_saved if self.checkpointer else None,
                loss_scaling=self.optimizer.scaler is not None,
                suspect=self.nonfinite.suspect(iteration),
            )
        with recorder().span("optimizer"):
            self.optimizer.step(self.learning_rate(iteration), norm)
        loss_handle.wait()
        return float(loss_sum) * scale, norm

    def _forward_backward(self, iteration: int, grad_scale: float) -> torch.Tensor:
        """The micro-batches' forward and backward with the gradients reduced; returns this rank's
        loss sum (zeros off the last pipeline stage). Run again for a step's re-run: the data of
        an iteration is drawn from its number, so a re-run reads the same batches."""
        t, ps = self.cfg.train, self.ps
        for ddp in self.ddps:
            ddp.zero_grad()
        batches = self.data.micro_batches(
            iteration,
            t.global_batch_size,
            t.micro_batch_size,
            ps.dp_rank,
            ps.layout.dp,
            ps.device,
            ps.cp_rank,
            ps.layout.cp,
        )
        loss_sum = torch.zeros((), dtype=torch.float32, device=ps.device)
        # 1F1B over the pipeline (PP = 1: forward then backward of each micro-batch in turn; with EP
        # overlap its steady steps merged, piece by piece): pipeline/executor.py, or torch's peer.
        for lm_loss in self.pipeline.step(batches, grad_scale):
            loss_sum += lm_loss.float()
        with recorder().span("grad_reduce"):
            for ddp in self.ddps:
                ddp.finish_grad_sync()
            # the embedding and its copy on the last stage: one gradient, summed
            if self._tied is not None:
                group, grads = self._tied
                for grad in grads:
                    comm.all_reduce(grad, group, "pp_tied_grad").wait()
        return loss_sum

    def _reduce(
        self, loss_sum: torch.Tensor, overflow: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, comm.CommHandle, float | None]:
        """Sum the loss over PP and (launched, not waited) DP x CP, and read the grad norm: (the
        loss sum, this rank's loss before the DP sum where NaN checks need it, the DP sum's handle,
        the norm). `overflow` [1] (the sync-free dispatch's count on this rank) rides the same
        reductions, the loss's over PP and DP x CP and the norm's over TP, and comes back in the
        norm's one read: the norm is None where its sum over every rank is > 0."""
        ps = self.ps
        reduced = loss_sum if overflow is None else torch.cat([loss_sum.view(1), overflow])
        loss_sum = reduced if overflow is None else reduced[0]
        # The reported loss is summed over DP now, before the norm's own all-reduce and the
        # optimizer's parameter gather: launched after the step, it queued behind that gather and
        # exposed it. Only the last pipeline stage has losses: the sum over PP (zeros elsewhere)
        # gives every rank, rank 0 included, the same number.
        if ps.layout.pp > 1:
            comm.all_reduce(reduced, ps.pp_group, "pp_loss").wait()
        # before the DP sum mixes the ranks' losses
        local_loss = loss_sum.clone() if self.cfg.ddp.check_for_nan_in_grad else None
        loss_handle = comm.all_reduce(reduced, ps.dp_cp_group, "dp_loss")
        if overflow is None:
            return loss_sum, local_loss, loss_handle, self.optimizer.grad_norm()
        # the norm's reductions take the count on from the DP sum (a stream wait on NCCL)
        loss_handle.wait()
        return loss_sum, local_loss, loss_handle, self.optimizer.grad_norm(reduced[1:])

    def learning_rate(self, iteration: int) -> float:
        """The schedule's rate for `iteration`; steps skipped for an overflow do not advance it
        (Megatron's scheduler steps only with the optimizer)."""
        return learning_rate(
            iteration - self.optimizer.skipped,
            self.cfg.optimizer,
            self.cfg.scheduler,
            self.cfg.train.train_iters,
        )

    def loss_scaling(self) -> tuple[float | None, bool]:
        """(the loss scale, whether the last step overflowed and was skipped); (None, False) where
        the precision needs no loss scaling."""
        o = self.optimizer
        return (o.loss_scale if o.scaler is not None else None), o.overflowed

    def _named_params(self):
        return ((n, p) for c in self.chunks for n, p in c.named_parameters())

    def finish_param_sync(self) -> None:
        """Complete any parameter all-gather still deferred into a next forward
        (overlap_param_gather)."""
        self.optimizer.finish_param_sync()

    def train(self, metrics: MetricsSink | None = None, progress=None) -> RunSummary:
        t, m = self.cfg.train, self.cfg.resolved.model
        tokens_per_step = t.global_batch_size * m.seq_length
        flops_step = flops_per_token(m) * tokens_per_step
        records: list[StepRecord] = []
        comm_sum: dict[str, float] = defaultdict(float)
        recorder().drain()
        first = self.start_iteration
        if first >= t.train_iters and self.ps.rank == 0:
            log.info(
                "nothing to train: the checkpoint is at iteration %d and train.train_iters=%d is "
                "reached (raise -ms/--max_steps to train on)",
                first,
                t.train_iters,
            )
        loaded = self.checkpointer.loaded_from if self.checkpointer is not None else None
        self.nonfinite = NonFiniteCount(
            self.cfg.ddp.check_for_nan_in_grad,
            self.ps.rank,
            str(loaded) if loaded is not None else None,
            first,
        )
        watch = ExitWatch(t, self.ps.device)
        stopped: str | None = None
        try:
            for it in range(first, t.train_iters):
                self._iteration(
                    it, tokens_per_step, flops_step, records, comm_sum, metrics, progress
                )
                stopped = watch.reason()
                if self.checkpointer is not None:
                    self.checkpointer.poll()
                    if stopped or self.checkpointer.due(it + 1):
                        # the checkpoint holds the updated weights, not a pending gather
                        self.finish_param_sync()
                        self.checkpointer.save(it + 1, self.nonfinite.first)
                        # its gathers belong to no step (their cost: checkpointer.save_times)
                        recorder().discard()
                if stopped:
                    if self.ps.rank == 0:
                        where = (
                            f"checkpoint of iteration {it + 1} in {self.cfg.checkpoint.save}"
                            if self.cfg.checkpoint.save
                            else "no checkpoint (checkpoint.save is not set)"
                        )
                        log.info(
                            "stopping after iteration %d of %d: %s; %s",
                            it + 1,
                            t.train_iters,
                            stopped,
                            where,
                        )
                    break
            self._check_some_step_taken(records)
            needed = self._report_static_dispatch(records)
            self.finish_param_sync()
            if self.checkpointer is not None:
                end = records[-1].iteration + 1 if records else first
                if (
                    not stopped
                    and self.cfg.checkpoint.save
                    and self.checkpointer.last_requested != end
                    and records
                ):
                    self.checkpointer.save(end, self.nonfinite.first)
        finally:
            watch.close()
            if self.checkpointer is not None:
                try:
                    if sys.exc_info()[0] in (None, NonFiniteError):
                        # a save in flight completes (every rank is here: no peer is gone)
                        self.checkpointer.close()
                finally:
                    self.checkpointer.release()
            self.nonfinite.report()
        window = steady_window(t, first, records[-1].iteration + 1 if records else None)
        return RunSummary(
            records,
            window,
            steady_mean_ms(records, window),
            peak_memory_mb(),
            dict(comm_sum),
            first,
            stopped,
            self.checkpointer.report() if self.checkpointer is not None else None,
            self.pipeline_memory.peak_bytes,
            needed,
        )

    def _report_static_dispatch(self, records: list[StepRecord]) -> float | None:
        """The sync-free MoE dispatch's run in two numbers, said by rank 0: the iterations re-run
        dropless, and the largest factor a block needed on any rank (one collective and one read
        after the last step, none in a step): what the factor's memory bought, and what it would
        have had to be for no re-run. None without that dispatch."""
        if self.static_dispatch is None:
            return None
        needed = self.static_dispatch.needed_factor()
        comm.all_reduce(needed, dist.group.WORLD, "ctl_moe_blocks", dist.ReduceOp.MAX).wait()
        recorder().discard()  # after the last step: no step's communication
        needed = float(needed)
        if self.ps.rank == 0:
            log.info(
                "sync-free MoE dispatch (model.moe_expert_rank_capacity_factor=%g): %d of %d "
                "iterations re-ran dropless (one more forward-backward each); the fullest block "
                "needed a factor of %.3g",
                self.cfg.resolved.model.moe_expert_rank_capacity_factor,
                sum(r.moe_reruns for r in records),
                len(records),
                needed,
            )
        return needed

    def _check_some_step_taken(self, records: list[StepRecord]) -> None:
        """A run whose every iteration overflowed and was skipped changed nothing: with a static
        loss scale it never will (an error, before a checkpoint of the unchanged model is saved);
        with the dynamic scaler it is still backing off (said)."""
        if not records or any(r.skipped_to is None for r in records):
            return
        o = self.cfg.resolved.precision
        if o.loss_scale is not None:
            raise NonFiniteError(
                "mixed_precision.loss_scale",
                o.loss_scale,
                f"every one of this run's {len(records)} iterations overflowed at this static "
                "loss scale and was skipped: the optimizer took no step, nothing was trained.",
                "lower it (e.g. mixed_precision.loss_scale=65536), or unset it for fp16's dynamic "
                "loss scaling.",
            )
        if self.ps.rank == 0:
            log.warning(
                "every one of this run's %d iterations overflowed and was skipped while the loss "
                "scale backed off (now %g): the optimizer took no step; train longer, or start "
                "lower (mixed_precision.initial_loss_scale)",
                len(records),
                self.optimizer.loss_scale,
            )

    def _iteration(
        self,
        it: int,
        tokens_per_step: int,
        flops_step: float,
        records: list[StepRecord],
        comm_sum: dict[str, float],
        metrics: MetricsSink | None,
        progress,
    ) -> None:
        """One logged training iteration."""
        t = self.cfg.train
        lr, (loss_scale, _) = self.learning_rate(it), self.loss_scaling()
        start = recorder().mark()
        loss, norm = self.train_step(it)
        end = recorder().mark()
        program = comm.session().program  # the run's recorder, where it records (NCCL's rules)
        if program is not None:
            program.step_end()
        events, _spans = recorder().drain()
        # event to event: on a GPU the step's last collective can end inside the drain's
        # synchronisation, after the host finished the step (parallel/trace.py)
        step_s = recorder().step_seconds(start, end, events)
        c_ms, c_bytes = comm_totals(events)
        for k, v in c_ms.items():
            comm_sum[k] += v
        scaling = loss_scale is not None
        scale_after, overflowed = self.loss_scaling()
        self.nonfinite.see(it, loss, norm, skipped=overflowed)
        rec = StepRecord(
            it,
            loss,
            norm,
            step_s * 1e3,
            lr,
            loss_scale,
            scale_after if overflowed else None,
            self.last_step_reruns,
        )
        records.append(rec)
        tokens_per_s = tokens_per_step / step_s / self.ps.layout.world_size
        tflops = flops_step / step_s / self.ps.layout.world_size / 1e12
        if self.ps.rank == 0:
            skipped = rec.skipped_to is not None
            if rec.moe_reruns:
                log.info(
                    "iteration %d: a sync-free MoE block overflowed (model."
                    "moe_expert_rank_capacity_factor=%g); the step was re-run dropless",
                    it + 1,
                    self.cfg.resolved.model.moe_expert_rank_capacity_factor,
                )
            if (it + 1) % self.cfg.logger.log_interval == 0 or it + 1 == t.train_iters or skipped:
                log.info(
                    format_iteration(
                        rec, t, tokens_per_s, tflops, on_gpu=self.ps.mesh.device_type == "cuda"
                    )
                )
            if metrics is not None:  # --metrics, TensorBoard, W&B (profiling/sinks.py)
                metrics.write(
                    {
                        "iteration": it + 1,
                        "lm_loss": loss,
                        "grad_norm": norm,
                        "step_time_ms": rec.step_time_ms,
                        "tokens_per_s": tokens_per_s,
                        "tflops_per_rank": tflops,
                        "lr": rec.lr,
                        "comm_ms": c_ms,
                        "comm_bytes": c_bytes,
                        "peak_mem_mb": peak_memory_mb(),
                        **({"loss_scale": loss_scale, "skipped": skipped} if scaling else {}),
                        **(
                            {"moe_reruns": rec.moe_reruns}
                            if self.static_dispatch is not None
                            else {}
                        ),
                    }
                )
            if progress is not None:
                progress(it + 1, t.train_iters, loss)
