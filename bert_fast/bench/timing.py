"""Timing with stated precision, shared by ``bert-fast bench``, ``bert-fast bench-ops``, the
ceilings and the pytest-benchmark suites in benchmarks/.

A shared machine drifts (other jobs, clocks, thermals): one provider timed for a minute and then
the next for a minute see different machines, and a ratio of those times says little. So:

* **Interleaved rounds.** ``measure()`` takes every provider of a comparison at once. One round
  calls every provider once, in orders from a Williams design (``round_orders``): over a cycle of P
  rounds (2P for odd P) every provider runs first equally often and follows every other provider
  equally often, so drift and any "who ran just before me" effect (a rival's thread pool still
  spinning after its call) hit all providers alike. (A plain rotation, used before, keeps each
  provider's predecessor fixed: one provider always paid for the same neighbour.)
* **Warm-up first** (Triton autotuning, torch.compile, cuDNN/cuBLAS heuristics, caches, lazy
  allocation happen there), in rounds too.
* **Repeat until precise.** After ``min_rounds`` rounds, and after every round from then on, the
  95% confidence interval of each provider's median is computed; rounds stop when every interval
  is within ``target`` (default +-3%) of its median, when the time budget ``budget_s`` is spent,
  or at ``max_rounds``.
* **The interval of a median** is distribution-free: the order-statistic (binomial) interval
  [x_(l), x_(n+1-l)], with l the largest rank such that P(Bin(n, 1/2) <= l-1) <= 2.5%. It assumes
  only that rounds are independent draws; its exact coverage is reported as ``ci_level`` (>= 95%
  from n = 6 rounds on; below that no order-statistic interval reaches 95%, and the interval is
  [min, max] with its lower level stated).
* **The interval of a speedup** (a ratio of medians, ``speedup()``) is a percentile bootstrap that
  resamples whole rounds (2000 resamples, fixed seed), so each round's pair of times stays
  together and what drift a round shared cancels in the ratio.
* **Flags.** ``converged``: the interval is within the target. ``unstable``: the interval is
  wider than +-10% (``UNSTABLE_REL``) of the median; tables, JSON and plots say so.
* Reported per provider: median, p20, p80, the interval (ci_low_ms, ci_high_ms, ci_rel = its
  larger half-width over the median), rounds, mean, min, max.
* **Threads** are fixed by ``fix_threads()`` (torch.set_num_threads) and reported with the figures:
  a CPU figure without its thread count cannot be compared with anything.

The clock is injectable: a ``Timer`` turns one round of calls into one time per call.
``PerfCounterTimer`` (CPU) times each call with time.perf_counter. ``CudaEventTimer`` (GPU)
records a CUDA event pair around each call on the current stream and synchronizes once per round,
so the host does not stall the GPU between the calls of a round; the optional L2 flush (a write
over a buffer larger than any L2 of today's GPUs) happens before each call, outside its events.
Tests pass a synthetic timer and clock to check the stopping rule and the flags in milliseconds.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

_L2_FLUSH_BYTES = 256 * 1024 * 1024  # H100 has 50 MB of L2, H200 the same, B200 126 MB
_flush_buffers: dict = {}

CONFIDENCE = 0.95
TARGET_REL = 0.03  # stop when every median's interval is within +-3%
UNSTABLE_REL = 0.10  # flag a figure whose interval is wider than +-10%
MIN_ROUNDS = 6  # the fewest rounds whose order-statistic interval reaches 95% (96.9%)
BOOTSTRAP_RESAMPLES = 2000


class ProviderUnavailable(Exception):
    """Raised by a provider (its factory or its first call) that cannot run on this device or
    build, e.g. an SDPA backend this GPU or the CPU lacks. The benchmarks skip it with the
    message as a one-line reason, instead of failing the command."""


# ----------------------------------------------------------------------------- statistics
def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_vals:
        return float("nan")
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return float(sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo))


def _binom_half_cdf(n: int, k: int) -> float:
    """P(Bin(n, 1/2) <= k)."""
    if k < 0:
        return 0.0
    if n > 1000:  # normal approximation with continuity correction (exact sums get slow)
        return 0.5 * (1.0 + math.erf((k + 0.5 - n / 2) / math.sqrt(n / 4) / math.sqrt(2.0)))
    return sum(math.comb(n, i) for i in range(k + 1)) / 2**n


def median_ci(values: Sequence[float], confidence: float = CONFIDENCE):
    """(low, high, level): the distribution-free order-statistic interval of the median.

    With x sorted, the interval [x_(l), x_(n+1-l)] covers the true median with probability
    1 - 2 P(Bin(n, 1/2) <= l-1); l is the largest rank keeping that >= ``confidence``. With too
    few values for any such l (n < 6 at 95%) the interval is [min, max] and ``level`` says how much
    less than ``confidence`` it covers.
    """
    vals = sorted(float(v) for v in values)
    n = len(vals)
    if n == 0:
        return float("nan"), float("nan"), 0.0
    tail = (1.0 - confidence) / 2.0
    l = 0
    while l < n // 2 and _binom_half_cdf(n, l) <= tail:
        l += 1
    l = max(l, 1)
    level = 1.0 - 2.0 * _binom_half_cdf(n, l - 1)
    return vals[l - 1], vals[n - l], level


def ci_rel(median: float, low: float, high: float) -> float:
    """The larger half-width of [low, high] over the median (0.03 = +-3%)."""
    if not median or median != median:
        return float("inf")
    return max(median - low, high - median) / abs(median)


def summarize(times_ms: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    vals = sorted(float(t) for t in times_ms)
    if not vals:
        raise ValueError("no timings to summarize")
    med = _percentile(vals, 50)
    lo, hi, level = median_ci(vals, confidence)
    return {
        "median_ms": med,
        "p20_ms": _percentile(vals, 20),
        "p80_ms": _percentile(vals, 80),
        "mean_ms": sum(vals) / len(vals),
        "min_ms": vals[0],
        "max_ms": vals[-1],
        "ci_low_ms": lo,
        "ci_high_ms": hi,
        "ci_level": level,
        "ci_rel": ci_rel(med, lo, hi),
    }


# A timed provider's median and its interval, the figures every benchmark suite reports
# (benchmarks/model/bench_model.py, benchmarks/ops/bench_ops.py).
INTERVAL_FIELDS = ("median_ms", "p20_ms", "p80_ms", "ci_low_ms", "ci_high_ms", "ci_rel", "unstable")


@dataclass
class Timing:
    """The figures of one timed provider. Times are milliseconds per call."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    ci_low_ms: float  # 95% interval of the median (see median_ci)
    ci_high_ms: float
    ci_level: float  # its exact coverage (>= 0.95 from 6 rounds on)
    ci_rel: float  # larger half-width / median
    iters: int  # timed calls = rounds
    warmup: int
    n_inputs: int
    method: str  # "cuda_event", "perf_counter" or a test timer's name
    l2_flush: bool
    peak_mem_bytes: Optional[int]  # None on the CPU
    converged: bool = False  # ci_rel <= the target
    unstable: bool = False  # ci_rel > UNSTABLE_REL
    threads: Optional[int] = None  # torch.get_num_threads() while measured

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Speedup:
    """How many times faster ``subject`` is than ``baseline``: median(baseline) / median(subject)."""

    value: float
    ci_low: float
    ci_high: float
    ci_rel: float
    unstable: bool
    rounds: int

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        text = f"{self.value:.2f}x ({self.ci_low:.2f}-{self.ci_high:.2f})"
        return text + (" unstable" if self.unstable else "")


