"""DDP, optimizer, scheduler, training-loop and tokenizer configuration (Megatron-Bridge field names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class DDPConfig:
    """Data-parallel gradient reduction and parameter gather. `None` = not set: resolved by finalize and logged."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    align_param_gather: bool | None = None
    bucket_size: int | None = None  # counted in PARAMETERS, not bytes (as in Megatron-Core)
    grad_reduce_in_fp32: bool | None = None  # owned by mixed precision; a different value here is logged
    fp8_param_gather: bool | None = None  # owned by mixed precision
    average_in_collective: bool = False
    check_for_nan_in_grad: bool = False
    # Which data-parallel runtime trains: "overlap" (ours) or a PyTorch peer measured against it on the same model,
    # data and network: "torch_ddp" (DistributedDataParallel) or "fsdp2" (fully_shard). Peers ignore the overlap
    # fields above: they bring their own bucketing and overlap.
    impl: str = "overlap"


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # kept in sync with ddp.use_distributed_optimizer (logged)
    overlap_param_gather_with_optimizer_step: bool | None = None
    bf16: bool = False  # written by mixed precision
    fp16: bool = False
    # Loss scaling (Megatron's names; mixed precision owns and writes them; None: not set). A
    # static `loss_scale` replaces the dynamic scaler that fp16 gets (optim/loss_scaler.py).
    loss_scale: float | None = None
    initial_loss_scale: float | None = None
    min_loss_scale: float | None = None
    loss_scale_window: int | None = None
    hysteresis: int | None = None


@dataclass
class SchedulerConfig:
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    lr_decay_style: str = "cosine"  # "cosine" | "linear" | "constant"
    # A resume whose schedule differs from the checkpoint's is refused unless one of these says whose to use
    override_opt_param_scheduler: bool = False  # this run's values
    use_checkpoint_opt_param_scheduler: bool = False  # the checkpoint's values


@dataclass
class TrainConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 1
    train_iters: int = 10
    seed: int = 1234
    eval_time_start_step: int | None = None  # steady-state window start (iteration index, 0-based); None: auto
    eval_time_end_step: int | None = None
    skip_first_percent_time: float = 0.1  # window start when eval_time_start_step is None (0.1 as the library)
    comm_timeout_s: float = 300.0  # a dead or hung rank fails the run after this long instead of 30 minutes
    # Leaving early with a checkpoint (Megatron's names): after this many minutes of training, or on SIGTERM (what
    # Slurm sends before a preemption or the time limit) with the handler on, every rank stops at the next step
    # boundary, the run saves (if checkpoint.save is set) and exits 0 saying where.
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False


@dataclass
class TokenizerConfig:
    tokenizer_type: str = "NullTokenizer"  # NullTokenizer: token ids as they are (mock data); HuggingFaceTokenizer
    tokenizer_model: str | None = None  # HuggingFaceTokenizer: a tokenizer.json or its folder
    vocab_size: int | None = None  # NullTokenizer vocabulary; None: keep model.vocab_size


@dataclass
class DatasetConfig:
    """Pretraining data (Bridge's GPTDatasetConfig names). `blend` None: mock data (random tokens), said in the
    decision table - the reference falls back to mock data silently."""

    blend: list[Any] | str | None = None  # [[prefix, ...], [weight, ...] | null], or [prefix, ...] / [w1, p1, w2, p2]
    split: str = "9999,8,2"  # train, validation, test document shares (training reads the first)
    random_seed: int = 1234  # document and sample shuffling (numpy RandomState, as the reference)
