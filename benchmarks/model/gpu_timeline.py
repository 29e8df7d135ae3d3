"""Where a forward's GPU time goes, kernel by kernel (issue #41): torch.profiler (CPU + CUDA
activities) of one bert_fast call after warm-up, built as `bert-fast bench` builds its bert_fast
provider (seeded weights, bf16). A case is named MODE-BxS[-graphs|-padded]:

  fwd-1x128-graphs   a forward at batch 1 x 128 under CudaGraphRunner (the bench's --cuda-graphs)
  fwd-32x128         a dense forward at 32 x 128 (fwd-16x512-padded: random lengths, random:0.2)
  train-32x128       one MLM training step (forward, backward, clip, AdamW) as `bench --mode train-mlm`

Per case in --out: CASE.json and CASE.txt (every GPU kernel: name, count, total us, share; the sum of
kernel time against the wall time of an unprofiled call, the GPU's busy span, launches per call) and
CASE.trace.json.gz (the Chrome trace: ui.perfetto.dev), and CASE.host.txt: where the host's time goes
per call, Python function by function (cProfile of three calls; the second H200 lease found the
un-graphed forward host-bound at ~95 us per launch, 17 ms for 0.5 ms of kernels). Without a GPU the
same runs on the CPU (CPU activities; the rows are the leaf ops), which is what the GPU check's dry
run exercises.

--warm-only: no profiler, one call of each case for each of --models (cases default to the shapes
the GPU check benchmarks), to fill the Triton cache and the first-use verdicts before timed runs.

    python benchmarks/model/gpu_timeline.py --out benchmarks/results/RUN/timeline
    python benchmarks/model/gpu_timeline.py --device cpu --model tiny --out /tmp/timeline
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bert_fast.bench import model_providers as mp  # noqa: E402
from bert_fast.bench import train_bench  # noqa: E402
from bert_fast.bench.model_workload import load_config, make_inputs, parse_lengths  # noqa: E402
from bert_fast.bench.timing import synchronize  # noqa: E402

CASES = "fwd-1x128-graphs,fwd-1x128,fwd-32x128,train-32x128"
WARM_CASES = "fwd-1x128-graphs,fwd-32x128,fwd-128x128,fwd-16x512-padded,train-32x128,train-8x512"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LAUNCH_API = re.compile(r"(cu|cuda)(LaunchKernel|GraphLaunch)")  # the host calls that launch work


def parse_case(name: str) -> dict:
    m = re.fullmatch(r"(fwd|train)-(\d+)x(\d+)(-graphs|-padded)?", name)
    if not m:
        raise SystemExit(f"case {name!r}: expected fwd-BxS, fwd-BxS-graphs, fwd-BxS-padded or train-BxS")
    return dict(name=name, mode=m[1], batch=int(m[2]), seq=int(m[3]), extra=(m[4] or "")[1:])


def build_call(case: dict, model: str, device, dtype, seed: int = 0):
    """(the call to profile, notes): one forward (no grad) or one training step, built as the bench does."""
    config = load_config(model)
    lengths = parse_lengths("random:0.2" if case["extra"] == "padded" else "full", case["batch"], case["seq"], seed)
    if case["mode"] == "train":
        fast, _ = train_bench.build_models(config, device, seed)
        batch = train_bench.make_batches(config, case["batch"], case["seq"], lengths, 1, seed)[0]
        batch = {k: v.to(device) for k, v in batch.items()}
        amp = None if dtype == torch.float32 else dtype
        return train_bench.loop_step(fast, mp.make_optimizer(fast, device), batch, amp, device), []
    state = mp.reference_state_dict(config, model, seed)
    graphs = case["extra"] == "graphs"
    net, runner, notes = mp.build_provider_model("bert_fast", config, state, device, dtype, "infer", graphs, model)
    inputs = make_inputs(config, lengths, case["seq"], device, 1, seed)[0]

    def forward():
        with torch.no_grad():
            return runner(**inputs)

    return forward, notes


def wall_ms(call, device, n: int) -> float:
    """Median milliseconds of ``n`` unprofiled calls (each synchronized)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def trace_of(call, device, path: Path) -> list:
    """The Chrome trace events of one profiled call, written gzipped to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        call()
        synchronize(device)
    raw = path.with_suffix("")  # CASE.trace.json
    prof.export_chrome_trace(str(raw))
    data = raw.read_bytes()
    raw.unlink()
    path.write_bytes(gzip.compress(data))
    events = json.loads(data).get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X"]


def leaves(events: list) -> list:
    """The CPU ops that contain no other op on their thread (what runs, not what calls)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    out = []
    for i, e in enumerate(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        if not (nxt and nxt["tid"] == e["tid"] and nxt["ts"] < e["ts"] + e["dur"]):
            out.append(e)
    return out


def summarize(events: list, cuda: bool) -> dict:
    """Kernels grouped by name (count, total us, share), their sum, the busy span, launches."""
    work = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")] if cuda else leaves(events)
    rows = {}
    for e in work:
        r = rows.setdefault(e["name"], {"name": e["name"], "count": 0, "total_us": 0.0})
        r["count"] += 1
        r["total_us"] += float(e["dur"])
    total = sum(r["total_us"] for r in rows.values())
    for r in rows.values():
        r["share"] = r["total_us"] / total if total else 0.0
    launches = sum(1 for e in events if LAUNCH_API.search(e.get("name", ""))) if cuda else len(work)
    span = (max(e["ts"] + e["dur"] for e in work) - min(e["ts"] for e in work)) if work else 0.0
    return {
        "what": "GPU kernels, memcpy and memset" if cuda else "CPU leaf ops (no GPU: the dry run's stand-in)",
        "kernels": sorted(rows.values(), key=lambda r: -r["total_us"]),
        "kernel_count": len(work),
        "kernel_sum_us": total,
        "busy_span_us": float(span),
        "launch_calls": launches,
    }


def table(doc: dict) -> str:
    lines = [
        f"{doc['case']} {doc['model']} {doc['dtype']} on {doc['device_name']}: wall {doc['wall_ms'] * 1e3:,.0f} us "
        f"(median of {doc['wall_calls']} unprofiled calls); {doc['what']}: sum {doc['kernel_sum_us']:,.0f} us in "
        f"{doc['kernel_count']} ({doc['kernel_sum_us'] / max(doc['wall_ms'] * 1e3, 1e-9):.0%} of the wall: the rest "
        f"is gaps), busy span {doc['busy_span_us']:,.0f} us, {doc['launch_calls']} launch calls",
        f"{'total us':>11} {'share':>6} {'count':>6}  name",
    ]
    for r in doc["kernels"]:
        lines.append(f"{r['total_us']:>11,.1f} {r['share']:>6.1%} {r['count']:>6}  {r['name'][:140]}")
    return "\n".join(lines + [f"note: {n}" for n in doc["notes"]]) + "\n"


def host_profile(call, device, path: Path, calls: int = 3) -> None:
    """The host's time per call by Python function (cProfile over ``calls`` calls): the functions
    with the most time of their own, then the most in all (callees included), in us per call."""
    import cProfile
    import pstats

    synchronize(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    synchronize(device)
    prof.disable()
    stats = pstats.Stats(prof)
    lines = [f"host time per call: {1e6 * stats.total_tt / calls:,.0f} us under cProfile ({calls} calls)"]
    for key, title in (("tottime", "own time"), ("cumulative", "in all")):
        lines.append(f"\n   us/call  calls/call  function  (by {title})")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2 if key == "tottime" else 3])[:40]
        for (file, line, name), (_, ncalls, tt, ct, _) in rows:
            us = 1e6 * (tt if key == "tottime" else ct) / calls
            lines.append(f"{us:10.1f} {ncalls / calls:10.1f}  {name} ({Path(file).name}:{line})")
    path.write_text("\n".join(lines) + "\n")