def paired_speedup(
    baseline_ms: Sequence[float],
    subject_ms: Sequence[float],
    *,
    confidence: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Speedup:
    """Ratio of medians with a percentile-bootstrap interval over paired rounds (index i of both
    sequences is one round)."""
    import numpy as np

    a = np.asarray(baseline_ms, dtype=np.float64)
    b = np.asarray(subject_ms, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"paired_speedup needs two equally long, non-empty series, got {a.size} and {b.size}")
    value = float(np.median(a) / np.median(b))
    if a.size == 1:
        lo = hi = value
    else:
        idx = np.random.default_rng(seed).integers(0, a.size, size=(resamples, a.size))
        ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
        tail = (1.0 - confidence) / 2.0
        lo, hi = (float(v) for v in np.quantile(ratios, [tail, 1.0 - tail]))
    rel = ci_rel(value, lo, hi)
    return Speedup(
        value=value,
        ci_low=lo,
        ci_high=hi,
        ci_rel=rel,
        unstable=bool(rel > UNSTABLE_REL or a.size < MIN_ROUNDS),
        rounds=int(a.size),
    )


# ----------------------------------------------------------------------------- devices
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


def allocated_memory(device: torch.device) -> Optional[int]:
    device = torch.device(device)
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None


def _indexed(device: torch.device) -> torch.device:
    """cuda -> cuda:<current> (one key per GPU for the flush buffers)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def synchronize(device: torch.device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fix_threads(threads: Optional[int] = None) -> int:
    """Set torch's intra-op thread count (to ``threads``, or to its current value, so that nothing
    later changes it silently) and return it. Every CPU figure is reported with this number."""
    n = int(threads) if threads else torch.get_num_threads()
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return torch.get_num_threads()


# ----------------------------------------------------------------------------- timers
class PerfCounterTimer:
    """Host wall time of each call (the CPU timer; on a GPU it would include a synchronize)."""

    method = "perf_counter"

    def __init__(self, device="cpu"):
        self.device = torch.device(device)

    def time_round(self, calls: Sequence[Callable[[], Any]]) -> List[float]:
        out = []
        for call in calls:
            t0 = time.perf_counter()
            call()
            synchronize(self.device)
            out.append((time.perf_counter() - t0) * 1e3)
        return out


class CudaEventTimer:
    """GPU time of each call from a CUDA event pair on the current stream of ``device``; one
    synchronize per round, after the round's last call (the host queues a whole round ahead)."""

    method = "cuda_event"

    def __init__(self, device, flush_l2: bool = False):
        self.device = torch.device(device)
        self.flush_l2 = flush_l2

    def time_round(self, calls: Sequence[Callable[[], Any]]) -> List[float]:
        # Events on the stream the callables are queued on: the current stream of ``device``
        # (Event.record() without a stream would use the current *device's* stream).
        stream = torch.cuda.current_stream(self.device)
        events = []
        for call in calls:
            if self.flush_l2:
                _flush_l2(self.device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            call()
            end.record(stream)
            events.append((start, end))
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) for s, e in events]


