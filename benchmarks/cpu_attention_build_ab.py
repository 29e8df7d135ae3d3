"""The CPU attention kernels of another build of bert_fast._C (say, the previous commit's) against this
build's: per call at BERT's shapes and in whole no-grad forwards, fp32 and bf16 and the int8 model
(whose attention runs bf16 where the CPU has AVX-512 BF16), in one process. The other build's module is
loaded beside ours and swapped into bert_fast.ops.cpu_attention inside each timed call, so both
variants run the same Python, weights and inputs (timing.measure: interleaved rounds, 95% intervals,
paired speedups). Both variants run our kernels (BERT_FAST_CPU_ATTENTION=1), not torch's.

    git worktree add /tmp/old <commit> && cmake -S /tmp/old -B /tmp/old/build -DBERT_FAST_CUDA=OFF \\
        -DCMAKE_BUILD_TYPE=Release -DBERT_FAST_OUTPUT_DIR=/tmp/old/out && cmake --build /tmp/old/build
    python benchmarks/cpu_attention_build_ab.py --old-ext /tmp/old/out/_C*.so [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.machinery
import importlib.util
import os

import torch
import transformers
from _env_ab import compare_variants, minilm_path  # benchmarks/, the script's folder

import bert_fast
from bert_fast.bench import cpu_caps
from bert_fast.ops import cpu_attention


def load_other_build(path: str):
    """The module at ``path`` as a second bert_fast._C (its init function is PyInit__C: the name's last
    part must be _C)."""
    loader = importlib.machinery.ExtensionFileLoader("other_build._C", path)
    spec = importlib.util.spec_from_file_location("other_build._C", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def per_call(exts: dict, rounds: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        if not cpu_attention.available(dtype):
            print(f"  {dtype}: our kernel does not run on this CPU, skipped")
            continue
        for b, heads, d in ((1, 12, 32), (8, 12, 32), (1, 12, 64), (8, 12, 64)):
            qkv = torch.randn(b, 128, 3, heads, d).to(dtype)
            line = compare_variants(
                {name: functools.partial(setattr, cpu_attention, "_ext", ext) for name, ext in exts.items()},
                lambda: cpu_attention.padded(qkv, None, d**-0.5),
                rounds,
                restore=functools.partial(setattr, cpu_attention, "_ext", exts["this"]),
                warmup=3,
            )
            print(f"  per call {str(dtype)[6:]} b{b} x 128, {heads} heads x d{d}: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-ext", required=True, help="the other build's _C*.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["BERT_FAST_CPU_ATTENTION"] = "1"
    print(cpu_caps.describe(cpu_caps.capabilities()))
    exts = {"old": load_other_build(args.old_ext), "this": cpu_attention._ext}
    per_call(exts, args.rounds)

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.BertModel.from_pretrained(path).eval()
    base = transformers.BertModel(transformers.BertConfig()).eval()
    bf16 = cpu_attention.available(torch.bfloat16)
    models = {
        "MiniLM fp32 frozen": bert_fast.optimize(copy.deepcopy(hf), freeze=True),
        "bert-base fp32 frozen": bert_fast.optimize(copy.deepcopy(base), freeze=True),
    }
    if bf16:
        models["MiniLM bf16 frozen"] = bert_fast.optimize(copy.deepcopy(hf), freeze=True, dtype=torch.bfloat16)
        models["bert-base bf16 frozen"] = bert_fast.optimize(copy.deepcopy(base), freeze=True, dtype=torch.bfloat16)
    models["MiniLM int8"] = bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok)
    for name, model in models.items():
        for batch in (1, 8) if name.startswith("MiniLM") else (1,):
            ids = torch.randint(1000, 20000, (batch, 128))
            mask = torch.ones(batch, 128, dtype=torch.long)
            with torch.no_grad():
                line = compare_variants(
                    {n: functools.partial(setattr, cpu_attention, "_ext", e) for n, e in exts.items()},
                    lambda: model(input_ids=ids, attention_mask=mask),
                    args.rounds,
                    restore=functools.partial(setattr, cpu_attention, "_ext", exts["this"]),
                )
            print(f"  {name} {batch}x128 no-grad: {line}")


if __name__ == "__main__":
    main()
