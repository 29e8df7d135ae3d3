"""Another checkout of bert_fast against this one (a refactor's before and after): the same forwards,
each tree in processes of its own."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .harness import minilm_path, variant

THIS_TREE = Path(__file__).resolve().parents[2]

# The child: runs under PYTHONPATH=<tree>, so it imports that tree's bert_fast (its compiled _C too, which
# each checkout must have built or copied in). Prints the median ms of each case.
CHILD = r"""
import json, statistics, sys, time
import torch, transformers
import bert_fast

path, threads, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
tok = transformers.AutoTokenizer.from_pretrained(path)
hf = transformers.BertModel.from_pretrained(path).eval()
variants = {"plain fp32": {}, "frozen fp32": {"freeze": True}, "int8": {"int8": True, "tokenizer": tok}}
from bert_fast.bench import cpu_caps
if cpu_caps.capabilities().get("bf16"):
    variants["frozen bf16"] = {"freeze": True, "dtype": torch.bfloat16}
out = {"bert_fast": bert_fast.__file__}
gen = torch.Generator().manual_seed(0)
for name, kw in variants.items():
    model = bert_fast.optimize(transformers.BertModel.from_pretrained(path).eval(), **kw)
    for b in (1, 8):
        ids = torch.randint(1000, 20000, (b, 128), generator=gen)
        mask = torch.ones_like(ids)
        with torch.inference_mode():
            for _ in range(3):
                model(input_ids=ids, attention_mask=mask)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask)
                times.append((time.perf_counter() - t0) * 1e3)
        out[f"{name} b{b}"] = statistics.median(times)
print("MS " + json.dumps(out), flush=True)
"""


def _sample(tree: str, args) -> dict:
    """One process of ``tree``: the median ms of every case."""
    env = dict(os.environ, PYTHONPATH=tree, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-c", CHILD, minilm_path(), str(args.threads), str(args.calls)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True, cwd=tree).stdout
    return json.loads([ln for ln in out.splitlines() if ln.startswith("MS ")][-1][3:])


def _arguments(ap) -> None:
    ap.add_argument("--old", required=True, help="the other checkout (a worktree with bert_fast/_C built or copied)")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per case and process (default 30)")
    ap.add_argument("--json", default=None, help="write every round's medians and the ratios here")


@variant("tree", rounds=4, arguments=_arguments)
def tree(args) -> int:
    """Another checkout (--old) against this one: MiniLM no-grad forwards, plain / frozen / int8 / bf16, b1 and b8.

    all-MiniLM-L6-v2 at b1 s128 and b8 s128, bert_fast plain fp32, frozen fp32, int8 and frozen bf16
    (where the CPU has bf16 units). Each sample is a process of one tree (it imports that tree's
    bert_fast); rounds alternate the trees, the order flipping every round. Prints, per case, the
    median of the per-round ratios old / new (> 1: this tree is faster) and their min-max.

        git worktree add /tmp/before HEAD~5 && cp bert_fast/_C*.so /tmp/before/bert_fast/
        python benchmarks/cpu_ab.py tree --old /tmp/before --rounds 4
    """
    from bert_fast.bench import cpu_caps

    print(f"{cpu_caps.describe(cpu_caps.capabilities())}; {args.threads} threads, {args.calls} calls per case")
    trees = {"old": str(Path(args.old).resolve()), "new": str(THIS_TREE)}
    rounds = {"old": [], "new": []}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            rounds[name].append(_sample(trees[name], args))
    cases = [k for k in rounds["new"][0] if k != "bert_fast"]
    ratios = {c: [o[c] / n[c] for o, n in zip(rounds["old"], rounds["new"])] for c in cases}
    for c in cases:
        old_ms = statistics.median(x[c] for x in rounds["old"])
        new_ms = statistics.median(x[c] for x in rounds["new"])
        rs = ratios[c]
        print(
            f"{c:>16}: old {old_ms:7.2f} ms, new {new_ms:7.2f} ms; old/new {statistics.median(rs):.3f} "
            f"(rounds {min(rs):.3f}-{max(rs):.3f})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"trees": trees, "rounds": rounds, "ratios": ratios}, indent=1) + "\n")
    return 0
