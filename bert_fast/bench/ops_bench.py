"""``bert-fast bench-ops``: every OpCase of every op module present, per provider.

Cases come from ``bert_fast/bench/op_cases/<op>.py`` (``cases(device, dtype) -> list[OpCase]``).
A memory-bound case reports GB/s = case.bytes / time and its % of the measured copy bandwidth; a
compute-bound case reports TFLOP/s = case.flops / time and its % of the measured GEMM rate (both
figures are given whenever the case declares bytes / flops).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from bert_fast.bench.model_options import add_target_argument, rounds_args
from bert_fast.bench.op_backends import OP_KERNELS
from bert_fast.bench.results import fill_speedups, flags, new_record, record_failure, speedup_text, take_timings

CASES_PACKAGE = "bert_fast.bench.op_cases"


class OpsBenchError(Exception):
    pass


def discover_modules(ops: Optional[List[str]] = None) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """({op: module}, {op: import error}) for the op-case modules that exist.

    The known ops come first, in data-flow order, then any other module of the package.
    A module that is absent is skipped silently; one that fails to import is reported.
    """
    names = list(OP_KERNELS)
    try:
        pkg = importlib.import_module(CASES_PACKAGE)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_") and info.name not in names:
                names.append(info.name)
    except ImportError:
        pass
    if ops:
        unknown = [o for o in ops if o not in names]
        if unknown:
            raise OpsBenchError(
                f"unknown op(s) {', '.join(unknown)}; op case modules present or expected: {', '.join(names)}"
            )
        names = [n for n in names if n in ops]
    modules, errors = {}, {}
    for name in names:
        full = f"{CASES_PACKAGE}.{name}"
        try:
            modules[name] = importlib.import_module(full)
        except ModuleNotFoundError as exc:
            if exc.name == full:
                continue
            errors[name] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001
            errors[name] = f"{type(exc).__name__}: {exc}"
    return modules, errors


def _summ_provider(case, rec, ceilings):
    """GB/s, TFLOP/s and the % of the ceiling the case is bound by. A figure above 100% of its
    ceiling, or quoted against an unstable ceiling, carries the flag "ceiling unstable": a rate
    above a ceiling means the ceiling was not one here (measured while the machine was busier, or
    the op's data stayed in a cache the large copy cannot use)."""
    sec = rec["median_ms"] * 1e-3
    rec["gbs"] = case.bytes / sec / 1e9 if case.bytes else None
    rec["tflops"] = case.flops / sec / 1e12 if case.flops else None
    rec["pct_of_ceiling_ci"] = None
    if case.bound == "compute" and rec["tflops"] is not None:
        rec["ceiling"] = "matmul_tflops"
        work, unstable = case.flops / 1e12, ceilings.get("matmul_unstable")
    elif rec["gbs"] is not None:
        rec["ceiling"] = "copy_bandwidth_gbs"
        work, unstable = case.bytes / 1e9, ceilings.get("copy_unstable")
    else:
        rec["ceiling"] = None
        rec["pct_of_ceiling"] = None
        rec["ceiling_unstable"] = None
        return
    ceiling = ceilings[rec["ceiling"]]
    rec["pct_of_ceiling"] = 100.0 * work / sec / ceiling
    if rec.get("ci_low_ms") and rec.get("ci_high_ms"):
        rec["pct_of_ceiling_ci"] = [
            100.0 * work / (rec["ci_high_ms"] * 1e-3) / ceiling,
            100.0 * work / (rec["ci_low_ms"] * 1e-3) / ceiling,
        ]
    rec["ceiling_unstable"] = bool(unstable or rec["pct_of_ceiling"] > 100.0)


def format_table(doc: Dict[str, Any]) -> str:
    header = (
        f"{'case':<50} {'provider':<24} {'median ms':>10} {'95% CI ms':>19} {'p20-p80 ms':>19} {'GB/s':>9} "
        f"{'TFLOP/s':>8} {'% ceiling':>10} {'speedup of bert_fast':>22}  flags"
    )
    lines = [header, "-" * len(header)]
    for c in doc.get("cases", []):
        name = c["name"]
        for r in c.get("results", []):
            if r["status"] != "ok":
                err = (r.get("error") or "").splitlines()[0][:100] if r.get("error") else ""
                lines.append(f"{name:<50.50} {r['provider']:<24} {r['status'].upper():>10}  {err}")
                continue
            gbs = f"{r['gbs']:.1f}" if r.get("gbs") is not None else "-"
            tfl = f"{r['tflops']:.2f}" if r.get("tflops") is not None else "-"
            pct = f"{r['pct_of_ceiling']:.1f}%" if r.get("pct_of_ceiling") is not None else "-"
            tag = {"matmul_tflops": " mm", "copy_bandwidth_gbs": " bw"}.get(r.get("ceiling"), "")
            lines.append(
                f"{name:<50.50} {r['provider']:<24} {r['median_ms']:>10.4f} "
                f"{r['ci_low_ms']:>9.4f}-{r['ci_high_ms']:<9.4f} "
                f"{r['p20_ms']:>9.4f}-{r['p80_ms']:<9.4f} {gbs:>9} {tfl:>8} {pct + tag:>10} "
                f"{speedup_text(r):>22}  {flags(r)}".rstrip()
            )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=None, help=f"comma-separated subset of the ops ({', '.join(OP_KERNELS)})")
    p.add_argument(
        "--providers",
        default=None,
        help="comma-separated subset of the providers of each case (e.g. bert_fast,torch); default: all",
    )
    p.add_argument("--filter", default=None, help="only cases whose name contains this text")
    p.add_argument("--direction", choices=("fwd", "bwd", "all"), default="all")
    p.add_argument(
        "--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="default: bf16 on CUDA, fp32 on the CPU"
    )
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed rounds first, each calling every provider once (default: 10 on CUDA, 1 on the CPU)",
    )
    p.add_argument(
        "--min-rounds", type=int, default=None, help="timed rounds at least (default: 10 on CUDA, 6 on the CPU)"
    )
    p.add_argument(
        "--max-rounds",
        "--iters",
        type=int,
        default=None,
        dest="max_rounds",
        help="timed rounds at most; a round calls every provider of the case once, in carry-over "
        "balanced orders (default: 500 on CUDA, 50 on the CPU)",
    )
    add_target_argument(p)
    p.add_argument(
        "--inputs",
        type=int,
        default=3,
        dest="n_inputs",
        help="input sets (factory calls) per provider, rotated among the rounds (default: 3)",
    )
    p.add_argument(
        "--max-cases",
        type=int,
        default=None,
        help="at most this many cases per op (default: all on CUDA, 1 on the CPU)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="time budget of one case's rounds (default: 3 on CUDA, 20 on the CPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads, fixed for the run and reported (default: torch's current count)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        default=5.0,
        help="skip a case whose estimated cost (its FLOPs and bytes at the measured ceilings: first "
        "calls, warm-up and the minimum rounds of every provider) exceeds this (default: 5)",
    )
    p.add_argument("--flush-l2", action="store_true", help="flush the L2 cache before each timed call (CUDA)")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG of the per-op %% of roofline")
    p.add_argument("--no-progress", action="store_true")


