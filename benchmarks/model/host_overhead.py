"""The host's cost of the GPU path, measured on the CPU: a forward of the kernel path (the Triton
interpreter's route through every op, launcher and first-use check) with the kernels' bodies
stubbed out, so what is timed is our Python and torch's dispatch, not arithmetic (issue #41).

The second H200 lease found the un-graphed forward host-bound: ~95 us of host time per launch, 17 ms
for 0.5 ms of kernels at bert-base 1 x 128. A GPU is rarely lent; this measures the same host code
on any machine. It leaves out Triton's own launch (JITFunction.run, the driver call), which only a
GPU runs. Its CPU's Python is not the GPU host's: compare variants within one run.

Per variant, interleaved rounds: microseconds per forward and per kernel launch (median, p20-p80),
then the functions with the most time of their own (cProfile, us per forward). Variants:
  dispatcher   every op through torch.ops.bert_fast.* (the dispatcher, autograd wrapper, schema)
  direct       ops called directly where nothing watches them (_dispatch.call_op; the default)

    python benchmarks/model/host_overhead.py                       # tiny model, fwd-1x16
    python benchmarks/model/host_overhead.py --case fwd-4x16-padded --rounds 10
(a larger model works too, but its one real forward runs through the interpreter: minutes)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernel path on the CPU
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gpu_timeline  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from bert_fast.ops import _dispatch  # noqa: E402

VARIANTS = {"dispatcher": lambda args: False, "direct": _dispatch._direct_allowed}


class StubbedKernels:
    """Inside: every Triton launch returns at once (counted), its outputs left as allocated."""

    def __init__(self):
        self.launches = 0
        self._run = interpreter.InterpretedFunction.run

    def __enter__(self):
        def run(fn, *args, **kwargs):
            self.launches += 1

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        interpreter.InterpretedFunction.run = self._run


def measure(call, rounds: int, calls: int) -> dict:
    """Per variant: us per forward over ``rounds`` interleaved rounds of ``calls`` forwards."""
    times = {name: [] for name in VARIANTS}
    launches = {}
    for _ in range(rounds):
        for name, rule in VARIANTS.items():
            _dispatch._direct_allowed = rule
            with StubbedKernels() as stub, torch.no_grad():
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                times[name].append(1e6 * (time.perf_counter() - t0) / calls)
            launches[name] = stub.launches / calls
    _dispatch._direct_allowed = VARIANTS["direct"]
    out = {}
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=5) if len(ts) > 1 else [ts[0]] * 4
        out[name] = dict(us=statistics.median(ts), p20=q[0], p80=q[-1], launches=launches[name])
    return out


def top_functions(call, calls: int, n: int) -> list[str]:
    prof = cProfile.Profile()
    with StubbedKernels(), torch.no_grad():
        prof.enable()
        for _ in range(calls):
            call()
        prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [
        f"{1e6 * tt / calls:9.1f} us {nc / calls:7.1f}x  {name} ({Path(file).name}:{line})"
        for (file, line, name), (_, nc, tt, _, _) in rows
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="a preset of bert-fast bench (default tiny)")
    p.add_argument("--case", default="fwd-1x16", help="a forward case of gpu_timeline.py (fwd-BxS[-padded])")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16"], help="the interpreter's dtypes")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=5, help="forwards per round")
    p.add_argument("--top", type=int, default=25, help="functions listed (0: none)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    case = gpu_timeline.parse_case(args.case)
    call, _ = gpu_timeline.build_call(case, args.model, torch.device("cpu"), gpu_timeline.DTYPES[args.dtype])
    call()  # the real kernels once: compiles nothing, but the first-use checks pass and are kept
    print(f"{args.model} {args.case} {args.dtype}, kernels stubbed, {os.cpu_count()} CPUs, torch {torch.__version__}")
    for name, r in measure(call, args.rounds, args.calls).items():
        per = r["us"] / max(r["launches"], 1)
        print(
            f"  {name:10s} {r['us']:9.0f} us per forward (p20-p80 {r['p20']:.0f}-{r['p80']:.0f}), "
            f"{r['launches']:.0f} launches, {per:.1f} us per launch"
        )
    if args.top:
        print("\nown time per forward (direct):")
        print("\n".join(top_functions(call, args.calls, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
