"""The CPU A/Bs on one harness: two variants of one forward (an environment setting, a code path, a
build, a backend) timed side by side in one process (interleaved rounds, medians with 95% intervals,
the paired speedup: benchmarks/ab/harness.py), or a process per sample where the setting is read
once at a process's start.

    python benchmarks/cpu_ab.py --list                 # the variants, one line each
    python benchmarks/cpu_ab.py VARIANT [options]      # run one (VARIANT --help: what A and B are)

The variants live in benchmarks/ab/ (attention.py, int8.py, backends.py, process.py, tree.py). Timing rules: a
quiet machine, a fixed thread count (--threads, 2 by default).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ab import VARIANTS  # noqa: E402  (benchmarks/ab/, beside this script)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the variants, one line each")
    sub = ap.add_subparsers(dest="variant", metavar="VARIANT")
    for v in VARIANTS.values():
        v.add_parser(sub)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.list:
        width = max(map(len, VARIANTS))
        for v in VARIANTS.values():
            print(f"{v.name:<{width}}  {v.summary}")
        return 0
    if args.variant is None:
        ap.error("name a VARIANT (--list lists them)")
    return VARIANTS[args.variant].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
