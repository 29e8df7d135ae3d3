"""pytest-benchmark suite of bias_gelu (CUDA only): `pytest benchmarks -o python_files='bench_*.py'`.

Each round times ITERS back-to-back calls (rotating over several input sets) then synchronizes;
extra_info records the per-call time and the GB/s of the case's minimal traffic.
"""
import itertools

import pytest
import torch

from bert_fast.bench.op_cases.bias_gelu import cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ITERS = 20
INPUT_SETS = 3
CASES = cases(torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else []


@pytest.mark.parametrize("case,provider", [(c, p) for c in CASES for p in c.providers],
                         ids=lambda v: v.name if hasattr(v, "name") else str(v))
def test_bias_gelu(benchmark, case, provider):
    fns = itertools.cycle([case.providers[provider]() for _ in range(INPUT_SETS)])

    def run():
        for _ in range(ITERS):
            next(fns)()
        torch.cuda.synchronize()

    benchmark.group = case.name
    benchmark.pedantic(run, rounds=25, warmup_rounds=3)
    per_call = benchmark.stats.stats.median / ITERS
    benchmark.extra_info.update(case.params)
    benchmark.extra_info.update({"provider": provider, "direction": case.direction, "bytes": case.bytes,
                                 "us_per_call": per_call * 1e6, "GB/s": case.bytes / per_call / 1e9})
