"""GPT pretraining samples from indexed datasets, as Megatron-Core's GPTDataset and BlendedDataset
build them.

- Split: `dataset.split` ("9999,8,2": train, validation, test weights) cuts each dataset's documents
  into contiguous ranges with Megatron's rounding; training reads the first range.
- Samples: every epoch the split's documents are shuffled (numpy RandomState, the reference's
  generator, seeded by (seed, epoch)) and concatenated (each document already ends with the
  end-of-document token: `overlap preprocess` appends it unless told --no-append-eod); a sample is
  `seq_length + 1` consecutive tokens starting every `seq_length` tokens within the epoch (tokens =
  [:-1], labels = [1:]), and the epoch's samples are shuffled too. Unlike Megatron (one generator
  over all epochs, the count fixed by the run's length) an epoch does not depend on the run's
  length.
- Blend: datasets with weights; global sample k comes from the dataset whose share is most behind,
  the reference's greedy rule (`build_blending_indices`), so every prefix of the sample stream
  matches the weights as well as a whole number of samples can.
Sample k of the run depends only on (files, split, seed, sequence length, k): any parallel layout
reads the same samples, and a resumed run continues at the consumed-sample count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overlap.data.indexed import IndexedDataset
from overlap.errors import ConfigError


def split_ranges(split: str, count: int, field: str = "dataset.split") -> list[tuple[int, int]]:
    """[start, end) of each split's documents (Megatron's `_get_split_indices`)."""
    try:
        weights = [float(w) for w in str(split).replace("/", ",").split(",")]
    except ValueError:
        raise ConfigError(
            field, split, "the split is comma-separated weights.", 'write e.g. "969,30,1".'
        ) from None
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0 or len(weights) > 3:
        raise ConfigError(
            field,
            split,
            "one to three non-negative weights (train, validation, test) with a positive sum.",
            'write e.g. "969,30,1".',
        )
    weights = [w / sum(weights) for w in weights] + [0.0] * (3 - len(weights))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(count))))
    diff = bounds[-1] - count
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class GPTDataset:
    """The training split of one indexed dataset as `seq_length + 1`-token samples, epoch after
    epoch.

    Epoch e shuffles the split's documents with RandomState([seed, e, 0]), concatenates them, cuts
    (tokens - 1) // seq_length windows and orders them with RandomState([seed, e, 1]). An epoch
    depends on nothing but (files, split, seed, sequence length, e) - not on how many samples the
    run will draw - so a run resumed with more iterations, or a longer run, reads exactly the
    samples a shorter one read first."""

    def __init__(self, data: IndexedDataset, split: str, seq_length: int, seed: int) -> None:
        self.data, self.seq, self.seed = data, seq_length, seed
        start, end = split_ranges(split, len(data))[0]
        self.docs = np.arange(start, end, dtype=np.int64)
        tokens_per_epoch = int(data.lengths[self.docs].sum(dtype=np.int64)) if len(self.docs) else 0
        if tokens_per_epoch < seq_length + 1:
            raise ConfigError(
                "dataset.blend",
                data.prefix,
                f"its training split holds {tokens_per_epoch} tokens ({len(self.docs)} documents), "
                f"less than one sample of {seq_length + 1}.",
                "give more data, a larger training share in dataset.split, or a shorter -sl.",
            )
        self.per_epoch = (tokens_per_epoch - 1) // seq_length
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, document start offsets in the epoch's stream, sample order) of epoch
        e."""
        if e not in self._epochs:
            order = np.random.RandomState([self.seed, e, 0]).permutation(self.docs)
            starts = np.concatenate([[0], np.cumsum(self.data.lengths[order], dtype=np.int64)])
            self._epochs = {
                e: (
                    order,
                    starts,
                    np.random.RandomState([self.seed, e, 1]).permutation(self.per_epoch),
                )
            }
        return self._epochs[e]

    def __getitem__(self, k: int) -> np.ndarray:
        e, j = divmod(k, self.per_epoch)
        order, starts, shuffle = self.epoch(e)
        first = int(shuffle[j]) * self.seq
        last = first + self.seq + 1
        pieces = []
        d = int(np.searchsorted(starts, first, side="right")) - 1
        while first < last:
            doc_start, doc_end = int(starts[d]), int(starts[d + 1])
            take = min(last, doc_end) - first
            pieces.append(self.data.document(int(order[d]), first - doc_start, take))
            first += take
            d += 1
        return np.concatenate(pieces)