def run_op_case(case, entry: Dict[str, Any], providers: List[str], device, args, ceilings, timer=None) -> None:
    """Build every provider's input sets (one untimed call each: compile, autotune, and on CUDA the
    peak memory of its inputs plus one call), then time the providers side by side in interleaved
    rounds (bert_fast.bench.timing.measure). A provider that cannot run here is skipped with its
    reason; one that fails is an error; neither stops the others."""
    import torch

    from bert_fast.bench.timing import allocated_memory, measure, peak_memory, reset_peak_memory, synchronize

    fns: Dict[str, List[Any]] = {}
    recs: Dict[str, Dict[str, Any]] = {}
    cuda = device.type == "cuda"
    failure = dict(where=f"{case.name} ", with_traceback=True)

    try:
        for provider in providers:
            rec = recs[provider] = new_record(provider, "ops")
            entry["results"].append(rec)
            reason = (getattr(case, "unavailable", None) or {}).get(provider)
            if reason:
                rec.update(status="skipped", error=reason)
                print(f"  {case.name} {provider}: skipped: {reason}", file=sys.stderr)
                continue
            try:
                base = allocated_memory(device)
                reset_peak_memory(device)
                sets = [case.providers[provider]() for _ in range(args.n_inputs)]
                sets[0]()
                synchronize(device)
                peak = peak_memory(device)
                rec["peak_mem_bytes"] = max(0, peak - base) if peak is not None and base is not None else None
                fns[provider] = sets
            except Exception as exc:  # noqa: BLE001
                record_failure(rec, exc, **failure)
        if not fns:
            return
        m = measure(fns, device, **rounds_args(args), budget_s=args.max_seconds, flush_l2=args.flush_l2, timer=timer)
        entry["timing"] = m.summary()
        for provider in take_timings(m, recs, **failure):
            _summ_provider(case, recs[provider], ceilings)
        fill_speedups(entry, m)
    except KeyboardInterrupt:
        for rec in recs.values():
            if rec["status"] == "ok" and rec["median_ms"] is None:
                rec.update(status="interrupted", error="interrupted")
        raise
    finally:
        fns.clear()
        if cuda:
            torch.cuda.empty_cache()


