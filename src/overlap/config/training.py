"""DDP, optimizer, scheduler, training-loop and tokenizer configuration (Megatron-Bridge field
names)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from overlap.config.aliases import aliased
from overlap.errors import NotBuiltError, check_rules


@aliased("ddp")
@dataclass
class DDPConfig:
    """Data-parallel gradient reduction and parameter gather. Bridge's `ddp.overlap_grad_reduce`,
    `ddp.overlap_param_gather`, `ddp.align_param_gather` and `ddp.bucket_size` are aliases of
    comm_overlap's switches (`overlap.config.aliases`): accepted here, kept as typed, read by
    finalize below comm_overlap's value. `use_distributed_optimizer` is the home of Bridge's two
    spellings (`optimizer.use_distributed_optimizer` is its alias; either true turns it on). The
    resolved values, logged, live in `cfg.resolved.overlap` (the distributed optimizer's too), which
    the runtime reads.
    `ddp.grad_reduce_in_fp32` and `ddp.fp8_param_gather` are aliases of the mixed-precision
    section's fields (resolved: `cfg.resolved.precision`)."""

    # shard optimizer state over DP (the distributed optimizer)
    use_distributed_optimizer: bool = False
    # average inside the collective (refused: gradients are summed)
    average_in_collective: bool = False
    # stop before the update when the loss or gradient norm is not finite
    check_for_nan_in_grad: bool = False
    # Which data-parallel runtime trains: "overlap" (ours) or a PyTorch peer measured against it on
    # the same model, data and network: "torch_ddp" (DistributedDataParallel) or "fsdp2"
    # (fully_shard). Peers ignore the overlap fields above: they bring their own bucketing and
    # overlap.
    impl: str = "overlap"
    # Megatron-FSDP (priced by the planner; `overlap run` refuses it, not built): each rank keeps
    # 1 / (DP x CP) of what `data_parallel_sharding_strategy` names, gathered layer by layer
    use_megatron_fsdp: bool = False
    # no_shard | optim (the optimizer state) | optim_grads (+ gradients, reduce-scattered every
    # micro-batch) | optim_grads_params (+ parameters, gathered every forward and backward)
    data_parallel_sharding_strategy: str = "no_shard"


@aliased("optimizer")
@dataclass
class OptimizerConfig:
    """The optimizer and its learning rate. Megatron's precision copies (`optimizer.bf16`,
    `optimizer.fp16` and the loss-scaling fields `optimizer.loss_scale`, ...) are aliases of the
    mixed-precision section's fields (resolved: `cfg.resolved.precision`)."""

    optimizer: str = "adam"  # the optimizer (adam; others are refused)
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # learning rate at the end of the decay
    weight_decay: float = 0.1  # decoupled weight decay (AdamW)
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.95  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's epsilon
    clip_grad: float = 1.0  # global gradient-norm clip (0: none)

    def validate(self) -> None:
        """The optimizer's own rules (NaN fails each; a float rule also refuses infinity)."""
        fin = math.isfinite
        lr, min_lr = self.lr, self.min_lr
        check_rules(
            [
                (
                    "optimizer.optimizer",
                    self.optimizer,
                    self.optimizer == "adam",
                    "This optimizer",
                    "use optimizer.optimizer=adam.",
                    NotBuiltError,
                ),
                (
                    "optimizer.lr",
                    lr,
                    fin(lr) and lr >= 0,
                    "the learning rate must be a finite number >= 0.",
                    "use e.g. optimizer.lr=3e-4.",
                ),
                (
                    "optimizer.min_lr",
                    min_lr,
                    fin(min_lr) and 0 <= min_lr <= lr,
                    f"the decay floor must be between 0 and optimizer.lr ({lr:g}).",
                    f"use optimizer.min_lr <= {lr:g}, e.g. a tenth of it.",
                ),
                (
                    "optimizer.adam_beta1",
                    self.adam_beta1,
                    0 <= self.adam_beta1 < 1,
                    "Adam's beta1 must be in [0, 1).",
                    "use e.g. optimizer.adam_beta1=0.9.",
                ),
                (
                    "optimizer.adam_beta2",
                    self.adam_beta2,
                    0 <= self.adam_beta2 < 1,
                    "Adam's beta2 must be in [0, 1).",
                    "use e.g. optimizer.adam_beta2=0.95.",
                ),
                (
                    "optimizer.adam_eps",
                    self.adam_eps,
                    fin(self.adam_eps) and self.adam_eps > 0,
                    "Adam's epsilon must be > 0.",
                    "use e.g. optimizer.adam_eps=1e-8.",
                ),
                (
                    "optimizer.weight_decay",
                    self.weight_decay,
                    fin(self.weight_decay) and self.weight_decay >= 0,
                    "weight decay must be >= 0 (0: none).",
                    "use e.g. optimizer.weight_decay=0.1, or 0.",
                ),
                (
                    "optimizer.clip_grad",
                    self.clip_grad,
                    fin(self.clip_grad) and self.clip_grad >= 0,
                    "the gradient-norm clip must be >= 0 (0: no clipping).",
                    "use e.g. optimizer.clip_grad=1.0, or 0.",
                ),
            ]
        )


@dataclass
class SchedulerConfig:
    lr_warmup_iters: int = 0  # steps of linear warm-up from 0 to optimizer.lr
    lr_decay_iters: int | None = None  # steps of decay after warm-up; None: train_iters
    lr_decay_style: str = "cosine"  # "cosine" | "linear" | "constant"
    # A resume whose schedule differs from the checkpoint's is refused unless one of these says
    # whose to use
    override_opt_param_scheduler: bool = False  # a resume uses this run's schedule values
    use_checkpoint_opt_param_scheduler: bool = False  # a resume uses the checkpoint's values

    def validate(self) -> None:
        decay = self.lr_decay_iters
        check_rules(
            [
                (
                    "scheduler.lr_decay_style",
                    self.lr_decay_style,
                    self.lr_decay_style in ("cosine", "linear", "constant"),
                    "unknown decay style.",
                    "use cosine, linear or constant.",
                ),
                (
                    "scheduler.lr_warmup_iters",
                    self.lr_warmup_iters,
                    self.lr_warmup_iters >= 0,
                    "warm-up iterations must be >= 0 (0: no warm-up).",
                    "use e.g. scheduler.lr_warmup_iters=0.",
                ),
                (
                    "scheduler.lr_decay_iters",
                    decay,
                    decay is None or decay >= 1,
                    "decay iterations must be >= 1 (null: train_iters).",
                    "use scheduler.lr_decay_iters=null.",
                ),
            ]
        )


@dataclass
class TrainConfig:
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks (-gb)
    micro_batch_size: int = 1  # sequences per forward/backward on one rank (-mb)
    train_iters: int = 10  # optimizer steps to run (-ms)
    seed: int = 1234  # seed of the weight initialisation and of the mock data
    # steady-state window start (iteration index, 0-based); None: auto
    eval_time_start_step: int | None = None
    # steady-state window end (exclusive); None: the last step
    eval_time_end_step: int | None = None
    # window start when eval_time_start_step is None (0.1 as the library)
    skip_first_percent_time: float = 0.1
    # a dead or hung rank fails the run after this long instead of 30 minutes
    comm_timeout_s: float = 300.0
    # Leaving early with a checkpoint (Megatron's names): after this many minutes of training, or on
    # SIGTERM (what Slurm sends before a preemption or the time limit) with the handler on, every
    # rank stops at the next step boundary, the run saves (if checkpoint.save is set) and exits 0
    # saying where.
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False  # on SIGTERM: stop at the next step boundary, save and exit 0

    def validate(self) -> None:
        """The training loop's own rules: a positive timeout, at least one step, and a steady-state
        window inside the run."""
        n, start, end = self.train_iters, self.eval_time_start_step, self.eval_time_end_step
        timeout = self.comm_timeout_s
        check_rules(
            [
                (
                    "train.comm_timeout_s",
                    timeout,
                    timeout > 0,
                    "a timeout must be positive.",
                    "set train.comm_timeout_s to a number of seconds, e.g. 300.",
                ),
                (
                    "train.train_iters",
                    n,
                    n >= 1,
                    "a run needs at least one step.",
                    "use -ms 1 or more.",
                ),
                (
                    "train.skip_first_percent_time",
                    self.skip_first_percent_time,
                    0 <= self.skip_first_percent_time < 1,
                    "the skipped share of the steps is a fraction in [0, 1) (0.1 skips the first "
                    "10%), not a percentage.",
                    "use e.g. --skip_first_percent_time 0.1.",
                ),
                (
                    "train.eval_time_start_step",
                    start,
                    start is None or 0 <= start < n,
                    "the steady-state window starts at a 0-based step index in [0, "
                    f"train_iters={n}).",
                    f"use --eval_time_start_step between 0 and {n - 1}, or raise -ms.",
                ),
                (
                    "train.eval_time_end_step",
                    end,
                    end is None or 1 <= end <= n,
                    f"the steady-state window ends (exclusive) at a step in [1, train_iters={n}].",
                    f"use --eval_time_end_step between 1 and {n}, or raise -ms.",
                ),
                (
                    "train.eval_time_end_step",
                    end,
                    start is None or end is None or start < end,
                    f"the window end must come after its start (--eval_time_start_step {start}); "
                    "an empty window would silently fall back to the whole run, warm-up included.",
                    f"use --eval_time_end_step {(start or 0) + 1} or more.",
                ),
                (
                    "train.seed",
                    self.seed,
                    0 <= self.seed < 2**63,
                    "the seed must be in [0, 2^63).",
                    "use e.g. train.seed=1234.",
                ),
                (
                    "train.comm_timeout_s",
                    timeout,
                    math.isfinite(timeout) and timeout <= 7 * 86400,
                    "a timeout must be a finite number of seconds (at most a week).",
                    "set train.comm_timeout_s to a number of seconds, e.g. 300.",
                ),
            ]
        )


@aliased("tokenizer")
@dataclass
class TokenizerConfig:
    """The tokenizer. Bridge's `tokenizer.vocab_size` (the NullTokenizer's vocabulary, --vocab_size)
    is an alias of `model.vocab_size` that beats it when set (`overlap.config.aliases`)."""

    # NullTokenizer: token ids as they are (mock data); HuggingFaceTokenizer
    tokenizer_type: str = "NullTokenizer"
    tokenizer_model: str | None = None  # HuggingFaceTokenizer: a tokenizer.json or its folder


@dataclass
class DatasetConfig:
    """Pretraining data (Bridge's GPTDatasetConfig names). `blend` None: mock data (random tokens),
    said in the decision table - the reference falls back to mock data silently."""

    # [[prefix, ...], [weight, ...] | null], or [prefix, ...] / [w1, p1, w2, p2]
    blend: list[Any] | str | None = None
    split: str = "9999,8,2"  # train, validation, test document shares (training reads the first)
    random_seed: int = 1234  # document and sample shuffling (numpy RandomState, as the reference)
