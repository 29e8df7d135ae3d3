"""``bert-fast bench``: the whole-model benchmark (bert_fast against Hugging Face transformers).

Every provider gets the same random weights (one state dict, seeded), the same random token ids
(never 0, the pad id) and the same attention masks, built from ``--lengths``. Figures per provider:
median and p20/p80 milliseconds per call (a forward in ``infer``, forward + backward + AdamW step in
``train``), tokens/s on real tokens, MFU against the measured GEMM rate, peak memory, and the
speedup of bert_fast over it. No hub is ever reached: configs are built in code (or read from a
local directory) and weights are random.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


from bert_fast.bench.model_providers import (_hidden, _make_optimizer, bert_fast_model_class,
                                             build_provider_model, make_step, reference_state_dict)
from bert_fast.bench.model_workload import BenchError, load_config, make_inputs, parse_lengths, step_flops

PROVIDERS = ("bert_fast", "hf-eager", "hf-sdpa", "hf-compile")
MODES = ("infer", "train")
BASELINE_ORDER = ("hf-compile", "hf-sdpa", "hf-eager")

# Presets (no downloads): shapes of the Hugging Face checkpoints of the same names.
CPU_NOTE = ("No CUDA GPU: bert_fast's Triton and CUDA kernels need a CUDA GPU. On this CPU, the "
            "bert_fast provider runs its pure-PyTorch reference path{interp}, so these figures "
            "measure CPU PyTorch, not the kernels; the speedups and MFU say nothing about GPU speed.")


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None, None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=total, desc=desc, unit="it", leave=False, file=sys.stderr, dynamic_ncols=True)
    return bar, (lambda k: bar.update(k))


def _cleanup(device) -> None:
    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass


def _parity(reference_out, bf_out, mask) -> Dict[str, Any]:
    """Max |bert_fast - reference| over real tokens (pads are not compared)."""
    a = reference_out.float()
    b = bf_out.float()
    m = mask.bool()
    diff = (a[m] - b[m]).abs()
    return {"max_abs_diff": float(diff.max()) if diff.numel() else 0.0,
            "mean_abs_diff": float(diff.mean()) if diff.numel() else 0.0,
            "ref_max_abs": float(a[m].abs().max()) if diff.numel() else 0.0}


def run_case(case: Dict[str, Any], providers: Sequence[str], device, dtype, *, warmup: int, iters: int,
             n_inputs: int, seed: int, progress: bool, ceilings: Dict[str, Any],
             max_seconds: Optional[float] = None, on_result: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """Run every provider on one (model, batch, seq, lengths, mode) case; fills ``case['results']``."""
    import torch

    from bert_fast.bench.timing import reset_peak_memory, time_callables

    config = case["_config"]
    mode = case["mode"]
    lengths = case["_lengths"]
    state = reference_state_dict(config, case["model"], seed)
    inputs = make_inputs(config, lengths, case["seq"], device, n_inputs, seed)
    real = int(sum(lengths))
    flops = case["flops_per_step"]
    matmul_rate = ceilings.get("matmul_tflops")
    results: List[Dict[str, Any]] = case.setdefault("results", [])
    parity_outs: Dict[str, Any] = {}
    label = f"{case['model']} B={case['batch']} S={case['seq']} {case['lengths']} {mode}"
    for provider in providers:
        rec: Dict[str, Any] = {"provider": provider, "status": "ok", "error": None, "notes": [],
                               **{k: None for k in ("median_ms", "p20_ms", "p80_ms", "mean_ms", "min_ms", "max_ms",
                                                    "iters", "method", "tokens_per_s", "padded_tokens_per_s",
                                                    "tflops", "mfu", "peak_mem_bytes", "peak_mem_mb",
                                                    "speedup_of_bert_fast")}}
        model = runner = optimizer = None
        bar = None
        try:
            if provider == "bert_fast":
                try:
                    bert_fast_model_class()
                except (ImportError, AttributeError) as exc:
                    rec.update(status="unavailable", error=f"bert_fast.BertModel not importable: {exc}")
                    results.append(rec)
                    continue
            reset_peak_memory(device)
            model, runner, notes = build_provider_model(provider, config, state, device, dtype, mode,
                                                        case["cuda_graphs"])
            rec["notes"] = notes
            if mode == "train":
                optimizer = _make_optimizer(model, device)
            fns = [make_step(runner, model, inp, mode, optimizer) for inp in inputs]
            if mode == "infer" and provider in ("hf-eager", "hf-sdpa", "bert_fast"):
                # one untimed forward on the first input set, kept (on the CPU) for the parity check
                with torch.no_grad():
                    out = runner(**inputs[0])
                    parity_outs[provider] = _hidden(out).detach().float().cpu()
                    del out
            bar, cb = _progress(warmup + iters, f"{label} | {provider}", progress)
            t = time_callables(fns, device, warmup=warmup, iters=iters, progress=cb, max_seconds=max_seconds)
            del fns
            sec = t.median_ms * 1e-3
            rec.update(t.to_dict())
            rec["tokens_per_s"] = real / sec
            rec["padded_tokens_per_s"] = case["batch"] * case["seq"] / sec
            rec["tflops"] = flops / sec / 1e12
            rec["mfu"] = rec["tflops"] / matmul_rate if matmul_rate else None
            rec["peak_mem_mb"] = t.peak_mem_bytes / 2**20 if t.peak_mem_bytes is not None else None
        except KeyboardInterrupt:
            rec.update(status="interrupted", error="interrupted (timeout or Ctrl-C)")
            results.append(rec)
            raise
        except BenchError:
            raise
        except Exception as exc:  # noqa: BLE001 - one provider failing must not lose the others
            msg = f"{type(exc).__name__}: {exc}"
            rec.update(status="error", error=msg[:2000])
            print(f"  {provider}: FAILED: {msg.splitlines()[0] if msg else msg}", file=sys.stderr)
        finally:
            if bar is not None:
                bar.close()
            del model, runner, optimizer
            _cleanup(device)
        results.append(rec)
        _fill_speedups(case)
        if on_result is not None:
            on_result()
    ref = next((p for p in ("hf-eager", "hf-sdpa") if p in parity_outs), None)
    if ref is not None and "bert_fast" in parity_outs:
        case["parity"] = {"reference": ref, **_parity(parity_outs[ref], parity_outs["bert_fast"],
                                                      inputs[0]["attention_mask"].cpu())}
    _fill_speedups(case)
    return case


def _fill_speedups(case: Dict[str, Any]) -> None:
    """speedup_of_bert_fast = provider median / bert_fast median (>1: bert_fast is faster)."""
    res = case.get("results", [])
    bf = next((r for r in res if r["provider"] == "bert_fast" and r["status"] == "ok"), None)
    for r in res:
        ok = r["status"] == "ok" and bf is not None
        r["speedup_of_bert_fast"] = (r["median_ms"] / bf["median_ms"]) if ok else None
    case["speedups"] = {r["provider"]: r["speedup_of_bert_fast"] for r in res
                        if r["provider"] != "bert_fast" and r.get("speedup_of_bert_fast") is not None}


# ----------------------------------------------------------------------------- table
def format_table(doc: Dict[str, Any]) -> str:
    lines = []
    header = (f"{'case':<44} {'provider':<11} {'median ms':>10} {'p20-p80 ms':>16} {'tokens/s':>11} "
              f"{'TFLOP/s':>8} {'MFU':>6} {'peak MiB':>9} {'bf speedup':>10}")
    for case in doc.get("runs", []):
        label = (f"{case['model']} {case['mode']} B={case['batch']} S={case['seq']} {case['lengths']}"
                 + (" graphs" if case.get("cuda_graphs") else ""))
        lines.append(header)
        lines.append("-" * len(header))
        for r in case.get("results", []):
            if r["status"] != "ok":
                err = (r.get("error") or "").splitlines()[0][:90] if r.get("error") else ""
                lines.append(f"{label:<44.44} {r['provider']:<11} {r['status'].upper():>10}  {err}")
                continue
            sp = r.get("speedup_of_bert_fast")
            mfu = r.get("mfu")
            mem = r.get("peak_mem_mb")
            lines.append(
                f"{label:<44.44} {r['provider']:<11} {r['median_ms']:>10.3f} "
                f"{r['p20_ms']:>7.3f}-{r['p80_ms']:<8.3f} {r['tokens_per_s']:>11,.0f} {r['tflops']:>8.2f} "
                f"{(f'{100 * mfu:.1f}%' if mfu is not None else '-'):>6} "
                f"{(f'{mem:,.0f}' if mem is not None else '-'):>9} "
                f"{(f'{sp:.2f}x' if sp is not None else '-'):>10}")
        par = case.get("parity")
        if par:
            lines.append(f"  parity bert_fast vs {par['reference']} (real tokens): max |diff| "
                         f"{par['max_abs_diff']:.3e} (|ref| max {par['ref_max_abs']:.2f})")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- CLI
def _csv(text: str) -> List[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _int_list(name: str):
    def parse(text: str) -> List[int]:
        try:
            vals = [int(v) for v in _csv(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer or a comma-separated list of integers, "
                                             f"got {text!r}") from None
        if not vals or any(v < 1 for v in vals):
            raise argparse.ArgumentTypeError(f"{name} values must be >= 1, got {text!r}")
        return vals
    return parse


def _providers(text: str) -> List[str]:
    names = _csv(text)
    bad = [n for n in names if n not in PROVIDERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown provider(s) {', '.join(map(repr, bad)) or repr(text)}; "
                                         f"valid providers: {', '.join(PROVIDERS)}")
    return list(dict.fromkeys(names))


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _pos_int(text: str) -> int:
    v = _nonneg_int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="bert-base, bert-large, minilm (all-MiniLM-L6-v2 shapes), tiny, or a local "
                        "checkpoint directory with config.json; comma-separated for several "
                        "(default: bert-base on CUDA, tiny on the CPU). Weights are always random.")
    p.add_argument("--batch", type=_int_list("--batch"), default=None,
                   help="batch size(s), comma-separated for a grid (default: 32 on CUDA, 2 on the CPU)")
    p.add_argument("--seq", type=_int_list("--seq"), default=None,
                   help="padded sequence length(s), comma-separated for a grid (default: 128 on CUDA, 64 on the CPU)")
    p.add_argument("--lengths", default="full",
                   help="real lengths: full | random:MINFRAC (uniform in [MINFRAC, 1] x seq, fixed seed) | "
                        "path to a file of integers (default: full)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"),
                   help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--mode", default="infer", choices=MODES,
                   help="infer: forward under no_grad; train: forward + backward + AdamW step")
    p.add_argument("--providers", type=_providers, default=None,
                   help=f"comma-separated, from {', '.join(PROVIDERS)} "
                        "(default: bert_fast,hf-eager,hf-sdpa,hf-compile on CUDA; bert_fast,hf-eager,hf-sdpa on the CPU)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="infer only: bert_fast through bert_fast.cuda_graphs.CudaGraphRunner, hf-compile "
                        "with mode='reduce-overhead'")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--warmup", type=_nonneg_int, default=None, help="untimed calls (default: 10 on CUDA, 2 on the CPU)")
    p.add_argument("--iters", type=_pos_int, default=None, help="timed calls (default: 50 on CUDA, 5 on the CPU)")
    p.add_argument("--inputs", type=_pos_int, default=3, dest="n_inputs",
                   help="input sets rotated among the timed calls (default: 3)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop timing a provider after this many seconds (at least 5 calls)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG: speedup by batch and sequence length")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_device(name: Optional[str]):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise BenchError(f"--device {name!r} is not a device (use cuda, cuda:N or cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"--device {name}: torch sees no CUDA GPU (torch {torch.__version__})")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise BenchError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    if dev.type not in ("cuda", "cpu"):
        raise BenchError(f"--device {name}: only cuda and cpu are supported")
    return dev


def apply_defaults(args) -> Tuple[Any, List[str]]:
    """Fill the device-dependent defaults in ``args``; returns (device, notes)."""
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    notes: List[str] = []
    if args.model is None:
        args.model = "bert-base" if cuda else "tiny"
    if args.batch is None:
        args.batch = [32] if cuda else [2]
    if args.seq is None:
        args.seq = [128] if cuda else [64]
    if args.dtype is None:
        args.dtype = "bf16" if cuda else "fp32"
    if args.providers is None:
        args.providers = list(PROVIDERS) if cuda else ["bert_fast", "hf-eager", "hf-sdpa"]
    if args.warmup is None:
        args.warmup = 10 if cuda else 2
    if args.iters is None:
        args.iters = 50 if cuda else 5
    if args.cuda_graphs and args.mode != "infer":
        raise BenchError("--cuda-graphs applies to --mode infer only")
    if not cuda:
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        notes.append(CPU_NOTE.format(interp=" (TRITON_INTERPRET=1: the Triton kernels through the "
                                            "interpreter, far slower than the reference)" if interp else ""))
        if args.cuda_graphs:
            notes.append("--cuda-graphs has no effect on the CPU")
        if "hf-compile" in args.providers:
            notes.append("hf-compile on the CPU compiles C++ with the host compiler: the first call takes long")
    return device, notes


def run(args) -> int:
    """``bert-fast bench``."""
    import torch

    from bert_fast.bench import ceilings as ceil_mod
    from bert_fast.bench.results import new_document, write_json

    device, notes = apply_defaults(args)
    dtype = ceil_mod.parse_dtype(args.dtype)
    models = _csv(args.model)
    configs = {}
    for m in models:
        configs[m] = load_config(m)   # raises BenchError naming the path
    cases: List[Dict[str, Any]] = []
    for m in models:
        cfg = configs[m]
        for b in args.batch:
            for s in args.seq:
                if s > cfg.max_position_embeddings:
                    raise BenchError(f"--seq {s} exceeds max_position_embeddings={cfg.max_position_embeddings} of {m}")
                lengths = parse_lengths(args.lengths, b, s, args.seed)
                cases.append({"model": m, "config": {k: getattr(cfg, k) for k in (
                    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                    "vocab_size", "max_position_embeddings", "type_vocab_size")},
                    "batch": b, "seq": s, "lengths": args.lengths, "length_values": lengths,
                    "real_tokens": int(sum(lengths)), "padded_tokens": b * s, "mode": args.mode,
                    "dtype": args.dtype, "cuda_graphs": bool(args.cuda_graphs),
                    "flops_per_step": step_flops(cfg, lengths, args.mode),
                    "flops_per_token": step_flops(cfg, lengths, args.mode) / max(1, sum(lengths)),
                    "parity": None, "results": [], "_config": cfg, "_lengths": lengths})

    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    print(f"bert-fast bench: {len(cases)} case(s) x {len(args.providers)} provider(s) on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), {args.dtype}, "
          f"{args.mode}", file=sys.stderr)
    print("measuring ceilings (copy bandwidth, GEMM rate)...", file=sys.stderr)
    ceilings = ceil_mod.measure(device, dtype)
    print(f"  copy {ceilings['copy_bandwidth_gbs']:.1f} GB/s, {args.dtype} GEMM "
          f"{ceilings['matmul_tflops']:.2f} TFLOP/s", file=sys.stderr)

    arguments = {k: v for k, v in vars(args).items() if k not in ("func", "handler")}
    arguments["device"] = str(device)
    doc = new_document("model", device, arguments, ceilings, notes)
    doc["runs"] = cases

    def public() -> Dict[str, Any]:
        return {**doc, "runs": [{k: v for k, v in c.items() if not k.startswith("_")} for c in cases]}

    def save():
        if args.json:
            write_json(args.json, public())

    interrupted = False
    t0 = time.perf_counter()
    try:
        for case in cases:
            run_case(case, args.providers, device, dtype, warmup=args.warmup, iters=args.iters,
                     n_inputs=args.n_inputs, seed=args.seed, progress=not args.no_progress,
                     ceilings=ceilings, max_seconds=args.max_seconds, on_result=save)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing what was measured", file=sys.stderr)
    doc["status"] = "interrupted" if interrupted else "complete"
    doc["wall_seconds"] = time.perf_counter() - t0
    out = public()
    print(format_table(out))
    for n in notes:
        print(f"note: {n}")
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    if args.plot:
        from bert_fast.bench.plots import plot_model

        if plot_model(out, args.plot):
            print(f"wrote {args.plot}")
        else:
            print(f"no successful figures to plot; {args.plot} not written", file=sys.stderr)
    failed = [(c["model"], r["provider"]) for c in cases for r in c["results"] if r["status"] == "error"]
    if interrupted:
        return 130
    if failed:
        print(f"bert-fast bench: {len(failed)} provider run(s) failed: "
              + ", ".join(f"{m}/{p}" for m, p in failed), file=sys.stderr)
        return 1
    return 0
