"""The attention of CPU inference, ours against torch's flash CPU kernel: bf16 (bert_fast/ops/cpu_attention.py,
AVX-512 BF16) and fp32 (csrc/attention_f32_cpu.cpp, AVX-512 and AVX2), per call and in whole forwards
(switched by BERT_FAST_CPU_ATTENTION)."""

from __future__ import annotations

import copy
import os
import platform
import time

import torch
import transformers

import bert_fast
from bert_fast import BertModel
from bert_fast.bench import cpu_caps, timing
from bert_fast.ops import cpu_attention

from .harness import compare, dense_forward, load_minilm, variant

ENV = "BERT_FAST_CPU_ATTENTION"


def _bf16_kernels() -> None:
    """Each call right after a bf16 GEMM, as in a layer (the GEMM outside the timed part)."""
    x, w = torch.randn(1024, 768).bfloat16(), torch.randn(2304, 768).bfloat16()
    for b, s, h, d in [(8, 128, 12, 64), (1, 128, 12, 64), (8, 128, 12, 32), (1, 128, 12, 32), (16, 256, 12, 64)]:
        qkv = torch.randn(b, s, 3, h, d).to(torch.bfloat16)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
        fns = {
            "ours": lambda: cpu_attention.padded(qkv, None, d**-0.5),
            "torch flash": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=d**-0.5),
        }
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for _ in range(21):
            for name, fn in fns.items():
                torch.nn.functional.linear(x, w)  # as in the model: right after a GEMM
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        flop = 4 * b * s * s * h * d
        stats = {n: timing.summarize(t) for n, t in times.items()}
        print(
            f"B={b} S={s} heads={h} d={d}: "
            + ", ".join(
                f"{n} {st['median_ms']:.3f} ms ({st['ci_low_ms']:.3f}-{st['ci_high_ms']:.3f}; "
                f"{flop / st['median_ms'] / 1e9:.3f} TFLOP/s)"
                for n, st in stats.items()
            )
        )


def _with_attention(setting: str, model, ids, mask):
    """A forward with BERT_FAST_CPU_ATTENTION=setting (read at every layer's call)."""

    def run():
        os.environ[ENV] = setting
        model(input_ids=ids, attention_mask=mask)

    return run


def _bf16_forward_cases(model, name: str) -> None:
    """Dense 8x128, ragged 16x256 (lengths U[0.2, 1]) and 1x128 through ``model``, ours then torch's."""
    g = torch.Generator().manual_seed(0)
    for b, s, ragged in [(8, 128, False), (16, 256, True), (1, 128, False)]:
        ids = torch.randint(1000, 2000, (b, s), generator=g)
        lens = ((torch.rand(b, generator=g) * 0.8 + 0.2) * s).long().clamp(min=1) if ragged else torch.full((b,), s)
        mask = (torch.arange(s)[None, :] < lens[:, None]).long()
        with torch.inference_mode():
            res = timing.measure(
                {"ours": _with_attention("1", model, ids, mask), "torch": _with_attention("0", model, ids, mask)},
                warmup=2,
                min_rounds=6,
                budget_s=30.0,
            )
        ours, theirs = res.timings["ours"], res.timings["torch"]
        case = f"B={b} S={s} {'ragged U[0.2,1]' if ragged else 'full'}"
        print(
            f"{name} bf16 frozen {case}: forward with our attention {ours.median_ms:.1f} ms "
            f"({ours.ci_low_ms:.1f}-{ours.ci_high_ms:.1f}), with torch flash {theirs.median_ms:.1f} ms "
            f"({theirs.ci_low_ms:.1f}-{theirs.ci_high_ms:.1f}): {res.speedup('ours', 'torch').format()}, "
            f"{len(res.rounds)} rounds"
        )


def _bf16_forwards() -> None:
    """Whole bf16 frozen forwards, ours vs torch's kernel, interleaved by bert_fast.bench.timing.measure (the
    bench's own rounds, medians and paired-bootstrap 95% intervals)."""
    shapes = {
        "bert-base": transformers.BertConfig(),
        "MiniLM-shape": transformers.BertConfig(
            hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
        ),
    }
    for name, cfg in shapes.items():
        torch.manual_seed(0)
        _bf16_forward_cases(bert_fast.optimize(BertModel(cfg).eval(), dtype=torch.bfloat16, freeze=True), name)
    os.environ.pop(ENV, None)


