"""Mock pretraining data (NullTokenizer): deterministic random tokens.

Sample `i` of iteration `k` depends only on (seed, k, i), never on the parallel layout, so every layout trains on
exactly the samples of the single-process reference: data-parallel rank d takes its contiguous share of the global
batch, and micro-batch j of that share holds the next micro_batch_size samples.
"""

from __future__ import annotations

import torch


class MockDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        """seq_length + 1 tokens; the model reads [:-1] and predicts [1:]."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + iteration) * 1_000_003 + index)
        # Drawn on the CPU (the generator's device) whatever the default device, so GPUs see the same samples.
        return torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=gen, device="cpu")

    def micro_batches(self, iteration: int, global_batch: int, micro_batch: int, dp_rank: int,
                      dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's micro-batches of one iteration as (tokens [b, s], labels [b, s])."""
        per_rank = global_batch // dp_size
        first = dp_rank * per_rank
        batches = []
        for start in range(first, first + per_rank, micro_batch):
            rows = torch.stack([self.sample(iteration, i) for i in range(start, start + micro_batch)])
            rows = rows.to(torch.get_default_device())
            batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        return batches
