"""Measure both linear backends on this GPU at BERT's shapes and write the dispatch table.

    python benchmarks/ops/tune_linear_dispatch.py                  # merges into bert_fast/data/linear_dispatch.json
    python benchmarks/ops/tune_linear_dispatch.py --out table.json --hidden 768 --tokens 4096 16384

For every (direction, activation, dtype, M bucket, N, K) it times
  fwd: linear_fwd with backend "triton" (our GEMM + fused epilogue) vs "cublas" (torch.mm + our
       bias_gelu kernel), saving z as training does;
  bwd: linear_bwd with the same dZ/db kernel and the GEMMs of each backend (the only part the
       backward choice controls),
with triton.testing.do_bench (CUDA events, L2 flushed between calls, median), and records the
faster one (ties within --margin go to cuBLAS, the path with less of our code to trust).
Entries are stored under the device name with its compute capability; bert_fast.ops.linear looks up
the name first, then the capability.
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
from pathlib import Path

import torch


def _shapes(h: int, intermediate: int):
    # (N, K, activation): FFN up (+GELU), FFN down, fused QKV, attention output; the FFN first (2/3
    # of the GEMM FLOPs, and where our GEMM measured half cuBLAS's rate): a run cut short keeps them
    return [(intermediate, h, "gelu"), (h, intermediate, "none"), (3 * h, h, "none"), (h, h, "none")]


def _parser(default_out: Path) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[384, 768, 1024])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096, 8192, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"])
    ap.add_argument("--margin", type=float, default=0.02, help="triton must win by this fraction")
    ap.add_argument("--out", type=Path, default=default_out)
    return ap


def _time_shape(m: int, n: int, k: int, act: str, dtype, dev) -> dict:
    """{"fwd": {backend: ms}, "bwd": {backend: ms}} of one GEMM shape, each backend timed by do_bench."""
    from triton.testing import do_bench

    x = torch.randn(m, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(n, device=dev, dtype=dtype)
    dy = torch.randn(m, n, device=dev, dtype=dtype)
    fwd = torch.ops.bert_fast.linear_fwd
    # (ruff cannot see that the names are bound for the lambdas' whole life: F821)
    t_fwd = {
        be: do_bench(lambda: fwd(x, w, b, act, be, True), return_mode="median")  # noqa: F821
        for be in ("triton", "cublas")
    }
    _, z = fwd(x, w, b, act, "triton", True)
    bwd = torch.ops.bert_fast.linear_bwd
    t_bwd = {
        be: do_bench(
            lambda: bwd(dy, x, w, b, z, act, "triton", be, True, True, True),  # noqa: F821
            return_mode="median",
        )
        for be in ("triton", "cublas")
    }
    return {"fwd": t_fwd, "bwd": t_bwd}


def _measure(args, dev, entries: dict) -> None:
    """Time every shape of the arguments into ``entries`` (table key -> the faster backend, both times)."""
    from bert_fast.ops.linear import table_key  # (bert_fast.ops.linear is also the op's name)

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for dname in args.dtypes:
        dtype = dtypes[dname]
        for h in args.hidden:
            for m in args.tokens:
                for n, k, act in _shapes(h, 4 * h):
                    for direction, t in _time_shape(m, n, k, act, dtype, dev).items():
                        best = "triton" if t["triton"] < (1.0 - args.margin) * t["cublas"] else "cublas"
                        key = table_key(direction, act, dtype, m, n, k)
                        entries[key] = {
                            "backend": best,
                            "triton_ms": round(t["triton"], 5),
                            "cublas_ms": round(t["cublas"], 5),
                        }
                        flops = (2 if direction == "fwd" else 4) * m * n * k
                        print(
                            f"{key:42s} triton {t['triton'] * 1e3:8.1f} us "
                            f"({flops / t['triton'] / 1e9:6.0f} TFLOP/s)  cublas {t['cublas'] * 1e3:8.1f} us "
                            f"({flops / t['cublas'] / 1e9:6.0f} TFLOP/s)  -> {best}",
                            flush=True,
                        )


def main() -> None:
    import triton

    from bert_fast.ops.linear import DISPATCH_TABLE

    args = _parser(DISPATCH_TABLE).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_linear_dispatch.py needs a CUDA GPU")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    major, minor = torch.cuda.get_device_capability(dev)
    entries = {}
    try:
        _measure(args, dev, entries)
    except KeyboardInterrupt:  # e.g. the GPU check's stage time limit (SIGINT): keep what was measured
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # timeout's second SIGINT (to the group) must not cut the write
        print(f"interrupted: writing the {len(entries)} entries measured so far", flush=True)
    if not entries:
        raise SystemExit("nothing measured: table left as it was")
    table = json.loads(args.out.read_text()) if args.out.exists() else {"schema": 1, "devices": {}}
    header = {
        "capability": f"sm{major}{minor}",
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    merge_device_entries(table, name, header, entries)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(table, indent=1) + "\n")
    print(
        f"wrote {len(entries)} new entries ({len(table['devices'][name]['entries'])} in all) for {name} to {args.out}"
    )


def merge_device_entries(table: dict, name: str, header: dict, entries: dict) -> dict:
    """Put ``entries`` measured on device ``name`` into ``table``: the shapes measured now replace
    their old entries, the device's other shapes are kept (a partial run, e.g. one cut short by
    a time limit, adds to the table instead of shrinking it); ``header`` replaces the device's."""
    merged = dict(table.setdefault("devices", {}).get(name, {}).get("entries", {}))
    merged.update(entries)
    table["devices"][name] = {**header, "entries": dict(sorted(merged.items()))}
    return table


if __name__ == "__main__":
    main()
