"""Bounded time: what a benchmark case will cost, estimated before it runs, and an ETA while it runs.

A case's cost is estimated from its FLOPs and GEMM rates measured at the start of the run
(bert_fast.bench.ceilings), counting the calls it cannot do without: per provider one first call
(compile, autotune, parity), the warm-up rounds and the timed rounds, plus a fixed cost for
providers that compile, export or calibrate first. A case whose minimum cost exceeds the budget
(``--max-minutes``) is skipped with a message saying what it would cost, instead of running for an
hour on a CPU with no output.

Each provider's call is charged at the rate of the GEMM it mostly runs (``provider_gemm_kind``): on
a CPU, fp32 through F.linear (bert_fast, transformers), fp32 through a prepacked oneDNN-class GEMM
(bert_fast-frozen, ONNX Runtime, OpenVINO f32), bf16, int8 (the int8 providers), each measured at
a BERT FFN shape (``ceilings.gemm_rates``); bert_fast's providers skip padding and are charged the
real tokens' FLOPs, the others the padded ones. The first estimate of the main job on a Zen 5 was
2.5x too long when every provider was charged the padded FLOPs at half the fp32 rate: int8 and
packed fp32 run 2-5x faster than F.linear's fp32 there. ``MODEL_EFFICIENCY`` (of the kind's rate,
for what a forward runs besides GEMMs) and ``TYPICAL_ROUNDS`` (how many interleaved rounds the
timing takes to converge to +-3% when the budget does not stop it first) were read off that run's
per-case records (benchmarks/notes/2026-11-27-cpu-inference-32.md, "The bench's time estimate").

While cases run, ``Progress`` prints one line per case and, at most every few seconds, the round
count and an ETA for the rest of the run: the remaining estimates, scaled by how the finished
cases compared with theirs.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

MODEL_EFFICIENCY = 0.8
TYPICAL_ROUNDS = 30
# Seconds a provider spends before its first timed call, beyond its FLOPs, as (fixed, per million
# parameters): torch.compile's Inductor compiles C++ (CPU) or Triton (GPU) per shape; ONNX Runtime
# exports and optimizes the model, quantizes it (int8), OpenVINO converts and compiles it, bert_fast
# int8 runs its speed check (~2 s, once per process) and calibration forwards: once per model (the
# first case of a model pays it). The CPU figures: build_seconds of bert-base (110 M) and MiniLM
# (22 M) in the main job on a 2-core Zen 4 (2026-11-28), each provider in its own process, the
# exports shared between them (ONNX Runtime int8 quantizes the fp32 export; OpenVINO f32 and int8
# compile and quantize the one conversion; NNCF's quantization is the slowest build).
FIXED_SECONDS: Dict[str, Dict[str, Tuple[float, float]]] = {
    "hf-compile": {"cpu": (120.0, 0.0), "cuda": (60.0, 0.0)},
    "onnxruntime": {"cpu": (2.0, 0.24), "cuda": (30.0, 0.0)},
    "onnxruntime-int8": {"cpu": (1.0, 0.11)},
    "openvino": {"cpu": (1.5, 0.05)},
    "openvino-f32": {"cpu": (1.0, 0.035)},
    "openvino-int8": {"cpu": (2.0, 0.3)},
    "bert_fast-int8": {"cpu": (0.5, 0.07)},
}

# The GEMM a provider mostly runs on a CPU, per case precision (provider_gemm_kind)
_PACKED_FP32 = ("bert_fast-frozen", "onnxruntime", "openvino-f32")
_INT8 = ("bert_fast-int8", "onnxruntime-int8", "openvino-int8")


def fixed_seconds(provider: str, device_type: str, params_millions: float = 110.0) -> float:
    base, per_m = FIXED_SECONDS.get(provider, {}).get(device_type, (0.0, 0.0))
    return base + per_m * params_millions


def provider_gemm_kind(provider: str, case_dtype: str, bf16_units: bool) -> str:
    """The ceilings.gemm_kernels kind whose rate a provider's CPU call is charged at."""
    if provider in _INT8:
        return "int8"
    if provider == "openvino":  # its default inference precision: bf16 where the CPU has bf16 units
        return "bf16_packed" if bf16_units else "fp32_packed"
    if provider in ("onnxruntime", "openvino-f32"):  # fp32 whatever the case's precision
        return "fp32_packed"
    if provider == "bert_fast-frozen":
        return "bf16_packed" if case_dtype == "bf16" else "fp32_packed"
    return "bf16" if case_dtype == "bf16" else "fp32"


def kind_rate(rates: Dict[str, Optional[float]], kind: str) -> Optional[float]:
    """The measured rate of ``kind``, else the nearest one measured: a packed kind falls back to its
    plain precision, int8 to 1.5x packed fp32 (what the AVX2 int8 GEMM gives without _int_mm)."""
    got = rates.get(kind)
    if got:
        return got
    if kind == "int8":
        base = kind_rate(rates, "fp32_packed")
        return None if base is None else 1.5 * base
    if kind.endswith("_packed"):
        return kind_rate(rates, kind[: -len("_packed")])
    if kind == "bf16":
        return rates.get("fp32")
    return None


