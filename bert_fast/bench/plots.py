"""PNG plots of the benchmark JSON (matplotlib, Agg backend; no display needed).

* plot_model: speedup of bert_fast over each baseline, one group per case (model, mode,
  batch x sequence length, lengths), on a log axis (2x faster and 2x slower are the same distance
  from 1, and one large ratio does not flatten the others), and tokens/s per provider.
* plot_ops: per op case, the % of the measured ceiling (copy bandwidth or GEMM rate) per provider.
* plot_combined: both, for the GPU-check results file.
Every figure carries its 95% interval as an error bar; a figure flagged unstable (interval wider
than +-10%, bert_fast.bench.timing) is drawn hatched and hollow and labelled "unstable", and a %
of a ceiling that is itself unstable (or above 100%) is labelled "ceiling unstable". Legends sit
outside the axes so that they never hide data.
Each returns True when it wrote a file (False when there was nothing successful to draw).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List

_RATIO_TICKS = [
    1 / 64,
    1 / 32,
    1 / 16,
    1 / 8,
    0.2,
    0.25,
    0.33,
    0.5,
    0.67,
    0.8,
    0.9,
    1.0,
    1.1,
    1.25,
    1.5,
    2.0,
    3.0,
    4.0,
    5.0,
    8.0,
    16.0,
    32.0,
    64.0,
    128.0,
]

_FIXED = {
    "bert_fast": "#d62728",
    "hf-eager": "#7f7f7f",
    "hf-sdpa": "#1f77b4",
    "hf-compile": "#2ca02c",
    "torch": "#1f77b4",
    "torch.compile": "#2ca02c",
    "bert_fast-triton": "#ff7f0e",
    "bert_fast-cublas": "#9467bd",
    "onnxruntime": "#9467bd",
    "st+optimize": "#d62728",
    "sentence-transformers": "#1f77b4",
}
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
    name = c.get("model_name") or c["model"]
    if c.get("mode") == "encode":
        return f"{name} encode\n{c['batch']} sentences"
    lens = "" if c.get("lengths") in (None, "full") else f"\n{c['lengths']}"
    graphs = " graphs" if c.get("cuda_graphs") else ""
    return f"{name} {c['mode']}\nB={c['batch']} S={c['seq']}{lens}{graphs}"


def _sorted_runs(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return sorted(
        runs,
        key=lambda c: (
            c.get("mode", ""),
            c.get("model", ""),
            c.get("seq", 0),
            c.get("batch", 0),
            str(c.get("lengths")),
            bool(c.get("cuda_graphs")),
        ),
    )


def _legend_outside(ax) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _err(value, ci):
    """Error-bar half-lengths [[below], [above]] of ``value`` from its interval (zero without one)."""
    if not ci or value is None:
        return [[0.0], [0.0]]
    return [[max(0.0, value - ci[0])], [max(0.0, ci[1] - value)]]


def _draw_model(axes, runs) -> bool:
    """Speedups (top) and throughput (bottom) of every case with a successful record."""
    runs = [c for c in _sorted_runs(runs) if any(r.get("status") == "ok" for r in c.get("results", []))]
    if not runs:
        return False
    ax_sp, ax_tp = axes
    x = list(range(len(runs)))
    labels = [_case_label(c) for c in runs]
    _draw_speedups(ax_sp, runs)
    ax_sp.set_title("speedup of bert_fast (ratio of medians; bars: 95% interval; hollow: unstable)")
    ax_sp.set_xticks(x)
    ax_sp.set_xticklabels(labels, fontsize=7)
    ax_sp.set_xlim(-0.6, len(runs) - 0.4)
    _draw_throughput(ax_tp, runs)
    ax_tp.set_ylabel("k real tokens / s")
    ax_tp.set_title("throughput on real tokens (bars: 95% interval; hatched: unstable)")
    ax_tp.set_xticks(x)
    ax_tp.set_xticklabels(labels, fontsize=7)
    _legend_outside(ax_tp)
    return True


def _has_speedup(c: Dict[str, Any], r: Dict[str, Any]) -> bool:
    """Whether record ``r`` of case ``c`` carries a speedup of the case's subject over it."""
    # the subject of a case's speedups: bert_fast, or "st+optimize" in an --encode case
    return bool(r.get("speedup_of_bert_fast")) and r["provider"] != c.get("subject", "bert_fast")


