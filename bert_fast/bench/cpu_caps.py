"""What this CPU offers for low precision (issue 25): its model name, the instruction-set flags that
matter for bf16 and int8 (AMX, AVX-512 BF16 / VNNI, AVX2: bert_fast.model.precision.cpu_flags, the
flags the model's own precision checks read) and whether oneDNN, in this torch, runs bf16 on it
(torch.ops.mkldnn._is_mkldnn_bf16_supported()).

``bert-fast bench`` uses it to decide whether the CPU default includes bf16 cases, and prints
``describe()`` with the results; ``bert-fast doctor`` (a layer above) imports it for its
recommendation. Needs only torch; every probe degrades to "unknown" rather than raising.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any, Dict, FrozenSet, Optional, Tuple

from bert_fast.model import precision
from bert_fast.ops import cpu_isa

# The flags reported, strongest first. amx_bf16 / avx512_bf16: bf16 dot products in hardware;
# amx_int8 / avx512_vnni: int8 dot products (VNNI also comes as avx_vnni on AVX2-only parts).
FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")


def _cpuinfo_text(path: str = "/proc/cpuinfo") -> Optional[str]:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return None


def cpu_model(text: Optional[str] = None) -> str:
    """The CPU's model name ("model name" in /proc/cpuinfo), else platform.processor(), else "unknown CPU"."""
    text = _cpuinfo_text() if text is None else text
    for line in (text or "").splitlines():
        if line.lower().startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def cpu_flags() -> Optional[FrozenSet[str]]:
    """The CPU's flags as bert_fast.model.precision reads them, or None where they cannot be read (not Linux)."""
    return precision.cpu_flags()


def mkldnn_bf16() -> Optional[bool]:
    """torch's own answer: does oneDNN run bf16 GEMMs natively on this CPU (None: torch cannot say)."""
    try:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - an old torch or a build without mkldnn
        return None


def capabilities() -> Dict[str, Any]:
    """{"model", "flags": {flag: bool or None}, "mkldnn_bf16", "bf16", "bf16_reason", "int8_units",
    "native_passes": the ISA each native CPU pass runs (bert_fast.ops.cpu_isa.native_passes)}."""
    flags = cpu_flags()
    found = {f: (None if flags is None else f in flags) for f in FLAGS}
    onednn = mkldnn_bf16()
    ok, why = _bf16_verdict(found, onednn)
    return {
        "model": cpu_model(),
        "machine": platform.machine(),
        "flags": found,
        "mkldnn_bf16": onednn,
        "bf16": ok,
        "bf16_reason": why,
        "int8_units": bool(found.get("amx_int8") or found.get("avx512_vnni") or found.get("avx_vnni")),
        "native_passes": _native_passes(),
    }


def _native_passes() -> Dict[str, str]:
    try:
        return cpu_isa.native_passes()
    except ValueError as exc:  # a bad BERT_FAST_CPU_ISA: said, not raised, in a capability report
        return {"error": str(exc)}


def _bf16_verdict(found: Dict[str, Optional[bool]], onednn: Optional[bool]) -> Tuple[bool, str]:
    units = [f for f in ("amx_bf16", "avx512_bf16") if found.get(f)]
    if onednn is False and units:
        return False, (
            f"torch's oneDNN has no native bf16 on this CPU (though it lists {', '.join(units)}): "
            "bf16 would be emulated and slow"
        )
    if units:
        return True, f"bf16 units: {', '.join(units)}" + ("" if onednn else " (torch cannot confirm oneDNN bf16)")
    if onednn:
        return True, "torch's oneDNN reports native bf16"
    if all(v is None for v in found.values()):
        return False, "cannot read the CPU's flags (no /proc/cpuinfo) and torch cannot confirm bf16"
    return False, "no bf16 units (neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo): bf16 would be emulated and slow"


def bf16_supported(caps: Optional[Dict[str, Any]] = None) -> Tuple[bool, str]:
    """(does this CPU run bf16 natively, why in a few words)."""
    caps = capabilities() if caps is None else caps
    return bool(caps["bf16"]), caps["bf16_reason"]


def describe(caps: Optional[Dict[str, Any]] = None) -> str:
    """One line: "CPU: <model>; AMX-BF16 no, AVX512-BF16 yes, ...; oneDNN bf16 yes; native passes (widest
    ISA): keep_mask avx512, int8_passes avx512, attention_bf16 avx512_bf16"."""
    caps = capabilities() if caps is None else caps

    def yn(v):
        return "?" if v is None else ("yes" if v else "no")

    shown = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx2")
    flags = ", ".join(f"{f} {yn(caps['flags'].get(f))}" for f in shown)
    line = f"CPU: {caps['model']}; {flags}; oneDNN bf16 {yn(caps['mkldnn_bf16'])}"
    passes = caps.get("native_passes") or {}
    if passes and "error" not in passes:
        named = ", ".join(f"{k} {v.split(':')[0]}" for k, v in passes.items() if k not in ("cpu", "cap"))
        line += f"; native passes ({'BERT_FAST_CPU_ISA=' + passes['cap'] if passes['cap'] != '-' else 'widest ISA'}): {named}"
    elif passes:
        line += f"; native passes: {passes['error']}"
    return line
