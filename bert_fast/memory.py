"""Resident memory of a CPU inference server (issue 25, item 7; benchmarks/notes/2026-11-25-memory-25.md,
"Memory under load (#25)").

Why RSS grows under a stream of random shapes: glibc malloc, not a cache. With varying shapes every
forward frees and allocates tensors of new sizes; glibc's mmap threshold rises to 32 MiB after the
first large free, so from then on every activation tensor comes from the malloc heaps, and the holes
they leave are kept (free inside the heap, counted in RSS) instead of going back to the system. The
live bytes stay flat; what grows is the free memory glibc holds. oneDNN's primitive cache (up to
1024 primitives, keyed by shape: frozen models' packed GEMMs) adds a bounded step on top, reached
within the first few hundred shapes.

The default since #32 item 7 (bert_fast/onednn_caches.py): oneDNN's and ideep's caches, keyed by the
token count, are bounded at import; their entries were what kept the holes from merging, and with them
bounded RSS stays flat (benchmarks/notes/2026-11-27-memory-32.md). What is below is for a process
that needs less still, or that ran oneDNN before importing bert_fast.

Two remedies, each measured by benchmarks/memory/soak.py:

- ``malloc_trim()`` every few forwards (``MemoryTrimmer``): glibc gives the free pages inside its
  heaps back to the system (madvise), so RSS tracks the live bytes. It costs one walk of the heaps
  per call (10-16 ms with a 0.9-1.4 GB heap on the 2-core soak machine, about 1 ms per forward at
  ``every=10``) and fresh-page faults on the memory it gave back.
- the allocator setting ``MALLOC_MMAP_THRESHOLD_=1048576`` in the server's environment (it also
  switches the dynamic threshold off): tensors of 1 MiB and more are mmapped and returned at free;
  costs fresh-page faults on every large tensor.

``bucket()`` rounds a batch's shape (length up to a multiple, batch up to a power of two): fewer
distinct padded shapes. bert_fast's unpadded path skips pads, so bucketing costs it little, but its
GEMMs see the real token count, which still varies: see the #25 note above for what it did on the soak.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional, Tuple


@functools.lru_cache(maxsize=1)
def _libc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS, Windows): nothing to trim this way
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def malloc_trim() -> bool:
    """Give the free memory glibc holds inside its heaps back to the system (``malloc_trim(0)``).
    Returns True where glibc released something, False where it had nothing to release or this is not
    glibc. Safe to call from any thread at any time."""
    fn = _libc_trim()
    return bool(fn(0)) if fn is not None else False


def trim_available() -> bool:
    """True where malloc_trim() can act (glibc)."""
    return _libc_trim() is not None


class MemoryTrimmer:
    """Call ``step()`` once per forward (or per request): every ``every`` steps it runs malloc_trim().

    trimmer = bert_fast.memory.MemoryTrimmer(every=10)
    for batch in requests:
        out = model(**batch)
        trimmer.step()
    """

    def __init__(self, every: int = 10):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"MemoryTrimmer(every={every!r}): every must be an int >= 1")
        self.every = every
        self.steps = 0
        self.trims = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            malloc_trim()
            self.trims += 1


def bucket_shape(batch: int, length: int, multiple: int = 64) -> Tuple[int, int]:
    """(batch up to a power of two, length up to a multiple of ``multiple``)."""
    if batch < 0 or length < 0 or multiple < 1:
        raise ValueError(f"bucket_shape(batch={batch}, length={length}, multiple={multiple}): need >= 0, >= 0, >= 1")
    b = 0 if batch == 0 else 1 << (batch - 1).bit_length()
    return b, -(-length // multiple) * multiple


def bucket(input_ids, attention_mask, token_type_ids=None, multiple: int = 64, pad_id: int = 0):
    """Pad a batch to its bucketed shape (bucket_shape). Extra positions are pads (mask 0); extra rows
    hold one real pad-id token each (so no row is empty) and are to be dropped from the output:
    ``out[:batch]``. Returns (input_ids, attention_mask, token_type_ids or None, batch)."""
    import torch

    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"bucket: input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must both be [batch, length]"
        )
    b, s = input_ids.shape
    pb, ps = bucket_shape(b, s, multiple)

    def grow(t: Optional[torch.Tensor], fill: int):
        if t is None:
            return None
        out = t.new_full((pb, ps), fill)
        out[:b, :s] = t
        return out

    ids, mask = grow(input_ids, pad_id), grow(attention_mask, 0)
    if pb > b:
        mask[b:, 0] = 1
    return ids, mask, grow(token_type_ids, 0), b