def _draw_speedups(ax, runs) -> None:
    """One point per case and baseline: the subject's speedup over it, with its interval."""
    baselines = list(dict.fromkeys(r["provider"] for c in runs for r in c["results"] if _has_speedup(c, r)))
    if not baselines:
        ax.text(
            0.5, 0.5, "no speedup: bert_fast or baselines missing", ha="center", va="center", transform=ax.transAxes
        )
        return
    w = 0.8 / len(baselines)
    lo_all, hi_all = [], []
    for j, p in enumerate(baselines):
        first = True
        for i, c in enumerate(runs):
            r = next((r for r in c["results"] if r["provider"] == p and _has_speedup(c, r)), None)
            if r is None:
                continue
            v, ci = r["speedup_of_bert_fast"], r.get("speedup_ci")
            unstable = bool(r.get("speedup_unstable") or r.get("unstable"))
            xi = i + (j - (len(baselines) - 1) / 2) * w
            if first:  # the legend's entry: a filled marker whatever the first point's flag
                ax.plot([], [], "o", ms=7, color=COLORS.get(p), label=f"vs {p}")
            mfc = "white" if unstable else COLORS.get(p)
            ax.errorbar([xi], [v], yerr=_err(v, ci), fmt="o", ms=7, capsize=3, color=COLORS.get(p), mfc=mfc)
            first = False
            lo_all.append(ci[0] if ci else v)
            hi_all.append(ci[1] if ci else v)
            text = f"{v:.2f}x" + ("\nunstable" if unstable else "")
            ax.annotate(text, (xi, v), xytext=(4, 4), textcoords="offset points", fontsize=7, color="black")
    _ratio_axis(ax, min(lo_all + [1.0]) / 1.3, max(hi_all + [1.0]) * 1.3)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("speedup of bert_fast (x, log scale)")
    _legend_outside(ax)


