"""Batches: BERT masking, padding, and length-bucketed global batches.

Masking (Devlin et al. 2019): each maskable token (not [CLS]/[SEP]/[PAD]/other specials) is
selected with probability ``mlm_probability`` (0.15); a selected token becomes [MASK] 80% of the
time, a random non-special token 10%, and stays unchanged 10%. Labels are the original ids at
selected positions and -100 elsewhere. The random draws of an example come from
``numpy.random.default_rng((seed, epoch, index))``: an example is masked the same way whichever rank,
micro-batch or DataLoader worker collates it, so 1 rank and N ranks see identical batches and a
resumed run sees the batches of the uninterrupted one.

Batch planning (``epoch_batches``): the indices of an epoch are shuffled (seeded by seed, epoch);
with bucketing, windows of ``bucket_window`` global batches are sorted by length before being cut
into global batches, and the batch order is shuffled again. A global batch is split into
world_size * grad_accum micro-batches of adjacent (similar-length) examples; at accumulation step
``a`` rank ``r`` takes slice ``a * world_size + r``, so the ranks of one step get similar lengths.
Similar lengths in a micro-batch mean little padding: the padded transformers path wastes less,
and bert_fast's unpadded path (which never computes pads) keeps its GEMMs full.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch


class MaskingCollator:
    """Collate examples from data.ExampleDataset into padded tensors, masking for MLM when
    ``mlm`` is True. Returns input_ids, attention_mask, token_type_ids (+ labels,
    next_sentence_label, or labels for classification) and the host-side counts
    ``num_tokens`` (real tokens) and ``num_targets`` (loss terms: masked tokens / sequences)."""

    def __init__(
        self,
        tokenizer,
        mlm: bool = True,
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_to_multiple_of: Optional[int] = None,
        mask_fraction: float = 0.8,
        random_fraction: float = 0.1,
    ):
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        self.mlm = mlm
        self.p = float(mlm_probability)
        self.seed = int(seed)
        self.pad_id = int(tokenizer.pad_token_id)
        self.mask_id = int(tokenizer.mask_token_id) if tokenizer.mask_token_id is not None else None
        if mlm and self.mask_id is None:
            raise ValueError("MLM needs a tokenizer with a [MASK] token")
        self.multiple = pad_to_multiple_of
        self.mask_fraction, self.random_fraction = mask_fraction, random_fraction
        vocab = len(tokenizer)
        self.special = np.zeros(max(vocab, 1), dtype=bool)
        for i in tokenizer.all_special_ids:
            if 0 <= i < vocab:
                self.special[i] = True
        self.random_pool = np.flatnonzero(~self.special).astype(np.int64)

    def mask_example(self, ids: np.ndarray, key) -> tuple[np.ndarray, np.ndarray]:
        """(masked ids, labels) of one example, drawn from (seed, epoch, index)."""
        rng = np.random.default_rng([self.seed, int(key[0]), int(key[1])])
        ids = ids.astype(np.int64)
        maskable = ~self.special[np.clip(ids, 0, len(self.special) - 1)]
        selected = (rng.random(ids.shape[0]) < self.p) & maskable
        labels = np.where(selected, ids, -100)
        action = rng.random(ids.shape[0])
        to_mask = selected & (action < self.mask_fraction)
        to_random = selected & (action >= self.mask_fraction) & (action < self.mask_fraction + self.random_fraction)
        out = ids.copy()
        out[to_mask] = self.mask_id
        if to_random.any():
            out[to_random] = self.random_pool[rng.integers(0, len(self.random_pool), int(to_random.sum()))]
        return out, labels

    def __call__(self, examples: Sequence[dict]) -> Dict[str, object]:
        b = len(examples)
        s = max((len(e["input_ids"]) for e in examples), default=0)
        if self.multiple and s % self.multiple:
            s += self.multiple - s % self.multiple
        input_ids = np.full((b, s), self.pad_id, dtype=np.int64)
        attention = np.zeros((b, s), dtype=np.int64)
        token_types = np.zeros((b, s), dtype=np.int64)
        labels = np.full((b, s), -100, dtype=np.int64) if self.mlm else None
        for row, ex in enumerate(examples):
            ids = ex["input_ids"]
            n = len(ids)
            if self.mlm:
                ids, lab = self.mask_example(ids, ex.get("_key", (0, row)))
                labels[row, :n] = lab
            input_ids[row, :n] = ids
            attention[row, :n] = 1
            if "token_type_ids" in ex:
                token_types[row, :n] = ex["token_type_ids"]
        batch: Dict[str, object] = {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(attention),
            "token_type_ids": torch.from_numpy(token_types),
        }
        batch["num_tokens"] = int(attention.sum())
        if self.mlm:
            batch["labels"] = torch.from_numpy(labels)
            batch["num_targets"] = int((labels != -100).sum())
            if examples and "next_sentence_label" in examples[0]:
                batch["next_sentence_label"] = torch.tensor([int(e["next_sentence_label"]) for e in examples])
                batch["num_sequences"] = b
        else:
            batch["labels"] = torch.tensor([int(e["label"]) for e in examples], dtype=torch.long)
            batch["num_targets"] = b
        return batch


# ----------------------------------------------------------------------------- batch planning
class LazyLengths:
    """The lengths of a streamed dataset (data on disk, never loaded): ``n`` sequences of (up to)
    ``max_len`` tokens. ``epoch_batches`` on it returns a ``LazyEpochPlan`` instead of building
    arrays of corpus size; bucketing does not apply (the sequences are full)."""

    def __init__(self, n: int, max_len: int):
        self.n, self.max_len = int(n), int(max_len)

    def __len__(self) -> int:
        return self.n


_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (wrapping uint64 arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def keyed_permutation(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Entry ``positions`` of a pseudo-random permutation of range(n) keyed by (seed, epoch), computed
    per entry in O(1) memory: a 4-round Feistel network on the next even power of two, cycle-walked
    into [0, n) (a bijection of [0, n))."""
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    keys = np.random.default_rng([seed, epoch, 0xFE15]).integers(0, 2**63, 4, dtype=np.uint64)

    def rounds(x):
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    with np.errstate(over="ignore"):
        y = rounds(np.asarray(positions, dtype=np.uint64))
        bad = y >= np.uint64(n)
        while bad.any():
            y[bad] = rounds(y[bad])
            bad = y >= np.uint64(n)
    return y.astype(np.int64)


