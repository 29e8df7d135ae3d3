"""The two ceilings every figure is compared against, measured on the device at hand.

* ``copy_bandwidth_gbs(device)``: a device-to-device copy of a large buffer (dst.copy_(src));
  GB/s = (bytes read + bytes written) / time, 1 GB = 1e9 bytes. A memory-bound op's GB/s is
  quoted as a percentage of this.
* ``matmul_tflops(device, dtype)``: a large square GEMM (8192^3 on the GPU); TFLOP/s =
  2*n^3 / time. A compute-bound op's TFLOP/s and the model's MFU are quoted against this.

Each is the best (fastest) of its timed repetitions: a ceiling is what the device can reach.
Both are measured (not datasheet numbers: a datasheet's peak is not reachable and differs between
SKUs, clocks and power caps) once per process and cached. On the CPU they are measured the same
way with small sizes so that the CLI still runs; they only describe that CPU.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from bert_fast.bench.timing import time_callables

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
           "float32": torch.float32, "float": torch.float32}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: bf16, fp16, fp32") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype).replace("torch.", ""))


def _copy_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # 1 GiB per buffer (two buffers), far beyond any L2; less when the GPU is nearly full.
        return int(min(1 << 30, max(64 << 20, free // 8)))
    return 64 << 20


@functools.lru_cache(maxsize=None)
def _copy_bandwidth(device_str: str) -> float:
    device = torch.device(device_str)
    nbytes = _copy_bytes(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    iters = 20 if device.type == "cuda" else 5
    t = time_callables([lambda: dst.copy_(src)], device, warmup=3, iters=iters)
    gbs = 2.0 * src.numel() * src.element_size() / (t.min_ms * 1e-3) / 1e9
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return gbs


@functools.lru_cache(maxsize=None)
def _matmul_rate(device_str: str, dtype: torch.dtype, n: int) -> float:
    device = torch.device(device_str)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.float32, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32, generator=g).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    iters = 20 if device.type == "cuda" else 5
    t = time_callables([lambda: torch.matmul(a, b, out=c)], device, warmup=3, iters=iters)
    del a, b, c
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2.0 * n ** 3 / (t.min_ms * 1e-3) / 1e12


def _device_str(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def copy_bandwidth_gbs(device) -> float:
    """Measured device-to-device copy bandwidth of ``device`` in GB/s (read + write bytes)."""
    return _copy_bandwidth(_device_str(device))


def matmul_size(device) -> int:
    return 8192 if torch.device(device).type == "cuda" else 1024


def matmul_tflops(device, dtype=torch.bfloat16, n: Optional[int] = None) -> float:
    """Measured rate of a large ``dtype`` GEMM (n^3, n=8192 on the GPU) on ``device``, TFLOP/s."""
    dtype = parse_dtype(dtype)
    return _matmul_rate(_device_str(device), dtype, int(n or matmul_size(device)))


def measure(device, dtype) -> dict:
    """Both ceilings, as written into the JSON results."""
    dtype = parse_dtype(dtype)
    n = matmul_size(device)
    return {
        "copy_bandwidth_gbs": copy_bandwidth_gbs(device),
        "matmul_tflops": matmul_tflops(device, dtype, n),
        "matmul_dtype": dtype_name(dtype),
        "matmul_shape": [n, n, n],
        "copy_bytes_per_buffer": _copy_bytes(torch.device(device)),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if torch.device(device).type == "cuda" else None,
        "method": "measured at the start of this run: fastest of the timed dst.copy_(src) and torch.matmul calls",
    }
