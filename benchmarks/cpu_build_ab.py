"""Another build of bert_fast._C (say, the previous commit's) against this build, in one process: per call
of the CPU attention kernels at BERT's shapes, and whole no-grad forwards (fp32 and bf16 frozen, int8)
of all-MiniLM-L6-v2 (real weights) and bert-base (random weights). The other build's module is loaded
beside ours and swapped into every bert_fast module that holds the extension (``from bert_fast import _C
as _ext``) inside each timed call, so both variants run the same Python, weights and inputs
(timing.measure: interleaved rounds, 95% intervals, paired speedups). Our attention kernels run in
both variants (BERT_FAST_CPU_ATTENTION=1), not torch's.

    git worktree add /tmp/old <commit> && cmake -S /tmp/old -B /tmp/old/build -DBERT_FAST_CUDA=OFF \\
        -DCMAKE_BUILD_TYPE=Release -DBERT_FAST_OUTPUT_DIR=/tmp/old/out && cmake --build /tmp/old/build
    python benchmarks/cpu_build_ab.py --old-ext /tmp/old/out/_C*.so [--threads 2] [--rounds 15] [--per-call-only]

BERT_FAST_CPU_ISA=avx2 in the environment runs both builds' AVX2 code (what an AVX2-only CPU runs). An A/A
run (--old-ext a copy of this build's module) measures the floor: what code placement alone moves.
"""

from __future__ import annotations

import argparse
import copy
import importlib.machinery
import importlib.util
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch
import transformers
from _env_ab import compare_variants, minilm_path  # benchmarks/, the script's folder

import bert_fast
from bert_fast import _C as this_build
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


def holders() -> List[Tuple[Any, str]]:
    """(module, attribute) of every reference bert_fast's modules hold to this build's extension."""
    out = []
    for name, module in list(sys.modules.items()):
        if name.startswith("bert_fast") and module is not None and module is not this_build:
            out += [(module, attr) for attr, value in vars(module).items() if value is this_build]
    return out


def swapper(ext, where: List[Tuple[Any, str]]) -> Callable[[], None]:
    def swap() -> None:
        for module, attr in where:
            setattr(module, attr, ext)

    return swap


def per_call(variants: Dict[str, Callable[[], None]], restore, rounds: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        if not cpu_attention.available(dtype):
            print(f"  attention {str(dtype)[6:]}: our kernel does not run on this CPU, skipped")
            continue
        for b, heads, d in ((1, 12, 32), (8, 12, 32), (1, 12, 64), (8, 12, 64)):
            qkv = torch.randn(b, 128, 3, heads, d).to(dtype)
            line = compare_variants(
                variants, lambda: cpu_attention.padded(qkv, None, d**-0.5), rounds, restore=restore, warmup=3
            )
            print(f"  attention per call {str(dtype)[6:]} b{b} x 128, {heads} heads x d{d}: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-ext", required=True, help="the other build's _C*.so")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-call-only", action="store_true", help="the attention calls, no whole forwards")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["BERT_FAST_CPU_ATTENTION"] = "1"
    print(cpu_caps.describe(cpu_caps.capabilities()))
    print(f"BERT_FAST_CPU_ISA={os.environ.get('BERT_FAST_CPU_ISA', '')!r}, other build: {args.old_ext}")
    if args.per_call_only:
        where = holders()
        variants = {"old": swapper(load_other_build(args.old_ext), where), "this": swapper(this_build, where)}
        per_call(variants, variants["this"], args.rounds)
        return

    path = minilm_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.BertModel.from_pretrained(path).eval()
    base = transformers.BertModel(transformers.BertConfig()).eval()
    models = {
        "MiniLM fp32 frozen": bert_fast.optimize(copy.deepcopy(hf), freeze=True),
        "bert-base fp32 frozen": bert_fast.optimize(copy.deepcopy(base), freeze=True),
    }
    if cpu_attention.available(torch.bfloat16):
        models["MiniLM bf16 frozen"] = bert_fast.optimize(copy.deepcopy(hf), freeze=True, dtype=torch.bfloat16)
        models["bert-base bf16 frozen"] = bert_fast.optimize(copy.deepcopy(base), freeze=True, dtype=torch.bfloat16)
    models["MiniLM int8"] = bert_fast.optimize(copy.deepcopy(hf), int8=True, tokenizer=tok)
    models["bert-base int8"] = bert_fast.optimize(copy.deepcopy(base), int8=True, tokenizer=tok)

    where = holders()  # after every import the models above needed
    print(f"swapping the extension in {len(where)} places: " + ", ".join(sorted({m.__name__ for m, _ in where})))
    variants = {"old": swapper(load_other_build(args.old_ext), where), "this": swapper(this_build, where)}
    restore = variants["this"]
    per_call(variants, restore, args.rounds)
    for name, model in models.items():
        for batch in (1, 8) if name.startswith("MiniLM") else (1,):
            ids = torch.randint(1000, 20000, (batch, 128))
            mask = torch.ones(batch, 128, dtype=torch.long)
            with torch.no_grad():
                line = compare_variants(
                    variants, lambda: model(input_ids=ids, attention_mask=mask), args.rounds, restore=restore
                )
            print(f"  {name} {batch}x128 no-grad: {line}")


if __name__ == "__main__":
    main()
