"""Which precision this CPU should run inference in, and why (issue 25, item 6): part of
``bert-fast doctor``.

Three inputs: the CPU's capability (bert_fast.bench.cpu_caps: AMX-BF16/INT8, AVX-512 BF16/VNNI,
AVX2, the model name, and whether torch's oneDNN runs bf16 natively here), GEMM rates measured
here at BERT-base shapes (M=1024 rows, K=768, N=768 and N=3072; fp32 through F.linear, bf16
through F.linear and through oneDNN's prepacked linear, int8 through torch._int_mm), and a rule:

- bf16 units and bf16 measured faster than fp32: ``bert_fast.optimize(model, dtype=torch.bfloat16,
  freeze=True)`` (LayerNorm and softmax statistics stay fp32; pooled embeddings keep cosine >= 0.999
  to fp32);
- bf16 units but bf16 not faster than fp32 here: fp32, ``bert_fast.optimize(model, freeze=True)``;
- no bf16 units: fp32 with ``freeze=True``; bf16 would be emulated and slow;
- int8 is said to be refused where optimize(int8=True)'s own speed check (bert_fast.model.int8_speed)
  measures it slower than fp32 (CPUs without AVX-512 VNNI / AMX-INT8), with both rates;
- otherwise int8 is mentioned (never the default) when its measured rate is at least INT8_OVER_BEST times the
  recommended precision's: ``bert_fast.optimize(model, int8=True)``, which checks the accuracy against
  fp32 on calibration sentences and refuses a model it would degrade.

The measurement takes about a second or two at 2 threads (the GEMMs of a shape timed side by side
for at most len(KINDS) x BUDGET_S seconds); ``recommend()`` is pure, so the rule is testable with
faked capabilities/rates.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional

from bert_fast.bench import ceilings, cpu_caps

SHAPES = ((1024, 768, 768), (1024, 3072, 768))  # (M, N, K): attention-out / QKV-like, FFN-up of BERT-base
THREADS = 2
BUDGET_S = 0.15  # per GEMM kind and shape: a shape's KINDS share len(KINDS) x this, warm-up round included
MAX_REPS = 7
KINDS = ("fp32", "bf16", "bf16_packed", "int8")  # ceilings.gemm_kernels' kinds measured here
BF16_OVER_FP32 = 1.05  # bf16 must beat fp32 by this much to be recommended (a tie keeps fp32)
INT8_OVER_BEST = 1.3  # int8 is mentioned only when it measures this much faster than the recommendation

CALL_BF16 = "bert_fast.optimize(model, dtype=torch.bfloat16, freeze=True)"
CALL_FP32 = "bert_fast.optimize(model, freeze=True)"
CALL_INT8 = "bert_fast.optimize(model, int8=True)"

UNIT_NAMES = {
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
    "avx512_bf16": "AVX-512 BF16",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512f": "AVX-512F",
    "avx2": "AVX2",
}


def _sig(x: float) -> float:
    return float(f"{x:.4g}")


def measure_rates(threads: int = THREADS, shapes=SHAPES, budget_s: float = BUDGET_S) -> Dict[str, Any]:
    """GEMM rates at ``shapes`` with ``threads`` threads: {"fp32", "bf16", "bf16_linear", "bf16_packed",
    "int8": TFLOP/s (TOPS for int8) over all shapes together, or None where the kernel is missing;
    "per_shape": [...], "threads", "seconds"}. bf16 is the faster of F.linear and the packed linear.
    The GEMMs are bert_fast.bench.ceilings.gemm_rates' (the four kinds of one shape side by side, after
    one warm-up round, for at most MAX_REPS rounds or ``budget_s`` seconds per kind)."""
    import torch

    t0 = time.perf_counter()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            rows = ceilings.gemm_rates(shapes, KINDS, max_rounds=MAX_REPS, budget_s=budget_s * len(KINDS))
    finally:
        torch.set_num_threads(before)
    total_s: Dict[str, Optional[float]] = {k: 0.0 for k in KINDS}
    flops = 0.0
    per_shape = []
    for row in rows:
        f = 2.0 * row["m"] * row["n"] * row["k"]
        flops += f
        for kind in KINDS:
            r = row[kind]
            total_s[kind] = None if r is None or total_s[kind] is None else total_s[kind] + f / (r * 1e12)
        per_shape.append({**row, **{kind: None if row[kind] is None else _sig(row[kind]) for kind in KINDS}})
    rate = {k: (None if s is None or s <= 0 else _sig(flops / s / 1e12)) for k, s in total_s.items()}
    bf16 = max((r for r in (rate["bf16"], rate["bf16_packed"]) if r is not None), default=None)
    return {
        "int8_check": _int8_check(threads),
        "fp32": rate["fp32"],
        "bf16": bf16,
        "bf16_linear": rate["bf16"],
        "bf16_packed": rate["bf16_packed"],
        "int8": rate["int8"],
        "per_shape": per_shape,
        "threads": threads,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _int8_check(threads: int) -> Optional[Dict[str, Any]]:
    """optimize(int8=True)'s own speed check (bert_fast.model.int8_speed) at ``threads`` threads, or
    None where this torch has no CPU int8 GEMM."""
    import torch

    from bert_fast.model import int8_speed

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return int8_speed.check().as_dict()
    except RuntimeError:
        return None
    finally:
        torch.set_num_threads(before)


def _units(caps: Dict[str, Any]) -> str:
    flags = caps.get("flags") or {}
    have = [UNIT_NAMES[f] for f in UNIT_NAMES if flags.get(f)]
    return ", ".join(have) if have else "none of AMX, AVX-512 BF16/VNNI, AVX2"


def recommend(caps: Dict[str, Any], rates: Dict[str, Any]) -> Dict[str, Any]:
    """The precision to use and why: {"precision": "bf16" | "fp32", "call", "why": [...], "int8": None or
    a sentence}. ``caps`` as cpu_caps.capabilities(), ``rates`` as measure_rates() (pure: testable)."""
    fp32, bf16, int8 = rates.get("fp32"), rates.get("bf16"), rates.get("int8")
    bf16_units = bool(caps.get("bf16"))
    why = [f"{caps.get('model', 'unknown CPU')}: {_units(caps)}; {caps.get('bf16_reason', '')}".rstrip("; ")]
    if bf16_units and bf16 is not None and fp32 and bf16 >= BF16_OVER_FP32 * fp32:
        precision, call, best = "bf16", CALL_BF16, bf16
        why.append(
            f"bf16 GEMMs measured {bf16 / fp32:.1f}x fp32 here ({bf16:.3g} vs {fp32:.3g} TFLOP/s); "
            "bf16 keeps pooled-embedding cosine >= 0.999 to fp32 (LayerNorm and softmax statistics in fp32)"
        )
    elif bf16_units:
        precision, call, best = "fp32", CALL_FP32, fp32
        measured = (
            "bf16 could not be measured here"
            if bf16 is None or not fp32
            else f"bf16 measured {bf16:.3g} TFLOP/s, not faster than fp32 {fp32:.3g} TFLOP/s"
        )
        why.append(f"the CPU lists bf16 units but {measured}: keep fp32")
    else:
        precision, call, best = "fp32", CALL_FP32, fp32
        emulated = "" if bf16 is None or not fp32 else f" (measured {bf16:.3g} vs fp32 {fp32:.3g} TFLOP/s)"
        why.append(f"no bf16 units: bf16 here would be emulated and slow{emulated}; use fp32")
    why.append("freeze=True packs the weights for oneDNN where that measured faster (never slower than plain)")
    int8_note = None
    check = rates.get("int8_check")  # bert_fast.model.int8_speed: what optimize(int8=True) decides from
    if check is not None and not check["faster"]:
        int8_note = (
            f"{CALL_INT8} refuses on this CPU (Int8SpeedError): int8 GEMM {check['int8_tops']:.3g} TOPS vs fp32 "
            f"{check['fp32_tflops']:.3g} TFLOP/s measured at M x K x N = {' x '.join(map(str, check['shape']))}; "
            f"(fastest int8 GEMM here: {check.get('backend', 'int_mm')})"
            + (f"; {check['note']}" if check.get("note") else "")
        )
    elif int8 is not None and best and int8 >= INT8_OVER_BEST * best:
        int8_note = (
            f"int8 GEMMs measured {int8 / best:.1f}x {precision} ({int8:.3g} TOPS): {CALL_INT8} may be faster; "
            "it checks pooled-embedding cosine to fp32 on calibration sentences and refuses a model it would "
            "degrade (small sentence-embedding models often are)"
        )
    return {"precision": precision, "call": call, "why": why, "int8": int8_note}


def report(caps: Optional[Dict[str, Any]] = None, rates: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """{"capabilities", "rates", "recommendation"} for this machine (measured unless given)."""
    caps = cpu_caps.capabilities() if caps is None else caps
    rates = measure_rates() if rates is None else rates
    return {"capabilities": caps, "rates": rates, "recommendation": recommend(caps, rates)}


def _fmt(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def format_report(rep: Dict[str, Any]) -> str:
    """The doctor's "precision" section, a few lines."""
    caps, rates, rec = rep["capabilities"], rep["rates"], rep["recommendation"]
    shapes = ", ".join(f"{r['m']}x{r['n']}x{r['k']}" for r in rates.get("per_shape", [])) or "BERT shapes"
    lines = [
        "precision for CPU inference:",
        "  " + cpu_caps.describe(caps),
        f"  GEMM rates at {shapes} (M x N x K), {rates.get('threads')} threads: fp32 {_fmt(rates.get('fp32'))} "
        f"TFLOP/s, bf16 {_fmt(rates.get('bf16_linear'))} (F.linear) / {_fmt(rates.get('bf16_packed'))} "
        f"(oneDNN packed) TFLOP/s, int8 {_fmt(rates.get('int8'))} TOPS (torch._int_mm)",
        f"  recommended: {rec['precision']}: {rec['call']}",
    ]
    lines += [f"    why: {w}" for w in rec["why"]]
    if rec.get("int8"):
        lines.append(f"    int8: {rec['int8']}")
    return "\n".join(lines)
