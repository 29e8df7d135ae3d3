"""The int8 GEMM of CPU inference, y = act(x W^T + b) with x quantized per row and W per output
channel (bert_fast/model/int8.py builds the weights and guards the accuracy):

    x_q, s_x = quantize_rows(x)               one pass over x (bert_fast._C), or 5 torch ops
    acc      = torch._int_mm(x_q, W_q^T)      int32, oneDNN (AVX-512 VNNI / AMX-INT8); or our VNNI GEMM on
                                              weights packed once, the same sums (csrc/int8_gemm_vnni.cpp:
                                              int_mm_vnni, or VnniLinear with the other two steps in the same
                                              call); or on CPUs without VNNI our AVX2 GEMM with the next step
                                              in its epilogue (csrc/int8_gemm_avx2.cpp)
    y        = act(dequantize(acc, s_x, s_w, b))  one pass over acc with the GELU in it (bert_fast._C),
                                              or 3-4 torch ops and the GELU

The torch-op versions are the oracle of the C++ ones (equal bit for bit: tests/cpu/test_int8_gemm.py)
and the fallback where the extension was built without them.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

try:
    from bert_fast import _C as _ext

    if not hasattr(_ext, "int8_quantize_rows"):  # an extension built before these passes existed
        _ext = None
except ImportError:  # pragma: no cover - the extension is part of every install
    _ext = None

_CODES = {torch.float32: 0, torch.bfloat16: 1}
# GELU ``approximate`` -> the pass's activation code (0: none)
_ACT_CODES = {None: 0, "none": 1, "tanh": 2}


def native() -> bool:
    """The one-pass C++ versions are in this build."""
    return _ext is not None


def quantize_rows_torch(x: Tensor) -> Tuple[Tensor, Tensor]:
    """(x_q int8 [M, K], s_x fp32 [M]): symmetric per row, s_x = max|x_row| / 127, round half to even."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale.squeeze(1)


def dequantize_torch(acc: Tensor, sx: Tensor, sw: Tensor, bias: Optional[Tensor], dtype: torch.dtype) -> Tensor:
    y = acc.float().mul_(sx[:, None]).mul_(sw)
    if bias is not None:
        y.add_(bias)
    return y.to(dtype)


def quantize_rows(x: Tensor) -> Tuple[Tensor, Tensor]:
    """quantize_rows_torch in one pass where the extension has it (x fp32 or bf16, [M, K])."""
    code = _CODES.get(x.dtype)
    if _ext is None or code is None or x.device.type != "cpu":
        return quantize_rows_torch(x)
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    s = torch.empty((m,), dtype=torch.float32)
    _ext.int8_quantize_rows(x.data_ptr(), code, m, k, q.data_ptr(), s.data_ptr(), torch.get_num_threads())
    return q, s


def dequantize(
    acc: Tensor,
    sx: Tensor,
    sw: Tensor,
    bias: Optional[Tensor],
    dtype: torch.dtype,
    gelu: Optional[str] = None,
    *,
    threads: Optional[int] = None,
    isa: str = "",
) -> Tensor:
    """act(acc * s_x[:, None] * s_w + b) in ``dtype`` (fp32 or bf16), act = GELU(approximate=``gelu``)
    or none, computed in fp32 before the cast: one pass where the extension has it, on at most
    ``threads`` (default: torch's count) and the instruction set ``isa`` ("": the widest usable; tests
    and A/B scripts pin both)."""
    code = _CODES.get(dtype)
    if _ext is None or code is None or acc.device.type != "cpu":
        y = dequantize_torch(acc, sx, sw, bias, torch.float32 if gelu is not None else dtype)
        if gelu is None:
            return y
        return torch._C._nn.gelu_(y, approximate=gelu).to(dtype)
    m, n = acc.shape
    # bound here: a `.contiguous()` copy made inside the call's arguments is freed before the C++ pass reads it
    acc, sx = acc.contiguous(), sx.contiguous()
    y = torch.empty((m, n), dtype=dtype)
    _ext.int8_dequantize(
        acc.data_ptr(),
        m,
        n,
        sx.data_ptr(),
        sw.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        code,
        torch.get_num_threads() if threads is None else threads,
        isa,
        _ACT_CODES[gelu],
    )
    return y


def dequantize_residual_ln_torch(
    acc: Tensor,
    sx: Tensor,
    sw: Tensor,
    bias: Optional[Tensor],
    residual: Tensor,
    ln_w: Tensor,
    ln_b: Tensor,
    eps: float,
) -> Tensor:
    """LayerNorm(acc * s_x * s_w + b + residual) in fp32, cast to the residual's dtype (torch ops)."""
    v = dequantize_torch(acc, sx, sw, bias, torch.float32) + residual.float()
    return torch.nn.functional.layer_norm(v, (v.shape[-1],), ln_w.float(), ln_b.float(), eps).to(residual.dtype)


