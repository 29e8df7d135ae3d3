"""A/B of the int8 dequantize pass with the residual add and LayerNorm folded in (#32 item 2's lever,
csrc/int8_cpu.cpp ``int8_dequantize_residual_ln``) against the unfused path (dequantize, then aten's
add and layer_norm), whole no-grad forwards of the real all-MiniLM-L6-v2 (int8 with fp32 and with bf16
activations) and a bert-base config: bert_fast.bench.timing.measure, interleaved rounds, 95% intervals.

    python benchmarks/cpu_int8_residual_ln_ab.py [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import functools

import torch
import transformers
from _env_ab import compare_variants, minilm_path  # benchmarks/, the script's folder

import bert_fast
from bert_fast.bench import cpu_caps
from bert_fast.model import int8 as int8_mod

FUSED = int8_mod._Int8Linear.residual_ln


def unfused(self, *args, **kwargs):  # residual_ln declining: the caller runs the GEMM, then the ops
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()), f"{args.threads} threads, torch {torch.__version__}")
    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.BertModel.from_pretrained(path).eval()
    cases = [
        ("MiniLM int8", bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok), (1, 8)),
        ("MiniLM int8, bf16", bert_fast.optimize(copy.deepcopy(hf).to(torch.bfloat16), int8=True, tokenizer=tok), (1,)),
        (
            "bert-base int8",
            bert_fast.optimize(transformers.BertModel(transformers.BertConfig()).eval(), int8=True, tokenizer=tok),
            (1,),
        ),
    ]
    for name, model, batches in cases:
        for batch in batches:
            ids = torch.randint(1000, 20000, (batch, 128))
            mask = torch.ones(batch, 128, dtype=torch.long)

            def call():
                with torch.no_grad():
                    return model(input_ids=ids, attention_mask=mask)

            line = compare_variants(
                {
                    "unfused": functools.partial(setattr, int8_mod._Int8Linear, "residual_ln", unfused),
                    "fused": functools.partial(setattr, int8_mod._Int8Linear, "residual_ln", FUSED),
                },
                call,
                args.rounds,
                restore=functools.partial(setattr, int8_mod._Int8Linear, "residual_ln", FUSED),
                warmup=2,
            )
            print(f"{name} {batch}x128 no-grad: {line}")


if __name__ == "__main__":
    main()
