#!/usr/bin/env python
"""Regenerate the README's GPU table and the docs' GPU page from the newest GPU-check results file.

    python benchmarks/report/make_readme_performance.py [--results-dir benchmarks/results] [--readme README.md]
                                                        [--check] [--stdout]

The README's short table (one line per case: bert_fast's fastest against the fastest other provider
at equal or better accuracy) lies between ``<!-- perf:start -->`` and ``<!-- perf:end -->``
(appended, under a "## Performance" heading, when the README has no markers yet); every table goes to
docs/results/gpu.md beside the README (benchmarks/report/make_docs_results.py renders both). Everything in it comes from the
results file written by benchmarks/gpu_check.sh (schema bert_fast.gpu_check/1): device, driver,
commit, test counts, ceilings, the model and op tables and the summary plot. Nothing is typed by
hand. Without a results file it writes one line saying that no GPU results exist yet.

Results from a machine without a CUDA GPU are ignored (--allow-cpu to use them).
--check: exit 1 when the README or the docs page is not what this script would write (for CI);
--stdout: print the full section (render()) instead of writing. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- perf:start -->", "<!-- perf:end -->"
GPU_CHECK_SCHEMA = "bert_fast.gpu_check/1"
NO_RESULTS = (
    "No GPU results exist yet: run `bash benchmarks/gpu_check.sh` on a CUDA machine, then "
    "`python benchmarks/report/make_readme_performance.py`."
)


def newest_results(results_dir: Path, allow_cpu: bool = False) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The most recent GPU-check results file with model figures (by its 'created' stamp, then file
    name; one without, a lease's correctness call, only where none has any); files from a machine
    without a CUDA GPU are ignored unless ``allow_cpu``."""
    found = []
    for p in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not (isinstance(doc, dict) and doc.get("schema") == GPU_CHECK_SCHEMA):
            continue
        if allow_cpu or (doc.get("environment") or {}).get("device_type") == "cuda":
            found.append((bool((doc.get("model") or {}).get("runs")), str(doc.get("created", "")), p.name, p, doc))
    if not found:
        return None
    *_, path, doc = max(found, key=lambda t: t[:3])
    return path, doc


def _f(v, fmt: str, none: str = "–") -> str:
    return none if v is None else format(v, fmt)


