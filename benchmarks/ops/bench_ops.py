"""pytest-benchmark suite of every op over bert_fast.bench.op_cases.<op> (CUDA only).

    pytest benchmarks -o python_files='bench_*.py' -k "ops and attention" --benchmark-json=ops.json

The cases (shapes, providers: bert_fast vs torch eager / torch.compile / SDPA, useful FLOPs and
minimal bytes) are the same ones `bert-fast bench-ops` runs, and so is the timing: one test per
case times all its providers side by side with bert_fast.bench.timing.measure (interleaved
rounds, warm-up first, until each median's 95% interval is within +-3% or CASE_SECONDS is spent),
each provider rotating through INPUT_SETS fresh input sets. The figures are in ``extra_info``
(per provider: median, p20/p80, the interval, the unstable flag, TFLOP/s, GB/s; the speedup of
bert_fast over each with its interval). pytest-benchmark's own statistics time the whole
measurement (one round), not a call. A provider that cannot run here (a pinned SDPA backend this
GPU lacks) is listed in extra_info["skipped"] with its reason.
"""

import os

import pytest
import torch

from bert_fast.bench.ops_bench import discover_modules
from bert_fast.bench.timing import INTERVAL_FIELDS, ProviderUnavailable, measure

INPUT_SETS = 3
DTYPE = torch.bfloat16
CASE_SECONDS = float(os.environ.get("BERT_FAST_BENCH_CASE_SECONDS", "2"))

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _params():
    if not torch.cuda.is_available():
        return []
    modules, errors = discover_modules()
    if errors:
        raise ImportError(f"op case modules failed to import: {errors}")
    return [
        pytest.param(case, id=case.name)
        for module in modules.values()
        for case in module.cases(torch.device("cuda"), DTYPE)
    ]


def measure_case(case, device, budget_s=CASE_SECONDS, timer=None, warmup=5):
    """{"providers": {name: figures}, "speedups": {...}, "skipped": {...}, "errors": {...}}."""
    fns, skipped, errors = {}, dict(case.unavailable), {}
    for provider, factory in case.providers.items():
        if provider in skipped:
            continue
        try:
            sets = [factory() for _ in range(INPUT_SETS)]
            sets[0]()  # compile / autotune before the warm-up rounds
            fns[provider] = sets
        except ProviderUnavailable as exc:
            skipped[provider] = str(exc).splitlines()[0]
        except RuntimeError as exc:  # a provider that breaks here must not hide the others
            errors[provider] = f"{type(exc).__name__}: {exc}"[:500]
    out = {"providers": {}, "speedups": {}, "skipped": skipped, "errors": errors}
    if not fns:
        return out
    m = measure(fns, device, warmup=warmup, min_rounds=10, max_rounds=500, budget_s=budget_s, timer=timer)
    skipped.update(m.skipped)
    errors.update({p: f"{type(e).__name__}: {e}"[:500] for p, e in m.errors.items()})
    for provider, t in m.timings.items():
        if provider in errors or provider in skipped:
            continue
        sec = t.median_ms * 1e-3
        out["providers"][provider] = {
            **{k: getattr(t, k) for k in (*INTERVAL_FIELDS, "iters", "method")},
            "TFLOP/s": case.flops / sec / 1e12 if case.flops else None,
            "GB/s": case.bytes / sec / 1e9 if case.bytes else None,
        }
        if provider != "bert_fast" and "bert_fast" in m.timings:
            sp = m.speedup("bert_fast", provider)
            out["speedups"][provider] = sp.to_dict() if sp is not None else None
    out["rounds"], out["stop_reason"] = len(m.rounds), m.stop_reason
    return out


@pytest.mark.parametrize("case", _params())
def test_op(benchmark, case):
    device = torch.device("cuda")
    result = {}

    def run():
        result.update(measure_case(case, device))
        torch.cuda.empty_cache()

    benchmark.group = case.op
    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    if result.get("errors"):
        pytest.fail(f"{case.name}: {result['errors']}")
    benchmark.extra_info.update(
        {
            "op": case.op,
            "direction": case.direction,
            "bound": case.bound,
            "device": torch.cuda.get_device_name(),
            **case.params,
            **result,
        }
    )