def _ratio_axis(ax, lo: float, hi: float) -> None:
    """A log y axis from ``lo`` to ``hi`` with ticks at round ratios inside the range, written as
    ratios (0.5x, 1x, 2x), not as 10^0."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    ticks = [t for t in _RATIO_TICKS if lo <= t <= hi]
    if len(ticks) > 9:
        ticks = [t for t in ticks if math.log2(t) == int(math.log2(t))]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}x"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _draw_throughput(ax, runs) -> None:
    """One bar per case and provider: thousands of real tokens per second, with its interval."""
    providers = list(dict.fromkeys(r["provider"] for c in runs for r in c["results"] if r.get("status") == "ok"))
    w = 0.8 / max(1, len(providers))
    for j, p in enumerate(providers):
        first = True
        for i, c in enumerate(runs):
            r = next((r for r in c["results"] if r["provider"] == p and r.get("status") == "ok"), None)
            if r is None or not r.get("tokens_per_s"):
                continue
            v = r["tokens_per_s"] / 1e3
            ci = None
            if r.get("ci_low_ms") and r.get("ci_high_ms"):
                tokens = r["tokens_per_s"] * r["median_ms"]  # tokens per call x 1e3
                ci = [tokens / r["ci_high_ms"] / 1e3, tokens / r["ci_low_ms"] / 1e3]
            unstable = bool(r.get("unstable"))
            xi = i + (j - (len(providers) - 1) / 2) * w
            if first:  # the legend's entry: a plain bar whatever the first bar's flag
                ax.bar([xi], [0], w, label=p, color=COLORS.get(p))
            ax.bar(
                [xi],
                [v],
                w,
                yerr=_err(v, ci),
                capsize=2,
                color="white" if unstable else COLORS.get(p),
                edgecolor=COLORS.get(p),
                hatch="//" if unstable else None,
            )
            first = False
            if unstable:
                ax.annotate(
                    "unstable", (xi, v), xytext=(0, 3), textcoords="offset points", ha="center", fontsize=6, rotation=90
                )


def _draw_ops(ax, cases) -> bool:
    rows = []
    for c in cases:
        for r in c.get("results", []):
            if r.get("status") == "ok" and r.get("pct_of_ceiling") is not None:
                rows.append((f"{c['op']} {c['direction']} {c['label']}", r["provider"], r))
    if not rows:
        return False
    names = list(dict.fromkeys(n for n, _, _ in rows))
    providers = list(dict.fromkeys(p for _, p, _ in rows))
    h = 0.8 / len(providers)
    for j, p in enumerate(providers):
        first = True
        for n, pp, r in rows:
            if pp != p:
                continue
            i = names.index(n)
            y = i + (j - (len(providers) - 1) / 2) * h
            v = r["pct_of_ceiling"]
            unstable = bool(r.get("unstable"))
            if first:  # the legend's entry: a plain bar whatever the first bar's flag
                ax.barh([y], [0], h, label=p, color=COLORS.get(p))
            ax.barh(
                [y],
                [v],
                h,
                xerr=_err(v, r.get("pct_of_ceiling_ci")),
                capsize=2,
                color="white" if unstable else COLORS.get(p),
                edgecolor=COLORS.get(p),
                hatch="//" if unstable else None,
            )
            first = False
            tags = [t for t, on in (("unstable", unstable), ("ceiling unstable", r.get("ceiling_unstable"))) if on]
            if tags:
                ax.annotate(", ".join(tags), (v, y), xytext=(4, 0), textcoords="offset points", va="center", fontsize=6)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8, ls="--")
    ax.set_xlabel("% of measured ceiling (memory-bound: copy GB/s; compute-bound: GEMM TFLOP/s); bars: 95% interval")
    ax.set_title("per-op % of roofline (hatched: unstable; 'ceiling unstable': the ceiling is not a bound here)")
    _legend_outside(ax)
    return True


def _title(doc: Dict[str, Any]) -> str:
    env = doc.get("environment") or {}
    commit = str(env.get("git_commit", "unknown"))[:12]
    device = (doc.get("cpu") or {}).get("model") or env.get("device_name", "?")  # the CPU's name, not "x86_64"
    title = f"{device} | driver {env.get('driver_version') or '-'} | commit {commit}"
    threads = doc.get("threads") or env.get("cpu_threads")
    if threads:
        title += f" | {threads} threads"
    if env.get("device_type") == "cpu":  # a CPU figure read out of context must not pass for kernel speed
        title += "\nCPU: bert_fast runs its CPU path here, not the GPU kernels"
    return title


def _finish(plt, fig, ok: bool, doc: Dict[str, Any], path, dpi: int = 110) -> bool:
    """Title and save ``fig`` when something was drawn; always close it."""
    if ok:
        fig.suptitle(_title(doc), fontsize=9)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi, bbox_inches="tight")  # "tight": keeps the outside legends in
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


_OURS_SHADES = ["#d62728", "#ff7f0e", "#8c1b13", "#e377c2"]


def plot_cases(doc: Dict[str, Any], path) -> bool:
    """One bar chart per case: each provider's median time (ms) with its 95% interval, fastest at
    the top; bert_fast's providers in red shades, the others grey, the best other provider at equal
    or better accuracy (bert_fast.bench.results.summarize_case) outlined in black; the label of
    each bar gives the time, the precision and the accuracy (min cosine to transformers fp32).
    Hatched: an unstable figure. Written by default beside the JSON of ``bert-fast bench``."""
    from bert_fast.bench.summary import is_ours, summarize_case, summary_case_label

    cases = []
    for c in doc.get("runs", []):
        ok = [r for r in c.get("results", []) if r.get("status") == "ok" and r.get("median_ms")]
        if ok:
            cases.append((c, sorted(ok, key=lambda r: r["median_ms"])))
    if not cases:
        return False
    plt = _plt()
    ncol = 1 if len(cases) == 1 else 2
    nrow = (len(cases) + ncol - 1) // ncol
    most = max(len(ok) for _, ok in cases)
    fig, axes = plt.subplots(nrow, ncol, figsize=(7.5 * ncol, (0.42 * most + 1.3) * nrow), squeeze=False)
    for ax in axes.flat[len(cases) :]:
        ax.axis("off")
    for ax, (case, ok) in zip(axes.flat, cases):
        s = summarize_case(case)
        rival = s["rival"]["provider"] if s and s["rival"] else None
        ours = [r["provider"] for r in ok if is_ours(case, r["provider"])]
        top = max((r.get("ci_high_ms") or r["median_ms"]) for r in ok)
        for i, r in enumerate(ok):
            p = r["provider"]
            color = _OURS_SHADES[ours.index(p) % len(_OURS_SHADES)] if p in ours else "#9e9e9e"
            unstable = bool(r.get("unstable"))
            ci = [r["ci_low_ms"], r["ci_high_ms"]] if r.get("ci_low_ms") and r.get("ci_high_ms") else None
            ax.barh(
                [i],
                [r["median_ms"]],
                0.7,
                xerr=_err(r["median_ms"], ci),
                capsize=2,
                color="white" if unstable else color,
                edgecolor="black" if p == rival else color,
                linewidth=1.6 if p == rival else 0.8,
                hatch="//" if unstable else None,
            )
            cos = (r.get("accuracy") or {}).get("min_cosine")
            ms = r["median_ms"]
            label = f"{ms:.1f} ms" if ms < 100 else f"{ms:.0f} ms"
            label += f" {r['precision']}" if r.get("precision") else ""
            label += f", cos {cos:.5f}" if cos is not None else ", cos -"
            label += " (unstable)" if unstable else ""
            label += "  <- best other at equal or better accuracy" if p == rival else ""
            ax.annotate(
                label,
                (ci[1] if ci else r["median_ms"], i),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        ax.set_yticks(range(len(ok)))
        ax.set_yticklabels([r["provider"] for r in ok], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.9)
        ax.set_xlabel("median ms per call (bars: 95% interval; lower is faster)", fontsize=8)
        ax.set_title(summary_case_label(case), fontsize=9)
    return _finish(plt, fig, True, doc, path)


def plot_bench(doc: Dict[str, Any], path) -> List[str]:
    """The plots of ``bert-fast bench``: the bar chart per case (plot_cases) at ``path`` and the
    speedup / throughput overview (plot_model) beside it as ``<name>-speedups.png``. Returns the
    files written."""
    path = Path(path)
    written = []
    if plot_cases(doc, path):
        written.append(str(path))
    extra = path.with_name(f"{path.stem}-speedups{path.suffix or '.png'}")
    if plot_model(doc, extra):
        written.append(str(extra))
    return written