def _md_row(cells: List[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _speedup(sp, ci) -> str:
    if not sp:
        return "–"
    return f"{sp:.2f}× ({ci[0]:.2f}–{ci[1]:.2f})" if ci else f"{sp:.2f}×"


def _flags(r: Dict[str, Any]) -> str:
    """The flags of bert_fast.bench.timing: an interval wider than +-10% is 'unstable'."""
    names = (
        ("unstable", "unstable"),
        ("speedup_unstable", "unstable speedup"),
        ("ceiling_unstable", "ceiling unstable"),
    )
    out = [text for key, text in names if r.get(key)]
    if r.get("kernel_fallbacks"):  # the figure is the torch fallbacks', not the kernels'
        out.insert(0, "**torch fallback:** " + ", ".join(r["kernel_fallbacks"]))
    return ", ".join(out)


def model_table(runs: List[Dict[str, Any]]) -> List[str]:
    if not runs:
        return ["_No model benchmark figures in this run._"]
    head = [
        "model",
        "mode",
        "batch × seq",
        "lengths",
        "CUDA graphs",
        "provider",
        "median ms",
        "p20–p80 ms",
        "tokens/s",
        "MFU",
        "peak MiB",
        "speedup of bert_fast (95% CI)",
        "flags",
    ]
    lines = [_md_row(head), _md_row(["---"] * len(head))]
    order = {"train": 1, "infer": 0}
    for c in sorted(
        runs,
        key=lambda c: (
            order.get(c.get("mode"), 2),
            c.get("model", ""),
            c.get("seq", 0),
            c.get("batch", 0),
            bool(c.get("cuda_graphs")),
        ),
    ):
        for r in c.get("results", []):
            base = [
                c.get("model_name") or c.get("model"),
                c.get("mode"),
                f"{c.get('batch')} × {c.get('seq')}",
                c.get("lengths"),
                "yes" if c.get("cuda_graphs") else "no",
                f"`{r.get('provider')}`",
            ]
            if r.get("status") != "ok":
                err = (r.get("error") or "").splitlines()[0][:60] if r.get("error") else ""
                lines.append(_md_row(base + [f"{r.get('status')}: {err}"] + [""] * 6))
                continue
            sp = r.get("speedup_of_bert_fast")
            lines.append(
                _md_row(
                    base
                    + [
                        _f(r.get("median_ms"), ".3f"),
                        f"{_f(r.get('p20_ms'), '.3f')}–{_f(r.get('p80_ms'), '.3f')}",
                        _f(r.get("tokens_per_s"), ",.0f"),
                        _f(None if r.get("mfu") is None else 100 * r["mfu"], ".1f")
                        + ("%" if r.get("mfu") is not None else ""),
                        _f(r.get("peak_mem_mb"), ",.0f"),
                        "1.00× (itself)" if r.get("provider") == "bert_fast" else _speedup(sp, r.get("speedup_ci")),
                        _flags(r),
                    ]
                )
            )
    return lines


def ops_table(cases: List[Dict[str, Any]]) -> List[str]:
    if not cases:
        return ["_No per-op figures in this run._"]
    head = ["op", "dir", "case", "bound", "provider", "median µs", "GB/s", "TFLOP/s", "% of ceiling", "flags"]
    lines = [_md_row(head), _md_row(["---"] * len(head))]
    for c in cases:
        for r in c.get("results", []):
            base = [c.get("op"), c.get("direction"), c.get("label"), c.get("bound"), f"`{r.get('provider')}`"]
            if r.get("status") != "ok":
                lines.append(_md_row(base + [str(r.get("status")), "", "", "", ""]))
                continue
            lines.append(
                _md_row(
                    base
                    + [
                        _f(None if r.get("median_ms") is None else 1e3 * r["median_ms"], ",.1f"),
                        _f(r.get("gbs"), ",.0f"),
                        _f(r.get("tflops"), ".1f"),
                        _f(r.get("pct_of_ceiling"), ".0f") + ("%" if r.get("pct_of_ceiling") is not None else ""),
                        _flags(r),
                    ]
                )
            )
    return lines


def render(path: Optional[Path], doc: Optional[Dict[str, Any]], readme: Path) -> str:
    if doc is None or path is None:
        return NO_RESULTS
    env = doc.get("environment") or {}
    tests = doc.get("tests") or {}
    ops = doc.get("ops") or {}
    ceil = (
        ops.get("ceilings")
        or next((f.get("ceilings") for f in (doc.get("model") or {}).get("files", []) if f.get("ceilings")), None)
        or {}
    )
    rel = os.path.relpath(path, readme.parent)
    out = [
        f"_Generated by `benchmarks/report/make_readme_performance.py` from [`{rel}`]({rel}); do not edit by hand._",
        "",
    ]
    cap = f" (compute capability {env['device_capability']})" if env.get("device_capability") else ""
    out.append(
        f"- **Device:** {env.get('device_name', 'unknown')}{cap}, driver "
        f"{env.get('driver_version') or 'unknown'}, CUDA runtime {env.get('cuda_runtime') or 'none'}"
    )
    out.append(f"- **Commit:** `{env.get('git_commit', 'unknown')}` · run {doc.get('created', '?')}")
    out.append(
        f"- **Versions:** torch {env.get('torch')}, triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, Python {env.get('python')}"
    )
    if tests:
        out.append(
            f"- **Tests on this GPU:** {tests.get('passed', 0)} passed, {tests.get('failed', 0)} failed, "
            f"{tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped"
        )
    if ceil:
        out.append(
            f"- **Measured ceilings:** copy {_f(ceil.get('copy_bandwidth_gbs'), ',.0f')} GB/s, "
            f"{ceil.get('matmul_dtype', '')} GEMM {_f(ceil.get('matmul_tflops'), '.0f')} TFLOP/s "
            f"({'×'.join(map(str, ceil.get('matmul_shape', [])))}); MFU and % of ceiling are against these"
        )
    bad = [s for s in doc.get("stages", []) if s.get("status") != "ok"]
    if bad:
        out.append("- **Stages not ok:** " + ", ".join(f"{s['name']} ({s.get('status')})" for s in bad))
    out += [
        "",
        "### Model",
        "",
        "Median latency per call (forward under no_grad for `infer`; forward + backward + AdamW step for "
        "`train`), tokens/s on real tokens, MFU = model FLOPs / time / measured GEMM rate; speedup = "
        "provider median / bert_fast median.",
        "",
    ]
    out += model_table((doc.get("model") or {}).get("runs", []))
    out += ["", "### Ops", ""]
    out += ops_table(ops.get("cases", []))
    for plot in doc.get("plots", [])[:1]:
        img = os.path.relpath(path.parent / plot, readme.parent)
        out += ["", f"![bert_fast performance on {env.get('device_name', 'GPU')}]({img})"]
    return "\n".join(out)


def splice(text: str, section: str) -> str:
    block = f"{START}\n{section}\n{END}"
    if START in text and END in text and text.index(START) < text.index(END):
        a = text.index(START)
        b = text.index(END) + len(END)
        return text[:a] + block + text[b:]
    sep = "" if text.endswith("\n") or not text else "\n"
    return f"{text}{sep}\n## Performance\n\n{block}\n"


def _docs_module():
    """make_docs_results.py, beside this script (benchmarks/report/ is not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_docs_results

    return make_docs_results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--check", action="store_true", help="exit 1 if the README or the docs page is out of date")
    p.add_argument("--stdout", action="store_true", help="print the full section, do not write the README")
    p.add_argument("--allow-cpu", action="store_true", help="also consider results from machines without a GPU")
    args = p.parse_args(argv)
    readme = Path(args.readme)
    found = newest_results(Path(args.results_dir), allow_cpu=args.allow_cpu)
    if args.stdout:
        print(render(*(found or (None, None)), readme=readme))
        return 0
    docs = _docs_module()
    old = readme.read_text(encoding="utf-8") if readme.exists() else ""
    block = docs.gpu_readme_block(*(found or (None, None)), readme=readme)
    files = {
        readme: splice(old, block),
        readme.parent / docs.DOCS_GPU: docs.gpu_page(Path(args.results_dir), allow_cpu=args.allow_cpu),
    }
    rc = docs.write_or_check(files, check=args.check)
    if not args.check:
        try:  # the docs page's bar chart (needs bert_fast and matplotlib)
            docs.gpu_plots(Path(args.results_dir), readme.parent, allow_cpu=args.allow_cpu)
        except ImportError as exc:
            print(f"docs plot not drawn: {exc}", file=sys.stderr)
        print(f"{readme}: GPU results from {found[0] if found else 'no results (none yet)'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
