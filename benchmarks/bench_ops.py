"""pytest-benchmark suite of every op over bert_fast.bench.op_cases.<op> (CUDA only).

    pytest benchmarks -o python_files='bench_*.py' -k "ops and attention" --benchmark-json=ops.json

The cases (shapes, providers: bert_fast vs torch eager / torch.compile / SDPA, useful FLOPs and
minimal bytes) are the same ones `bert-fast bench-ops` runs. Each round runs CALLS_PER_ROUND calls
rotating through INPUT_SETS fresh input sets, so no call re-reads the previous one's operands from
L2, and synchronizes once. extra_info holds the per-call time, TFLOP/s and GB/s. A provider the
installed torch cannot run (say an SDPA backend missing on this GPU) is skipped, with the reason.
"""
import itertools

import pytest
import torch

from bert_fast.bench.ops_bench import discover_modules

CALLS_PER_ROUND = 10
INPUT_SETS = 3
DTYPE = torch.bfloat16

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _params():
    if not torch.cuda.is_available():
        return []
    modules, errors = discover_modules()
    if errors:
        raise ImportError(f"op case modules failed to import: {errors}")
    return [pytest.param(case, provider, id=f"{case.name}/{provider}")
            for module in modules.values() for case in module.cases(torch.device("cuda"), DTYPE)
            for provider in case.providers]


@pytest.mark.parametrize("case,provider", _params())
def test_op(benchmark, case, provider):
    try:
        fns = [case.providers[provider]() for _ in range(INPUT_SETS)]
        for f in fns:                   # warm-up: Triton / torch.compile compilation, autotuning
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
        "us_per_call": per_call * 1e6, "TFLOP/s": case.flops / per_call / 1e12,
        "GB/s": case.bytes / per_call / 1e9, "device": torch.cuda.get_device_name(), **case.params,
    })