def default_timer(device, flush_l2: bool = False):
    device = torch.device(device)
    if device.type == "cuda":
        return CudaEventTimer(device, flush_l2=flush_l2)
    return PerfCounterTimer(device)


# ----------------------------------------------------------------------------- measure
@dataclass
class Measurement:
    """What ``measure()`` found. ``rounds[i]`` maps provider -> ms of round i (a provider that
    failed or was skipped is absent from the rounds after that)."""

    timings: Dict[str, Timing] = field(default_factory=dict)
    rounds: List[Dict[str, float]] = field(default_factory=list)
    errors: Dict[str, BaseException] = field(default_factory=dict)  # real failures
    skipped: Dict[str, str] = field(default_factory=dict)  # ProviderUnavailable reasons
    stop_reason: str = ""  # "converged", "budget", "max_rounds"
    seconds: float = 0.0  # wall time of warm-up + rounds
    threads: Optional[int] = None

    def samples(self, name: str) -> List[float]:
        return [r[name] for r in self.rounds if name in r]

    def speedup(self, subject: str, baseline: str, **kw) -> Optional[Speedup]:
        """Speedup of ``subject`` over ``baseline`` (> 1: subject is faster), over the rounds in
        which both ran; None when either has no timing."""
        pairs = [(r[baseline], r[subject]) for r in self.rounds if baseline in r and subject in r]
        if not pairs:
            return None
        return paired_speedup([p[0] for p in pairs], [p[1] for p in pairs], **kw)

    def summary(self, **extra) -> Dict[str, Any]:
        """How the rounds went (a case's "timing" entry in the results): rounds, why they stopped,
        seconds, threads, then ``extra``."""
        return {
            "rounds": len(self.rounds),
            "stop_reason": self.stop_reason,
            "seconds": self.seconds,
            "threads": self.threads,
            **extra,
        }


