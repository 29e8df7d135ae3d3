"""Per-GEMM figures behind BertModel.freeze() (benchmarks/notes/2026-11-24-cpu-masks-freeze-targets.md):
F.linear (+ GELU for the FFN up) against oneDNN's linear on a weight packed once
(mkldnn._reorder_linear_weight; GELU fused), MiniLM and bert-base shapes, fp32 and bf16, 128 and
1024 rows, interleaved, medians of 7 rounds.

    python benchmarks/cpu/packed_gemm.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _median_us(fns, reps: int, rounds: int = 7):
    times = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(5):
            f()
    for r in range(rounds):
        for k in list(fns) if r % 2 else list(fns)[::-1]:
            t = time.perf_counter()
            for _ in range(reps):
                fns[k]()
            times[k].append((time.perf_counter() - t) / reps * 1e6)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, torch {torch.__version__}; us per call, base / packed (speedup)")
    for name, h in (("MiniLM", 384), ("bert-base", 768)):
        for gemm, (k, n, act) in (
            ("QKV", (h, 3 * h, None)),
            ("out", (h, h, None)),
            ("up+GELU", (h, 4 * h, "gelu")),
            ("down", (4 * h, h, None)),
        ):
            cells = []
            for dtype in (torch.float32, torch.bfloat16):
                for m in (128, 1024):
                    x = torch.randn(m, k).to(dtype)
                    w, b = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(n).to(dtype)
                    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                    attr, algo = ("gelu", "none") if act else ("none", "")
                    base = (lambda: F.gelu(F.linear(x, w, b))) if act else (lambda: F.linear(x, w, b))
                    fused = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, attr, [], algo)  # noqa: E731
                    t = _median_us({"base": base, "packed": fused}, reps=max(5, 20000 // (m * n // 1024 + 1)))
                    cells.append(
                        f"{str(dtype)[6:]} M={m}: {t['base']:.0f} / {t['packed']:.0f} ({t['base'] / t['packed']:.2f}x)"
                    )
            print(f"{name} {gemm} {k}->{n}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
