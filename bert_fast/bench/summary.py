"""The summary a person reads in ten seconds at the end of ``bert-fast bench``: per case, bert_fast's
fastest provider against the fastest other provider at equal or better accuracy (min cosine of the
mean-pooled output to transformers fp32), with the speedup's 95% interval, and a faster but less
accurate provider where one exists. Used by results.publish (the printed summary) and by
plots.plot_cases (the rival outlined in the bar chart); imports nothing of bert_fast.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

# Two accuracies (min cosine of the mean-pooled output to transformers fp32) closer than a quarter
# of bert_fast's own distance to 1, and never closer than 1e-6, are the same accuracy: rounding noise
# between engines of one precision, not a precision. bf16 (cos ~0.99999) stays below fp32 (cos 1.0);
# two bf16 engines at 0.999975 and 0.999971 are level (bert-large on an H200, where a fixed 1e-6
# left bert_fast without a rival and hid a 0.34x).
SUMMARY_COS_EPS = 1e-6
SUMMARY_COS_SHARE = 0.25


def cos_tolerance(cos: float) -> float:
    """How far below bert_fast's min cosine ``cos`` another provider still counts as as accurate."""
    return max(SUMMARY_COS_EPS, SUMMARY_COS_SHARE * (1.0 - cos))


def is_ours(case: Dict[str, Any], provider: str) -> bool:
    """Whether ``provider`` is one of bert_fast's in ``case`` (bert_fast, bert_fast-frozen,
    bert_fast-int8; in an --encode case its subject, st+optimize, and st+optimize+freeze)."""
    subject = case.get("subject", "bert_fast")
    return provider.startswith("bert_fast") or provider == subject or provider.startswith(subject + "+")


def _cos(r: Dict[str, Any]) -> Optional[float]:
    return (r.get("accuracy") or {}).get("min_cosine")


def _speedup_of(case: Dict[str, Any], ours: str, other: str) -> Dict[str, Any]:
    """The speedup of ``ours`` over ``other`` in ``case`` with its 95% interval where the run measured
    it from paired rounds (case records, speedups_frozen, speedups_int8), else the ratio of medians."""
    res = {r["provider"]: r for r in case.get("results", [])}
    if ours == case.get("subject", "bert_fast") and res[other].get("speedup_of_bert_fast") is not None:
        r = res[other]
        return {
            "value": r["speedup_of_bert_fast"],
            "ci": r.get("speedup_ci"),
            "unstable": bool(r.get("speedup_unstable")),
        }
    for key, who in (
        ("speedups_frozen", case.get("frozen_provider", "bert_fast-frozen")),
        ("speedups_int8", "bert_fast-int8"),
    ):
        got = (case.get(key) or {}).get(other)
        if who == ours and got:
            return {"value": got["value"], "ci": got.get("ci"), "unstable": bool(got.get("unstable"))}
    return {"value": res[other]["median_ms"] / res[ours]["median_ms"], "ci": None, "unstable": False}


