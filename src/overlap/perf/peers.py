"""PyTorch's own data-parallel runtimes as peers: the same model, data, schedule and optimizer
arithmetic as our Trainer, with gradient reduction done by
`torch.nn.parallel.DistributedDataParallel` or FSDP2 (`fully_shard`).

Peers reduce with torch's own collectives, not through `overlap.parallel.comm`, so the modelled link
does not slow them and the tracer does not see their traffic: compare against them on the emulated
interconnect (`--network tbf:RATE`), where every byte of every runtime crosses the same rate-limited
link. Both average gradients over data parallel, so their loss is scaled by 1 / micro-batches only
(ours sums, with 1 / (micro-batches x DP)).
"""

from __future__ import annotations

import torch

from overlap.config.container import ConfigContainer
from overlap.model.gpt import GPTModel
from overlap.optim.adam import learning_rate, multi_tensor_impl
from overlap.parallel import comm, groups
from overlap.parallel.state import ParallelState
from overlap.parallel.trace import recorder
from overlap.pipeline.output_memory import PipelineMemory
from overlap.training.data import build_data
from overlap.training.trainer import Trainer


class PeerTrainer(Trainer):
    """Trainer whose data parallelism is torch DDP ("torch_ddp") or FSDP2 ("fsdp2")."""

    def __init__(self, cfg: ConfigContainer, ps: ParallelState) -> None:
        self.cfg, self.ps, self.impl = cfg, ps, cfg.ddp.impl
        torch.manual_seed(cfg.train.seed)
        res = cfg.resolved
        model = GPTModel(cfg.resolved.model, ps, res.overlap, res.precision, res.kernels)
        model.init_weights(cfg.train.seed)
        if self.impl == "torch_ddp":
            bucket = cfg.resolved.overlap.bucket_size
            bucket_mb = 25 if bucket is None else bucket * 4 / 2**20
            self.model = torch.nn.parallel.DistributedDataParallel(
                model, process_group=ps.dp_group, bucket_cap_mb=bucket_mb
            )
        else:
            from torch.distributed.fsdp import fully_shard

            mesh = groups.device_mesh("cpu", (ps.layout.dp,), ("dp",))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        o = cfg.optimizer
        decay = [p for p in self.model.parameters() if p.dim() > 1]
        no_decay = [p for p in self.model.parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": o.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=o.lr,
            betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps,
            **multi_tensor_impl(decay + no_decay),
        )
        self.data = build_data(cfg)
        t = cfg.train
        self.num_micro_batches = t.global_batch_size // (t.micro_batch_size * ps.layout.dp)
        # What Trainer.train reads: peers do not checkpoint (runtime_refusals says so), do not
        # pipeline, and run no sync-free MoE dispatch, so never re-run a step.
        self.checkpointer, self.start_iteration = None, 0
        self.pipeline_memory = PipelineMemory()
        self.static_dispatch, self.last_step_reruns = None, 0

    def finish_param_sync(self) -> None:
        """Peers keep their parameters in sync themselves."""

    def learning_rate(self, iteration: int) -> float:
        """Peers train fp32 (support.runtime_refusals): no step is ever skipped for an overflow."""
        return learning_rate(
            iteration, self.cfg.optimizer, self.cfg.scheduler, self.cfg.train.train_iters
        )

    def loss_scaling(self) -> tuple[float | None, bool]:
        return None, False

    def _sync_gradients(self, last: bool):
        if self.impl == "torch_ddp":
            return torch.enable_grad() if last else self.model.no_sync()
        self.model.set_requires_gradient_sync(last)
        return torch.enable_grad()

    def train_step(self, iteration: int) -> tuple[float, float]:
        t, ps = self.cfg.train, self.ps
        self.optimizer.zero_grad(set_to_none=True)
        batches = self.data.micro_batches(
            iteration, t.global_batch_size, t.micro_batch_size, ps.dp_rank, ps.layout.dp, ps.device
        )
        loss_sum = torch.zeros((), dtype=torch.float32, device=ps.device)
        for i, (tokens, labels) in enumerate(batches):
            with self._sync_gradients(i == len(batches) - 1):
                with recorder().span("forward"):
                    lm_loss, aux_loss = self.model(tokens, labels)
                with recorder().span("backward"):
                    ((lm_loss + aux_loss) / self.num_micro_batches).backward()
            loss_sum += lm_loss.detach().float()
        clip = self.cfg.optimizer.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(iteration)
        with recorder().span("optimizer"):
            self.optimizer.step()
        comm.all_reduce(loss_sum, ps.dp_group, "dp_loss").wait()
        return float(loss_sum) / (self.num_micro_batches * ps.layout.dp), norm
