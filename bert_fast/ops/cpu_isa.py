"""Which instruction set each native CPU pass runs on this machine (csrc/cpu_isa.h decides it at run
time from the CPU, capped by ``BERT_FAST_CPU_ISA``), for ``bert-fast info``, the bench and the tests.

``BERT_FAST_CPU_ISA=scalar|avx2|avx512|avx512_bf16`` caps every native pass: on an AVX-512 machine
``BERT_FAST_CPU_ISA=avx2`` runs exactly what an AVX2-only CPU runs (the int8 passes' portable code,
the AVX2 dropout mask, torch's attention instead of the AVX-512 BF16 kernel). The int8 GEMM itself
(torch._int_mm, oneDNN) and the fp32/bf16 GEMMs pick their own code inside torch (oneDNN reads
``ONEDNN_MAX_CPU_ISA``); bert_fast.model.int8_speed measures the int8 one before int8 is offered.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

ISAS = ("scalar", "avx2", "avx512", "avx512_bf16")  # narrowest first

try:
    from bert_fast import _C as _ext

    if not hasattr(_ext, "cpu_isa"):  # an extension built before the run-time ISA cap existed
        _ext = None
except ImportError:  # pragma: no cover - the extension is part of every install
    _ext = None


def cap() -> Optional[str]:
    """BERT_FAST_CPU_ISA, checked: None when unset or empty; ValueError naming the value otherwise."""
    value = os.environ.get("BERT_FAST_CPU_ISA", "").strip()
    if not value:
        return None
    if value not in ISAS:
        raise ValueError(f"BERT_FAST_CPU_ISA={value!r}: expected one of {', '.join(ISAS)} (or unset)")
    return value


def native_passes() -> Dict[str, str]:
    """{"cpu": the CPU's widest ISA, "cap": BERT_FAST_CPU_ISA or "-", and per native pass the version
    it runs: "keep_mask" (dropout mask), "int8_passes" (int8 quantize / dequantize),
    "attention_bf16" / "attention_fp32" (the attention kernels, or "not used: ..." where they cannot
    run; where they run, a first-use timing still decides against torch's kernel)}; {} without the
    extension."""
    if _ext is None:
        return {}
    cap()  # a bad value is a clear error here, before the extension says it
    isa = _ext.cpu_isa()
    out = {"cpu": isa["cpu"], "cap": os.environ.get("BERT_FAST_CPU_ISA") or "-"}
    out["keep_mask"] = _ext.keep_mask_isa()
    out["int8_passes"] = _ext.int8_isa() if hasattr(_ext, "int8_isa") else "scalar"
    has_attn = hasattr(_ext, "cpu_has_bf16_dot") and _ext.cpu_has_bf16_dot()
    out["attention_bf16"] = "avx512_bf16" if has_attn else "not used: needs avx512_bf16 (torch's kernel runs)"
    f32 = _ext.attention_f32_isa() if hasattr(_ext, "attention_f32_isa") else ""
    out["attention_fp32"] = f32 or "not used: needs avx2+fma (torch's kernel runs)"
    return out


def describe() -> str:
    """One line: "native CPU passes: CPU avx512_bf16 (cap -): keep_mask avx512, int8_passes avx512, ..."."""
    p = native_passes()
    if not p:
        return "native CPU passes: bert_fast._C not built"
    passes = ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("cpu", "cap"))
    return f"native CPU passes: CPU {p['cpu']} (BERT_FAST_CPU_ISA {p['cap']}): {passes}"