def run(args, modules: Optional[Dict[str, Any]] = None) -> int:
    """``bert-fast bench-ops``. ``modules`` ({op: module with cases()}) replaces discovery (tests)."""
    from bert_fast.bench import ceilings as ceil_mod
    from bert_fast.bench.results import close_document, run_document

    device = _apply_defaults(args)
    dtype = ceil_mod.parse_dtype(args.dtype)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    modules, import_errors = discover_modules(ops) if modules is None else (modules, {})
    notes = _notes(args, device, modules, import_errors)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    ceilings = ceil_mod.measure(device, dtype)
    print(f"ceilings on {device}: {ceil_mod.describe(ceilings, args.dtype)}", file=sys.stderr)
    doc = run_document("ops", device, args, ceilings, notes)
    doc["import_errors"] = import_errors
    doc["cases"] = []
    selected = _provider_filter(args, device)
    todo = [(c, [p for p in c.providers if selected(p)]) for c in _collect_cases(modules, device, dtype, args, doc)]
    skip_why, estimates = _estimate(todo, ceilings, device, args)
    t0 = time.perf_counter()
    interrupted = _run_cases(todo, skip_why, estimates, doc, device, args, ceilings)
    close_document(doc, interrupted, t0)
    return _publish(doc, notes, import_errors, interrupted, args)


def _apply_defaults(args):
    """Fill the device-dependent defaults in ``args`` and check the values; returns the device."""
    from bert_fast.bench.model_options import BenchError, resolve_device
    from bert_fast.bench.timing import fix_threads

    try:
        device = resolve_device(args.device)
    except BenchError as exc:
        raise OpsBenchError(str(exc)) from None
    cuda = device.type == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.warmup = (10 if cuda else 1) if args.warmup is None else args.warmup
    args.min_rounds = (10 if cuda else 6) if args.min_rounds is None else args.min_rounds
    args.max_rounds = (500 if cuda else 50) if args.max_rounds is None else args.max_rounds
    args.max_seconds = (3.0 if cuda else 20.0) if args.max_seconds is None else args.max_seconds
    if args.max_rounds < 1 or args.min_rounds < 1 or args.warmup < 0 or args.n_inputs < 1:
        raise OpsBenchError("--min-rounds, --max-rounds and --inputs must be >= 1 and --warmup >= 0")
    if not 0 < args.target < 1:
        raise OpsBenchError(f"--target must be in (0, 1), got {args.target}")
    if not args.max_minutes > 0:
        raise OpsBenchError(f"--max-minutes must be > 0, got {args.max_minutes}")
    if args.threads is not None and args.threads < 1:
        raise OpsBenchError(f"--threads must be >= 1, got {args.threads}")
    args.threads = fix_threads(args.threads)
    if args.max_cases is None and not cuda:
        args.max_cases = 1
    return device


def _notes(args, device, modules, import_errors) -> List[str]:
    """What the run measures (the CPU path on a CPU), the modules that failed, or that none exist."""
    notes: List[str] = []
    if device.type != "cuda":
        notes.append(
            "This measures the CPU path. No CUDA GPU: bert_fast's Triton and CUDA kernels are not "
            "measured here; the bert_fast provider runs the implementation bert_fast.ops._dispatch "
            "picks for CPU tensors (the Triton interpreter with TRITON_INTERPRET=1), "
            f"{args.threads} thread(s); at most "
            f"{args.max_cases} case(s) per op (--max-cases); torch.compile providers are left out "
            f"unless named in --providers (compiling C++ on the CPU takes minutes)."
        )
    for op, err in import_errors.items():
        notes.append(f"op case module {op} failed to import: {err}")
    if not modules:
        msg = (
            f"no op case modules found in {CASES_PACKAGE} (expected modules named "
            f"{', '.join(OP_KERNELS)}, each with cases(device, dtype)); nothing to benchmark"
        )
        notes.append(msg)
        print(f"bert-fast bench-ops: {msg}", file=sys.stderr)
    return notes


