"""Streaming data from prepared token shards: peak RSS and start-up time do not grow with corpus size.

For each corpus size: generate a synthetic text corpus (random words of a small vocabulary, documents
of 20 to 2,000 words, blank line between documents) under --workdir, run ``bert-fast prepare-data``
on it, then, in a fresh subprocess, open the prepared directory the way ``bert-fast train --data DIR``
does (token_shards.open_for_training, the MaskingCollator, the lazy epoch plan, StepBatchSampler and a
DataLoader) and iterate --batches training micro-batches. The child reports

  start-up   seconds from opening the data to the first batch (index read + first reads)
  peak RSS   resource.getrusage(RUSAGE_SELF).ru_maxrss at the end (imports included), and the RSS
             after the imports, before the data was opened (the difference is what the data costs)

The issue's target (#26): peak RSS at 10 MB and 1 GB within 10%, start-up time flat.

    python benchmarks/data/stream.py --sizes-mb 10 1024 --workers 16        # the real run
    python benchmarks/data/stream.py --sizes-mb 5 50 --batches 50          # a quick check

Timings are only meaningful on an otherwise idle machine. Corpora are cached in --workdir by size
(delete it, or pass --fresh, to regenerate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _vocab(n: int, rng) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = set()
    while len(words) < n:
        k = int(rng.integers(2, 10))
        words.add("".join(rng.choice(letters, k)))
    return np.array(sorted(words))


def make_corpus(path: Path, size_mb: float, seed: int = 0, vocab_size: int = 5000) -> Path:
    """A text corpus of about size_mb MB: 16 distinct random blocks of ~4 MB, cycled (fast at 1 GB)."""
    rng = np.random.default_rng(seed)
    vocab = _vocab(vocab_size, rng)
    target = int(size_mb * (1 << 20))
    block_bytes = min(4 << 20, max(64 << 10, target // 4))
    blocks = []
    for _ in range(16):
        docs, size = [], 0
        while size < block_bytes:
            n = int(rng.integers(20, 2000))
            words = vocab[rng.integers(0, len(vocab), n)]
            lines = [" ".join(words[i : i + 40]) for i in range(0, n, 40)]  # ~40 words a line
            doc = "\n".join(lines)
            docs.append(doc)
            size += len(doc) + 2
        blocks.append(("\n\n".join(docs) + "\n\n").encode())
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    with open(tmp, "wb") as f:
        i = 0
        while written < target:
            b = blocks[i % len(blocks)]
            f.write(b)
            written += len(b)
            i += 1
    os.replace(tmp, path)
    return path


CHILD = r"""
import json, os, resource, sys, time
import argparse
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np, torch
from bert_fast.training import collator as coll, token_shards
rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = json.loads(sys.argv[1])
args = argparse.Namespace(data=cfg["data"], tokenizer=None, max_len=cfg["max_len"], task="mlm", nsp=False, truncate=False)
t0 = time.perf_counter()
tokenizer, dataset = token_shards.open_for_training(args)
collate = coll.MaskingCollator(tokenizer, mlm=True, seed=0)
gb = cfg["micro"] * cfg["world"]
plan = coll.epoch_batches(dataset.lengths, gb, 0, 0)
sampler = coll.StepBatchSampler(plan, 0, cfg["world"], cfg["rank"], 1)
loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=cfg["num_workers"])
it = iter(loader)
batch = next(it)
t_first = time.perf_counter() - t0
tokens = int(batch["num_tokens"])
n = 1
t1 = time.perf_counter()
for batch in it:
    tokens += int(batch["num_tokens"])
    n += 1
    if n >= cfg["batches"]:
        break
dt = time.perf_counter() - t1
print(json.dumps(dict(startup_s=t_first, batches=n, batch_tokens=tokens, batches_per_s=(n - 1) / max(dt, 1e-9),
                      sequences=len(dataset), rss_imports_mb=rss_imports / 1024,
                      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


def measure(prep: Path, args) -> dict:
    cfg = dict(
        data=str(prep),
        max_len=args.max_len,
        micro=args.micro_batch_size,
        world=args.world,
        rank=args.world - 1,
        batches=args.batches,
        num_workers=args.num_workers,
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cfg)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"measurement child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[10, 1024], help="corpus sizes in MB")
    p.add_argument("--workdir", default="/tmp/bert_fast_bench_data")
    p.add_argument("--fresh", action="store_true", help="regenerate corpora and prepared data")
    p.add_argument("--tokenizer", default="minilm")
    p.add_argument("--workers", type=int, default=max(1, min(16, os.cpu_count() or 1)), help="prepare-data workers")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--world", type=int, default=8, help="simulated ranks: the child reads the last rank's slice")
    p.add_argument("--batches", type=int, default=200, help="micro-batches to iterate per size")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers in the child")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)

    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes_mb:
        corpus = root / f"corpus_{size:g}mb.txt"
        prep = root / f"prepared_{size:g}mb"
        if args.fresh:
            corpus.unlink(missing_ok=True)
            shutil.rmtree(prep, ignore_errors=True)
        t = time.perf_counter()
        if not corpus.is_file():
            make_corpus(corpus, size)
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        if not (prep / "index.json").is_file():
            shutil.rmtree(prep, ignore_errors=True)
            cmd = [sys.executable, "-m", "bert_fast", "prepare-data", str(corpus), "--output", str(prep)]
            cmd += ["--tokenizer", args.tokenizer, "--workers", str(args.workers), "--max-len", str(args.max_len)]
            cmd += ["--chunk-mb", str(max(1.0, min(64.0, size / max(1, args.workers))))]
            res = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"prepare-data failed:\n{res.stderr[-3000:]}")
            print(res.stderr.strip(), file=sys.stderr)
        prep_s = time.perf_counter() - t
        index = json.loads((prep / "index.json").read_text())
        m = measure(prep, args)
        row = dict(
            size_mb=corpus.stat().st_size / 2**20,
            tokens=index["num_tokens"],
            shards=index["num_shards"],
            generate_s=gen_s,
            prepare_s=prep_s,
            **m,
        )
        rows.append(row)
        print(
            f"{row['size_mb']:9.1f} MB  {row['tokens']:>13,} tokens  {row['shards']:>4} shards  "
            f"prepare {prep_s:7.1f} s  start-up {m['startup_s']:6.3f} s  "
            f"peak RSS {m['peak_rss_mb']:7.1f} MB (after imports {m['rss_imports_mb']:7.1f} MB, "
            f"data {m['peak_rss_mb'] - m['rss_imports_mb']:+6.1f} MB)  {m['batches']} batches "
            f"{m['batches_per_s']:.0f}/s",
            flush=True,
        )
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        print(
            f"largest vs smallest corpus ({b['size_mb'] / a['size_mb']:.0f}x the text): peak RSS "
            f"{100 * (b['peak_rss_mb'] / a['peak_rss_mb'] - 1):+.1f}% (target within 10%), start-up "
            f"{b['startup_s']:.3f} s vs {a['startup_s']:.3f} s"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
