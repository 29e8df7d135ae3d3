"""The dropout keep-mask of the torch and reference implementations: a function of (seed, shape).

The stream is the Philox4x32-10 one of the embedding kernels (csrc/embedding_common.h), laid over
the mask as [rows, cols] = [prod(shape[:-1]), shape[-1]]: element j of row r is kept iff word
j % 4 of philox(counter = (j // 4, 0, lo32(r), hi32(r)), key = (lo32(seed), hi32(seed))) is
>= round(p * 2^32). Being counter-based, it is drawn again bit for bit in the backward and under
activation checkpointing from the saved seed, by any number of threads, on any device.

Why not torch.rand(generator=...) >= p, which this replaced: torch's CPU generator (mt19937) is
sequential, ~3.7 ns an element on one thread; a BERT-base training step draws ~75 M mask elements
(every dropout, forward and backward), which made the masks a fifth of a CPU training step.
bert_fast._C.keep_mask_cpu draws the same bits vectorized (AVX-512/AVX2) and threaded, ~0.3 ns an
element on the 2-core machine (benchmarks/notes/2026-11-24-cpu-masks-freeze-targets.md).

Masks for CUDA tensors are drawn on the host and copied (this is the fallback's path, not the
kernels'): the bits do not depend on the device. Without the compiled module (bert_fast._C not
built) the same stream is computed with torch integer ops, ~20x slower but the same bits.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

try:  # the compiled module is optional: the torch version below draws the same bits
    from bert_fast import _C as _ext
except ImportError:  # pragma: no cover - exercised by forcing _ext = None in the tests
    _ext = None

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def keep_threshold(p: float) -> int:
    """round(p * 2^32) clamped to [0, 2^32], as csrc/embedding_common.h's keep_threshold_from_p."""
    if not p > 0.0:
        return 0
    return min(int(math.floor(p * 4294967296.0 + 0.5)), 1 << 32)


def keep_mask(shape, dropout_p: float, seed: int, device="cpu") -> Tensor:
    """The bool keep-mask of ``shape`` for the 64-bit ``seed`` (any int; taken modulo 2^64)."""
    shape = tuple(int(n) for n in shape)
    # device="cpu" explicitly: under `with torch.device("meta"/"cuda")` a bare empty() would not be
    # host memory, and the C++ side writes through its pointer
    out = torch.empty(shape, dtype=torch.uint8, device="cpu")
    if out.numel() > 0:
        cols = shape[-1] if shape else 1
        rows = out.numel() // cols
        seed = int(seed) & 0xFFFFFFFFFFFFFFFF
        if _ext is not None and hasattr(_ext, "keep_mask_cpu"):
            # the C++ side takes an int64: pass the same 64 bits as a signed value
            signed = seed - (1 << 64) if seed >= 1 << 63 else seed
            _ext.keep_mask_cpu(out.data_ptr(), rows, cols, signed, float(dropout_p), torch.get_num_threads())
        else:
            out.view(rows, cols).copy_(keep_mask_torch(rows, cols, dropout_p, seed))
    return out.view(torch.bool).to(device)


def _mulhilo(a: int, b: Tensor):
    """(hi, lo) 32-bit words of a * b for a uint32 constant and uint32 values held in int64, without
    overflowing int64: b is split into 16-bit halves (each partial product < 2^48)."""
    p_lo = (b & 0xFFFF) * a
    p_hi = (b >> 16) * a
    lo = (p_lo + ((p_hi & 0xFFFF) << 16)) & _MASK32
    hi = (p_hi + (p_lo >> 16)) >> 16
    return hi, lo


def keep_mask_torch(rows: int, cols: int, dropout_p: float, seed: int, rows_per_chunk: int = 4096) -> Tensor:
    """The same uint8 [rows, cols] mask with torch integer ops (no compiled code), in row chunks
    to bound the int64 temporaries."""
    out = torch.empty((rows, cols), dtype=torch.uint8, device="cpu")
    thr = keep_threshold(dropout_p)
    groups = (cols + 3) // 4
    seed &= 0xFFFFFFFFFFFFFFFF
    g = torch.arange(groups, dtype=torch.int64, device="cpu")[None, :]
    for r0 in range(0, rows, rows_per_chunk):
        r = torch.arange(r0, min(rows, r0 + rows_per_chunk), dtype=torch.int64, device="cpu")[:, None]
        c0 = g.expand(r.shape[0], groups)
        c1 = torch.zeros_like(c0)
        c2 = (r & _MASK32).expand_as(c0)
        c3 = (r >> 32).expand_as(c0)
        k0, k1 = seed & _MASK32, seed >> 32
        for _ in range(10):
            hi0, lo0 = _mulhilo(_M0, c0)
            hi1, lo1 = _mulhilo(_M1, c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        words = torch.stack([c0, c1, c2, c3], dim=-1).reshape(r.shape[0], groups * 4)[:, :cols]
        out[r0 : r0 + r.shape[0]] = words >= thr
    return out
