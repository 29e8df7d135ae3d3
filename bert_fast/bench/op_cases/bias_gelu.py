"""Benchmark cases of bias_gelu: y = gelu(x + b) over [T, 4H] (the BERT FFN up-projection epilogue
measured alone), forward and backward; memory-bound, so the figure of merit is GB/s of minimal traffic."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase

TOKENS = (8192, 16384)
HIDDEN = (768, 1024)


def _eager(x, b):
    return F.gelu(x + b)


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_eager, dynamic=False)


def _fn(provider):
    if provider == "bert_fast":
        from bert_fast.ops import bias_gelu

        return bias_gelu
    if provider == "torch":
        return _eager
    return _compiled()


def _factory(provider, direction, t, n, device, dtype):
    def make():
        fn = _fn(provider)
        x = torch.randn(t, n, device=device, dtype=dtype)
        b = torch.randn(n, device=device, dtype=dtype)
        if direction == "fwd":
            return lambda: fn(x, b)
        x.requires_grad_(True)
        b.requires_grad_(True)
        y = fn(x, b)
        dy = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, (x, b), dy, retain_graph=True)

    return make


def cases(device, dtype) -> list[OpCase]:
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for h in HIDDEN:
        n = 4 * h
        for t in TOKENS:
            for direction in ("fwd", "bwd"):
                if direction == "fwd":  # read x, bias; write y
                    nbytes = (2 * t * n + n) * es
                    flops = 8.0 * t * n
                else:  # read dy, x, bias; write dx, dbias
                    nbytes = (3 * t * n + 2 * n) * es
                    flops = 12.0 * t * n
                out.append(
                    OpCase(
                        op="bias_gelu",
                        label=f"T={t} N={n}",
                        direction=direction,
                        bound="memory",
                        flops=flops,
                        bytes=float(nbytes),
                        providers={
                            p: _factory(p, direction, t, n, device, dtype)
                            for p in ("bert_fast", "torch", "torch.compile")
                        },
                        params={
                            "T": t,
                            "H": h,
                            "N": n,
                            "dtype": str(dtype).replace("torch.", ""),
                            "approximate": "none",
                        },
                    )
                )
    return out