def summarize_case(case: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """bert_fast's fastest provider in ``case`` against the fastest other provider whose accuracy is
    equal or better (min cosine >= bert_fast's - cos_tolerance; any other when an accuracy is unknown),
    and the fastest other provider that beats it only by being less accurate. None when bert_fast or
    every other provider has no median."""
    ok = [r for r in case.get("results", []) if r.get("status") == "ok" and r.get("median_ms")]
    ours = [r for r in ok if is_ours(case, r["provider"])]
    others = [r for r in ok if not is_ours(case, r["provider"])]
    if not ours or not others:
        return None
    best = min(ours, key=lambda r: r["median_ms"])
    cos = _cos(best)
    if best.get("cuda_graphs"):  # against CUDA graphs only a graphed rival is fair (issue 41): eager ones left out
        others = [r for r in others if r.get("cuda_graphs")]

    def as_accurate(r):
        return cos is None or _cos(r) is None or _cos(r) >= cos - cos_tolerance(cos)

    fair = [r for r in others if as_accurate(r)]
    rival = min(fair, key=lambda r: r["median_ms"]) if fair else None
    faster_less = [r for r in others if not as_accurate(r) and r["median_ms"] < best["median_ms"]]
    out: Dict[str, Any] = {
        "case": case,
        "ours": best,
        "rival": rival,
        "speedup": _speedup_of(case, best["provider"], rival["provider"]) if rival else None,
        "faster_less_accurate": min(faster_less, key=lambda r: r["median_ms"]) if faster_less else None,
    }
    return out


def _who(r: Dict[str, Any]) -> str:
    prec = f" {r['precision']}" if r.get("precision") else ""
    cos = f", cos {_cos(r):.5f}" if _cos(r) is not None else ""
    return f"{r['provider']} {r['median_ms']:.1f} ms{prec}{cos}"


def summary_case_label(case: Dict[str, Any]) -> str:
    """A case in a few words: model, mode, batch x length, lengths, dtype."""
    name = case.get("model_name") or case.get("model", "?")
    if case.get("mode") == "encode":
        return f"{name} encode() of {case.get('batch')} sentences"
    lens = "" if case.get("lengths") in (None, "full") else f" ragged {case['lengths']}"
    dtype = f" {case['dtype']}" if case.get("dtype") else ""
    mode = "" if case.get("mode") in (None, "infer") else f" {case['mode']}"
    return f"{name}{mode} B={case.get('batch')} S={case.get('seq')}{lens}{dtype}"


def summary_lines(doc: Dict[str, Any]) -> List[str]:
    """The summary a person reads in ten seconds: per case, bert_fast's best against the best other
    provider at equal or better accuracy (speedup with its 95% interval), and a faster but less
    accurate provider where one exists."""
    lines = []
    for case in doc.get("runs", []):
        s = summarize_case(case)
        label = summary_case_label(case)
        if case.get("skipped"):
            lines.append(f"- {label}: skipped ({str(case['skipped'])[:80]})")
            continue
        if s is None:
            lines.append(f"- {label}: nothing to compare (bert_fast or every other provider did not run)")
            continue
        if s["rival"] is None and s["ours"].get("cuda_graphs"):
            text = f"- {label}: {_who(s['ours'])}; no other provider ran with CUDA graphs (eager ones are not compared)"
        elif s["rival"] is None:
            text = f"- {label}: {_who(s['ours'])}; no other provider as accurate"
        else:
            sp = s["speedup"]
            ci = f" (95% {sp['ci'][0]:.2f}-{sp['ci'][1]:.2f})" if sp.get("ci") else " (no interval)"
            ci_v = sp.get("ci")
            if ci_v and ci_v[0] <= 1.0 <= ci_v[1]:
                verdict = "level (the interval spans 1)"
            else:
                verdict = "faster" if sp["value"] >= 1 else "slower"
            text = (
                f"- {label}: {_who(s['ours'])} vs {_who(s['rival'])}: "
                f"{sp['value']:.2f}x{ci}{' unstable' if sp['unstable'] else ''}: bert_fast {verdict}"
            )
        if s["faster_less_accurate"] is not None:
            text += f"; faster but less accurate: {_who(s['faster_less_accurate'])}"
        if s["ours"].get("kernel_fallbacks"):
            text += (
                "; NOT the kernels' speed: it ran the torch fallback for "
                + ", ".join(s["ours"]["kernel_fallbacks"])
                + " (failed first-use checks: bert-fast doctor)"
            )
        lines.append(text)
    if not lines:
        return []
    isolation = {
        "solo": "each provider alone in its own process",
        "in-process": "every provider in one process, their thread pools side by side",
    }.get(doc.get("isolation"))
    head = (
        "Summary: bert_fast's fastest against the fastest other provider at equal or better accuracy "
        "(cos = min cosine of the mean-pooled output to transformers fp32; above 1x: bert_fast is faster)"
        + (f"; timed with {isolation}" if isolation else "")
    )
    return [head, *lines]


def summary_text(doc: Dict[str, Any]) -> str:
    return "\n".join(summary_lines(doc))
