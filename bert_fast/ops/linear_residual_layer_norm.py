"""linear_residual_layer_norm: a BERT output projection with its residual add and LayerNorm,
    y = LayerNorm(dropout(x @ weight^T + bias) + residual) * ln_weight + ln_bias,
the attention output (BertSelfOutput) and the FFN down-projection (BertOutput) of every layer.

Why one call. At small M (batch 1: 128 tokens) a GEMM of N = 768 outputs has 6-24 output tiles for
the GPU's 132 SMs, so each tile walks the whole K alone (benchmarks/NOTES.md, the H200 lease). On
the kernel path, for inference at such an M, this op runs the GEMM split over K-slices that fill the
SMs (kernels/linear_tma.py, ``forward_splits``), writing fp32 partials with no epilogue, and one
more kernel sums the slices in a fixed order and applies the bias, the residual add and the
LayerNorm (kernels/residual_layer_norm.py, ``partials_residual_layer_norm_fwd``): two launches, as
before (GEMM, then residual_layer_norm), with the GEMM spread over the whole GPU and no rounding of
the GEMM's output to 16 bits before the LayerNorm. The fused path is checked against the torch
implementation the first time each specialization runs (bert_fast/ops/_verify.py).

Everywhere else (training, dropout, torch.compile, autocast, the CPU, an M whose tiles already fill the GPU,
operands the TMA kernel does not take, BERT_FAST_GEMM_LN=0, or the cuBLAS backend forced) it is
``linear`` then ``residual_layer_norm``: the same ops, the same numbers as calling them.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from bert_fast.ops import _dispatch, _verify, torch_impl
from bert_fast.ops.linear import linear, requested_backend
from bert_fast.ops.residual_layer_norm import residual_layer_norm

__all__ = ["linear_residual_layer_norm"]

KERNEL = "Triton split-K GEMM + partials-residual-LayerNorm"
_ENV = "BERT_FAST_GEMM_LN"  # "0": always the two ops (an A/B switch for a GPU run)


def linear_residual_layer_norm(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    residual: Tensor,
    ln_weight: Tensor,
    ln_bias: Tensor,
    eps: float = 1e-12,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """LayerNorm(dropout(x @ weight^T + bias) + residual) * ln_weight + ln_bias for x [..., K],
    weight [N, K], bias [N] (or None), residual [..., N], ln_weight and ln_bias [N]; one dtype."""
    splits = _fused_splits(x, weight, residual, ln_weight.dtype, dropout_p)
    if splits > 1:
        y = _fused(x, weight, bias, residual, ln_weight, ln_bias, eps, splits)
        if y is not None:
            return y
    # (under autocast linear() returns the autocast dtype: the LayerNorm runs in the residual's, as
    # the model's layers did before this op)
    y = linear(x, weight, bias).to(residual.dtype)
    return residual_layer_norm(y, residual, ln_weight, ln_bias, eps, dropout_p, generator)


def _fused_splits(x: Tensor, weight: Tensor, residual: Tensor, ln_dtype: torch.dtype, dropout_p: float) -> int:
    """The K-slices of the fused path for this call, or 1 where the two ops run (and check the inputs)."""
    if (
        dropout_p != 0.0
        or os.environ.get(_ENV, "auto") == "0"
        or torch.compiler.is_compiling()
        or torch.is_autocast_enabled(x.device.type)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or residual.requires_grad))
        or _dispatch.implementation(x, uses_dot=True) != "kernel"
        or requested_backend(None) == "cublas"
        or x.dim() < 1
        or weight.dim() != 2
        or not x.dtype == weight.dtype == residual.dtype == ln_dtype
        or residual.shape != x.shape[:-1] + (weight.shape[0],)
    ):
        return 1
    from bert_fast.kernels import linear_tma

    if not linear_tma.enabled_for(x.device, x.dtype):
        return 1
    n, k = weight.shape
    return linear_tma.forward_splits(x.numel() // max(k, 1), n, k, x.device)


def _spec(x: Tensor, weight: Tensor, splits: int) -> tuple:
    n, k = weight.shape
    return (x.dtype, _verify.bucket(x.numel() // max(k, 1)), n, k, splits)


def _fused(x, weight, bias, residual, ln_weight, ln_bias, eps, splits) -> Optional[Tensor]:
    """The two kernels (first-use checked), or None where the TMA kernel does not take the operands."""
    from bert_fast.kernels.linear import linear_fwd_partials
    from bert_fast.kernels.residual_layer_norm import partials_residual_layer_norm_fwd

    n, k = weight.shape
    x2, r2 = x.reshape(-1, k), residual.reshape(-1, n)
    b = bias if bias is not None else x.new_zeros((n,))
    gemm = linear_fwd_partials(x2, weight, splits)
    if gemm is None:
        return None

    def kernel():
        return partials_residual_layer_norm_fwd(gemm(), b, r2, ln_weight, ln_bias, eps)

    def fallback(_keep):
        z, _ = torch_impl.linear_fwd(x2, weight, b, None, False)
        return torch_impl.residual_layer_norm_fwd(z, r2, ln_weight, ln_bias, eps, 0.0, None)

    y, _, _ = _verify.run(
        "linear_residual_layer_norm",
        "fwd",
        _spec(x, weight, splits),
        x.device,
        label=KERNEL,
        dtype=x.dtype,
        kernel=kernel,
        fallback=fallback,
        checks=lambda kk, t, _keep: _checks(x2, weight, b, r2, ln_weight, ln_bias, kk, t),
    )
    return y.view(residual.shape)


def _checks(x2, weight, b, r2, ln_weight, ln_bias, k, t) -> list:
    """LayerNorm's checks on h = x W^T + b + residual, recomputed in fp32, whose terms have the
    magnitude |x| |W|^T + |b| + |residual|."""
    ax, aw, ab, ar = (_verify.absf(u) for u in (x2, weight, b, r2))
    h = x2.to(ax.dtype) @ weight.to(ax.dtype).t() + b.to(ax.dtype) + r2.to(ax.dtype)
    hmag = ax @ aw.t() + ab + ar
    n = r2.shape[-1]
    flat = lambda outs: (outs[0].reshape(-1, n), outs[1].reshape(-1), outs[2].reshape(-1))
    return _verify.layer_norm_checks(h, hmag, ln_weight, ln_bias, flat(k), flat(t))
