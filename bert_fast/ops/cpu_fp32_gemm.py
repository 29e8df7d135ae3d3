"""Which fp32 GEMM the CPU path's linear runs: oneDNN's linear (``mkldnn._linear_pointwise`` on the
plain weight: no packed copy, nothing cached) or aten's ``F.linear``, chosen by measurement.

Why. ``F.linear`` in fp32 goes to MKL (or OpenBLAS), and MKL takes its AVX-512 code on Intel CPUs
only: on an AMD Zen 5 with AVX-512 it ran the AVX2 sgemm at 0.19-0.22 TFLOP/s (2 threads), while
oneDNN's fp32 linear on the same plain weight ran 2.2-2.3x faster at every BERT GEMM shape (128 and
1024 rows; benchmarks/notes/2026-11-27-cpu-inference-32.md, "The plain fp32 path on oneDNN"), and fuses the GELU. On
Intel the two tie or MKL wins; on a CPU without AVX-512 either may win. So the first fp32 CPU
linear of a process times both on one BERT-sized GEMM (~30 ms, once per thread count) and oneDNN
is taken only where it is at least ``MARGIN`` faster.

``BERT_FAST_CPU_FP32_GEMM``: ``auto`` (default, the measurement), ``onednn`` or ``aten`` (forced).
"""

from __future__ import annotations

import functools
import os
from typing import Dict

import torch
import torch.nn.functional as F

from bert_fast.ops.cpu_timing import median_pair

ENV = "BERT_FAST_CPU_FP32_GEMM"
MARGIN = 0.9  # oneDNN must take at most this fraction of F.linear's time
SHAPE = (256, 2304, 768)  # rows, out, in: a bert-base QKV projection of two 128-token sequences
_CHOICE: Dict[int, bool] = {}


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """oneDNN's linear is in this torch build."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def mode() -> str:
    m = os.environ.get(ENV, "").strip().lower() or "auto"
    if m not in ("auto", "onednn", "aten"):
        raise ValueError(f"{ENV} must be auto, onednn or aten, got {m!r}")
    return m


def use_onednn() -> bool:
    """Whether fp32 CPU linears run on oneDNN in this process at the current thread count."""
    m = mode()
    if m == "aten" or not available():
        return False
    if m == "onednn":
        return True
    threads = torch.get_num_threads()
    choice = _CHOICE.get(threads)
    if choice is None:
        choice = _CHOICE[threads] = _measure()
    return choice


def choices() -> Dict[int, bool]:
    """{thread count: oneDNN chosen} measured in this process (for `bert-fast info` and the notes)."""
    return dict(_CHOICE)


def _measure(reps: int = 5) -> bool:
    rows, n, k = SHAPE
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    try:
        with torch.no_grad():
            t_onednn, t_aten = median_pair(
                lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""), lambda: F.linear(x, w, b), reps
            )
    except Exception:  # noqa: BLE001 - oneDNN refused this CPU or build: aten
        return False
    return t_onednn <= MARGIN * t_aten


def reset() -> None:
    """Forget the measurements (tests)."""
    _CHOICE.clear()