def dequantize_residual_ln(
    acc: Tensor,
    sx: Tensor,
    sw: Tensor,
    bias: Optional[Tensor],
    residual: Tensor,
    ln_w: Tensor,
    ln_b: Tensor,
    eps: float,
) -> Tensor:
    """LayerNorm(acc * s_x[:, None] * s_w + b + residual) * ln_w + ln_b in the residual's dtype (fp32 or
    bf16), computed in fp32 with one cast at the end: one pass where the extension has it. For the GEMMs
    a residual add and a LayerNorm follow (the attention output and the FFN's down projection)."""
    code = _CODES.get(residual.dtype)
    if _ext is None or code is None or acc.device.type != "cpu" or not hasattr(_ext, "int8_dequantize_residual_ln"):
        return dequantize_residual_ln_torch(acc, sx, sw, bias, residual, ln_w, ln_b, eps)
    m, n = acc.shape
    residual = residual.reshape(m, n).contiguous()
    w, b = ln_w.float().contiguous(), ln_b.float().contiguous()  # no copy for fp32 weights
    acc, sx = acc.contiguous(), sx.contiguous()  # bound: see dequantize
    y = torch.empty((m, n), dtype=residual.dtype)
    _ext.int8_dequantize_residual_ln(
        acc.data_ptr(),
        m,
        n,
        sx.data_ptr(),
        sw.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        residual.data_ptr(),
        w.data_ptr(),
        b.data_ptr(),
        float(eps),
        y.data_ptr(),
        code,
        torch.get_num_threads(),
    )
    return y