def profile_case(case: dict, args, device, out: Path) -> dict:
    call, notes = build_call(case, args.model, device, DTYPES[args.dtype])
    for _ in range(args.warmup):
        call()
    synchronize(device)
    doc = {"case": case["name"], "model": args.model, "dtype": args.dtype, "device": str(device)}
    doc["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    doc.update(wall_ms=wall_ms(call, device, args.calls), wall_calls=args.calls)
    trace = out / f"{case['name']}.trace.json.gz"
    doc.update(summarize(trace_of(call, device, trace), device.type == "cuda"), trace=trace.name)
    host_profile(call, device, out / f"{case['name']}.host.txt")
    if device.type == "cuda" and not doc["kernels"]:
        notes.append("the profiler recorded no kernel (a CUDA graph's kernels may be hidden from CUPTI): see the trace")
    doc["notes"] = notes
    (out / f"{case['name']}.json").write_text(json.dumps(doc, indent=1))
    (out / f"{case['name']}.txt").write_text(table(doc))
    return doc


def warm(cases, models, args, device, out: Path) -> None:
    """One call of each case for each model: the seconds each took (its compiles) into warm.json."""
    took = []
    for model in models:
        for case in cases:
            t0 = time.perf_counter()
            call, _ = build_call(case, model, device, DTYPES[args.dtype])
            call()
            synchronize(device)
            took.append({"model": model, "case": case["name"], "seconds": round(time.perf_counter() - t0, 2)})
            print(f"warm {model} {case['name']}: {took[-1]['seconds']} s", flush=True)
            del call
    (out / "warm.json").write_text(json.dumps({"dtype": args.dtype, "device": str(device), "calls": took}, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="folder for CASE.json, CASE.txt, CASE.trace.json.gz")
    p.add_argument("--model", default="bert-base", help="a preset of bert-fast bench (default bert-base)")
    p.add_argument("--models", default=None, help="--warm-only: comma-separated (default: --model)")
    p.add_argument("--cases", default=None, help=f"comma-separated (default {CASES}; --warm-only: {WARM_CASES})")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before the timed and profiled ones")
    p.add_argument("--calls", type=int, default=10, help="unprofiled calls timed for the wall time")
    p.add_argument("--warm-only", action="store_true", help="one call per case and model, no profiler")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [parse_case(c) for c in (args.cases or (WARM_CASES if args.warm_only else CASES)).split(",")]
    if args.warm_only:
        warm(cases, (args.models or args.model).split(","), args, device, out)
        return 0
    for case in cases:
        doc = profile_case(case, args, device, out)
        print(table(doc).split("\n")[0], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
