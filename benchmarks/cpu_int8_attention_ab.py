"""A/B of an int8 model's attention: fp32 (torch's flash CPU kernel) against bf16 (our AVX-512 BF16
kernel, bert_fast/ops/cpu_attention.py), whole no-grad forwards of the real all-MiniLM-L6-v2 and a
bert-base config, side by side (benchmarks/_env_ab.py: timing.measure, 95% intervals); and the
accuracy of each (min cosine of the mean-pooled outputs on the 64 shipped sentences to the fp32 model).

    python benchmarks/cpu_int8_attention_ab.py [--threads 2] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from _env_ab import compare, minilm_path  # benchmarks/, the script's folder

import bert_fast
from bert_fast.bench import cpu_caps
from bert_fast.model import int8 as int8_mod

MODES = ("fp32", "bf16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_caps.describe(cpu_caps.capabilities()))
    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    calib = int8_mod.calibration_batch(tok, None)
    reference = bert_fast.optimize(transformers.BertModel.from_pretrained(path).eval())
    m_int8 = bert_fast.optimize(transformers.BertModel.from_pretrained(path).eval(), int8=True, tokenizer=tok)
    with torch.no_grad():
        ref = int8_mod._pooled(reference, calib)
        for mode in MODES:
            os.environ[int8_mod.ATTENTION_ENV] = mode
            cos = int8_mod.min_cosine_to(ref, int8_mod._pooled(m_int8, calib))
            print(f"MiniLM int8, attention {mode}: min cosine to fp32 on the shipped sentences {cos:.5f}")
    bert = transformers.BertModel(transformers.BertConfig()).eval()
    b_int8 = bert_fast.optimize(bert, int8=True, tokenizer=tok)
    for name, model, batch in (("MiniLM", m_int8, 1), ("MiniLM", m_int8, 8), ("bert-base", b_int8, 1)):
        ids = torch.randint(1000, 20000, (batch, 128))
        mask = torch.ones(batch, 128, dtype=torch.long)
        with torch.no_grad():
            line = compare(
                int8_mod.ATTENTION_ENV, MODES, lambda: model(input_ids=ids, attention_mask=mask), args.rounds
            )
        print(f"{name} int8 {batch}x128 no-grad, attention {line}")


if __name__ == "__main__":
    main()