def _fns(v) -> List[Callable[[], Any]]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def round_orders(p: int) -> List[List[int]]:
    """The call orders of one cycle of rounds for ``p`` providers: a Williams design. Each order is a
    permutation of range(p); over the cycle every provider is first equally often and every ordered
    pair (a just before b) occurs equally often (once for even p, twice for odd p, whose cycle adds
    the reversed orders)."""
    if p <= 0:
        return [[]]
    base, lo, hi = [0], 1, p - 1
    while len(base) < p:  # 0, 1, p-1, 2, p-2, ...
        base.append(lo)
        lo += 1
        if len(base) < p:
            base.append(hi)
            hi -= 1
    orders = [[(b + r) % p for b in base] for r in range(p)]
    if p % 2:
        orders += [list(reversed(o)) for o in orders]
    return orders


def measure(
    providers: Mapping[str, Any],
    device="cpu",
    *,
    warmup: int = 2,
    min_rounds: int = MIN_ROUNDS,
    max_rounds: int = 200,
    target: float = TARGET_REL,
    budget_s: Optional[float] = None,
    timer=None,
    clock: Callable[[], float] = time.perf_counter,
    flush_l2: bool = False,
    on_round: Optional[Callable[["Measurement", int], None]] = None,
    catch: bool = True,
) -> Measurement:
    """Time ``providers`` side by side in interleaved rounds (see the module docstring).

    providers: name -> a zero-argument callable, or a list of them (one per prepared input set;
      round i calls set i mod len, so caches do not flatter the figures).
    warmup: untimed rounds first. min_rounds / max_rounds: bounds on the timed rounds.
    target: stop once every provider's median interval is within +-target of its median.
    budget_s: stop (after min_rounds) once warm-up plus rounds took this long, by ``clock``;
      a budget spent before min_rounds still stops, with the flags saying what that is worth.
    timer: an object with ``method`` and ``time_round(calls) -> [ms]`` (default: CUDA events on
      a GPU, perf_counter elsewhere).
    on_round: called after each timed round with (measurement so far, rounds done).
    catch: a provider raising is recorded in ``errors`` (``skipped`` for ProviderUnavailable) and
      dropped from the following rounds; the others go on. With catch=False it propagates.
    """
    if not providers:
        raise ValueError("measure needs at least one provider")
    if min_rounds < 1 or max_rounds < 1:
        raise ValueError(f"min_rounds and max_rounds must be >= 1, got {min_rounds} and {max_rounds}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    device = torch.device(device)
    timer = timer or default_timer(device, flush_l2=flush_l2)
    min_rounds = min(min_rounds, max_rounds)
    rounds = _Rounds(providers, device, timer, warmup=warmup, target=target, flush_l2=flush_l2, catch=catch)
    t0 = clock()
    for i in range(warmup):
        if not rounds.live:
            break
        rounds.warm(i)
    stop = rounds.timed_until_stop(min_rounds, max_rounds, budget_s, clock, t0, on_round)
    res = rounds.res
    res.stop_reason = stop if rounds.live else "failed"
    res.seconds = clock() - t0
    rounds.finish()
    return res


class _Rounds:
    """The providers of one ``measure()`` while they run: the input sets of each, those still live
    (a provider that raised is dropped), and the Measurement their rounds fill."""

    def __init__(self, providers, device, timer, *, warmup, target, flush_l2, catch):
        self.fns = {name: _fns(v) for name, v in providers.items()}
        self.live = list(self.fns)
        self.device, self.timer, self.catch = device, timer, catch
        self.warmup, self.target, self.flush_l2 = warmup, target, flush_l2
        self.res = Measurement(threads=torch.get_num_threads())

    def drop(self, name: str, exc: BaseException) -> None:
        if not self.catch or isinstance(exc, KeyboardInterrupt):
            raise exc
        if isinstance(exc, ProviderUnavailable):
            self.res.skipped[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        else:
            self.res.errors[name] = exc
        self.live.remove(name)

    def _order(self, i: int) -> List[str]:
        """The live providers in round ``i``'s order of the Williams design."""
        orders = round_orders(len(self.live))
        return [self.live[j] for j in orders[i % len(orders)]]

    def _call(self, name: str, i: int) -> Callable[[], Any]:
        """The provider's callable of round ``i`` (its input sets in turn)."""
        f = self.fns[name]
        return f[i % len(f)]

    def warm(self, i: int) -> None:
        """One untimed round (warm-up)."""
        for name in self._order(i):
            try:
                self._call(name, i)()
            except Exception as exc:  # noqa: BLE001 - one provider must not lose the others
                self.drop(name, exc)
        synchronize(self.device)

    def timed(self, i: int) -> Dict[str, float]:
        """One timed round: provider -> ms ({} when every provider dropped out)."""
        # Time the round as one batch (one synchronize per round for CUDA events); a provider that
        # raises is dropped and the round is retimed without it.
        order = self._order(i)
        while order:
            calls = [_guarded(name, self._call(name, i)) for name in order]
            try:
                times = self.timer.time_round(calls)
            except _ProviderError as err:
                self.drop(err.name, err.exc)
                order = [n for n in order if n in self.live]
                continue
            return dict(zip(order, (float(t) for t in times)))
        return {}

    def timed_until_stop(self, min_rounds, max_rounds, budget_s, clock, t0, on_round) -> str:
        """Timed rounds until the stopping rule (the module docstring) holds; returns why they
        stopped: "converged", "budget" or "max_rounds"."""
        res = self.res
        n = 0
        while self.live and n < max_rounds:
            times = self.timed(n)
            if times:
                res.rounds.append(times)
            n += 1
            if on_round is not None:
                self.finish()
                on_round(res, n)
            if n >= min_rounds:
                self.finish()
                if res.timings and all(res.timings[p].converged for p in self.live if p in res.timings):
                    return "converged"
            if budget_s is not None and clock() - t0 >= budget_s and n >= min(min_rounds, max_rounds):
                return "budget"
            if budget_s is not None and clock() - t0 >= 4 * budget_s:
                return "budget"  # far over budget (calls much slower than expected): stop early
        return "max_rounds"

    def finish(self) -> None:
        """(Re)compute every provider's Timing from the rounds so far."""
        res, device = self.res, self.device
        for name in self.fns:
            samples = res.samples(name)
            if not samples:
                res.timings.pop(name, None)
                continue
            stats = summarize(samples)
            res.timings[name] = Timing(
                iters=len(samples),
                warmup=self.warmup,
                n_inputs=len(self.fns[name]),
                method=getattr(self.timer, "method", "custom"),
                l2_flush=bool(self.flush_l2 and device.type == "cuda"),
                peak_mem_bytes=None,
                converged=bool(stats["ci_rel"] <= self.target and stats["ci_level"] >= CONFIDENCE - 1e-9),
                unstable=bool(stats["ci_rel"] > UNSTABLE_REL or stats["ci_level"] < CONFIDENCE - 1e-9),
                threads=res.threads,
                **stats,
            )


class _ProviderError(Exception):
    def __init__(self, name: str, exc: BaseException):
        super().__init__(name)
        self.name, self.exc = name, exc


def _guarded(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    def call():
        try:
            return fn()
        except (KeyboardInterrupt, _ProviderError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise _ProviderError(name, exc) from exc

    return call


def method_description(
    device,
    *,
    warmup: int,
    min_rounds: int,
    max_rounds: int,
    target: float,
    budget_s: Optional[float],
    flush_l2: bool = False,
) -> Dict[str, Any]:
    """How the figures of a results file were measured (its "timing" entry)."""
    device = torch.device(device)
    return {
        "clock": "cuda_event" if device.type == "cuda" else "perf_counter",
        "scheme": "providers interleaved in rounds, orders of a Williams design (carry-over balanced), warm-up rounds first",
        "warmup_rounds": warmup,
        "min_rounds": min_rounds,
        "max_rounds": max_rounds,
        "budget_s": budget_s,
        "target_rel": target,
        "unstable_above_rel": UNSTABLE_REL,
        "confidence": CONFIDENCE,
        "l2_flush": bool(flush_l2 and device.type == "cuda"),
        "median_ci": "distribution-free order-statistic (binomial) interval of the median",
        "speedup_ci": f"percentile bootstrap of the ratio of medians over paired rounds "
        f"({BOOTSTRAP_RESAMPLES} resamples)",
        "threads": torch.get_num_threads(),
    }


# ----------------------------------------------------------------------------- one provider
def time_callables(
    fns: Sequence[Callable[[], Any]],
    device,
    *,
    warmup: int = 10,
    iters: int = 50,
    flush_l2: bool = False,
    reset_memory: bool = False,
    progress: Optional[Callable[[int], None]] = None,
    max_seconds: Optional[float] = None,
    timer=None,
    min_rounds: int = MIN_ROUNDS,
    target: float = TARGET_REL,
) -> Timing:
    """One provider alone (``measure`` with a single entry): ``fns`` are its input sets, ``iters``
    the most rounds, ``max_seconds`` the budget. Raises what the callables raise."""
    if not fns:
        raise ValueError("time_callables needs at least one callable")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    device = torch.device(device)
    if reset_memory:
        reset_peak_memory(device)
    cb = (lambda _m, _n: progress(1)) if progress is not None else None
    m = measure(
        {"x": list(fns)},
        device,
        warmup=warmup,
        min_rounds=min(min_rounds, iters),
        max_rounds=iters,
        target=target,
        budget_s=max_seconds,
        timer=timer,
        flush_l2=flush_l2,
        on_round=cb,
        catch=False,
    )
    t = m.timings["x"]
    t.peak_mem_bytes = peak_memory(device)
    return t


def time_factory(
    factory: Callable[[], Callable[[], Any]],
    device,
    *,
    n_inputs: int = 3,
    warmup: int = 10,
    iters: int = 50,
    flush_l2: bool = False,
    progress: Optional[Callable[[int], None]] = None,
    max_seconds: Optional[float] = None,
    timer=None,
) -> Timing:
    """Time an OpCase provider alone: reset the peak-memory counter, call ``factory``
    ``n_inputs`` times (fresh inputs each), then time_callables."""
    if n_inputs < 1:
        raise ValueError(f"n_inputs must be >= 1, got {n_inputs}")
    reset_peak_memory(device)
    fns = [factory() for _ in range(n_inputs)]
    synchronize(device)
    try:
        return time_callables(
            fns,
            device,
            warmup=warmup,
            iters=iters,
            flush_l2=flush_l2,
            progress=progress,
            max_seconds=max_seconds,
            timer=timer,
        )
    finally:
        del fns
