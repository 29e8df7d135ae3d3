"""Benchmark cases of ``linear`` at BERT's GEMM shapes (fused QKV, FFN up + GELU, FFN down).

Providers: "bert_fast" (auto dispatch), "bert_fast-triton" and "bert_fast-cublas" (each path
forced; on Hopper "triton" is the TMA / persistent GEMM of kernels/linear_tma.py),
"bert_fast-triton-pointer" (the triton path with BERT_FAST_GEMM_TMA=0: the pointer-based GEMM, to
measure what TMA buys), "torch" (F.linear + F.gelu) and "torch.compile" (the same, compiled). Compute-bound:
flops = 2*M*N*K forward, 4*M*N*K backward (dX and dW); ``bytes`` is the minimal traffic of one call.
"""

from __future__ import annotations

import functools
import os
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase, device_randn, dtype_name, fwd_bwd, with_env

HIDDEN = (768, 1024)
TOKENS = (8192, 16384)


def gemm_shapes(h: int, ffn: Optional[int] = None) -> List[Tuple[str, int, int, Optional[str]]]:
    """(name, N, K, activation) of a layer's GEMMs at hidden size ``h`` and FFN width ``ffn`` (4h):
    the fused QKV projection, the FFN up-projection with its GELU, the FFN down-projection."""
    f = ffn or 4 * h
    return [("qkv", 3 * h, h, None), ("ffn_up", f, h, "gelu"), ("ffn_down", h, f, None)]


def sample_inputs(m: int, n: int, k: int, randn, bias_scale: float = 0.1) -> dict:
    """One call's inputs: x [M, K], the weight [N, K] (scaled 1/sqrt(K), as initialized), the bias [N]
    (``bias_scale``: small, as trained; the tests take 1.0, to spread the activation's input wider)."""
    return {"x": randn(m, k), "weight": randn(n, k, scale=k**-0.5), "bias": randn(n, scale=bias_scale)}


def _torch_linear(x, w, b, activation):
    y = F.linear(x, w, b)
    return y if activation is None else F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


@functools.lru_cache(maxsize=None)
def _compiled(activation):
    return torch.compile(functools.partial(_torch_linear, activation=activation))


def _make_fn(provider: str, activation):
    if provider == "bert_fast-triton-pointer":
        from bert_fast.ops.linear import linear

        return lambda x, w, b: with_env(
            "BERT_FAST_GEMM_TMA", "0", lambda: linear(x, w, b, activation, backend="triton")
        )
    if provider.startswith("bert_fast"):
        from bert_fast.ops.linear import linear

        backend = provider.split("-", 1)[1] if "-" in provider else None
        return lambda x, w, b: linear(x, w, b, activation, backend=backend)
    if provider == "torch":
        return lambda x, w, b: _torch_linear(x, w, b, activation)
    if provider == "torch.compile":
        return _compiled(activation)
    raise ValueError(provider)


def _factory(provider, direction, m, n, k, activation, device, dtype):
    def factory():
        fn = _make_fn(provider, activation)
        grad = direction == "bwd"
        x, w, b = (t.requires_grad_(grad) for t in sample_inputs(m, n, k, device_randn(device, dtype)).values())
        if not grad:
            return lambda: fn(x, w, b)
        y = fn(x, w, b)
        dy = torch.randn_like(y)
        grads = lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
        if provider == "bert_fast-triton-pointer":  # the backward's GEMMs too
            return lambda: with_env("BERT_FAST_GEMM_TMA", "0", grads)
        return grads

    return factory


PROVIDERS = ("bert_fast", "bert_fast-triton", "bert_fast-triton-pointer", "bert_fast-cublas", "torch", "torch.compile")


def _unavailable(device: torch.device):
    """Providers that name a GPU path: on a CPU (without the Triton interpreter) they would run the
    same CPU implementation as "bert_fast" under a misleading name, so they are skipped there."""
    if device.type == "cuda":
        return {}
    out = {"bert_fast-cublas": "cuBLAS needs a CUDA GPU"}
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        why = "the Triton GEMM needs a CUDA GPU (or TRITON_INTERPRET=1)"
        out.update({"bert_fast-triton": why, "bert_fast-triton-pointer": why})
    return out


def cases(device, dtype) -> List[OpCase]:
    device = torch.device(device)
    unavailable = _unavailable(device)
    esize = torch.empty((), dtype=dtype).element_size()
    out = []
    for h in HIDDEN:
        for m in TOKENS:
            for name, n, k, act in gemm_shapes(h):
                costs = {
                    "fwd": (2.0 * m * n * k, (m * k + n * k + n + m * n) * esize),
                    # read dy, x, W (+ z); write dx, dW, db
                    "bwd": (4.0 * m * n * k, (m * n * (2 if act else 1) + 2 * m * k + 2 * n * k + n) * esize),
                }
                params = {"name": name, "H": h, "M": m, "N": n, "K": k, "activation": act, "dtype": dtype_name(dtype)}
                factory = lambda p, direction: _factory(p, direction, m, n, k, act, device, dtype)
                label = f"{name} H={h} M={m} N={n} K={k}"
                out += fwd_bwd("linear", label, "compute", costs, factory, PROVIDERS, params, unavailable)
    return out
