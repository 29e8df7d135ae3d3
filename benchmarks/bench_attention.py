"""pytest-benchmark suite of attention over bert_fast.bench.op_cases.attention (CUDA only).

    pytest benchmarks -o python_files='bench_*.py' -k attention --benchmark-json=benchmarks/results/attention.json

Each round runs CALLS_PER_ROUND calls (rotating through 3 fresh input sets) and synchronises once;
extra_info holds the per-call time and TFLOP/s on real tokens (see the op_cases module for what is
counted). A provider the installed torch cannot run (an SDPA backend missing on this GPU) is skipped.
"""
import itertools

import pytest
import torch

from bert_fast.bench.op_cases.attention import cases

CALLS_PER_ROUND = 10
DTYPE = torch.bfloat16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _params():
    if not torch.cuda.is_available():
        return []
    return [pytest.param(case, provider, id=f"{case.name}/{provider}")
            for case in cases("cuda", DTYPE) for provider in case.providers]


@pytest.mark.parametrize("case,provider", _params())
def test_attention(benchmark, case, provider):
    try:
        fns = [case.providers[provider]() for _ in range(3)]
        for f in fns:                   # warm-up: Triton / torch.compile compilation
            f()
        torch.cuda.synchronize()
    except RuntimeError as exc:         # e.g. "No available kernel" for a pinned SDPA backend
        pytest.skip(f"{provider} unavailable: {exc}")
    rotation = itertools.cycle(fns)

    def run():
        for _ in range(CALLS_PER_ROUND):
            next(rotation)()
        torch.cuda.synchronize()

    benchmark.group = case.name
    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    if benchmark.stats is None:         # --benchmark-disable
        return
    per_call = benchmark.stats.stats.median / CALLS_PER_ROUND
    benchmark.extra_info.update({
        "op": case.op, "direction": case.direction, "provider": provider, "bound": case.bound,
        "ms_per_call": per_call * 1e3, "tflops": case.flops / per_call / 1e12,
        "TFLOP/s": case.flops / per_call / 1e12, "gbps": case.bytes / per_call / 1e9,
        "device": torch.cuda.get_device_name(), **case.params,
    })
