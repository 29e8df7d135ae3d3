"""bf16 attention of CPU inference: bert_fast's kernel (bert_fast/ops/cpu_attention.py) against
torch's flash CPU kernel, alone (each call right after a bf16 GEMM, as in a layer) and inside
whole bf16 frozen forwards (one process, interleaved, switched by BERT_FAST_CPU_ATTENTION).

    python benchmarks/cpu_attention_ab.py > benchmarks/results/cpu-attention/attention_bf16.txt

Analysis: benchmarks/NOTES.md, "CPU attention in bf16". Timing rules: a quiet machine, 2 threads.
"""

from __future__ import annotations

import os
import platform
import time

import torch

import bert_fast
from bert_fast import BertModel
from bert_fast.bench import cpu_caps
from bert_fast.ops import cpu_attention


def _median_ms(times):
    return sorted(times)[len(times) // 2] * 1e3


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
                times[name].append(time.perf_counter() - t0)
        flop = 4 * b * s * s * h * d
        print(
            f"B={b} S={s} heads={h} d={d}: "
            + ", ".join(
                f"{n} {_median_ms(t):.3f} ms ({flop / _median_ms(t) / 1e9:.3f} TFLOP/s)" for n, t in times.items()
            )
        )


def forwards() -> None:
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
            times = {"1": [], "0": []}
            with torch.inference_mode():
                for rnd in range(2 + (5 if b > 1 else 15)):
                    for setting in times:
                        os.environ["BERT_FAST_CPU_ATTENTION"] = setting
                        t0 = time.perf_counter()
                        model(input_ids=ids, attention_mask=mask)
                        if rnd >= 2:
                            times[setting].append(time.perf_counter() - t0)
            ours, theirs = _median_ms(times["1"]), _median_ms(times["0"])
            case = f"B={b} S={s} {'ragged U[0.2,1]' if ragged else 'full'}"
            print(
                f"{name} bf16 frozen {case}: forward with our attention {ours:.1f} ms, "
                f"with torch flash {theirs:.1f} ms ({theirs / ours:.2f}x)"
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
