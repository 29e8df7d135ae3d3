#!/usr/bin/env python
"""Write the README's CPU results (between ``<!-- cpu-perf:start -->`` and ``<!-- cpu-perf:end -->``)
from the files under benchmarks/results/cpu/, so that no figure in the README is typed by hand.

    python benchmarks/make_readme_cpu_performance.py [--results-dir benchmarks/results/cpu] [--stdout]

Reads: bench_fp32.json and bench_bf16.json (`bert-fast bench --json`), encode.json
(`bert-fast bench --encode --json`), train_mlm.json and bf16_error.json
(benchmarks/cpu_train_bf16.py), dropin.json (benchmarks/bench_dropin.py). A missing file leaves
its table out. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def _sp_frozen(run: dict, provider: str) -> str:
    v = (run.get("speedups_frozen") or {}).get(provider)
    if v is None:
        return "not run"
    lo, hi = v["ci"]
    return f"{v['value']:.2f}x ({lo:.2f}-{hi:.2f})" + (" unstable" if v.get("unstable") else "")


def _bench_table(doc: dict, title: str, name: str) -> list:
    env = doc.get("environment", {})
    lines = [
        f"**{title}** ({doc.get('threads')} threads, torch {env.get('torch', '?')}, "
        f"commit {str(env.get('git_commit', '?'))[:8]}; `benchmarks/results/cpu/{name}`). "
        "bert_fast: `optimize(model)`; frozen: `optimize(model, freeze=True)` (packed weights, "
        "inference only):",
        "",
        "| model | case | bert_fast ms | bert_fast vs transformers SDPA | bert_fast vs ONNX Runtime "
        "| frozen vs transformers SDPA | frozen vs ONNX Runtime |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in doc["runs"]:
        res = {r["provider"]: r for r in run["results"] if r.get("status") == "ok"}
        bf = res.get("bert_fast")
        if bf is None:
            continue
        lengths = "full" if run["lengths"] == "full" else f"ragged {run['lengths']}"
        case = f"B={run['batch']} S={run['seq']} {lengths}"
        cells = [_sp(res[p]) if p in res else "not run" for p in ("hf-sdpa", "onnxruntime")]
        cells += [_sp_frozen(run, p) if p in res else "not run" for p in ("hf-sdpa", "onnxruntime")]
        lines.append(f"| {run['model_name']} | {case} | {bf['median_ms']:.1f} | " + " | ".join(cells) + " |")
    return lines + [""]


def section(d: Path) -> str:
    out = [
        "### CPU results (the CPU path, not the GPU kernels)",
        "",
        "Measured on the project's 2-core CPU machine (AVX-512), providers side by side in one "
        "process, interleaved rounds, medians with 95% intervals; a speedup above 1 means "
        "bert_fast is faster. Files: `benchmarks/results/cpu/` (all of them: `bash benchmarks/run_cpu_results.sh`, "
        "then this table: `python benchmarks/make_readme_cpu_performance.py`).",
        "",
    ]
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
            f"**{r['case']}** (`python benchmarks/cpu_train_bf16.py train`), speedup over "
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
            "`python benchmarks/cpu_train_bf16.py bf16-error`): bert_fast / transformers = "
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
            out += [f"**{case}** (`python benchmarks/bench_dropin.py`): {sps}.", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results" / "cpu"))
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--stdout", action="store_true")
    args = ap.parse_args(argv)
    text = section(Path(args.results_dir))
    if args.stdout:
        sys.stdout.write(text)
        return 0
    readme = Path(args.readme)
    body = readme.read_text(encoding="utf-8")
    block = f"{START}\n{text}{END}"
    if START in body and END in body:
        body = body[: body.index(START)] + block + body[body.index(END) + len(END) :]
    else:
        body = body.replace("## Performance\n", f"## Performance\n\n{block}\n", 1)
    readme.write_text(body, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