class LazyEpochPlan:
    """The global batches of one epoch of a ``LazyLengths`` dataset, computed per step: batch ``s``
    holds the samples at positions [s * global_batch, (s + 1) * global_batch) of the epoch's order
    (a keyed permutation, or range(n) without shuffle); the last partial batch is dropped. The
    order of samples does not depend on the global batch size."""

    def __init__(self, n: int, global_batch: int, seed: int, epoch: int, shuffle: bool = True):
        self.n, self.global_batch, self.seed, self.epoch, self.shuffle = n, global_batch, seed, epoch, shuffle

    def __len__(self) -> int:
        return self.n // self.global_batch

    def __getitem__(self, step: int) -> np.ndarray:
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} out of range for an epoch of {len(self)} global batches")
        pos = np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64)
        return keyed_permutation(pos, self.n, self.seed, self.epoch) if self.shuffle else pos

    def __iter__(self):
        return (self[s] for s in range(len(self)))


def epoch_batches(
    lengths,
    global_batch: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    bucket: bool = True,
    bucket_window: int = 64,
) -> Sequence[np.ndarray]:
    """The global batches (arrays of example indices) of one epoch; the last partial one is dropped.
    A pure function of its arguments: every rank computes the same plan, and a resumed run too.
    ``lengths`` a ``LazyLengths``: a ``LazyEpochPlan`` (no bucketing, nothing of corpus size built)."""
    n = len(lengths)
    if global_batch < 1:
        raise ValueError(f"global batch size must be >= 1, got {global_batch}")
    if isinstance(lengths, LazyLengths):
        return LazyEpochPlan(n, global_batch, seed, epoch, shuffle=shuffle)
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    order = rng.permutation(n) if shuffle else np.arange(n)
    if bucket:
        window = global_batch * max(1, bucket_window)
        chunks = []
        for lo in range(0, n, window):
            part = order[lo : lo + window]
            chunks.append(part[np.argsort(lengths[part], kind="stable")])
        order = np.concatenate(chunks) if chunks else order
    batches = [order[i : i + global_batch] for i in range(0, n - global_batch + 1, global_batch)]
    if bucket and shuffle and batches:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def micro_slices(global_batch: np.ndarray, world_size: int, rank: int, grad_accum: int) -> List[np.ndarray]:
    """This rank's micro-batches (one per accumulation step) of one global batch."""
    micro = len(global_batch) // (world_size * grad_accum)
    out = []
    for a in range(grad_accum):
        j = a * world_size + rank
        out.append(global_batch[j * micro : (j + 1) * micro])
    return out


class StepBatchSampler:
    """Yields, for each optimizer step from ``start_step`` of ``epoch``, this rank's micro-batches as
    lists of (epoch, index) keys (for a DataLoader with ``batch_sampler=``)."""

    def __init__(
        self, plan: Sequence[np.ndarray], epoch: int, world_size: int, rank: int, grad_accum: int, start_step: int = 0
    ):
        self.plan, self.epoch = plan, epoch
        self.world_size, self.rank, self.grad_accum = world_size, rank, grad_accum
        self.start_step = start_step

    def __len__(self) -> int:
        return max(0, len(self.plan) - self.start_step) * self.grad_accum

    def __iter__(self):
        for step in range(self.start_step, len(self.plan)):
            for mb in micro_slices(self.plan[step], self.world_size, self.rank, self.grad_accum):
                yield [(self.epoch, int(i)) for i in mb]
