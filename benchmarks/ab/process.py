"""Settings a process reads once, at its start: glibc's allocator (one run per setting, the environment
given on the command line) and the capacity of oneDNN's caches (a process per sample)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

import bert_fast
from bert_fast.bench import timing

from .harness import minilm_path, variant

HERE = Path(__file__).resolve().parent
CPU_AB = HERE.parent / "cpu_ab.py"
MEMORY = HERE.parent / "memory"  # soak.py: the stream of random shapes, the CPU's name


@variant("allocator", rounds=21)
def allocator(args) -> int:
    """transformers SDPA against bert_fast.optimize() on all-MiniLM-L6-v2, dense 8 x 128, fp32, per malloc setting.

    In a process of their own, interleaved rounds (timing.measure), medians
    (benchmarks/notes/2026-11-24-cpu-masks-freeze-targets.md, "What decides the dense fp32 cases").
    Run it twice, the second time with glibc's fresh-page behaviour switched off:

        python benchmarks/cpu_ab.py allocator
        MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 python benchmarks/cpu_ab.py allocator
    """
    torch.set_num_threads(args.threads)
    path = minilm_path()
    hf = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    fast = bert_fast.optimize(transformers.BertModel.from_pretrained(path, attn_implementation="sdpa")).eval()
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    models = {"transformers": hf, "bert_fast": fast}
    with torch.inference_mode():
        res = timing.measure(
            {k: (lambda m=m: m(input_ids=ids, attention_mask=mask)) for k, m in models.items()},
            warmup=3,
            min_rounds=args.rounds,
            max_rounds=args.rounds,
            catch=False,
        )
    med = {k: t.median_ms for k, t in res.timings.items()}
    env = os.environ.get("MALLOC_MMAP_THRESHOLD_", "default malloc")
    print(
        f"{env}: transformers {med['transformers']:.1f} ms, bert_fast {med['bert_fast']:.1f} ms, "
        f"speedup {med['transformers'] / med['bert_fast']:.3f}x"
    )
    return 0


# --------------------------------------------------------------------- onednn-cache
SETTINGS = {"bounded (64)": "64", "oneDNN default (1024)": "1024"}


def _stream_seconds(provider: str, forwards: int, threads: int) -> float:
    """The child: seconds of ``forwards`` random-shape forwards, after a warm-up on other shapes.
    bert_fast sets no cache capacity here: the parent put both in the environment."""
    sys.path.insert(0, str(MEMORY))
    from soak import shapes

    torch.set_num_threads(threads)
    model = transformers.BertModel.from_pretrained(minilm_path()).eval()
    model = bert_fast.optimize(model, freeze=provider == "frozen").eval()
    gen = torch.Generator().manual_seed(0)

    def run(seq):
        for b, s, lens in seq:
            ids = torch.randint(1000, model.config.vocab_size, (b, s), generator=gen)
            mask = torch.zeros(b, s, dtype=torch.long)
            for r, n in enumerate(lens):
                mask[r, :n] = 1
            model(input_ids=ids, attention_mask=mask)

    with torch.inference_mode():
        run(shapes(30, seed=1))  # warm-up on other shapes: first-call costs, the GEMM choices
        t0 = time.perf_counter()
        run(shapes(forwards, seed=0))
        return time.perf_counter() - t0


def _child_process(provider: str, setting: str, args) -> float:
    """One sample: the stream's seconds in a fresh process whose caches hold ``setting`` entries."""
    env = dict(os.environ, ONEDNN_PRIMITIVE_CACHE_CAPACITY=setting, LRU_CACHE_CAPACITY=setting)
    cmd = [sys.executable, str(CPU_AB), "onednn-cache", "--child", provider, "--forwards", str(args.forwards)]
    cmd += ["--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("SECONDS ")][-1][8:])


def _onednn_arguments(ap) -> None:
    ap.add_argument("--providers", default="plain,frozen")
    ap.add_argument("--forwards", type=int, default=200)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)


@variant("onednn-cache", rounds=4, arguments=_onednn_arguments)
def onednn_cache(args) -> int:
    """Time cost of bounding oneDNN's caches (bert_fast/onednn_caches.py, #32 item 7): 64 entries against 1024.

    The same stream of random shapes (memory/soak.py's: batch 1-16, length 1-256, ragged) through
    all-MiniLM-L6-v2, with the caches at bert_fast's bound (64) and at oneDNN's default (1024).

    The capacities are read once per process, so each sample is a process of its own: rounds alternate
    the two settings (the order flips every round), each process warms up on other shapes, then times
    the stream. Prints the CPU, each round's seconds and the median ratio with its min-max over the rounds.

        python benchmarks/cpu_ab.py onednn-cache --providers plain,frozen --rounds 4 --forwards 200
    """
    if args.child:
        print("SECONDS " + json.dumps(_stream_seconds(args.child, args.forwards, args.threads)), flush=True)
        return 0
    sys.path.insert(0, str(MEMORY))
    from soak import cpu_model

    print(f"{cpu_model()}, {args.threads} threads, {args.forwards} random-shape forwards per process")
    for prov in [x for x in args.providers.split(",") if x]:
        secs = {name: [] for name in SETTINGS}
        for r in range(args.rounds):
            for name in list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]:
                secs[name].append(_child_process(prov, SETTINGS[name], args))
        a, b = (secs[n] for n in SETTINGS)
        ratios = [y / x for x, y in zip(a, b)]  # default time / bounded time: > 1 means bounded is faster
        print(
            f"{prov}: bounded {statistics.median(a):.2f} s, default {statistics.median(b):.2f} s per stream; "
            f"bounded speedup {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
            f"seconds {json.dumps(secs)}"
        )
    return 0