@variant("attention-bf16")
def attention_bf16(args) -> None:
    """bf16 attention of CPU inference: our AVX-512 BF16 kernel against torch's flash CPU kernel.

    bert_fast's kernel (bert_fast/ops/cpu_attention.py) against torch's flash CPU kernel, alone (each
    call right after a bf16 GEMM, as in a layer) and inside whole bf16 frozen forwards (one process,
    interleaved, switched by BERT_FAST_CPU_ATTENTION).

        python benchmarks/cpu_ab.py attention-bf16 > benchmarks/results/cpu-attention/attention_bf16.txt

    Analysis: benchmarks/notes/2026-11-26-cpu-attention-bf16.md. Timing rules: a quiet machine, 2 threads.
    """
    torch.set_num_threads(args.threads)
    print(f"{cpu_caps.describe()} ({platform.machine()}); {args.threads} threads, torch {torch.__version__}")
    if not cpu_attention.available():
        print("this CPU has no AVX-512 BF16 (or the extension lacks the kernel): nothing to compare")
        return
    _bf16_kernels()
    _bf16_forwards()


def _f32_per_call(rounds: int) -> None:
    for b, heads, d in ((1, 12, 32), (8, 12, 32), (1, 12, 64), (8, 12, 64)):
        s = 128
        qkv = torch.randn(b, s, 3, heads, d)
        q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
        scale = d**-0.5
        res = timing.measure(
            {
                "torch": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale),
                "ours": lambda: cpu_attention.padded(qkv, None, scale),
            },
            warmup=2,
            min_rounds=rounds,
            max_rounds=rounds,
            catch=False,
        )
        t, o = res.timings["torch"], res.timings["ours"]
        print(
            f"  per call b{b} x {s} tokens, {heads} heads x d{d}: torch {t.median_ms:.3f} ms, ours "
            f"{o.median_ms:.3f} ms, speedup {res.speedup('ours', 'torch').format()}"
        )


@variant("attention-f32", rounds=9)
def attention_f32(args) -> None:
    """fp32 attention of CPU inference (#32 item 3): our kernel against torch's flash CPU kernel, per ISA.

    Our kernel (csrc/attention_f32_cpu.cpp) against torch's flash CPU kernel, per call at BERT shapes
    and in whole no-grad forwards, on every instruction set this CPU has (AVX-512 and AVX2 through
    BERT_FAST_CPU_ISA, which runs exactly the AVX2 code an AVX2-only CPU runs). timing.measure:
    interleaved rounds, 95% intervals, paired speedups.

    Whole forwards switch ``BERT_FAST_CPU_ATTENTION`` between 0 (torch's kernel) and 1 (ours): fp32 plain
    and frozen all-MiniLM-L6-v2 (real weights) at 1x128 and 8x128, bert-base (random weights) at 1x128;
    under the AVX2 cap also the int8 MiniLM (whose attention runs fp32 where there is no AVX-512 BF16).

        python benchmarks/cpu_ab.py attention-f32 [--threads 2] [--rounds 9]
    """
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()))
    hf, tok = load_minilm()
    models = {
        "MiniLM fp32": bert_fast.optimize(copy.deepcopy(hf)),
        "MiniLM fp32 frozen": bert_fast.optimize(copy.deepcopy(hf), freeze=True),
        "bert-base fp32": bert_fast.optimize(transformers.BertModel(transformers.BertConfig()).eval()),
    }
    caps = [c for c in ("avx512", "avx2") if c == "avx2" or cpu_attention._ext.attention_f32_isa() == "avx512"]
    for cap in caps:
        os.environ["BERT_FAST_CPU_ISA"] = cap
        print(f"BERT_FAST_CPU_ISA={cap}: our fp32 kernel runs {cpu_attention._ext.attention_f32_isa()}")
        _f32_per_call(args.rounds)
        cases = [(n, m, b) for n, m in models.items() for b in ((1, 8) if n.startswith("MiniLM") else (1,))]
        if cap == "avx2":  # no AVX-512 BF16 under this cap: an int8 model's attention runs fp32
            os.environ["BERT_FAST_INT8_ATTENTION"] = "auto"
            cases.append(("MiniLM int8", bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok), 1))
        for name, model, batch in cases:
            line = compare(ENV, ("0", "1"), dense_forward(model, batch), args.rounds)
            print(f"  {name} {batch}x128 no-grad, {ENV} {line}")
    os.environ.pop("BERT_FAST_CPU_ISA", None)
