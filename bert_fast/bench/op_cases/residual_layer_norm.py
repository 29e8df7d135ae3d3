"""Benchmark cases of residual_layer_norm: y = LayerNorm(dropout(x) + residual) over [T, H] with BERT's
hidden dropout p = 0.1, forward and backward; memory-bound (GB/s of minimal traffic)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase

TOKENS = (8192, 16384)
HIDDEN = (768, 1024)
DROPOUT_P = 0.1
EPS = 1e-12


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
        x, r = (torch.randn(t, h, device=device, dtype=dtype) for _ in range(2))
        w = 1 + 0.1 * torch.randn(h, device=device, dtype=dtype)
        b = 0.1 * torch.randn(h, device=device, dtype=dtype)
        if direction == "fwd":
            return lambda: fn(x, r, w, b)
        ins = [t_.requires_grad_(True) for t_ in (x, r, w, b)]
        y = fn(*ins)
        dy = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, ins, dy, retain_graph=True)

    return make


def cases(device, dtype) -> list[OpCase]:
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for h in HIDDEN:
        for t in TOKENS:
            for direction in ("fwd", "bwd"):
                if direction == "fwd":
                    # read x, residual, weight, bias; write y (+ fp32 mean and rstd, needed by backward)
                    nbytes = 3 * t * h * es + 2 * h * es + 8 * t
                    flops = 10.0 * t * h
                else:
                    # read dy, x, residual (h is recomputed, never stored), weight, mean, rstd;
                    # write dx, dresidual, dweight, dbias
                    nbytes = 5 * t * h * es + 3 * h * es + 8 * t
                    flops = 16.0 * t * h
                out.append(
                    OpCase(
                        op="residual_layer_norm",
                        label=f"T={t} H={h}",
                        direction=direction,
                        bound="memory",
                        flops=flops,
                        bytes=float(nbytes),
                        providers={
                            p: _factory(p, direction, t, h, device, dtype)
                            for p in ("bert_fast", "torch", "torch.compile")
                        },
                        params={"T": t, "H": h, "dtype": str(dtype).replace("torch.", ""), "dropout_p": DROPOUT_P},
                    )
                )
    return out
