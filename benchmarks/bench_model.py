"""pytest-benchmark suite of the whole model (CUDA only; skipped elsewhere).

    python -m pytest benchmarks -o python_files='bench_*.py' --benchmark-json=out.json

Same models, weights, inputs and steps as ``bert-fast bench`` (bert_fast.bench.model_bench, model_workload, model_providers):
bert-base in bf16, inference at dense 32x128 and padded 8x512 (random:0.2 lengths), one training
step at 16x128, for bert_fast and transformers' sdpa attention. Each round is one call followed by
a synchronize; extra_info carries tokens/s on real tokens.
"""
from __future__ import annotations

import pytest
import torch

from bert_fast.bench import model_providers as mp
from bert_fast.bench import model_workload as mw

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="model benchmarks need a CUDA GPU")

CASES = [  # (id, batch, seq, lengths, mode)
    ("infer-32x128", 32, 128, "full", "infer"),
    ("infer-8x512-random0.2", 8, 512, "random:0.2", "infer"),
    ("train-16x128", 16, 128, "full", "train"),
]
PROVIDERS = ["bert_fast", "hf-sdpa"]


@pytest.fixture(scope="module")
def bench_env():
    return torch.device("cuda"), torch.bfloat16, mw.load_config("bert-base")


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_model(benchmark, bench_env, case, provider):
    device, dtype, config = bench_env
    _, batch, seq, lengths_spec, mode = case
    lengths = mw.parse_lengths(lengths_spec, batch, seq, seed=0)
    state = mp.reference_state_dict(config, "bert-base", seed=0)
    try:
        model, runner, _ = mp.build_provider_model(provider, config, state, device, dtype, mode, cuda_graphs=False)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"{provider} not available: {exc}")
    optimizer = mp._make_optimizer(model, device) if mode == "train" else None
    inputs = mw.make_inputs(config, lengths, seq, device, n_sets=3, seed=0)
    steps = [mp.make_step(runner, model, inp, mode, optimizer) for inp in inputs]
    for i in range(5):                      # warm-up: Triton autotuning, cuBLAS heuristics
        steps[i % len(steps)]()
    torch.cuda.synchronize()
    counter = {"i": 0}

    def call():
        steps[counter["i"] % len(steps)]()
        counter["i"] += 1
        torch.cuda.synchronize()

    benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=2)
    if benchmark.stats is None:        # --benchmark-disable
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(provider=provider, batch=batch, seq=seq, lengths=lengths_spec, mode=mode,
                                real_tokens=sum(lengths), tokens_per_s=sum(lengths) / median,
                                flops_per_step=mw.step_flops(config, lengths, mode))
    del steps, model, runner, optimizer
    torch.cuda.empty_cache()
