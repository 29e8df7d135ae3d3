"""Benchmark cases of bias_gelu: y = gelu(x + b) over [T, 4H] (the BERT FFN up-projection epilogue
measured alone), forward and backward; memory-bound, so the figure of merit is GB/s of minimal traffic."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase, device_randn, dtype_name, fwd_bwd

TOKENS = (8192, 16384)
HIDDEN = (768, 1024)


def sample_inputs(t: int, n: int, randn, x_scale: float = 1.0, bias_scale: float = 0.1) -> dict:
    """One call's inputs: x [T, N] and the bias [N] (small, as trained); the tests spread both wider
    (``x_scale``, ``bias_scale``), to reach further into GELU's tails."""
    return {"x": randn(t, n, scale=x_scale), "bias": randn(n, scale=bias_scale)}


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
        x, b = sample_inputs(t, n, device_randn(device, dtype)).values()
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
            costs = {
                "fwd": (8.0 * t * n, float((2 * t * n + n) * es)),  # read x, bias; write y
                "bwd": (12.0 * t * n, float((3 * t * n + 2 * n) * es)),  # read dy, x, bias; write dx, dbias
            }
            params = {"T": t, "H": h, "N": n, "dtype": dtype_name(dtype), "approximate": "none"}
            factory = lambda p, direction: _factory(p, direction, t, n, device, dtype)
            out += fwd_bwd(
                "bias_gelu", f"T={t} N={n}", "memory", costs, factory, ("bert_fast", "torch", "torch.compile"), params
            )
    return out
