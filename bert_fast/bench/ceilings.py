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

Beside them, ``gemm_rates``: the CPU's GEMM rates per precision (fp32 / bf16 through F.linear and
oneDNN's prepacked linear, int8 through torch._int_mm) at given (M, N, K) shapes, timed side by side
the same way; ``bert-fast doctor``'s precision advice and benchmarks/cpu/precision_roofline.py use it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

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


# ----------------------------------------------------------------------------- GEMM rates per precision
GEMM_KINDS = ("fp32", "fp32_packed", "bf16", "bf16_packed", "int8")


def gemm_kernels(
    m: int, n: int, k: int, kinds: Sequence[str] = GEMM_KINDS, *, bias: bool = False
) -> Dict[str, Optional[Callable[[], Any]]]:
    """Zero-argument callables, one per kind, each running one [m, k] x [k, n] CPU GEMM: "fp32" and "bf16"
    through F.linear, "fp32_packed" and "bf16_packed" through oneDNN's prepacked linear
    (torch.ops.mkldnn._linear_pointwise), "int8" through torch._int_mm (int8 in, int32 out, no bias);
    ``bias``: the linears add a bias. None for a kind this torch cannot run (probed once here)."""
    import torch.nn.functional as F

    unknown = [kind for kind in kinds if kind not in GEMM_KINDS]
    if unknown:
        raise ValueError(f"unknown GEMM kind(s) {unknown}; valid: {', '.join(GEMM_KINDS)}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    xb, wb, bb = x.bfloat16(), w.bfloat16(), (None if b is None else b.bfloat16())

    def packed(x_, w_, b_):
        pw = torch.ops.mkldnn._reorder_linear_weight(w_, None)
        torch.ops.mkldnn._linear_pointwise(x_[:8], pw, b_, "none", [], "")
        return lambda: torch.ops.mkldnn._linear_pointwise(x_, pw, b_, "none", [], "")

    def int_mm():
        xi = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
        wi = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=g)
        torch._int_mm(xi[:32], wi)
        return lambda: torch._int_mm(xi, wi)

    makers = {
        "fp32": lambda: lambda: F.linear(x, w, b),
        "fp32_packed": lambda: packed(x, w, b),
        "bf16": lambda: lambda: F.linear(xb, wb, bb),
        "bf16_packed": lambda: packed(xb, wb, bb),
        "int8": int_mm,
    }
    out: Dict[str, Optional[Callable[[], Any]]] = {}
    for kind in kinds:
        try:
            out[kind] = makers[kind]()
        except Exception:  # noqa: BLE001 - no oneDNN packed linear / int8 GEMM in this torch (or not here)
            out[kind] = None
    return out


def gemm_rates(
    shapes: Iterable[Tuple[int, int, int]],
    kinds: Sequence[str] = GEMM_KINDS,
    *,
    bias: bool = False,
    extra: Optional[Callable[[int, int, int], Dict[str, Callable[[], Any]]]] = None,
    warmup: int = 1,
    min_rounds: int = 1,
    max_rounds: int = 7,
    budget_s: Optional[float] = None,
) -> List[Dict[str, Any]]:
    """Per (M, N, K) of ``shapes``: {"m", "n", "k", kind: TFLOP/s (TOPS for int8) or None}, the rate
    2*M*N*K / median time of gemm_kernels(M, N, K, kinds, bias=bias) plus ``extra(M, N, K)`` (more
    callables doing that GEMM's work, rated the same way). The kernels of one shape are timed side by
    side in interleaved rounds (bert_fast.bench.timing.measure: ``warmup`` rounds, then ``min_rounds`` to
    ``max_rounds`` rounds, stopping after ``budget_s`` seconds per shape); a kind this torch lacks, or
    one that raises, is None. Runs at the current torch thread count."""
    rows: List[Dict[str, Any]] = []
    for m, n, k in shapes:
        fns = gemm_kernels(m, n, k, kinds, bias=bias)
        fns.update(extra(m, n, k) if extra is not None else {})
        live = {name: fn for name, fn in fns.items() if fn is not None}
        found = {}
        if live:
            res = timing.measure(
                live, "cpu", warmup=warmup, min_rounds=min_rounds, max_rounds=max_rounds, budget_s=budget_s
            )
            found = res.timings
        flops = 2.0 * m * n * k
        row: Dict[str, Any] = {"m": m, "n": n, "k": k}
        for name in fns:
            t = found.get(name)
            row[name] = None if t is None or t.median_ms <= 0 else flops / (t.median_ms * 1e-3) / 1e12
        rows.append(row)
    return rows
