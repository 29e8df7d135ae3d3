"""Which precisions this CPU runs fast, and the one message each wrong choice gets.

bf16 is fast on a CPU only with bf16 units: AMX (Intel Sapphire Rapids and later) or AVX-512 BF16
(Intel Cooper Lake, AMD Zen 4/5), and only where oneDNN may use them (``ONEDNN_MAX_CPU_ISA`` can cap it
below). Elsewhere oneDNN still runs bf16 (``_is_mkldnn_bf16_supported`` says True on any AVX-512 CPU)
by converting in software, slower than fp32. fp16 has no fast path on
x86 CPUs without AMX-FP16. int8 GEMMs use VNNI / AMX-INT8. The flags come from /proc/cpuinfo
(Linux); elsewhere the capability is unknown and nothing is refused.
"""

from __future__ import annotations

import functools
import warnings
from typing import FrozenSet, Optional

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")


@functools.lru_cache(maxsize=None)
def cpu_flags() -> Optional[FrozenSet[str]]:
    """The CPU's feature flags (/proc/cpuinfo: x86 ``flags``, Arm ``Features``), or None where they
    cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def has_bf16_units() -> Optional[bool]:
    """True/False where known: the CPU has bf16 GEMM units (AMX-BF16 or AVX-512 BF16) and oneDNN may
    use them here. ``ONEDNN_MAX_CPU_ISA`` (AVX2, say) caps oneDNN below them: bf16 would then run
    without them, as on a CPU that lacks them."""
    flags = cpu_flags()
    if flags is None:
        return None
    return any(f in flags for f in BF16_FLAGS) and onednn_runs_bf16()


@functools.lru_cache(maxsize=None)
def onednn_runs_bf16() -> bool:
    """oneDNN runs bf16 natively in this process: AVX-512 or wider allowed (``ONEDNN_MAX_CPU_ISA``, read
    once per process by oneDNN too). Necessary for fast bf16, not sufficient: it also says True on
    AVX-512 CPUs without bf16 units, where oneDNN converts in software."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001 - a torch build without oneDNN: no native bf16 GEMM either
        return False


def no_bf16_reason() -> str:
    """Why has_bf16_units() is False here, for the messages that refuse or warn."""
    flags = cpu_flags() or frozenset()
    if any(f in flags for f in BF16_FLAGS):
        return "the CPU has bf16 units but oneDNN may not use them in this process (ONEDNN_MAX_CPU_ISA caps it)"
    return "this CPU has no bf16 units (neither AMX-BF16 nor AVX-512 BF16 in /proc/cpuinfo)"


def has_int8_units() -> Optional[bool]:
    flags = cpu_flags()
    if flags is None:
        return None
    return any(f in flags for f in INT8_FLAGS)


def parse_dtype(dtype) -> Optional[torch.dtype]:
    """torch.float32 / torch.bfloat16 / torch.float16 or their names ("fp32", "bf16", ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "float": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if isinstance(dtype, str) and dtype.lower() in names:
        return names[dtype.lower()]
    raise ValueError(f"dtype must be torch.float32, torch.bfloat16 (or 'fp32', 'bf16'), got {dtype!r}")


def check_requested(dtype: torch.dtype, device: torch.device) -> None:
    """optimize(model, dtype=...): refuse what would be slow or unsupported on this CPU, with why."""
    if device.type != "cpu":
        return
    if dtype == torch.float16:
        raise ValueError(
            "float16 on the CPU has no fast GEMMs (x86 CPUs without AMX-FP16 convert it in software): "
            "use dtype=torch.bfloat16 on a CPU with bf16 units, else torch.float32"
        )
    if dtype == torch.bfloat16 and has_bf16_units() is False:
        raise ValueError(
            f"{no_bf16_reason()}: bf16 would run converted in software, slower than float32. "
            "Use dtype=torch.float32 (with freeze=True for inference)"
        )


_WARNED: set = set()


def warn_slow_dtype(dtype: torch.dtype) -> None:
    """A forward on CPU parameters in a dtype this CPU runs slowly: said once per process and dtype."""
    if dtype in _WARNED:
        return
    if dtype == torch.float16:
        msg = (
            "bert_fast: float16 weights on the CPU run without fast GEMMs (converted in software, far slower "
            "than float32): use torch.bfloat16 on a CPU with bf16 units, else torch.float32"
        )
    elif dtype == torch.bfloat16 and has_bf16_units() is False:
        msg = (
            f"bert_fast: bfloat16 weights, but {no_bf16_reason()}: oneDNN converts in software, slower than "
            "float32; use torch.float32 on this machine"
        )
    else:
        return
    _WARNED.add(dtype)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
