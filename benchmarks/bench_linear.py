"""pytest-benchmark suite of ``linear`` over bert_fast.bench.op_cases.linear (CUDA only).

    pytest benchmarks -o python_files='bench_*.py' -k linear --benchmark-json=benchmarks/results/linear.json

Each round runs CALLS_PER_ROUND calls (rotating through 3 fresh input sets, so no call re-reads
the previous one's operands from L2) and synchronises once; the figures pytest-benchmark prints
are per round. extra_info holds the per-call time and TFLOP/s.
"""
import itertools

import pytest
import torch

from bert_fast.bench.op_cases.linear import cases

CALLS_PER_ROUND = 10
DTYPE = torch.bfloat16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _params():
    out = []
    for case in cases("cuda", DTYPE):
        for provider in case.providers:
            out.append(pytest.param(case, provider, id=f"{case.name}/{provider}"))
    return out


@pytest.mark.parametrize("case,provider", _params())
def test_linear(benchmark, case, provider):
    fns = [case.providers[provider]() for _ in range(3)]
    for f in fns:                       # warm-up: compilation, autotuning, cuBLAS heuristics
        f()
    torch.cuda.synchronize()
    rotation = itertools.cycle(fns)

    def run():
        for _ in range(CALLS_PER_ROUND):
            next(rotation)()
        torch.cuda.synchronize()

    benchmark.pedantic(run, rounds=20, iterations=1, warmup_rounds=2)
    per_call = benchmark.stats.stats.median / CALLS_PER_ROUND
    benchmark.extra_info.update({
        "op": case.op, "direction": case.direction, "provider": provider, "bound": case.bound,
        "ms_per_call": per_call * 1e3, "tflops": case.flops / per_call / 1e12,
        "gbps": case.bytes / per_call / 1e9, "device": torch.cuda.get_device_name(),
        **case.params,
    })
