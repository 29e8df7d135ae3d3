"""bf16 attention of CPU inference: bert_fast's kernel (bert_fast/ops/cpu_attention.py) against
torch's flash CPU kernel, alone (each call right after a bf16 GEMM, as in a layer) and inside
whole bf16 frozen forwards (one process, interleaved, switched by BERT_FAST_CPU_ATTENTION).

    python benchmarks/cpu_attention_ab.py > benchmarks/results/cpu-attention/attention_bf16.txt

Analysis: benchmarks/notes/2026-11-26-cpu-attention-bf16.md. Timing rules: a quiet machine, 2 threads.
"""

from __future__ import annotations

import os
import platform
import time

import torch

import bert_fast
from bert_fast import BertModel
from bert_fast.bench import cpu_caps, timing
from bert_fast.ops import cpu_attention


def kernels() -> None:
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
        os.environ["BERT_FAST_CPU_ATTENTION"] = setting
        model(input_ids=ids, attention_mask=mask)

    return run


def forwards() -> None:
    """Whole forwards, ours vs torch's kernel, interleaved by bert_fast.bench.timing.measure (the
    bench's own rounds, medians and paired-bootstrap 95% intervals)."""
    from transformers import BertConfig

    shapes = {
        "bert-base": BertConfig(),
        "MiniLM-shape": BertConfig(
            hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
        ),
    }
    for name, cfg in shapes.items():
        torch.manual_seed(0)
        model = bert_fast.optimize(BertModel(cfg).eval(), dtype=torch.bfloat16, freeze=True)
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
    os.environ.pop("BERT_FAST_CPU_ATTENTION", None)


def main() -> None:
    torch.set_num_threads(2)
    print(f"{cpu_caps.describe()} ({platform.machine()}); 2 threads, torch {torch.__version__}")
    if not cpu_attention.available():
        print("this CPU has no AVX-512 BF16 (or the extension lacks the kernel): nothing to compare")
        return
    kernels()
    forwards()


if __name__ == "__main__":
    main()