def _entry(case, dtype_name: str) -> Dict[str, Any]:
    """A case's record in the JSON (its results come later)."""
    fields = ("name", "op", "label", "direction", "bound", "flops", "bytes", "params")
    return {**{k: getattr(case, k) for k in fields}, "dtype": dtype_name, "results": []}


def _collect_cases(modules, device, dtype, args, doc) -> List[Any]:
    """Every op's cases that --direction, --filter and --max-cases keep; an op whose cases() raised
    is an error entry in the document."""
    todo = []
    for op, mod in modules.items():
        try:
            cases = list(mod.cases(device, dtype))
        except Exception as exc:  # noqa: BLE001
            what = dict(name=f"{op}/cases()", op=op, label="cases()", direction="-", bound="-", flops=0, bytes=0)
            entry = _entry(SimpleNamespace(**what, params={}), args.dtype)
            entry["results"] = [
                {"provider": "-", "status": "error", "error": f"cases() raised {type(exc).__name__}: {exc}"}
            ]
            doc["cases"].append(entry)
            continue
        if args.direction != "all":
            cases = [c for c in cases if c.direction == args.direction]
        if args.filter:
            cases = [c for c in cases if args.filter in c.name]
        if args.max_cases is not None:
            cases = cases[: args.max_cases]
        todo.extend(cases)
    return todo


def _provider_filter(args, device) -> Callable[[str], bool]:
    """Whether a case's provider runs: those of --providers, else all but torch.compile on a CPU."""
    wanted = [p.strip() for p in args.providers.split(",") if p.strip()] if args.providers else None
    skip_compile = device.type != "cuda" and wanted is None
    return lambda provider: provider in wanted if wanted else not (skip_compile and "compile" in provider)


def _estimate(todo, ceilings, device, args) -> Tuple[Dict[int, str], List[Optional[float]]]:
    """Bounded time: each case estimated before anything runs; ({index: why} of the cases over
    --max-minutes, each case's expected seconds for the progress lines)."""
    from bert_fast.bench.budget import estimate_op_case

    estimates, skip_why = [], {}
    for i, (case, chosen) in enumerate(todo):
        est = estimate_op_case(
            case,
            chosen,
            ceilings,
            device.type,
            warmup=args.warmup,
            min_rounds=args.min_rounds,
            max_rounds=args.max_rounds,
            max_seconds=args.max_seconds,
        )
        over = est is not None and est.min_s > args.max_minutes * 60
        estimates.append(None if over or est is None else est.expected_s)
        if over:
            skip_why[i] = (
                f"estimated {est.describe(len(chosen), ceilings['matmul_tflops'])}, over the budget "
                f"of --max-minutes {args.max_minutes:g}; raise --max-minutes to run it"
            )
    return skip_why, estimates


def _run_cases(todo, skip_why, estimates, doc, device, args, ceilings) -> bool:
    """Every case in order (a skipped one recorded with why), the JSON rewritten after each; True
    when interrupted (what was measured is kept)."""
    from bert_fast.bench.budget import Progress
    from bert_fast.bench.results import write_json

    progress = Progress(estimates, enabled=not args.no_progress, every_s=30.0)
    try:
        for i, (case, chosen) in enumerate(todo):
            entry = _entry(case, args.dtype)
            doc["cases"].append(entry)
            why = skip_why.get(i)
            if why:
                entry["skipped"] = why
                entry["results"] = [dict(new_record(p, "ops"), status="skipped", error=f"case {why}") for p in chosen]
                print(f"skipping {case.name}: {why}", file=sys.stderr)
            else:
                progress.start_case(i, case.name)
                run_op_case(case, entry, chosen, device, args, ceilings)
                progress.end_case()
            if args.json:
                write_json(args.json, doc)
    except KeyboardInterrupt:
        print("interrupted: writing what was measured", file=sys.stderr)
        return True
    return False


def _publish(doc, notes, import_errors, interrupted: bool, args) -> int:
    """The table, JSON and plot; the exit status (130 interrupted, 1 when a case or module failed)."""
    from bert_fast.bench import plots
    from bert_fast.bench.results import publish

    out_cases = doc["cases"]
    publish(doc, format_table(doc) if out_cases else None, notes, args.json, args.plot, plots.plot_ops, "op figures")
    if interrupted:
        return 130
    failed = [c["name"] for c in out_cases for r in c["results"] if r["status"] == "error"]
    if failed or import_errors:
        print(
            f"bert-fast bench-ops: {len(failed)} case/provider run(s) failed"
            + (f", {len(import_errors)} op module(s) failed to import" if import_errors else ""),
            file=sys.stderr,
        )
        return 1
    return 0
