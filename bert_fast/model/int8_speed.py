"""Is int8 faster than fp32 on this CPU? Measured once per process and thread count, before anything
is calibrated, by every caller that offers int8: ``optimize(model, int8=True)``, ``int8.quantize``,
the bench's ``bert_fast-int8`` provider and ``bert-fast doctor``.

Why measure. Where the CPU has VNNI (AVX-512 VNNI, AMX-INT8), torch._int_mm runs oneDNN's int8
GEMM at 1.5-3x the fp32 rate. Elsewhere (AVX2-only CPUs: AMD Zen 2/3, Intel before Ice Lake, and
Intel client parts with only AVX-VNNI) torch takes a plain C++ loop instead, 35-55x slower than fp32
(bert-base b8 s128: 60.7 s against 1.10 s per forward on a Zen 3); there our own AVX2 int8 GEMM
(csrc/int8_gemm_avx2.cpp) runs instead. The CPU's flags alone do not say which is faster with a
given torch build, so each int8 linear bert_fast can run (bert_fast.ops.int8_gemm: int8_linear on
torch._int_mm, "int_mm"; VnniLinear, "vnni", our AVX-512 VNNI GEMM on weights packed once;
int8_linear_avx2, "avx2") is timed against fp32 F.linear on one BERT-base
GEMM, M=128 rows (a batch-1 forward), K=768, N=3072: the faster int8 backend is the one used, and
int8 is offered only where it beats fp32, refused with the measured rates where it does not.

Cost: at most ~MAX_SECONDS; on a slow int8 path one warm-up call already decides it (a call over
CLEARLY_SLOWER times the fp32 one ends the measurement).

Why an exactness check first (``int_mm_exact``). oneDNN's int8 GEMMs for CPUs without VNNI add pairs
of u8 x s8 products in int16 (vpmaddubsw), which saturates on the products this recipe makes (|x_q|,
|w_q| up to 127). Where torch routes torch._int_mm to such a kernel its sums are wrong: seen with
torch 2.13 on an AVX-512 VNNI CPU under ONEDNN_MAX_CPU_ISA=AVX2 (torch picks oneDNN from the CPU's
flags, oneDNN its AVX2 kernel: 16,370 of 16,384 sums of full-range int8 off, by up to 108,547), and
fast, so the speed check alone would pick it. So torch._int_mm is a backend only where it is exact
on such a probe; elsewhere our AVX2 GEMM (exact int32 sums) runs, or int8 is refused with the reason.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from bert_fast.ops import int8_gemm

SHAPE = (128, 768, 3072)  # (M, K, N): BERT-base's FFN-up GEMM at batch 1 x 128 tokens
MAX_SECONDS = 2.0  # the whole measurement, warm-up included, on a fast int8 path
MAX_ROUNDS = 15
CLEARLY_SLOWER = 4.0  # one int8 call this many times an fp32 call: int8 is slower, no need to repeat
MIN_SPEEDUP = 1.0  # int8 must beat fp32 by this factor to be offered

_CACHE: Dict[int, "Int8Speed"] = {}


class Int8SpeedError(ValueError):
    """int8 GEMMs measured slower than fp32 on this CPU: int8 was not applied."""


@dataclass(frozen=True)
class Int8Speed:
    """The measured rates of one shape: the faster int8 linear (TOPS, ``backend``) and fp32 F.linear
    (TFLOP/s); ``rates``: every int8 backend's TOPS ("int_mm": torch._int_mm, oneDNN; "vnni", "avx2": ours)."""

    int8_tops: float
    fp32_tflops: float
    shape: Tuple[int, int, int]
    threads: int
    rounds: int
    backend: str = "int_mm"  # "none": no exact int8 GEMM here (``note`` says why)
    rates: Dict[str, float] = field(default_factory=dict)
    note: str = ""  # why a backend was left out (torch._int_mm inexact here)

    @property
    def speedup(self) -> float:
        return self.int8_tops / self.fp32_tflops if self.fp32_tflops > 0 else 0.0

    @property
    def faster(self) -> bool:
        return self.speedup >= MIN_SPEEDUP

    def describe(self) -> str:
        m, k, n = self.shape
        others = ", ".join(f"{b} {r:.3g}" for b, r in self.rates.items() if b != self.backend)
        if self.backend == "none":
            return f"no exact int8 GEMM runs on this CPU: {self.note}"
        return (
            f"int8 GEMM {self.int8_tops:.3g} TOPS ({BACKEND_NAMES.get(self.backend, self.backend)}"
            + (f"; other int8 backends: {others} TOPS" if others else "")
            + f") vs fp32 {self.fp32_tflops:.3g} TFLOP/s ({self.speedup:.2f}x) "
            f"measured on this CPU at M={m} K={k} N={n}, {self.threads} thread(s)"
            + (f"; {self.note}" if self.note else "")
        )

    def as_dict(self) -> dict:
        return {
            "int8_tops": self.int8_tops,
            "fp32_tflops": self.fp32_tflops,
            "speedup": self.speedup,
            "faster": self.faster,
            "backend": self.backend,
            "rates": dict(self.rates),
            "shape": list(self.shape),
            "threads": self.threads,
            "rounds": self.rounds,
            "note": self.note,
        }


BACKEND_NAMES = {
    "int_mm": "torch._int_mm",
    "vnni": "bert_fast's AVX-512 VNNI int8 GEMM",
    "avx2": "bert_fast's AVX2 int8 GEMM",
}


# A forward reads each weight once, from L3 or DRAM, never warm from L2: each backend's call cycles
# through this many copies of its weights (bert-base's 2.4 MB int8 / 9.4 MB fp32 each), so that what
# a backend pays per call for its weight layout (torch._int_mm lays the plain weight out at every
# call; our GEMMs read weights packed once) counts as it does in a forward.
WEIGHT_COPIES = 4


