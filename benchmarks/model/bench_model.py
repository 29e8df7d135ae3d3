"""pytest-benchmark suite of the whole model (CUDA only; skipped elsewhere).

    python -m pytest benchmarks -o python_files='bench_*.py' --benchmark-json=out.json

Same models, weights, inputs, steps and timing as ``bert-fast bench`` (bert_fast.bench.model_bench:
its run_case builds every provider, then times them side by side in interleaved rounds with
bert_fast.bench.timing.measure until each median's 95% interval is within +-3% or CASE_SECONDS is
spent): bert-base in bf16, inference at dense 32x128 and padded 8x512 (random:0.2 lengths), one
training step at 16x128, bert_fast against transformers' sdpa attention. One test per case; the
figures (per provider: median, p20/p80, interval, unstable flag, tokens/s on real tokens; the
speedup of bert_fast with its interval) are in ``extra_info``. pytest-benchmark's own statistics
time the whole measurement (one round), not a call.
"""

from __future__ import annotations

import os

import pytest
import torch

from bert_fast.bench import model_bench as mb
from bert_fast.bench import model_workload as mw
from bert_fast.bench.timing import INTERVAL_FIELDS
from bert_fast.model import facts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="model benchmarks need a CUDA GPU")

CASES = [  # (id, batch, seq, lengths, mode)
    ("infer-32x128", 32, 128, "full", "infer"),
    ("infer-8x512-random0.2", 8, 512, "random:0.2", "infer"),
    ("train-16x128", 16, 128, "full", "train"),
]
PROVIDERS = ["bert_fast", "hf-sdpa"]
MODEL = "bert-base"
CASE_SECONDS = float(os.environ.get("BERT_FAST_BENCH_CASE_SECONDS", "5"))
KEYS = (
    "status",
    "error",
    *INTERVAL_FIELDS,
    "tokens_per_s",
    "peak_mem_bytes",
    "speedup_of_bert_fast",
    "speedup_ci",
    "speedup_unstable",
)


def make_case(model, batch, seq, lengths_spec, mode, dtype_name, seed=0):
    config = mw.load_config(model)
    lengths = mw.parse_lengths(lengths_spec, batch, seq, seed=seed)
    flops = facts.step_flops(config, lengths, mode)
    return {
        "model": model,
        "batch": batch,
        "seq": seq,
        "lengths": lengths_spec,
        "mode": mode,
        "dtype": dtype_name,
        "cuda_graphs": False,
        "flops_per_step": flops,
        "real_tokens": sum(lengths),
        "parity": None,
        "results": [],
        "_config": config,
        "_lengths": lengths,
    }


def measure_case(case, device, dtype, providers=PROVIDERS, budget_s=CASE_SECONDS, timer=None, warmup=5):
    mb.run_case(
        case,
        providers,
        device,
        dtype,
        warmup=warmup,
        n_inputs=3,
        seed=0,
        progress=False,
        ceilings={},
        min_rounds=10,
        max_rounds=500,
        max_seconds=budget_s,
        timer=timer,
    )
    return {
        "providers": {r["provider"]: {k: r.get(k) for k in KEYS} for r in case["results"]},
        "timing": case.get("timing"),
        "parity": case.get("parity"),
    }


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_model(benchmark, case):
    _, batch, seq, lengths_spec, mode = case
    bench_case = make_case(MODEL, batch, seq, lengths_spec, mode, "bf16")
    result = {}
    benchmark.pedantic(
        lambda: result.update(measure_case(bench_case, torch.device("cuda"), torch.bfloat16)),
        rounds=1,
        iterations=1,
        warmup_rounds=0,
    )
    benchmark.extra_info.update(
        model=MODEL,
        batch=batch,
        seq=seq,
        lengths=lengths_spec,
        mode=mode,
        real_tokens=bench_case["real_tokens"],
        flops_per_step=bench_case["flops_per_step"],
        **result,
    )
    failed = {p: r["error"] for p, r in result["providers"].items() if r["status"] == "error"}
    if failed:
        pytest.fail(f"providers failed: {failed}")
    torch.cuda.empty_cache()
