#!/usr/bin/env python
"""Every table of the CPU results (section()), for the docs' CPU page, and the README's short CPU table
(between ``<!-- cpu-perf:start -->`` and ``<!-- cpu-perf:end -->``), from the files under
benchmarks/results/cpu/, so that no figure is typed by hand (benchmarks/report/make_docs_results.py writes
both, and the GPU's).

    python benchmarks/report/make_readme_cpu_performance.py [--results-dir benchmarks/results/cpu] [--stdout]

Reads: bench_cpu.json (`bert-fast bench --json`, the CPU default: fp32 and bf16 tables, every
provider with its precision and accuracy; without it the older bench_fp32.json and bench_bf16.json), encode.json
(`bert-fast bench --encode --json`), train_mlm.json and bf16_error.json
(benchmarks/training/cpu_train_bf16.py), dropin.json (benchmarks/model/dropin.py). A missing file leaves
its table out. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- cpu-perf:start -->", "<!-- cpu-perf:end -->"


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else None


def _sp(r: dict) -> str:
    lo, hi = r.get("speedup_ci") or (None, None)
    text = f"{r['speedup_of_bert_fast']:.2f}x"
    if lo is not None:
        text += f" ({lo:.2f}-{hi:.2f})"
    return text + (" unstable" if r.get("speedup_unstable") else "")


def _sp_frozen(run: dict, provider: str, key: str = "speedups_frozen") -> str:
    v = (run.get(key) or {}).get(provider)
    if v is None:
        return "not run"
    lo, hi = v["ci"]
    return f"{v['value']:.2f}x ({lo:.2f}-{hi:.2f})" + (" unstable" if v.get("unstable") else "")


# Column names of the providers, in column order (others follow in the order the run has them).
_NAMES = {
    "bert_fast": "bert_fast",
    "bert_fast-frozen": "bert_fast frozen",
    "bert_fast-int8": "bert_fast int8",
    "hf-sdpa": "transformers SDPA",
    "onnxruntime": "ONNX Runtime",
    "onnxruntime-int8": "ONNX Runtime int8",
    "openvino": "OpenVINO",
    "openvino-f32": "OpenVINO f32",
    "openvino-int8": "OpenVINO int8",
}
_ORDER = tuple(_NAMES)


def _cell(r: dict) -> str:
    """A provider's median and its accuracy against transformers fp32 (min cosine), or why not."""
    if r.get("status") != "ok" or r.get("median_ms") is None:
        return r.get("status", "?")
    acc = r.get("accuracy") or {}
    cos = acc.get("min_cosine")
    text = f"{r['median_ms']:.1f}"
    if r.get("precision"):
        text += f" {r['precision']}"
    return text + (f", cos {cos:.5f}" if cos is not None else "")


def _bench_table(doc: dict, title: str, name: str, dtype=None) -> list:
    """The runs of ``doc`` (those of ``dtype`` when given): one table of each provider's median ms,
    precision and accuracy (min cosine of mean-pooled output to transformers fp32), one of the
    speedups of bert_fast (plain and frozen) over every other provider."""
    env = doc.get("environment", {})
    runs = [r for r in doc["runs"] if dtype is None or r.get("dtype", dtype) == dtype]
    runs = [r for r in runs if any(x.get("provider") == "bert_fast" and x.get("status") == "ok" for x in r["results"])]
    if not runs:
        return []
    seen = {x["provider"] for r in runs for x in r["results"]}
    provs = [p for p in _ORDER if p in seen] + sorted(seen - set(_ORDER))
    others = [p for p in provs if p not in ("bert_fast", "bert_fast-frozen", "bert_fast-int8")]
    cpu = doc.get("cpu_line") or f"CPU: {env.get('device_name', '?')}"
    isolation = {"solo": "each provider alone in its own process", "in-process": "every provider in one process"}
    lines = [
        f"**{title}** ({cpu}; {doc.get('threads')} threads, "
        f"{isolation.get(doc.get('isolation', 'in-process'), '?')}, torch {env.get('torch', '?')}, "
        f"commit {str(env.get('git_commit', '?'))[:8]}; `benchmarks/results/cpu/{name}`). "
        "bert_fast: `optimize(model)`; frozen: `optimize(model, freeze=True)`; int8: `optimize(model, int8=True)` (packed weights, int8 GEMMs; inference "
        "only). Median ms, the precision each provider ran in (ONNX Runtime and OpenVINO run their own, "
        "whatever the table's dtype) and cos = the min over the batch of the cosine of the mean-pooled "
        "output to transformers fp32:",
        "",
        "| model | case | " + " | ".join(_NAMES.get(p, p) for p in provs) + " |",
        "|---|---|" + "---|" * len(provs),
    ]
    for run in runs:
        res = {r["provider"]: r for r in run["results"]}
        lengths = "full" if run["lengths"] == "full" else f"ragged {run['lengths']}"
        case = f"B={run['batch']} S={run['seq']} {lengths}"
        cells = [_cell(res[p]) if p in res else "not run" for p in provs]
        lines.append(f"| {run['model_name']} | {case} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Speedup of bert_fast (and of bert_fast frozen, bert_fast int8) over each (95% interval; above 1: bert_fast is faster):",
        "",
        "| model | case | " + " | ".join(f"vs {_NAMES.get(p, p)}" for p in others) + " |",
        "|---|---|" + "---|" * len(others),
    ]
    for run in runs:
        res = {r["provider"]: r for r in run["results"] if r.get("status") == "ok"}
        lengths = "full" if run["lengths"] == "full" else f"ragged {run['lengths']}"
        case = f"B={run['batch']} S={run['seq']} {lengths}"
        cells = []
        for p in others:
            if p not in res or res[p].get("speedup_of_bert_fast") is None:
                cells.append("not run")
                continue
            text = _sp(res[p])
            if "bert_fast-frozen" in res:
                text += f"; frozen {_sp_frozen(run, p)}"
            if "bert_fast-int8" in res:
                text += f"; int8 {_sp_frozen(run, p, 'speedups_int8')}"
            cells.append(text)
        lines.append(f"| {run['model_name']} | {case} | " + " | ".join(cells) + " |")
    return lines + [""]