def _cycling(call, weights: list):
    """A zero-argument callable running ``call(w)`` on the next of ``weights`` at each call."""
    it = itertools.cycle(weights)
    return lambda: call(next(it))


def _measure(shape: Tuple[int, int, int]) -> Int8Speed:
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    ws = [torch.randn(n, k, generator=g) * 0.05 for _ in range(WEIGHT_COPIES)]
    b = torch.randn(n, generator=g)
    sw = (ws[0].abs().amax(1) / 127).clamp_min(1e-12)
    wqs = [torch.round(w / sw[:, None]).clamp_(-127, 127).to(torch.int8).t().contiguous() for w in ws]
    runs = {"fp32": _cycling(lambda w: F.linear(x, w, b), ws)}
    note = ""
    if int_mm_exact():
        runs["int_mm"] = _cycling(lambda wq: int8_gemm.int8_linear(x, wq, sw, b, None), wqs)
    else:
        note = INEXACT_NOTE
    if int8_gemm.vnni_available():
        # what the model runs: quantize, GEMM and dequantize in one call
        linears = [int8_gemm.VnniLinear(int8_gemm.pack_weight_vnni(wq), k, n, sw, b) for wq in wqs]
        runs["vnni"] = _cycling(lambda lin: lin.linear(x, None, x.dtype), linears)
    if int8_gemm.avx2_available():
        packed2 = [int8_gemm.pack_weight_avx2(wq) for wq in wqs]
        runs["avx2"] = _cycling(lambda p: int8_gemm.int8_linear_avx2(x, p, n, sw, b, None), packed2)
    times: Dict[str, list] = {name: [] for name in runs}
    active = list(runs)
    start = time.perf_counter()
    with torch.no_grad():
        for name in runs:  # warm-up: oneDNN's first call builds its kernel
            runs[name]()
        for _ in range(MAX_ROUNDS):
            for name in active:  # interleaved: the machine's load falls on all alike
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
            # a slow int8 path (torch's plain loop without VNNI): one call says so, no need to repeat it
            active = [a for a in active if a == "fp32" or times[a][-1] <= CLEARLY_SLOWER * times["fp32"][-1]]
            if len(active) == 1 or (time.perf_counter() - start > MAX_SECONDS and len(times["fp32"]) >= 3):
                break
    work = 2.0 * m * k * n / 1e12
    rates = {name: work / statistics.median(t) for name, t in times.items() if name != "fp32"}
    best = max(rates, key=rates.get) if rates else "none"
    return Int8Speed(
        int8_tops=rates.get(best, 0.0),
        fp32_tflops=work / statistics.median(times["fp32"]),
        shape=shape,
        threads=torch.get_num_threads(),
        rounds=len(times["fp32"]),
        backend=best,
        rates=rates,
        note=note,
    )


def check() -> Int8Speed:
    """The measured int8 and fp32 rates at SHAPE with torch's current thread count (cached per
    process and thread count). RuntimeError where this torch has no CPU int8 GEMM at all."""
    threads = torch.get_num_threads()
    got = _CACHE.get(threads)
    if got is None:
        if not int8_available():
            raise RuntimeError("int8 needs torch._int_mm on the CPU, which this torch build lacks")
        got = _CACHE[threads] = _measure(SHAPE)
    return got


def require_faster() -> Int8Speed:
    """check(), raising Int8SpeedError (with both measured rates) where int8 is not faster than fp32."""
    speed = check()
    if speed.backend == "none":
        raise Int8SpeedError(
            f"int8 cannot run correctly on this CPU: {speed.describe()}. int8 was not applied. Use float32 with "
            "freeze=True here (bert_fast.optimize(model, freeze=True)), or bf16 on a CPU with bf16 units."
        )
    if not speed.faster:
        raise Int8SpeedError(
            f"int8 would be slower than float32 on this CPU: {speed.describe()}. int8 was not applied. "
            "(torch's int8 GEMM is fast only with AVX-512 VNNI or AMX-INT8; bert_fast's own needs AVX2.) Use "
            "float32 with freeze=True here (bert_fast.optimize(model, freeze=True)), or bf16 on a CPU with bf16 units."
        )
    return speed


INEXACT_NOTE = (
    "torch._int_mm left out: its int32 sums are wrong here (int16 saturation of oneDNN's kernel for CPUs without VNNI)"
)
_EXACT: Dict[str, bool] = {}


def int_mm_exact() -> bool:
    """torch._int_mm gives exact int32 sums on this CPU for full-range int8 (the module docstring, "Why an
    exactness check"): a 32 x 256 by 256 x 64 product of +-127 patterns and random values, against int64
    sums. Cached per process (~1 ms once)."""
    got = _EXACT.get("int_mm")
    if got is None:
        got = False
        try:
            g = torch.Generator().manual_seed(0)
            a = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=g)
            b = torch.randint(-127, 128, (256, 64), dtype=torch.int8, generator=g)
            a[:8] = 127  # the largest pair sums: 2 x 255 x 127 in a u8 x s8 kernel's int16
            a[8:16] = -127
            b[:, :8] = 127
            b[:, 8:16] = -127
            got = bool(torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()))
        except Exception:  # noqa: BLE001 - no int8 op at all: not exact either
            got = False
        _EXACT["int_mm"] = got
    return got


def int8_available() -> bool:
    """torch._int_mm runs on the CPU in this torch build (it gives 32 for a 17x32 by 32x8 product of ones)."""
    try:
        a = torch.ones(17, 32, dtype=torch.int8)
        return bool(torch._int_mm(a, torch.ones(32, 8, dtype=torch.int8))[0, 0] == 32)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False
