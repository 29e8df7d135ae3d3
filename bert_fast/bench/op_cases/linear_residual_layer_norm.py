"""Benchmark cases of linear_residual_layer_norm: a BERT output projection with its residual add and
LayerNorm, y = LayerNorm(x W^T + b + residual), inference, at the token counts where its split-K path
runs on an H100/H200 (128: batch 1; 512) and one where it does not (16384: the two ops run).

Providers: "bert_fast" (the op), "bert_fast-two-ops" (BERT_FAST_GEMM_LN=0: linear, then
residual_layer_norm, what the layers ran before), "torch" (F.linear, add, F.layer_norm).
Compute-bound: 2 M N K flops; ``bytes`` is the minimal traffic of one call."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase, device_randn, dtype_name, with_env
from bert_fast.bench.op_cases import linear as linear_cases
from bert_fast.bench.op_cases import residual_layer_norm as residual_layer_norm_cases

HIDDEN = (768, 1024)
TOKENS = (128, 512, 16384)
EPS = 1e-12
PROVIDERS = ("bert_fast", "bert_fast-two-ops", "torch")


def sample_inputs(m: int, n: int, k: int, randn) -> dict:
    """One call's inputs, in the op's order: the linear's x [M, K], weight [N, K] and bias [N]
    (linear's cases), the residual [M, N] and the LayerNorm's weight and bias (residual_layer_norm's)."""
    lin = linear_cases.sample_inputs(m, n, k, randn)
    ln = residual_layer_norm_cases.sample_inputs(m, n, randn)
    return {**lin, "residual": ln["residual"], "ln_weight": ln["weight"], "ln_bias": ln["bias"]}


def _torch(x, w, b, r, lw, lb):
    return F.layer_norm(F.linear(x, w, b) + r, (w.shape[0],), lw, lb, EPS)


def _ours(x, w, b, r, lw, lb):
    from bert_fast.ops import linear_residual_layer_norm

    return linear_residual_layer_norm(x, w, b, r, lw, lb, EPS)


def _factory(provider, m, n, k, device, dtype):
    def make():
        ins = list(sample_inputs(m, n, k, device_randn(device, dtype)).values())
        if provider == "bert_fast-two-ops":
            return lambda: with_env("BERT_FAST_GEMM_LN", "0", lambda: _ours(*ins))
        fn = _ours if provider == "bert_fast" else _torch
        return lambda: fn(*ins)

    return make


def cases(device, dtype) -> list[OpCase]:
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for h in HIDDEN:
        for gemm, n, k in (("attn_out", h, h), ("ffn_down", h, 4 * h)):
            for m in TOKENS:
                out.append(
                    OpCase(
                        op="linear_residual_layer_norm",
                        label=f"{gemm} M={m} N={n} K={k}",
                        direction="fwd",
                        bound="compute",
                        flops=2.0 * m * n * k,
                        bytes=float((m * k + n * k + 2 * m * n + 3 * n) * es),  # x, W, residual, y, 3 vectors
                        providers={p: _factory(p, m, n, k, device, dtype) for p in PROVIDERS},
                        params={"M": m, "N": n, "K": k, "gemm": gemm, "dtype": dtype_name(dtype)},
                    )
                )
    return out
