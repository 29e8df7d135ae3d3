"""fp32 attention of CPU inference (#32 item 3): our kernel (csrc/attention_f32_cpu.cpp) against
torch's flash CPU kernel, per call at BERT shapes and in whole no-grad forwards, on every instruction
set this CPU has (AVX-512 and AVX2 through BERT_FAST_CPU_ISA, which runs exactly the AVX2 code an
AVX2-only CPU runs). timing.measure: interleaved rounds, 95% intervals, paired speedups.

Whole forwards switch ``BERT_FAST_CPU_ATTENTION`` between 0 (torch's kernel) and 1 (ours): fp32 plain
and frozen all-MiniLM-L6-v2 (real weights) at 1x128 and 8x128, bert-base (random weights) at 1x128; under
the AVX2 cap also the int8 MiniLM (whose attention runs fp32 where there is no AVX-512 BF16).

    python benchmarks/cpu_attention_f32_ab.py [--threads 2] [--rounds 9]
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import transformers
from _env_ab import compare, minilm_path  # benchmarks/, the script's folder

import bert_fast
from bert_fast.bench import cpu_caps, timing
from bert_fast.ops import cpu_attention

ENV = "BERT_FAST_CPU_ATTENTION"


def per_call(rounds: int) -> None:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()))
    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.BertModel.from_pretrained(path).eval()
    models = {
        "MiniLM fp32": bert_fast.optimize(copy.deepcopy(hf)),
        "MiniLM fp32 frozen": bert_fast.optimize(copy.deepcopy(hf), freeze=True),
        "bert-base fp32": bert_fast.optimize(transformers.BertModel(transformers.BertConfig()).eval()),
    }
    caps = [c for c in ("avx512", "avx2") if c == "avx2" or cpu_attention._ext.attention_f32_isa() == "avx512"]
    for cap in caps:
        os.environ["BERT_FAST_CPU_ISA"] = cap
        print(f"BERT_FAST_CPU_ISA={cap}: our fp32 kernel runs {cpu_attention._ext.attention_f32_isa()}")
        per_call(args.rounds)
        cases = [(n, m, b) for n, m in models.items() for b in ((1, 8) if n.startswith("MiniLM") else (1,))]
        if cap == "avx2":  # no AVX-512 BF16 under this cap: an int8 model's attention runs fp32
            os.environ["BERT_FAST_INT8_ATTENTION"] = "auto"
            cases.append(("MiniLM int8", bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok), 1))
        for name, model, batch in cases:
            ids = torch.randint(1000, 20000, (batch, 128))
            mask = torch.ones(batch, 128, dtype=torch.long)
            with torch.no_grad():
                line = compare(ENV, ("0", "1"), lambda: model(input_ids=ids, attention_mask=mask), args.rounds)
            print(f"  {name} {batch}x128 no-grad, {ENV} {line}")
    os.environ.pop("BERT_FAST_CPU_ISA", None)


if __name__ == "__main__":
    main()
