"""The two ceilings every figure is compared against, measured on the device at hand.

* copy bandwidth: a device-to-device copy of a large buffer (dst.copy_(src));
  GB/s = (bytes read + bytes written) / time, 1 GB = 1e9 bytes. A memory-bound op's GB/s is
  quoted as a percentage of this.
* GEMM rate: a large square GEMM (8192^3 on the GPU, 1024^3 on the CPU); TFLOP/s = 2*n^3 / time.
  A compute-bound op's TFLOP/s and the model's MFU are quoted against this.

Both are measured (not datasheet numbers: a datasheet's peak is not reachable and differs between
SKUs, clocks and power caps) the way every other figure is (bert_fast.bench.timing.measure): the
two are interleaved in rounds after a warm-up, until each median's 95% interval is within +-3% or
the budget is spent. A ceiling is the rate at the median time, with the interval of that rate;
one whose interval is wider than +-10% is flagged unstable, and so is every figure quoted above
100% of it (a rate above its ceiling means the ceiling was not one: measured while the machine
was busier, or the op's data stayed in a cache the large copy cannot use). Measured once per
process and device (cached).
"""

from __future__ import annotations

from typing import Optional

import torch

from bert_fast.bench import timing

_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; valid: bf16, fp16, fp32") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}.get(
        dtype, str(dtype).replace("torch.", "")
    )


def _copy_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # 1 GiB per buffer (two buffers), far beyond any L2; less when the GPU is nearly full.
        return int(min(1 << 30, max(64 << 20, free // 8)))
    return 64 << 20


def _ceilings(device_str: str, dtype: torch.dtype, n: int, budget_s: float) -> dict:
    device = torch.device(device_str)
    nbytes = _copy_bytes(device)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.float32, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, dtype=torch.float32, generator=g).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    cuda = device.type == "cuda"
    m = timing.measure(
        {"copy": lambda: dst.copy_(src), "matmul": lambda: torch.matmul(a, b, out=c)},
        device,
        warmup=3,
        min_rounds=10 if cuda else timing.MIN_ROUNDS,
        max_rounds=200 if cuda else 60,
        budget_s=budget_s,
        catch=False,
    )
    copy_work = 2.0 * src.numel() * src.element_size() / 1e9  # GB read + written per call
    src = dst = a = b = c = None  # free the buffers before anything else is measured
    if cuda:
        torch.cuda.empty_cache()
    mm_work = 2.0 * n**3 / 1e12  # TFLOP per call
    tc, tm = m.timings["copy"], m.timings["matmul"]

    def rate(work, t):  # the rate at the median time; the interval follows the times' interval
        return work / (t.median_ms * 1e-3), [work / (t.ci_high_ms * 1e-3), work / (t.ci_low_ms * 1e-3)]

    gbs, gbs_ci = rate(copy_work, tc)
    tfl, tfl_ci = rate(mm_work, tm)
    return {
        "copy_bandwidth_gbs": gbs,
        "copy_bandwidth_ci_gbs": gbs_ci,
        "copy_unstable": tc.unstable,
        "matmul_tflops": tfl,
        "matmul_tflops_ci": tfl_ci,
        "matmul_unstable": tm.unstable,
        "rounds": len(m.rounds),
        "threads": m.threads,
    }


_CACHE: dict = {}


def _cached(device, dtype, n: Optional[int] = None, budget_s: Optional[float] = None) -> dict:
    device_s = _device_str(device)
    dtype = parse_dtype(dtype)
    n = int(n or matmul_size(device))
    # the thread count is part of the key: a CPU ceiling measured with 8 threads is not one for 2
    key = (device_s, dtype, n, torch.get_num_threads())
    if key not in _CACHE:
        budget = budget_s if budget_s is not None else (5.0 if torch.device(device_s).type == "cuda" else 8.0)
        _CACHE[key] = _ceilings(device_s, dtype, n, budget)
    return _CACHE[key]


def _device_str(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def copy_bandwidth_gbs(device, dtype=torch.float32) -> float:
    """Measured device-to-device copy bandwidth of ``device`` in GB/s (read + write bytes)."""
    return _cached(device, dtype)["copy_bandwidth_gbs"]


def matmul_size(device) -> int:
    return 8192 if torch.device(device).type == "cuda" else 1024


def matmul_tflops(device, dtype=torch.bfloat16, n: Optional[int] = None) -> float:
    """Measured rate of a large ``dtype`` GEMM (n^3, n=8192 on the GPU) on ``device``, TFLOP/s."""
    return _cached(device, dtype, n)["matmul_tflops"]


def measure(device, dtype) -> dict:
    """Both ceilings with their intervals and flags, as written into the JSON results."""
    dtype = parse_dtype(dtype)
    n = matmul_size(device)
    found = _cached(device, dtype, n)
    return {
        **found,
        "matmul_dtype": dtype_name(dtype),
        "matmul_shape": [n, n, n],
        "copy_bytes_per_buffer": _copy_bytes(torch.device(device)),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32) if torch.device(device).type == "cuda" else None,
        "method": "rate at the median time of dst.copy_(src) and torch.matmul, interleaved in rounds "
        "(bert_fast.bench.timing.measure); *_ci: 95% interval; *_unstable: interval wider than +-10%",
    }


def describe(ceilings: dict, dtype_label: str) -> str:
    """One line for the console: both ceilings with their intervals and flags."""

    def one(value, ci, unit, fmt, unstable):
        text = f"{value:{fmt}} {unit} ({ci[0]:{fmt}}-{ci[1]:{fmt}})"
        return text + (" UNSTABLE" if unstable else "")

    copy = one(
        ceilings["copy_bandwidth_gbs"], ceilings["copy_bandwidth_ci_gbs"], "GB/s", ".1f", ceilings["copy_unstable"]
    )
    gemm = one(ceilings["matmul_tflops"], ceilings["matmul_tflops_ci"], "TFLOP/s", ".3g", ceilings["matmul_unstable"])
    return f"copy {copy}, {dtype_label} GEMM {gemm}; {ceilings['threads']} threads"
