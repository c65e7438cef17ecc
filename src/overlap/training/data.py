"""Pretraining samples: mock data (deterministic random tokens) or real data (`dataset.blend`,
overlap.data).

Sample `i` of iteration `k` depends only on (seed, k, i), never on the parallel layout, so every
layout trains on exactly the samples of the single-process reference: data-parallel rank d takes its
contiguous share of the global batch, and micro-batch j of that share holds the next
micro_batch_size samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from overlap.config.container import ConfigContainer
from overlap.errors import ConfigError
from overlap.parallel.cp_chunks import cp_positions


class SampleSource(ABC):
    """Where a run's samples come from; the micro-batch cut is common to all."""

    @abstractmethod
    def sample(self, iteration: int, index: int) -> torch.Tensor:
        """Sample `index` of iteration `iteration`: seq_length + 1 tokens (the model reads [:-1],
        predicts [1:])."""

    def micro_batches(
        self,
        iteration: int,
        global_batch: int,
        micro_batch: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's micro-batches of one iteration as (tokens [b, s], labels [b, s]) on
        `device` (samples are drawn on the host, by the CPU generator, so every device type reads
        the same tokens). Under context parallelism, s is this CP rank's share: its two
        load-balanced chunks of every sample (Megatron's `get_batch_on_this_cp_rank`)."""
        per_rank = global_batch // dp_size
        first = dp_rank * per_rank
        batches = []
        for start in range(first, first + per_rank, micro_batch):
            rows = torch.stack(
                [self.sample(iteration, i) for i in range(start, start + micro_batch)]
            )
            rows = to_device(rows, device)
            tokens, labels = rows[:, :-1], rows[:, 1:]
            if cp_size > 1:
                mine = cp_positions(tokens.shape[1], cp_rank, cp_size, rows.device)
                tokens, labels = tokens.index_select(1, mine), labels.index_select(1, mine)
            batches.append((tokens.contiguous(), labels.contiguous()))
        return batches


def to_device(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host samples onto the ranks' device without a host synchronisation: on CUDA through pinned
    memory, copied non-blocking (a copy from pageable memory stages through a driver buffer and
    waits for the stream, draining the queue that overlap needs: `perf/host_syncs.py` counts it).
    The pinned block goes back to torch's host allocator only once the copy is done. Elsewhere a
    plain `.to`: no copy on the CPU; the dry run's "meta" moves no data."""
    if device.type != "cuda":
        return rows.to(device)
    return rows.pin_memory().to(device, non_blocking=True)


class MockDataset(SampleSource):
    def __init__(self, vocab_size: int, seq_length: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + iteration) * 1_000_003 + index)
        # Drawn on the CPU (the generator's device), so GPUs see the same samples.
        return torch.randint(
            0, self.vocab_size, (self.seq_length + 1,), generator=gen, device="cpu"
        )


class TokenDataset(SampleSource):
    """Real data (`dataset.blend`): sample `index` of iteration `it` is sample `it x global_batch +
    index` of the blend, i.e. the run consumes the blend's samples in order, whatever the layout."""

    def __init__(self, cfg: ConfigContainer) -> None:
        from overlap.data.gpt_dataset import build_blend

        t, d = cfg.train, cfg.dataset
        self.global_batch, self.vocab_size = t.global_batch_size, cfg.resolved.model.vocab_size
        self.blend = build_blend(
            d.blend,
            d.split,
            cfg.resolved.model.seq_length,
            d.random_seed,
            t.train_iters * t.global_batch_size,
        )

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        k = iteration * self.global_batch + index
        tokens = torch.from_numpy(self.blend[k].astype("int64"))
        if int(tokens.max()) >= self.vocab_size:
            which = self.blend.datasets[int(self.blend.which[k])].data.prefix
            raise ConfigError(
                "dataset.blend",
                which,
                f"it holds token id {int(tokens.max())}, outside the model's vocabulary of "
                f"{self.vocab_size}.",
                "preprocess it with the tokenizer this run uses (--tokenizer_type / "
                "--tokenizer_model), or set the vocabulary to match.",
            )
        return tokens


def build_data(cfg: ConfigContainer) -> SampleSource:
    """Mock data unless `dataset.blend` names real data."""
    if cfg.dataset.blend is None:
        return MockDataset(
            cfg.resolved.model.vocab_size, cfg.resolved.model.seq_length, cfg.train.seed
        )
    return TokenDataset(cfg)
