"""Benchmark cases of residual_layer_norm: y = LayerNorm(dropout(x) + residual) over [T, H] with BERT's
hidden dropout p = 0.1, forward and backward; memory-bound (GB/s of minimal traffic)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase, device_randn, dtype_name, fwd_bwd

TOKENS = (8192, 16384)
HIDDEN = (768, 1024)
DROPOUT_P = 0.1
EPS = 1e-12


def sample_inputs(t: int, h: int, randn, affine_scale: float = 0.1) -> dict:
    """One call's inputs: x and the residual [T, H], the LayerNorm's weight (1 + ``affine_scale`` * N(0, 1))
    and bias (``affine_scale`` * N(0, 1)) [H]; the tests take 0.5, further from the identity."""
    a = affine_scale
    return {"x": randn(t, h), "residual": randn(t, h), "weight": 1.0 + randn(h, scale=a), "bias": randn(h, scale=a)}


def _eager(x, r, w, b):
    return F.layer_norm(F.dropout(x, DROPOUT_P, training=True) + r, (x.shape[-1],), w, b, EPS)


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_eager, dynamic=False)


def _ours(x, r, w, b):
    from bert_fast.ops import residual_layer_norm

    return residual_layer_norm(x, r, w, b, EPS, DROPOUT_P)


def _fn(provider):
    return {"bert_fast": _ours, "torch": _eager}.get(provider) or _compiled()


def _factory(provider, direction, t, h, device, dtype):
    def make():
        fn = _fn(provider)
        ins = list(sample_inputs(t, h, device_randn(device, dtype)).values())
        if direction == "fwd":
            return lambda: fn(*ins)
        ins = [t_.requires_grad_(True) for t_ in ins]
        y = fn(*ins)
        dy = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, ins, dy, retain_graph=True)

    return make


def cases(device, dtype) -> list[OpCase]:
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for h in HIDDEN:
        for t in TOKENS:
            costs = {
                # read x, residual, weight, bias; write y (+ fp32 mean and rstd, needed by backward)
                "fwd": (10.0 * t * h, float(3 * t * h * es + 2 * h * es + 8 * t)),
                # read dy, x, residual (h is recomputed, never stored), weight, mean, rstd;
                # write dx, dresidual, dweight, dbias
                "bwd": (16.0 * t * h, float(5 * t * h * es + 3 * h * es + 8 * t)),
            }
            params = {"T": t, "H": h, "dtype": dtype_name(dtype), "dropout_p": DROPOUT_P}
            factory = lambda p, direction: _factory(p, direction, t, h, device, dtype)
            out += fwd_bwd(
                "residual_layer_norm",
                f"T={t} H={h}",
                "memory",
                costs,
                factory,
                ("bert_fast", "torch", "torch.compile"),
                params,
            )
    return out