@dataclass
class Blend:
    """Weighted datasets; sample k of the blend is sample `positions[k]` of dataset `which[k]`."""

    datasets: list[GPTDataset]
    which: np.ndarray
    positions: np.ndarray

    def __getitem__(self, k: int) -> np.ndarray:
        return self.datasets[int(self.which[k])][int(self.positions[k])]


def blending_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference's greedy blending: sample k goes to the dataset furthest below its share, the
    first of equals (argmax of w_i * max(k, 1) - taken_i).

    Each choice depends on the previous ones, so this is a loop; it runs on Python floats and lists,
    which cost 0.5-0.9 us per sample (by the number of datasets) against ~4 us for the same loop
    over numpy scalars (a run of 50M samples: under a minute instead of ~200 s at start-up). The
    arithmetic is the same IEEE double arithmetic, so the choices are identical."""
    total = float(sum(weights))
    w = [float(x) / total for x in weights]
    which = [0] * num_samples
    positions = [0] * num_samples
    taken = [0] * len(w)
    others = range(1, len(w))
    for k in range(num_samples):
        scale = float(max(k, 1))
        best, best_gap = 0, w[0] * scale - taken[0]
        for i in others:
            gap = w[i] * scale - taken[i]
            if gap > best_gap:
                best, best_gap = i, gap
        which[k], positions[k] = best, taken[best]
        taken[best] += 1
    return np.asarray(which, dtype=np.int64), np.asarray(positions, dtype=np.int64)


def parse_blend(blend) -> tuple[list[str], list[float]]:
    """Bridge's `[[prefixes], [weights] | null]`, or Megatron's flat `[w1, p1, w2, p2]` / `[p1,
    p2]`."""
    field = "dataset.blend"
    if isinstance(blend, str):
        blend = [blend]
    if not isinstance(blend, list) or not blend:
        raise ConfigError(
            field,
            blend,
            "expected a list of dataset prefixes.",
            "write dataset.blend=[[data/a_text_document,data/b_text_document],[0.7,0.3]] or "
            "dataset.blend=[data/a_text_document].",
        )
    if isinstance(blend[0], list):
        prefixes = blend[0]
        weights = blend[1] if len(blend) > 1 and blend[1] is not None else [1.0] * len(prefixes)
    elif all(isinstance(b, str) for b in blend):
        prefixes, weights = blend, [1.0] * len(blend)
    else:
        weights, prefixes = blend[0::2], blend[1::2]
    if (
        len(prefixes) != len(weights)
        or not prefixes
        or not all(isinstance(p, str) for p in prefixes)
        or not all(isinstance(w, (int, float)) and w > 0 for w in weights)
    ):
        raise ConfigError(
            field,
            blend,
            "prefixes and positive weights must pair up.",
            "write [[prefix, ...], [weight, ...]] with one weight per prefix (or null weights).",
        )
    return [str(p) for p in prefixes], [float(w) for w in weights]


def build_blend(blend, split: str, seq_length: int, seed: int, num_samples: int) -> Blend:
    """The first `num_samples` samples of the blend (the greedy choice of sample k depends on k
    alone, so a longer run's first samples are a shorter run's)."""
    prefixes, weights = parse_blend(blend)
    which, positions = blending_indices(weights, num_samples)
    datasets = [GPTDataset(IndexedDataset(prefix), split, seq_length, seed) for prefix in prefixes]
    return Blend(datasets, which, positions)
