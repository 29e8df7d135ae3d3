"""What every CPU result file under benchmarks/results/ records about its run, and how it is
written (shared by the benchmark scripts that `bert-fast bench` does not cover)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import torch
import transformers


def machine(threads: int) -> dict:
    """The CPU, the fixed thread count, the versions and the commit the figures come from."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "commit": commit,
    }


def write_json(path, doc: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