def section(d: Path) -> str:
    out = [
        "### CPU results (the CPU path, not the GPU kernels)",
        "",
        "Measured on the project's 2-core CPU machine (the CPU line above each table), providers side by side in one "
        "process, interleaved rounds, medians with 95% intervals; a speedup above 1 means "
        "bert_fast is faster. Files: `benchmarks/results/cpu/` (all of them: `bash benchmarks/run_cpu_results.sh`, "
        "then this table: `python benchmarks/report/make_readme_cpu_performance.py`).",
        "",
    ]
    cpu = _load(d, "bench_cpu.json")  # `bert-fast bench` default: fp32 and (bf16 CPUs) bf16 tables
    if cpu:
        for dtype in cpu.get("dtypes") or sorted({r.get("dtype", "fp32") for r in cpu["runs"]}):
            out += _bench_table(cpu, f"Inference, {dtype}", "bench_cpu.json", dtype)
        if cpu.get("bf16_skipped"):
            out += [cpu["bf16_skipped"] + ".", ""]
    else:  # files of the runs before issue 25: one dtype each
        for name, title in (("bench_fp32.json", "Inference, fp32"), ("bench_bf16.json", "Inference, bf16")):
            doc = _load(d, name)
            if doc:
                out += _bench_table(doc, title, name)
    enc = _load(d, "encode.json")
    if enc:
        for run in enc["runs"]:
            res = {r["provider"]: r for r in run["results"]}
            st = res.get("sentence-transformers")
            if st:
                frozen = (
                    ""
                    if "speedups_frozen" not in run
                    else f"; with `optimize(model, freeze=True)`: {_sp_frozen(run, 'sentence-transformers')}"
                )
                out += [
                    f"**sentence-transformers encode()** of {run.get('batch', '')} shipped sentences "
                    f"with `bert_fast.optimize()` (`bert-fast bench --encode`): {_sp(st)} over the "
                    f"unoptimized model{frozen}.",
                    "",
                ]
    train = _load(d, "train_mlm.json")
    if train:
        r = train["result"]
        sp = r["speedups"]
        out += [
            f"**{r['case']}** (`python benchmarks/training/cpu_train_bf16.py train`), speedup over "
            "transformers SDPA: "
            + ", ".join(
                f"{k.split(' vs ')[0]} {v['value']:.2f}x ({v['ci_low']:.2f}-{v['ci_high']:.2f})"
                + (" unstable" if v.get("unstable") else "")
                for k, v in sp.items()
            )
            + ".",
            "",
        ]
    err = _load(d, "bf16_error.json")
    if err:
        r = err["result"]
        out += [
            f"**bf16 error** against the fp32 model ({r['sentences']} sentences, MiniLM, "
            "`python benchmarks/training/cpu_train_bf16.py bf16-error`): bert_fast / transformers = "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["ratios"].items())
            + " (bound: 2).",
            "",
        ]
    drop = _load(d, "dropin.json")
    if drop:
        for case, r in drop["cases"].items():
            sps = "; ".join(
                f"{k}: {v['value']:.2f}x ({v['ci_low']:.2f}-{v['ci_high']:.2f})" for k, v in r["speedups"].items()
            )
            out += [f"**{case}** (`python benchmarks/model/dropin.py`): {sps}.", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    """--stdout: print every table (section()). Otherwise write the README's short CPU table and the
    docs' CPU results page (docs/results/cpu.md beside the README) through make_docs_results.py."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--stdout", action="store_true")
    ap.add_argument("--no-plots", action="store_true", help="do not redraw the docs' PNGs")
    args = ap.parse_args(argv)
    d = Path(args.results_dir)
    if args.stdout:
        sys.stdout.write(section(d))
        return 0
    docs = _docs_module()
    readme = Path(args.readme)
    body = readme.read_text(encoding="utf-8") if readme.exists() else ""
    files = {
        readme: docs.splice(body, START, END, docs.cpu_readme_block(d)),
        readme.parent / docs.DOCS_CPU: docs.cpu_page(d),
    }
    rc = docs.write_or_check(files, check=False)
    if not args.no_plots:
        docs.cpu_plots(d, readme.parent)
    return rc


def _docs_module():
    """make_docs_results.py, beside this script (benchmarks/report/ is not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_docs_results

    return make_docs_results


if __name__ == "__main__":
    sys.exit(main())
