"""A/B of the CPU path's fp32 linear: aten (F.linear: MKL/OpenBLAS) against oneDNN's linear on the plain
weight (bert_fast/ops/cpu_fp32_gemm.py), whole no-grad forwards side by side (benchmarks/_env_ab.py:
timing.measure, 95% intervals).

    python benchmarks/cpu_fp32_gemm_ab.py [--threads 2] [--rounds 7]

Prints the CPU model and what the automatic choice picked first (benchmarks/notes/2026-11-27-cpu-inference-32.md,
"The plain fp32 path on oneDNN").
"""

from __future__ import annotations

import argparse

import torch
import transformers
from _env_ab import compare  # benchmarks/, the script's folder

import bert_fast
from bert_fast.bench import cpu_caps
from bert_fast.ops import cpu_fp32_gemm

MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
CASES = (("bert-base", {}, 8, 128), ("bert-base", {}, 1, 128), ("MiniLM", MINILM, 1, 128))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()))
    print(f"automatic choice at {args.threads} threads: {'oneDNN' if cpu_fp32_gemm.use_onednn() else 'aten'}")
    for name, overrides, batch, seq in CASES:
        model = bert_fast.BertModel(transformers.BertConfig(**overrides)).eval()
        ids = torch.randint(0, 30000, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        with torch.no_grad():
            line = compare(
                cpu_fp32_gemm.ENV, ("aten", "onednn"), lambda: model(input_ids=ids, attention_mask=mask), args.rounds
            )
        print(f"{name} {batch}x{seq} fp32 no-grad: {line}")


if __name__ == "__main__":
    main()
