"""pytest-benchmark: one MLM training step (forward, backward, AdamW) per round (CUDA only).

    python -m pytest benchmarks/training/bench_train.py -o python_files='bench_*.py' --benchmark-json=train.json

Cases: bert-base at S=128 (B=256) and S=512 (B=32), bert-large at S=512 (B=16), every sequence full
length (no padding: the comparison is kernels, not pad skipping), 15% of positions labelled.
Precision: torch.autocast bf16 with fp32 master weights, fused AdamW -- what ``bert-fast train
--precision bf16`` runs.

Providers:
  bert_fast            bert_fast.BertForMaskedLM, MLM head on the masked positions only (its default)
  bert_fast-full-head  the same encoder with the MLM head over every position (transformers' head)
  hf-sdpa              transformers.BertForMaskedLM, attn_implementation="sdpa", AMP
  hf-compile           torch.compile(transformers sdpa model), AMP

Timing: per case, all providers side by side (bert_fast.bench.timing.measure, interleaved rounds);
pytest-benchmark's own statistics time the whole measurement, the figures are in extra_info.
extra_info, per provider: median, p20/p80, 95% interval, unstable flag, tokens/s (real tokens), MFU = (6 * params * tokens + 12 * L * H * B * S^2) / time / peak
(peak: BERT_FAST_PEAK_TFLOPS or the measured bf16 GEMM rate of this GPU), peak memory (GiB).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="training benchmarks need a CUDA GPU")

CASES = [  # (id, preset, batch, seq)
    ("bert-base-S128-B256", "base", 256, 128),
    ("bert-base-S512-B32", "base", 32, 512),
    ("bert-large-S512-B16", "large", 16, 512),
]
PROVIDERS = ["bert_fast", "bert_fast-full-head", "hf-sdpa", "hf-compile"]
CASE_SECONDS = float(os.environ.get("BERT_FAST_BENCH_CASE_SECONDS", "10"))


@pytest.fixture(scope="module")
def peak_tflops():
    env = os.environ.get("BERT_FAST_PEAK_TFLOPS")
    if env:
        return float(env)
    from bert_fast.training.loop import measure_peak_tflops

    return measure_peak_tflops(torch.device("cuda"), torch.bfloat16)


def _config(preset: str):
    import transformers

    from bert_fast.training.loop import MODEL_SIZES

    return transformers.BertConfig(
        vocab_size=30528,
        max_position_embeddings=512,
        type_vocab_size=2,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        **MODEL_SIZES[preset],
    )


def _model(provider: str, config):
    import transformers

    import bert_fast

    torch.manual_seed(0)
    if provider.startswith("bert_fast"):
        model = bert_fast.BertForMaskedLM(config, mlm_masked_positions_only=(provider == "bert_fast"))
    else:
        config._attn_implementation = "sdpa"
        model = transformers.BertForMaskedLM(config)
    model = model.cuda().train()
    step_model = torch.compile(model) if provider == "hf-compile" else model
    return model, step_model


def _batch(config, b: int, s: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, config.vocab_size, (b, s), generator=g)
    labels = torch.where(torch.rand(b, s, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    mask = torch.ones(b, s, dtype=torch.long)
    return ids.cuda(), mask.cuda(), labels.cuda()


def _step_fn(provider, config, b, s):
    """(model, step) of one provider: one training step per call (no synchronize: the timer's
    CUDA events bracket each call)."""
    from bert_fast.training.loop import build_optimizer

    model, step_model = _model(provider, config)
    ids, mask, labels = _batch(config, b, s)

    class _Args:
        lr, beta1, beta2, adam_eps, weight_decay = 1e-4, 0.9, 0.999, 1e-6, 0.01

    opt = build_optimizer(model, _Args, torch.device("cuda"))

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def _build_steps(config, b: int, s: int):
    """Each provider's step, run once (compile, autotune, optimizer state); a provider that fails is skipped."""
    steps, models, skipped, peaks = {}, {}, {}, {}
    for provider in PROVIDERS:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            models[provider], steps[provider] = _step_fn(provider, config, b, s)
            steps[provider]()  # compile, autotune, allocate the optimizer state
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            skipped[provider] = "out of memory"
        except Exception as exc:  # noqa: BLE001 - a provider that cannot be built is reported, not fatal
            skipped[provider] = f"{type(exc).__name__}: {exc}"[:300]
        if provider in skipped:
            models.pop(provider, None)
            steps.pop(provider, None)
            torch.cuda.empty_cache()
            continue
        peaks[provider] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return steps, models, skipped, peaks


def _figures(m, config, b: int, s: int, peak_tflops: float, peaks: dict) -> dict:
    """Per provider: the median and its interval, throughput, MFU, peak memory, bert_fast's speedup."""
    # model FLOPs of the step (forward + backward), the same count `bert-fast train` reports MFU with;
    # this named a `model_flops` that no longer existed, which only a GPU run would have found
    from bert_fast.training.loop import train_flops

    tokens = b * s
    flops = train_flops(config, tokens, float(b * s * s))
    figures = {}
    for provider, t in m.timings.items():
        sec = t.median_ms * 1e-3
        sp = m.speedup("bert_fast", provider) if provider != "bert_fast" and "bert_fast" in m.timings else None
        figures[provider] = {
            "median_ms": t.median_ms,
            "p20_ms": t.p20_ms,
            "p80_ms": t.p80_ms,
            "ci_low_ms": t.ci_low_ms,
            "ci_high_ms": t.ci_high_ms,
            "unstable": t.unstable,
            "tokens_per_s": tokens / sec,
            "tflops": flops / sec / 1e12,
            "mfu": flops / sec / (peak_tflops * 1e12),
            "peak_memory_gib": peaks.get(provider),
            "speedup_of_bert_fast": sp.to_dict() if sp is not None else None,
        }
    return figures


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_train_step(benchmark, peak_tflops, case):
    """All providers of one case side by side (bert_fast.bench.timing.measure: interleaved rounds,
    warm-up first, until each median's 95% interval is within +-3% or CASE_SECONDS is spent);
    the figures are in extra_info, pytest-benchmark's own statistics time the whole measurement."""
    from bert_fast.bench.timing import measure

    name, preset, b, s = case
    config = _config(preset)
    torch.cuda.empty_cache()
    steps, models, skipped, peaks = _build_steps(config, b, s)
    if not steps:
        pytest.skip(f"no provider runs: {skipped}")
    result = {}

    def run():
        result["m"] = measure(
            steps,  # noqa: F821 (bound in the enclosing function)
            torch.device("cuda"),
            warmup=2,
            min_rounds=10,
            max_rounds=200,
            budget_s=CASE_SECONDS,
        )

    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    m = result["m"]
    skipped.update(m.skipped)
    benchmark.extra_info.update(
        {
            "case": name,
            "batch": b,
            "seq": s,
            "tokens": b * s,
            "peak_tflops": peak_tflops,
            "rounds": len(m.rounds),
            "stop_reason": m.stop_reason,
            "providers": _figures(m, config, b, s, peak_tflops, peaks),
            "skipped": skipped,
            "errors": {p: f"{type(e).__name__}: {e}"[:300] for p, e in m.errors.items()},
            "device": torch.cuda.get_device_name(),
            "precision": "bf16 autocast, fp32 master weights, fused AdamW",
        }
    )
    del models, steps
    torch.cuda.empty_cache()
    if m.errors:
        pytest.fail(f"{name}: {benchmark.extra_info['errors']}")