def provider_call_seconds(
    providers: Sequence[str],
    padded_flops: float,
    real_flops: float,
    rates: Dict[str, Optional[float]],
    device_type: str,
    case_dtype: str,
    bf16_units: bool = False,
) -> Optional[Dict[str, float]]:
    """{provider: seconds of one call}, or None without a measured rate. On a GPU every provider is
    charged the case precision's rate ("fp32" or "bf16" of ``rates``)."""
    out = {}
    for p in providers:
        kind = provider_gemm_kind(p, case_dtype, bf16_units) if device_type == "cpu" else case_dtype
        rate = kind_rate(rates, kind)
        if not rate or rate <= 0:
            return None
        flops = real_flops if p.startswith("bert_fast") else padded_flops
        out[p] = flops / (MODEL_EFFICIENCY * rate * 1e12)
    return out


@dataclass
class Estimate:
    call_s: float  # one call of one provider (the slowest provider's)
    fixed_s: float  # compile / export before the first call
    min_s: float  # what the case costs at the least: first calls, warm-up, min rounds
    expected_s: float  # with the rounds the timing typically takes, within the budget
    calls: int  # calls counted in min_s
    round_s: float = 0.0  # one timed round of every provider

    def describe(self, n_providers: int, rate_tflops: float) -> str:
        fixed = f", plus ~{fmt_duration(self.fixed_s)} of compile/export" if self.fixed_s else ""
        return (
            f"{fmt_duration(self.min_s)} at least ({n_providers} provider(s) x {self.calls // max(1, n_providers)} "
            f"calls of up to ~{fmt_duration(self.call_s)} each at {MODEL_EFFICIENCY:g} x the measured GEMM "
            f"rates ({rate_tflops * 1e3:.0f} GFLOP/s in the case's precision){fixed})"
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
    real_flops: Optional[float] = None,
    rates: Optional[Dict[str, Optional[float]]] = None,
    case_dtype: str = "fp32",
    bf16_units: bool = False,
    **rounds,
) -> Optional[Estimate]:
    """None without a measured rate (nothing to estimate from). ``flops_per_call``: the padded
    FLOPs; ``real_flops``: the real tokens' (bert_fast's providers skip padding; default: padded);
    ``rates``: measured rates per GEMM kind (default: ``rate_tflops`` for the case's precision);
    ``rounds``: the keywords of estimate_calls (warmup, min_rounds, max_rounds, max_seconds; paid,
    params_millions, burst)."""
    if not rate_tflops or rate_tflops <= 0:
        return None
    all_rates = {case_dtype: rate_tflops, **{k: v for k, v in (rates or {}).items() if v}}
    calls = provider_call_seconds(
        providers,
        flops_per_call,
        flops_per_call if real_flops is None else real_flops,
        all_rates,
        device_type,
        case_dtype,
        bf16_units,
    )
    if calls is None:
        return None
    return estimate_calls(providers, calls, device_type, **rounds)


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
    call: Union[float, Dict[str, float]],
    device_type: str,
    *,
    warmup: int,
    min_rounds: int,
    max_rounds: int,
    max_seconds: Optional[float],
    paid: Sequence[str] = (),
    params_millions: float = 110.0,
    burst: Optional[Tuple[float, int]] = None,
) -> Estimate:
    """``call``: seconds of one call, the same for every provider or per provider. The timed rounds:
    at least ``min_rounds``, then until the medians converge (``TYPICAL_ROUNDS``), ``max_rounds`` or
    ``max_seconds`` stop them (bert_fast.bench.timing.measure). ``paid``: providers whose fixed cost
    (export, conversion, calibration: once per model and process) an earlier case already paid;
    ``burst``: (lead_below_s, calls) of a solo worker's round (bert_fast.bench.hosts: a call shorter
    than lead_below_s is followed by ``calls`` more)."""
    per = {p: (call[p] if isinstance(call, dict) else call) for p in providers}
    fixed = sum(fixed_seconds(name, device_type, params_millions) for name in providers if name not in paid)
    first_s = sum(per.values())  # the untimed first call of each provider
    per_round = {p: (1 + burst[1] if burst and c < burst[0] else 1) for p, c in per.items()}
    round_s = sum(c * per_round[p] for p, c in per.items())
    calls = len(providers) + (warmup + min_rounds) * sum(per_round.values())
    min_s = fixed + first_s + (warmup + min_rounds) * round_s
    typical = min(max_rounds, max(min_rounds, TYPICAL_ROUNDS)) * round_s
    rounds_s = max(min_rounds * round_s, typical if max_seconds is None else min(max_seconds, typical))
    expected = fixed + first_s + warmup * round_s + rounds_s
    return Estimate(
        call_s=max(per.values(), default=0.0),
        fixed_s=fixed,
        min_s=min_s,
        expected_s=expected,
        calls=calls,
        round_s=round_s,
    )


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
