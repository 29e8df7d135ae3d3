"""Bounded time: what a benchmark case will cost, estimated before it runs, and an ETA while it runs.

A case's cost is estimated from its FLOPs and the GEMM rate measured at the start of the run
(bert_fast.bench.ceilings), counting the calls it cannot do without: per provider one first call
(compile, autotune, parity), the warm-up rounds and the minimum timed rounds, plus a fixed cost
for providers that compile or export first. A case whose minimum cost exceeds the budget
(``--max-minutes``) is skipped with a message saying what it would cost, instead of running for
an hour on a CPU with no output. The estimate is deliberately pessimistic: every provider is
charged the padded FLOPs (B x S tokens), at half the measured GEMM rate (``MODEL_EFFICIENCY``: a
whole forward also runs attention, LayerNorm, GELU and framework overhead, which are not GEMMs).

While cases run, ``Progress`` prints one line per case and, at most every few seconds, the round
count and an ETA for the rest of the run: the remaining estimates, scaled by how the finished
cases compared with theirs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

MODEL_EFFICIENCY = 0.5
# Seconds a provider spends before its first timed call, beyond its FLOPs: torch.compile's
# Inductor compiles C++ (CPU) or Triton (GPU) per shape; the ONNX Runtime provider exports and
# optimizes the model once per model (the first case of a model pays it).
FIXED_SECONDS: Dict[str, Dict[str, float]] = {
    "hf-compile": {"cpu": 120.0, "cuda": 60.0},
    "onnxruntime": {"cpu": 30.0, "cuda": 30.0},
    "onnxruntime-int8": {"cpu": 30.0},  # quantize_dynamic of the optimized graph (once per model)
    "openvino": {"cpu": 20.0},  # convert_model (once per model) and compile_model
    "openvino-f32": {"cpu": 5.0},
    # optimize(int8=True): its speed check (~2 s, once per process) and the calibration forwards of
    # the shipped sentences with and without int8 (once per model: ~3 s MiniLM, ~10 s bert-base on 2 cores)
    "bert_fast-int8": {"cpu": 10.0},
}


@dataclass
class Estimate:
    call_s: float  # one call of one provider
    fixed_s: float  # compile / export before the first call
    min_s: float  # what the case costs at the least: first calls, warm-up, min rounds
    expected_s: float  # with the rounds the budget allows
    calls: int  # calls counted in min_s

    def describe(self, n_providers: int, rate_tflops: float) -> str:
        fixed = f", plus ~{fmt_duration(self.fixed_s)} of compile/export" if self.fixed_s else ""
        return (
            f"{fmt_duration(self.min_s)} at least ({n_providers} provider(s) x {self.calls // max(1, n_providers)} "
            f"calls of ~{fmt_duration(self.call_s)} each at {MODEL_EFFICIENCY:g} x the measured "
            f"{rate_tflops * 1e3:.0f} GFLOP/s{fixed})"
        )


def fmt_duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def estimate_case(
    providers: Sequence[str],
    flops_per_call: float,
    rate_tflops: Optional[float],
    device_type: str,
    *,
    warmup: int,
    min_rounds: int,
    max_rounds: int,
    max_seconds: Optional[float],
    paid: Sequence[str] = (),
) -> Optional[Estimate]:
    """None without a measured rate (nothing to estimate from). ``paid``: providers whose fixed
    cost (export, conversion: once per model and process) an earlier case already paid."""
    if not rate_tflops or rate_tflops <= 0:
        return None
    call = flops_per_call / (MODEL_EFFICIENCY * rate_tflops * 1e12)
    return estimate_calls(
        providers,
        call,
        device_type,
        warmup=warmup,
        min_rounds=min_rounds,
        max_rounds=max_rounds,
        max_seconds=max_seconds,
        paid=paid,
    )


def estimate_op_case(case, providers: Sequence[str], ceilings: Dict, device_type: str, **kw) -> Optional[Estimate]:
    """An OpCase's estimate: the slower of its FLOPs at the GEMM rate and its bytes at the copy
    bandwidth (each at MODEL_EFFICIENCY of the ceiling)."""
    times = []
    if case.flops and ceilings.get("matmul_tflops"):
        times.append(case.flops / (MODEL_EFFICIENCY * ceilings["matmul_tflops"] * 1e12))
    if case.bytes and ceilings.get("copy_bandwidth_gbs"):
        times.append(case.bytes / (MODEL_EFFICIENCY * ceilings["copy_bandwidth_gbs"] * 1e9))
    if not times:
        return None
    fixed_names = ["hf-compile" if "compile" in p else p for p in providers]  # torch.compile providers
    return estimate_calls(fixed_names, max(times), device_type, **kw)


def estimate_calls(
    providers: Sequence[str],
    call: float,
    device_type: str,
    *,
    warmup: int,
    min_rounds: int,
    max_rounds: int,
    max_seconds: Optional[float],
    paid: Sequence[str] = (),
) -> Estimate:
    p = len(providers)
    fixed = sum(FIXED_SECONDS.get(name, {}).get(device_type, 0.0) for name in providers if name not in paid)
    calls = p * (1 + warmup + min_rounds)
    min_s = fixed + calls * call
    round_s = p * call
    rounds_s = min_rounds * round_s
    if max_seconds is not None:
        rounds_s = max(rounds_s, min(max_seconds, max_rounds * round_s))
    expected = fixed + p * (1 + warmup) * call + rounds_s
    return Estimate(call_s=call, fixed_s=fixed, min_s=min_s, expected_s=expected, calls=calls)


class Progress:
    """One line per case and a throttled round/ETA line on stderr (nothing when disabled)."""

    def __init__(
        self,
        estimates: List[Optional[float]],
        enabled: bool = True,
        every_s: float = 5.0,
        stream=None,
        clock=time.monotonic,
    ):
        self.estimates = [e or 0.0 for e in estimates]
        self.enabled = enabled
        self.every_s = every_s
        self.stream = stream or sys.stderr
        self.clock = clock
        self.done_est = 0.0  # estimates of the finished cases
        self.done_real = 0.0  # their real durations
        self.case = -1
        self.t_case = self.t_last = clock()

    def _scale(self) -> float:
        # how the finished cases compared with their estimates (1 until one has finished)
        return self.done_real / self.done_est if self.done_est > 0 and self.done_real > 0 else 1.0

    def eta(self, elapsed_in_case: float = 0.0) -> float:
        rest = sum(self.estimates[self.case + 1 :]) if self.case >= 0 else sum(self.estimates)
        cur = self.estimates[self.case] if 0 <= self.case < len(self.estimates) else 0.0
        return max(0.0, self._scale() * (rest + cur) - elapsed_in_case)

    def _print(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def start_case(self, index: int, label: str) -> None:
        self.case = index
        self.t_case = self.t_last = self.clock()
        est = self.estimates[index] if index < len(self.estimates) else 0.0
        self._print(
            f"[{index + 1}/{len(self.estimates)}] {label}: estimated {fmt_duration(self._scale() * est)}"
            f", ETA for the run {fmt_duration(self.eta())}"
        )

    def on_round(self, rounds: int) -> None:
        now = self.clock()
        if now - self.t_last < self.every_s:
            return
        self.t_last = now
        elapsed = now - self.t_case
        self._print(
            f"    round {rounds}, {fmt_duration(elapsed)} into this case, "
            f"ETA for the run {fmt_duration(self.eta(elapsed))}"
        )

    def end_case(self, skipped: bool = False) -> None:
        if 0 <= self.case < len(self.estimates) and not skipped:
            self.done_est += self.estimates[self.case]
            self.done_real += self.clock() - self.t_case
