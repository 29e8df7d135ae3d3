"""A linear layer of CPU inference in one call on weights packed once (csrc/cpu_linear.cpp): y = act(x W^T
+ b), or LayerNorm(x W^T + b + residual) * w + b, in bf16 (AVX-512 BF16) or fp32 (AVX-512), fp32 sums.

Where it runs: ``BertModel.freeze()``'s bf16 and fp32 layers (bert_fast/model/frozen.py), for the row
counts where it measured faster than the packed oneDNN call it replaces (batch 1 on a Zen 4: the call and
the LayerNorm op it saves are most of the host time between kernels). Its sums are fp32 in another order
than oneDNN's: held to the float64 oracle by the 2x rule (tests/cpu/test_cpu_linear.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:
    from bert_fast import _C as _ext

    if not hasattr(_ext, "F32Linear"):  # an extension built before it existed
        _ext = None
except ImportError:  # pragma: no cover - the extension is part of every install
    _ext = None

DTYPES = (torch.bfloat16, torch.float32)
_ACT_CODES = {None: 0, "none": 1, "tanh": 2}  # GELU ``approximate`` -> the kernel's activation code


def available(dtype: torch.dtype) -> bool:
    """Built, and this CPU (and BERT_FAST_CPU_ISA) runs the ``dtype`` linear: AVX-512 BF16 for bf16,
    AVX-512 for fp32."""
    if _ext is None or dtype not in DTYPES:
        return False
    return _ext.bf16_linear_usable() if dtype == torch.bfloat16 else _ext.f32_linear_usable()


def pack_weight(weight: Tensor) -> Tensor:
    """W [N, K] -> 16-column panels, zero columns past N: fp32 [ceil(N/16), K, 16] (packed[p, k, lane] =
    W[16p + lane, k]); bf16 (K even) int16 [ceil(N/16), K/2, 16, 2] (packed[p, j, lane, t] = W[16p +
    lane, 2j + t], the bf16 bits)."""
    n, k = weight.shape
    np_ = (n + 15) // 16
    w = torch.zeros((k, 16 * np_), dtype=weight.dtype)
    w[:, :n] = weight.t()
    if weight.dtype == torch.float32:
        return w.view(k, np_, 16).permute(1, 0, 2).contiguous()
    return w.view(torch.int16).view(k // 2, 2, np_, 16).permute(2, 0, 3, 1).contiguous()


class OneCallLinear:
    """One linear layer (weight [N, K], bf16 with K even or fp32; bias [N] or None) whose every call is
    one C++ call and one parallel region, in the weight's dtype. Keeps its packed weights and fp32 bias."""

    def __init__(self, weight: Tensor, bias: Optional[Tensor]):
        self.n, self.k = weight.shape
        self.dtype = weight.dtype
        self.weight = pack_weight(weight.detach())
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()
        b = 0 if self.bias is None else self.bias.data_ptr()
        native = _ext.Bf16Linear if self.dtype == torch.bfloat16 else _ext.F32Linear
        self._native = native(self.weight.data_ptr(), self.k, self.n, b)

    def linear(self, x2: Tensor, gelu: Optional[str] = None) -> Tensor:
        """act(x2 W^T + b) [M, N] for x2 [M, K] (the weight's dtype); ``gelu``: None or torch's GELU
        ``approximate``."""
        x2 = x2.contiguous()
        y = torch.empty((x2.shape[0], self.n), dtype=self.dtype)
        self._native.linear(x2.data_ptr(), x2.shape[0], y.data_ptr(), _ACT_CODES[gelu], torch.get_num_threads())
        return y

    def linear_residual_ln(self, x2: Tensor, residual: Tensor, ln_w: Tensor, ln_b: Tensor, eps: float) -> Tensor:
        """LayerNorm(x2 W^T + b + residual) * ln_w + ln_b [M, N] (residual in the weight's dtype)."""
        x2, m = x2.contiguous(), x2.shape[0]
        residual = residual.reshape(m, self.n).contiguous()
        w, b = ln_w.float().contiguous(), ln_b.float().contiguous()
        y = torch.empty((m, self.n), dtype=self.dtype)
        ptrs = (residual.data_ptr(), w.data_ptr(), b.data_ptr())
        self._native.linear_residual_ln(x2.data_ptr(), m, y.data_ptr(), *ptrs, float(eps), torch.get_num_threads())
        return y
