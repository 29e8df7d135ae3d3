"""Timing of benchmark callables: CUDA events on the GPU, time.perf_counter on the CPU.

Rules (shared by ``bert-fast bench``, ``bert-fast bench-ops`` and the pytest-benchmark suites):
  * warm-up first (Triton autotuning, torch.compile and cuDNN/cuBLAS heuristics happen there);
  * every iteration is timed on its own (one CUDA event pair per iteration, read after a single
    synchronize at the end, so the host never stalls the queue between iterations);
  * the figures are the median and the 20th/80th percentiles over iterations, not the mean;
  * several input sets are prepared (an OpCase provider is a factory: each call builds fresh
    inputs) and the iterations rotate through them, so caches do not flatter the figures;
  * optionally the L2 cache is flushed before each iteration (a write over a buffer larger than
    any L2 of today's GPUs), outside the timed region;
  * peak memory is torch.cuda.max_memory_allocated, reset just before the provider's inputs are
    built (the caller resets before building its model when the model must count).
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024   # H100 has 50 MB of L2, H200 the same, B200 126 MB
_flush_buffers: dict = {}


@dataclass
class Timing:
    """The figures of one timed provider. Times are milliseconds per call."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    iters: int
    warmup: int
    n_inputs: int
    method: str                       # "cuda_event" or "perf_counter"
    l2_flush: bool
    peak_mem_bytes: Optional[int]     # None on the CPU

    def to_dict(self) -> dict:
        return asdict(self)


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_vals:
        return float("nan")
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo))


def summarize(times_ms: Sequence[float]) -> dict:
    vals = sorted(float(t) for t in times_ms)
    if not vals:
        raise ValueError("no timings to summarize")
    return {"median_ms": _percentile(vals, 50), "p20_ms": _percentile(vals, 20),
            "p80_ms": _percentile(vals, 80), "mean_ms": sum(vals) / len(vals),
            "min_ms": vals[0], "max_ms": vals[-1]}


def _flush_l2(device: torch.device) -> None:
    key = str(_indexed(device))
    buf = _flush_buffers.get(key)
    if buf is None:
        buf = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
        _flush_buffers[key] = buf
    buf.zero_()


def reset_peak_memory(device: torch.device) -> None:
    """Free what the caching allocator holds and restart the peak counter (no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> Optional[int]:
    """Peak bytes allocated on ``device`` since the last reset, less the L2-flush buffer (a
    benchmark artefact that stays allocated between calls, not memory of the code measured)."""
    device = torch.device(device)
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        buf = _flush_buffers.get(str(_indexed(device)))
        if buf is not None:
            peak = max(0, peak - buf.numel() * buf.element_size())
        return peak
    return None


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:<current> (one key per GPU for the flush buffers)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_callables(fns: Sequence[Callable[[], Any]], device, *, warmup: int = 10, iters: int = 50,
                   flush_l2: bool = False, reset_memory: bool = False,
                   progress: Optional[Callable[[int], None]] = None,
                   max_seconds: Optional[float] = None) -> Timing:
    """Time ``fns`` (one zero-argument callable per prepared input set), rotating among them.

    warmup: untimed calls first (at least one per input set is not required; Triton autotunes on
      the first call of each shape, so warm-up must be >= 1 for kernel benchmarks).
    reset_memory: reset the CUDA peak-memory counter first (callers that built a model to be
      counted reset earlier themselves and pass False).
    progress: called with the number of calls just done (warm-up and timed), for a progress bar.
    max_seconds: stop timing early (but after at least 5 iterations) once this much time was
      spent in timed calls; keeps long grids within a budget. ``iters`` reports what was timed.
    """
    if not fns:
        raise ValueError("time_callables needs at least one callable")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    device = torch.device(device)
    n = len(fns)
    if reset_memory:
        reset_peak_memory(device)

    for i in range(warmup):
        fns[i % n]()
        if progress is not None:
            progress(1)
    synchronize(device)

    times: List[float] = []
    if device.type == "cuda":
        method = "cuda_event"
        # Events on the stream the callables are queued on: the current stream of ``device``
        # (Event.record() without a stream would use the current *device's* stream).
        stream = torch.cuda.current_stream(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        done = 0
        t_wall = time.perf_counter()
        for i in range(iters):
            if flush_l2:
                _flush_l2(device)
            starts[i].record(stream)
            fns[i % n]()
            ends[i].record(stream)
            done += 1
            if progress is not None:
                progress(1)
            if max_seconds is not None and done >= 5 and time.perf_counter() - t_wall > max_seconds:
                ends[i].synchronize()
                if time.perf_counter() - t_wall > max_seconds:
                    break
        torch.cuda.synchronize(device)
        times = [starts[i].elapsed_time(ends[i]) for i in range(done)]
    else:
        method = "perf_counter"
        spent = 0.0
        for i in range(iters):
            if flush_l2 and device.type != "cpu":
                _flush_l2(device)
            t0 = time.perf_counter()
            fns[i % n]()
            synchronize(device)
            dt = time.perf_counter() - t0
            times.append(dt * 1e3)
            spent += dt
            if progress is not None:
                progress(1)
            if max_seconds is not None and len(times) >= 5 and spent > max_seconds:
                break

    stats = summarize(times)
    return Timing(iters=len(times), warmup=warmup, n_inputs=n, method=method,
                  l2_flush=bool(flush_l2 and device.type == "cuda"),
                  peak_mem_bytes=peak_memory(device), **stats)


def time_factory(factory: Callable[[], Callable[[], Any]], device, *, n_inputs: int = 3,
                 warmup: int = 10, iters: int = 50, flush_l2: bool = False,
                 progress: Optional[Callable[[int], None]] = None,
                 max_seconds: Optional[float] = None) -> Timing:
    """Time an OpCase provider: reset the peak-memory counter, call ``factory`` ``n_inputs``
    times (fresh inputs each), then time the callables with rotation (see time_callables)."""
    if n_inputs < 1:
        raise ValueError(f"n_inputs must be >= 1, got {n_inputs}")
    reset_peak_memory(device)
    fns = [factory() for _ in range(n_inputs)]
    synchronize(device)
    try:
        return time_callables(fns, device, warmup=warmup, iters=iters, flush_l2=flush_l2,
                              progress=progress, max_seconds=max_seconds)
    finally:
        del fns
