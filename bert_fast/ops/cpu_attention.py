"""Self-attention of CPU inference in one native call: bf16 (csrc/attention_cpu.cpp, AVX-512 BF16) and
fp32 (csrc/attention_f32_cpu.cpp, AVX-512 or AVX2, #32 item 3).

Inference only (no log-sum-exp, no gradient): bert_fast/model/direct_ops.py calls it in place of
torch's flash CPU kernel, which runs bf16 attention at a sixth of the bf16 GEMM rate on CPUs
without AMX (benchmarks/notes/2026-11-26-cpu-attention-bf16.md) and spends most of an fp32 BERT-sized
problem in fixed per-block costs (benchmarks/notes/2026-11-27-cpu-attention-32.md). One call serves a padded
batch with a key mask, packed varlen sequences (cu_seqlens: no grouping by length, no gather or
scatter), and q, k, v from three separate GEMMs, because the kernels read every operand through
one row stride.

Where each runs: bf16 on a CPU with AVX-512 BF16 and an even head dim; fp32 on a CPU with AVX-512
or AVX2 (+FMA), any head dim; both capped by BERT_FAST_CPU_ISA. Whether ours beats torch's kernel is
measured once per process, dtype, (heads, head dim) and thread count (``choice``): on an AMX CPU
torch's bf16 kernel runs its GEMMs on AMX tiles and may win there; the measurement keeps whichever
is faster. ``BERT_FAST_CPU_ATTENTION=0`` turns both off, ``=1`` uses them without measuring.
"""

from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

try:
    from bert_fast import _C as _ext

    if not hasattr(_ext, "attention_bf16") or not hasattr(_ext, "attention_f32"):  # an older build
        _ext = None
except ImportError:  # pragma: no cover - the extension is part of every install
    _ext = None

# (dtype, heads, d, threads) -> whether ours won the first-use timing against torch's flash CPU kernel
_CHOICES: Dict[Tuple[torch.dtype, int, int, int], bool] = {}
DTYPES = (torch.bfloat16, torch.float32)


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """This build has the ``dtype`` kernel and this CPU can run it (bf16: AVX-512 BF16; fp32: AVX-512
    or AVX2), not ruled out by BERT_FAST_CPU_ISA: asked at every call, a few hundred nanoseconds."""
    if _ext is None:
        return False
    if dtype == torch.bfloat16:
        return bool(_ext.cpu_has_bf16_dot())
    if dtype == torch.float32:
        return bool(_ext.attention_f32_isa())
    return False


def _setting() -> str:
    return os.environ.get("BERT_FAST_CPU_ATTENTION", "auto").strip().lower()


def eligible(t: Tensor, heads: int) -> bool:
    """Whether attention over ``t`` (bf16 or fp32 CPU activations, hidden = heads x d) may run here."""
    setting = _setting()
    if t.dtype not in DTYPES or t.device.type != "cpu" or setting in ("0", "off", "false"):
        return False
    d = t.shape[-1] // heads if t.dim() == 2 else t.shape[-1]
    if (t.dtype == torch.bfloat16 and d % 2) or not available(t.dtype):
        return False
    return setting in ("1", "on", "true") or choice(heads, d, t.dtype)


def choice(heads: int, d: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Ours or torch's flash CPU kernel for this (dtype, heads, d) at the current thread count: timed
    once per process at b4 x 128 tokens (best of 3 each, ~10-30 ms in all), and the result cached."""
    key = (dtype, heads, d, torch.get_num_threads())
    got = _CHOICES.get(key)
    if got is not None:
        return got
    b, s = 4, 128
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn((b, s, 3, heads, d), generator=g).to(dtype)
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    scale = d**-0.5

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    ours = best(lambda: padded(qkv, None, scale))
    theirs = best(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale))
    _CHOICES[key] = ours <= theirs
    return _CHOICES[key]


def _run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    row_stride: int,
    out: Tensor,  # [T, h, d]
    starts: Tensor,
    mask: Optional[Tensor],
    heads: int,
    d: int,
    scale: float,
) -> Tensor:
    kernel = _ext.attention_bf16 if q.dtype == torch.bfloat16 else _ext.attention_f32
    kernel(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        row_stride,
        out.data_ptr(),
        out.stride(0),
        starts.data_ptr(),
        starts.numel() - 1,
        0 if mask is None else mask.data_ptr(),
        0 if mask is None else mask.stride(0),
        heads,
        d,
        float(scale),
        torch.get_num_threads(),
    )
    return out


def _rows_layout(qkv: Tensor) -> Tensor:
    """qkv [..., 3, h, d] as dense token rows [T, 3, h, d] (a view when qkv is contiguous)."""
    return qkv.reshape(-1, *qkv.shape[-3:]).contiguous()


def _starts(n: int, length: int) -> Tensor:
    """cu_seqlens of ``n`` sequences of ``length`` tokens each: 0, length, 2 length, ..."""
    return torch.arange(n + 1, dtype=torch.int64) * length


def padded(qkv: Tensor, key_mask: Optional[Tensor], scale: float) -> Tensor:
    """out [B, S, h, d] of qkv [B, S, 3, h, d] with key_mask [B, S] (nonzero = attend) or None."""
    b, s, _, h, d = qkv.shape
    tokens = _rows_layout(qkv)
    out = torch.empty((b, s, h, d), dtype=qkv.dtype)
    # nonzero = attend, as 0/1 bytes (a bool tensor's bytes are exactly that)
    mask = None if key_mask is None else key_mask.to(torch.bool).contiguous().view(torch.uint8)
    q, k, v = tokens[:, 0], tokens[:, 1], tokens[:, 2]
    return _run(q, k, v, tokens.stride(0), out.view(b * s, h, d), _starts(b, s), mask, h, d, scale).view(b, s, h, d)


def varlen(qkv: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    """out [T, h, d] of packed sequences qkv [T, 3, h, d] delimited by cu_seqlens [N + 1]."""
    t, _, h, d = qkv.shape
    tokens = _rows_layout(qkv)
    out = torch.empty((t, h, d), dtype=qkv.dtype)
    starts = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    return _run(tokens[:, 0], tokens[:, 1], tokens[:, 2], tokens.stride(0), out, starts, None, h, d, scale)


def separate(q: Tensor, k: Tensor, v: Tensor, batch: int, seqlen: int, heads: int, scale: float) -> Tensor:
    """Context [T, H] of ``batch`` sequences of ``seqlen`` tokens from q, k, v [T, H] (contiguous)."""
    t, hidden = q.shape
    d = hidden // heads
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty((t, hidden), dtype=q.dtype)
    _run(q, k, v, hidden, out.view(t, heads, d), _starts(batch, seqlen), None, heads, d, scale)
    return out
