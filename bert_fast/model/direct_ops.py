"""The encoder's ops without the custom-op plumbing, for inference on the torch implementation.

A call through a registered custom op (``torch.ops.bert_fast.*`` with its autograd formula, schema
checks and the public function's validation) costs ~20-45 us of Python and dispatch on the CPU,
against ~5 us for an aten call: at batch 1 that is several percent of a MiniLM forward. When no
gradient is taken, nothing is compiled and the op would run its torch implementation anyway
(CPU tensors without the interpreter, or BERT_FAST_BACKEND=torch), the model calls the very same
implementation functions (bert_fast.ops.torch_impl) directly: same code, same numbers (a test
checks the two paths agree bit for bit), minus the overhead. Dropout is never on here (eval only).
One exception: attention in bf16 (AVX-512 BF16) or fp32 (AVX-512 or AVX2) runs bert_fast.ops.cpu_attention
(our kernels, where they measured faster than torch's flash CPU kernel; held to the 2x rule against
the float64 oracle in tests/cpu/test_cpu_attention.py and tests/cpu/test_cpu_attention_f32.py), since
inference needs no log-sum-exp for a backward.

The object mirrors the subset of ``bert_fast.ops`` the model uses, so a layer runs unchanged on
either (``layer.layer_forward`` with ``batch.ops`` = bert_fast.ops or direct_ops).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_fast.ops import _dispatch, cpu_attention, torch_impl

_ACT = {None: None, "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def usable(t: Tensor, training: bool) -> bool:
    """Whether the model may run its layers on these direct calls for tensors like ``t``."""
    # Not under autocast: there the custom ops' public functions cast as nn.Linear does.
    return (
        not training
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled(t.device.type)
        and _dispatch.implementation_for(t.device, t.dtype, uses_dot=True) == "torch"
    )


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None) -> Tensor:
    n, k = weight.shape
    y, _ = torch_impl.linear_fwd(x.reshape(-1, k), weight, bias, _ACT[activation], False)
    return y.view(*x.shape[:-1], n)


def residual_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float, dropout_p: float = 0.0
) -> Tensor:
    assert dropout_p == 0.0, "direct ops run inference only"
    # Only y: aten's LayerNorm in the input's own dtype, without the fp32 weight copies and fp32
    # statistics the torch implementation makes for a backward (~16 us less per call at 128 x 384
    # bf16); the same y bit for bit (tests/cpu/test_direct_ops.py).
    return F.layer_norm(x + residual, (x.shape[-1],), weight, bias, eps)


def attention(qkv: Tensor, attention_mask: Optional[Tensor], dropout_p: float = 0.0) -> Tensor:
    assert dropout_p == 0.0, "direct ops run inference only"
    scale = 1.0 / math.sqrt(qkv.shape[-1])
    if cpu_attention.eligible(qkv, qkv.shape[-2]):
        return cpu_attention.padded(qkv, attention_mask, scale)
    return torch_impl.attention_fwd(qkv, attention_mask, 0.0, scale, None)[0]


def varlen_attention(
    qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0, validate: bool = False
) -> Tensor:
    assert dropout_p == 0.0, "direct ops run inference only"
    scale = 1.0 / math.sqrt(qkv.shape[-1])
    if cpu_attention.eligible(qkv, qkv.shape[-2]):
        return cpu_attention.varlen(qkv, cu_seqlens, scale)
    return torch_impl.varlen_attention_fwd(qkv, cu_seqlens, max_seqlen, 0.0, scale, None)[0]


def dense_self_attention(
    h: Tensor,
    wq: Tensor,
    bq: Tensor,
    wk: Tensor,
    bk: Tensor,
    wv: Tensor,
    bv: Tensor,
    batch: int,
    seqlen: int,
    heads: int,
) -> Tensor:
    """Self-attention context [T, H] of ``batch`` packed sequences that all have ``seqlen`` tokens
    (a dense batch: every row of the varlen layout is one [seqlen] block, in order).

    Three GEMMs instead of one over cat(Wq, Wk, Wv): at batch 1 x 128 the per-call weight
    concatenation (~3 H^2 elements copied per layer) costs more than the fused GEMM saves
    (measured: benchmarks/notes/2026-11-24-cpu-path.md, "CPU path, model level"), and with q, k, v apart the flash CPU
    kernel reads them as strided [B, heads, S, d] views: no packed qkv, no copy."""
    t, hidden = h.shape
    d = hidden // heads
    if cpu_attention.eligible(h, heads):
        # fp32: linear(), the CPU fp32 GEMM choice (oneDNN where it measured faster than F.linear)
        gemm = linear if h.dtype == torch.float32 else torch.nn.functional.linear
        q, k, v = (gemm(h, w, b) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        return cpu_attention.separate(q, k, v, batch, seqlen, heads, 1.0 / math.sqrt(d))

    def heads_view(x: Tensor) -> Tensor:
        return x.view(batch, seqlen, heads, d).transpose(1, 2)

    # linear(): the CPU fp32 GEMM choice (oneDNN where it measured faster than F.linear) holds here too
    q = heads_view(linear(h, wq, bq))
    k = heads_view(linear(h, wk, bk))
    v = heads_view(linear(h, wv, bv))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1.0 / math.sqrt(d))
    return out.transpose(1, 2).reshape(t, hidden)
