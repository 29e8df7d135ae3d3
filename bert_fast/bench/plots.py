"""PNG plots of the benchmark JSON (matplotlib, Agg backend; no display needed).

* plot_model: speedup of bert_fast over each baseline, one group of bars per case (model, mode,
  batch x sequence length, lengths), and tokens/s per provider.
* plot_ops: per op case, the % of the measured ceiling (copy bandwidth or GEMM rate) per provider.
* plot_combined: both, for the GPU-check results file.
Each returns True when it wrote a file (False when there was nothing successful to draw).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

_FIXED = {"bert_fast": "#d62728", "hf-eager": "#7f7f7f", "hf-sdpa": "#1f77b4", "hf-compile": "#2ca02c",
          "torch": "#1f77b4", "torch.compile": "#2ca02c", "bert_fast-triton": "#ff7f0e",
          "bert_fast-cublas": "#9467bd"}
_SPARE = ["#8c564b", "#e377c2", "#bcbd22", "#17becf", "#ff9896", "#c5b0d5", "#c49c94", "#dbdb8d"]


class _Colors(dict):
    """Fixed colours for the usual providers, distinct spare ones for any other."""

    def get(self, key, default=None):  # noqa: D401
        if key not in self:
            self[key] = _SPARE[len([k for k in self if k not in _FIXED]) % len(_SPARE)]
        return self[key]


COLORS = _Colors(_FIXED)


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _case_label(c: Dict[str, Any]) -> str:
    lens = "" if c.get("lengths") in (None, "full") else f"\n{c['lengths']}"
    graphs = " graphs" if c.get("cuda_graphs") else ""
    return f"{c['model']} {c['mode']}\nB={c['batch']} S={c['seq']}{lens}{graphs}"


def _sorted_runs(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return sorted(runs, key=lambda c: (c.get("mode", ""), c.get("model", ""), c.get("seq", 0), c.get("batch", 0),
                                       str(c.get("lengths")), bool(c.get("cuda_graphs"))))


def _draw_model(axes, runs) -> bool:
    runs = [c for c in _sorted_runs(runs) if any(r.get("status") == "ok" for r in c.get("results", []))]
    if not runs:
        return False
    ax_sp, ax_tp = axes
    baselines = [p for p in ("hf-eager", "hf-sdpa", "hf-compile")
                 if any(r["provider"] == p and r.get("speedup_of_bert_fast") for c in runs for r in c["results"])]
    providers = list(dict.fromkeys(r["provider"] for c in runs for r in c["results"] if r.get("status") == "ok"))
    x = list(range(len(runs)))
    labels = [_case_label(c) for c in runs]
    if baselines:
        w = 0.8 / len(baselines)
        for j, p in enumerate(baselines):
            vals = [next((r.get("speedup_of_bert_fast") or 0 for r in c["results"] if r["provider"] == p), 0)
                    for c in runs]
            bars = ax_sp.bar([i + (j - (len(baselines) - 1) / 2) * w for i in x], vals, w, label=f"vs {p}",
                             color=COLORS.get(p))
            for b, v in zip(bars, vals):
                if v:
                    ax_sp.annotate(f"{v:.2f}x", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                                   fontsize=7)
        ax_sp.axhline(1.0, color="black", lw=0.8, ls="--")
        ax_sp.set_ylabel("speedup of bert_fast (x)")
        ax_sp.legend(fontsize=8)
    else:
        ax_sp.text(0.5, 0.5, "no speedup: bert_fast or baselines missing", ha="center", va="center",
                   transform=ax_sp.transAxes)
    ax_sp.set_title("bert_fast speedup by model, batch and sequence length (median latency ratio)")
    ax_sp.set_xticks(x)
    ax_sp.set_xticklabels(labels, fontsize=7)
    w = 0.8 / max(1, len(providers))
    for j, p in enumerate(providers):
        vals = [next((r["tokens_per_s"] / 1e3 for r in c["results"] if r["provider"] == p and r.get("status") == "ok"), 0)
                for c in runs]
        ax_tp.bar([i + (j - (len(providers) - 1) / 2) * w for i in x], vals, w, label=p, color=COLORS.get(p))
    ax_tp.set_ylabel("k real tokens / s")
    ax_tp.set_title("throughput on real tokens")
    ax_tp.set_xticks(x)
    ax_tp.set_xticklabels(labels, fontsize=7)
    ax_tp.legend(fontsize=8)
    return True


def _draw_ops(ax, cases) -> bool:
    rows = []
    for c in cases:
        for r in c.get("results", []):
            if r.get("status") == "ok" and r.get("pct_of_ceiling") is not None:
                rows.append((f"{c['op']} {c['direction']} {c['label']}", r["provider"], r["pct_of_ceiling"]))
    if not rows:
        return False
    names = list(dict.fromkeys(n for n, _, _ in rows))
    providers = list(dict.fromkeys(p for _, p, _ in rows))
    h = 0.8 / len(providers)
    for j, p in enumerate(providers):
        vals = {n: v for n, pp, v in rows if pp == p}
        ys = [i + (j - (len(providers) - 1) / 2) * h for i in range(len(names))]
        ax.barh(ys, [vals.get(n, 0) for n in names], h, label=p, color=COLORS.get(p))
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8, ls="--")
    ax.set_xlabel("% of measured ceiling (memory-bound: copy GB/s; compute-bound: GEMM TFLOP/s)")
    ax.set_title("per-op % of roofline")
    ax.legend(fontsize=8)
    return True


def _title(doc: Dict[str, Any]) -> str:
    env = doc.get("environment") or {}
    commit = str(env.get("git_commit", "unknown"))[:12]
    title = f"{env.get('device_name', '?')} | driver {env.get('driver_version') or '-'} | commit {commit}"
    if env.get("device_type") == "cpu":   # a CPU figure read out of context must not pass for kernel speed
        title += "\nCPU: bert_fast runs its PyTorch reference path here, not the GPU kernels"
    return title


def _finish(plt, fig, ok: bool, doc: Dict[str, Any], path, dpi: int = 110) -> bool:
    """Title and save ``fig`` when something was drawn; always close it."""
    if ok:
        fig.suptitle(_title(doc), fontsize=9)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return ok


def plot_model(doc: Dict[str, Any], path) -> bool:
    plt = _plt()
    runs = doc.get("runs", [])
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * max(1, len(runs)) + 3), 9))
    return _finish(plt, fig, _draw_model(axes, runs), doc, path)


def plot_ops(doc: Dict[str, Any], path) -> bool:
    plt = _plt()
    cases = doc.get("cases", [])
    fig, ax = plt.subplots(1, 1, figsize=(10, max(3, 0.45 * len(cases) + 1.5)))
    return _finish(plt, fig, _draw_ops(ax, cases), doc, path)


def plot_combined(doc: Dict[str, Any], path) -> bool:
    """Model speedups + per-op roofline of a GPU-check results document."""
    plt = _plt()
    runs = (doc.get("model") or {}).get("runs", [])
    cases = (doc.get("ops") or {}).get("cases", [])
    n_ops = len(cases)
    fig = plt.figure(figsize=(max(10, 1.6 * len(runs) + 3), 9 + max(3, 0.4 * n_ops)))
    gs = fig.add_gridspec(3, 1, height_ratios=[3, 3, max(3, 0.4 * n_ops)])
    ok_model = _draw_model([fig.add_subplot(gs[0]), fig.add_subplot(gs[1])], runs)
    ok_ops = _draw_ops(fig.add_subplot(gs[2]), cases)
    return _finish(plt, fig, ok_model or ok_ops, doc, path, dpi=100)