def int8_linear(
    x2: Tensor,
    wq_t: Tensor,
    sw: Tensor,
    bias: Optional[Tensor],
    gelu: Optional[str],
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """act(x2 W^T + b) for x2 [M, K] fp32/bf16, W as (W_q^T int8 [K, N], s_w fp32 [N]), b fp32 [N] or
    None; ``gelu``: None or torch's GELU ``approximate`` ("none" / "tanh"). Returns ``out_dtype``
    (fp32 or bf16; default x2's dtype), written by the dequantize pass: no separate cast.
    The GEMM is torch._int_mm (oneDNN; fast where the CPU has AVX-512 VNNI or AMX-INT8)."""
    xq, sx = quantize_rows(x2)
    acc = torch._int_mm(xq, wq_t)
    return dequantize(acc, sx, sw, bias, out_dtype or x2.dtype, gelu)


# ----------------------------------------------------------------------------- AVX-512 VNNI, packed weights
def vnni_available() -> bool:
    """Our AVX-512 VNNI int8 GEMM (csrc/int8_gemm_vnni.cpp) is built and this CPU (and BERT_FAST_CPU_ISA) runs it."""
    return _ext is not None and hasattr(_ext, "int8_gemm_vnni") and _ext.int8_gemm_vnni_usable()


def pack_weight_vnni(wq_t: Tensor) -> Tensor:
    """W_q^T int8 [K, N] -> the VNNI GEMM's panels uint8 [ceil(N/16), ceil(K/4), 16, 4]:
    packed[p, j, lane, t] = W_q^T[4j + t, 16p + lane] + 128, and 128 (a zero weight) in the padding."""
    k, n = wq_t.shape
    kq, np_ = (k + 3) // 4, (n + 15) // 16
    w = torch.zeros((4 * kq, 16 * np_), dtype=torch.int16)
    w[:k, :n] = wq_t
    return (w + 128).to(torch.uint8).view(kq, 4, np_, 16).permute(2, 0, 3, 1).contiguous()


def int_mm_vnni(xq: Tensor, w_packed: Tensor, n: int) -> Tensor:
    """torch._int_mm(x_q, W_q^T) on the packed weights: int32 [M, N], the same sums bit for bit."""
    m, k = xq.shape
    if k % 4:  # the packed weights have zero rows up to a multiple of 4; x gets zero columns to meet them
        xq = torch.nn.functional.pad(xq, (0, 4 - k % 4))
    xq = xq.contiguous()
    acc = torch.empty((m, n), dtype=torch.int32)
    _ext.int8_gemm_vnni(xq.data_ptr(), m, xq.shape[1], w_packed.data_ptr(), n, acc.data_ptr(), torch.get_num_threads())
    return acc


class VnniLinear:
    """One int8 linear layer on packed weights whose every call is one C++ call and one parallel region
    (csrc/int8_gemm_vnni.cpp Int8VnniLinear): x quantized per row, the GEMM, the dequantization (GELU in
    the epilogue, or the residual add and LayerNorm after the sums). The same passes' arithmetic: the
    same bits as quantize_rows + int_mm_vnni + dequantize / dequantize_residual_ln, without the Python
    and the four parallel regions between them. Keeps the tensors it points at; K a multiple of 4."""

    def __init__(self, w_packed: Tensor, k: int, n: int, sw: Tensor, bias: Optional[Tensor]):
        self._keep = (w_packed, sw, bias)
        self.n = n
        b = 0 if bias is None else bias.data_ptr()
        self._native = _ext.Int8VnniLinear(w_packed.data_ptr(), k, n, sw.data_ptr(), b)

    def linear(self, x2: Tensor, gelu: Optional[str], out_dtype: torch.dtype) -> Tensor:
        """act(x2 W^T + b) [M, N] in ``out_dtype`` for x2 [M, K] fp32 / bf16."""
        x2 = x2.contiguous()
        y = torch.empty((x2.shape[0], self.n), dtype=out_dtype)
        self._native.linear(
            x2.data_ptr(),
            _CODES[x2.dtype],
            x2.shape[0],
            y.data_ptr(),
            _CODES[out_dtype],
            _ACT_CODES[gelu],
            torch.get_num_threads(),
        )
        return y

    def linear_residual_ln(self, x2: Tensor, residual: Tensor, ln_w: Tensor, ln_b: Tensor, eps: float) -> Tensor:
        """LayerNorm(x2 W^T + b + residual) * ln_w + ln_b in the residual's dtype."""
        x2, m = x2.contiguous(), x2.shape[0]
        residual = residual.reshape(m, self.n).contiguous()
        w, b = ln_w.float().contiguous(), ln_b.float().contiguous()  # no copy for fp32 weights
        y = torch.empty((m, self.n), dtype=residual.dtype)
        code = _CODES[residual.dtype]
        ptrs = (y.data_ptr(), residual.data_ptr(), code, w.data_ptr(), b.data_ptr())
        self._native.linear_residual_ln(x2.data_ptr(), _CODES[x2.dtype], m, *ptrs, float(eps), torch.get_num_threads())
        return y


# ----------------------------------------------------------------------------- AVX2 (no VNNI)
def avx2_available() -> bool:
    """Our AVX2 int8 GEMM (csrc/int8_gemm_avx2.cpp) is built and this CPU (and BERT_FAST_CPU_ISA) runs it."""
    if _ext is None or not hasattr(_ext, "int8_linear_avx2") or not hasattr(_ext, "cpu_isa"):
        return False
    return _ext.cpu_isa()["usable"] in ("avx2", "avx512", "avx512_bf16")


def pack_weight_avx2(wq_t: Tensor) -> Tensor:
    """W_q^T int8 [K, N] -> the AVX2 GEMM's int16 pair panels [ceil(N/16), ceil(K/2), 16, 2]:
    packed[p, j, lane, t] = W_q^T[2j + t, 16p + lane], zero padded (csrc/int8_gemm_avx2.cpp)."""
    k, n = wq_t.shape
    kp, np_ = (k + 1) // 2, (n + 15) // 16
    w = torch.zeros((2 * kp, 16 * np_), dtype=torch.int16)
    w[:k, :n] = wq_t
    return w.view(kp, 2, np_, 16).permute(2, 0, 3, 1).contiguous()


def int8_linear_avx2(
    x2: Tensor,
    w_packed: Tensor,
    n: int,
    sw: Tensor,
    bias: Optional[Tensor],
    gelu: Optional[str],
    out_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """int8_linear with our AVX2 GEMM, the dequantization and GELU in its epilogue (one pass over the
    output): the same int32 accumulators as torch._int_mm, so the same result as int8_linear."""
    out_dtype = out_dtype or x2.dtype
    code = _CODES.get(out_dtype)
    if code is None or x2.dtype not in _CODES:
        raise TypeError(f"int8_linear_avx2 takes and returns fp32 or bf16, got {x2.dtype} -> {out_dtype}")
    xq, sx = quantize_rows(x2)
    m, k = xq.shape
    y = torch.empty((m, n), dtype=out_dtype)
    _ext.int8_linear_avx2(
        xq.data_ptr(),
        m,
        k,
        w_packed.data_ptr(),
        n,
        sx.data_ptr(),
        sw.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        y.data_ptr(),
        code,
        _ACT_CODES[gelu],
        torch.get_num_threads(),
    )
    return y
