"""The "torch" implementation of every bert_fast op: each op built from torch's own fast operations.

It is the production CPU path (oneDNN / MKL GEMMs, aten's vectorized GELU and LayerNorm, the SDPA
flash CPU kernel) and, on CUDA, the fallback a user selects with ``BERT_FAST_BACKEND=torch``
(cuBLAS, the same aten ops). Dispatch: bert_fast/ops/_dispatch.py. Measurements and the roofline
behind each choice: benchmarks/notes/2026-11-24-cpu-path.md (``python benchmarks/cpu/cpu_path.py``).

Every function here has the signature and the outputs of the matching custom op's implementation
in bert_fast/ops/<op>.py (same shapes, dtypes, fp32 statistics and log-sum-exp), so the op module
calls it in one line, and a later self-check can call the kernel and this fallback on the same
inputs. These functions run below autograd (inside the custom ops): each backward is explicit aten
ops (gelu_backward, native_layer_norm_backward, the flash attention backward), never autograd.

Dropout: the keep-mask is ``_dispatch.reference_dropout_mask(shape, p, seed, device)``, a function
of (seed, shape) alone, regenerated in the backward (and under activation checkpointing) and the
same bits as the reference path, so the two agree exactly with the same seed. Kept values are
scaled by 1/(1-p). Every function with dropout also takes ``keep=``, a mask to apply instead: the
kernel's own Philox mask, when this implementation checks a kernel or stands in for one whose
forward already ran (bert_fast/ops/_verify.py).

What each op does (and why; figures in that note):
  * linear: F.linear (MKL sgemm in fp32, oneDNN in bf16) + GELU. Inference in bf16 on the CPU runs
    oneDNN's linear with the GELU fused (mkldnn._linear_pointwise: 1.2-1.3x over linear + gelu).
    Backward: aten.gelu_backward, then two mm; db summed in fp32.
  * bias_gelu: GELU(x + b) with the GELU in place on the sum; backward aten.gelu_backward.
    (Sums of bf16/fp16 accumulate in fp32 inside torch's reductions: db is a plain .sum.)
  * residual_layer_norm: dropout + add, then aten.native_layer_norm (one fused pass, fp32
    statistics: on the CPU with fp32 weight/bias, whose "mixed type" path returns fp32 mean/rstd
    for bf16/fp16 inputs, where pure bf16 would round them to bf16); backward
    aten.native_layer_norm_backward from the saved statistics (no recomputed forward).
  * attention: the SDPA flash CPU kernel (aten._scaled_dot_product_flash_attention_for_cpu: out and
    log-sum-exp, no S x S matrix) with the key-padding mask as an additive [B, 1, 1, S] bias; its
    backward op in fp32. Varlen: sequences grouped by length (one batched call per distinct
    length, a zero-copy view of qkv when every sequence has one length; optionally near-equal
    lengths padded into one group with a key mask, GROUP_WASTE_PER_CALL), not a Python loop per
    sequence; reading the lengths is this path's one host access.
    CUDA without dropout: torch's fused memory-efficient kernel (bert_fast/ops/fused_sdpa.py:
    aten._scaled_dot_product_efficient_attention with the key bias padded to 16 and the lse sliced
    from its 32-padding; varlen in one aten._efficient_attention_forward call on cu_seqlens, no
    grouping and no host read), self-checked against the materialized path the first time each
    (device, dtype, head dim, layout, direction) runs; a failure (or any exception) means the
    materialized path for the rest of the process, with one warning. Head dims not a multiple of 8,
    misaligned views and float64 take the materialized path too.
    Materialized softmax(QK^T)V (the reference's formulas, in the input dtype, the batch streamed
    in L2-sized chunks) where neither fused kernel serves or the flash one loses: dropout (the
    kernels draw their own mask and cannot take the seed's, nor could a backward regenerate it),
    the bf16/fp16 backward on the CPU (the flash backward measured ~5x slower in bf16 than in
    fp32), float64, other devices, and what fused_sdpa rejects.
  * embedding: index_select gathers + in-place sum + aten.native_layer_norm; backward
    native_layer_norm_backward + index_add_ into fp32 accumulators (for bf16 tables over the
    unique rows only, then one scatter into the bf16 gradient).
"""

from __future__ import annotations

import functools
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from bert_fast.ops import _dispatch, cpu_fp32_gemm, fused_sdpa

__all__ = [
    "linear_fwd",
    "linear_bwd",
    "bias_gelu_fwd",
    "bias_gelu_bwd",
    "residual_layer_norm_fwd",
    "residual_layer_norm_bwd",
    "attention_fwd",
    "attention_bwd",
    "varlen_attention_fwd",
    "varlen_attention_bwd",
    "embedding_fwd",
    "embedding_bwd",
]

GELU_APPROXIMATE = {"gelu": "none", "gelu_tanh": "tanh"}
# This module, handed to fused_sdpa's entry points: their first-use check compares with its
# attention functions (fused_sdpa cannot import this module, which imports it).
_THIS_MODULE = sys.modules[__name__]
# In-place GELU through its C binding: torch.ops.aten.gelu_ goes through the Python op dispatcher
# (~10 us a call measured, against ~1 us), which is a visible share of a batch-1 forward.
_gelu_ = getattr(torch._C._nn, "gelu_", None) or torch.ops.aten.gelu_


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dropout_mask(
    shape, dropout_p: float, seed: Optional[Tensor], device, keep: Optional[Tensor] = None
) -> Optional[Tensor]:
    """The keep-mask of an op: ``keep`` when given (a kernel's own Philox mask, when this
    implementation stands in for the kernel or checks it: bert_fast/ops/_verify.py), else the
    seed's reference mask."""
    if dropout_p == 0.0 or (seed is None and keep is None):
        return None
    if keep is not None:
        return keep.to(device=device, dtype=torch.bool)
    return _dispatch.reference_dropout_mask(shape, dropout_p, seed, device)


# ----------------------------------------------------------------------------- linear
@functools.lru_cache(maxsize=None)
def onednn_bf16() -> bool:
    """oneDNN's fused linear + GELU is there and has a bf16 kernel on this CPU."""
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        )
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def _fused_gelu_ok(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.shape[0] > 0
        and weight.is_contiguous()
        and onednn_bf16()
    )


def _onednn_fp32_ok(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.shape[0] > 0
        and weight.is_contiguous()
        and not isinstance(x, torch._subclasses.FakeTensor)
        and cpu_fp32_gemm.use_onednn()
    )


def linear_fwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str], save_z: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """(y, z): y = act(x @ W^T + b) for x [M, K]; z = x @ W^T + b when an activation is set and
    ``save_z`` (the backward's input), else None."""
    if _onednn_fp32_ok(x, weight):
        # oneDNN's fp32 linear where it measured faster than F.linear (bert_fast/ops/cpu_fp32_gemm.py)
        x = x.contiguous()
        if activation is None or save_z:
            z = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
            if activation is None:
                return z, None
            return F.gelu(z, approximate=GELU_APPROXIMATE[activation]), z
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], GELU_APPROXIMATE[activation]), None
    if activation is None:
        return F.linear(x, weight, bias), None
    approx = GELU_APPROXIMATE[activation]
    if not save_z and _fused_gelu_ok(x, weight):
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "gelu", [], approx)
        return y, None
    z = F.linear(x, weight, bias)
    if save_z:
        return F.gelu(z, approximate=approx), z
    return _gelu_(z, approximate=approx), None  # z is not needed: in place


def linear_bwd(
    dy: Tensor,
    x: Tensor,
    weight: Tensor,
    z: Optional[Tensor],
    activation: Optional[str],
    need_dx: bool,
    need_dw: bool,
    need_db: bool,
) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(dx, dw, db) of linear_fwd (None where not needed); dZ^T is read by strides, never copied."""
    dz = dy if activation is None else torch.ops.aten.gelu_backward(dy, z, approximate=GELU_APPROXIMATE[activation])
    dx = torch.mm(dz, weight) if need_dx else None
    dw = torch.mm(dz.t(), x) if need_dw else None
    db = dz.sum(0) if need_db else None  # bf16/fp16 sums accumulate in fp32 (opmath)
    return dx, dw, db


# ----------------------------------------------------------------------------- bias + GELU
def bias_gelu_fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    return _gelu_(x + bias, approximate=approximate)


def bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    dx = torch.ops.aten.gelu_backward(dy, x + bias, approximate=approximate)
    db = dx.reshape(-1, x.shape[-1]).sum(0)  # accumulates in fp32 (opmath) for bf16/fp16
    return dx.contiguous(), db


# ----------------------------------------------------------------------------- LayerNorm
def _ln_affine(weight: Tensor, bias: Tensor, x: Tensor) -> Tuple[Tensor, Tensor]:
    """weight/bias as native_layer_norm should get them. On the CPU a bf16/fp16 input with weights
    of its own dtype gets mean/rstd rounded to that dtype; with fp32 weights ("mixed type") they
    stay fp32 (and the output keeps the input's dtype). CUDA returns fp32 statistics either way."""
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        return weight.float(), bias.float()
    return weight, bias


def _layer_norm(h: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd) over the last dim; statistics fp32 (float64 for float64) of shape h.shape[:-1]."""
    w, b = _ln_affine(weight, bias, h)
    y, mean, rstd = torch.native_layer_norm(h, [h.shape[-1]], w, b, eps)
    lead = h.shape[:-1]
    mean, rstd = mean.view(lead), rstd.view(lead)
    stat = _acc(h.dtype)
    if mean.dtype != stat:
        mean, rstd = mean.to(stat), rstd.to(stat)
    return y, mean, rstd


def _layer_norm_bwd(
    dy: Tensor, h: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, need: Sequence[bool] = (True, True, True)
):
    """(dh, dweight, dbias) of _layer_norm from its saved statistics (not needed -> None).
    mean/rstd are fp32 (float64 for float64), as every path of native_layer_norm_backward wants
    them here: the CPU's mixed-type path (see _ln_affine) and CUDA's accumulate-type statistics.
    (The bias enters no gradient; ``weight`` stands in for it, as the kernel wants a defined one.)

    On the CPU in bf16/fp16, dweight and dbias are summed here in fp32: aten's CPU kernel sums them
    with errors of the input dtype's rounding (bf16, 100 rows: 0.27e-3 off a dbias of 0.02, where an
    fp32 sum is exact to 1e-9; the error grows with the rows), which the first-use check of the
    kernels (bert_fast/ops/_verify.py) would have to take as this implementation's precision. CUDA's
    kernel accumulates them in fp32 itself."""
    w, _ = _ln_affine(weight, weight, h)
    stat = _acc(h.dtype)
    mean, rstd = mean.reshape(-1).to(stat), rstd.reshape(-1).to(stat)
    own = h.device.type == "cpu" and h.dtype in (torch.bfloat16, torch.float16) and (need[1] or need[2])
    aten_need = [need[0], need[1] and not own, need[2] and not own]
    dh, dw, db = torch.ops.aten.native_layer_norm_backward(dy, h, [h.shape[-1]], mean, rstd, w, w, aten_need)
    if own:
        n = h.shape[-1]
        dyf = dy.reshape(-1, n).float()
        if need[1]:
            xhat = (h.reshape(-1, n).float() - mean[:, None]) * rstd[:, None]
            dw = (dyf * xhat).sum(dim=0)
        if need[2]:
            db = dyf.sum(dim=0)
    dw = dw.to(weight.dtype) if dw is not None else None
    db = db.to(weight.dtype) if db is not None else None
    return dh, dw, db


# ----------------------------------------------------------------------------- residual + LN
def _dropout_add(x: Tensor, residual: Tensor, keep: Optional[Tensor], dropout_p: float) -> Tensor:
    if keep is None:
        return x + residual
    return torch.addcmul(residual, x, keep.to(x.dtype), value=1.0 / (1.0 - dropout_p))


def residual_layer_norm_fwd(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    dropout_p: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(y, mean, rstd): y = LayerNorm(dropout(x) + residual); mean/rstd fp32 of shape x.shape[:-1].
    ``keep``: the keep-mask to apply instead of the seed's (every function here takes one)."""
    if dropout_p == 0.0:
        return _layer_norm(x + residual, weight, bias, eps)
    keep = _dropout_mask(x.shape, dropout_p, seed, x.device, keep)
    return _layer_norm(_dropout_add(x, residual, keep, dropout_p), weight, bias, eps)


def residual_layer_norm_bwd(
    dy: Tensor,
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor,
    mean: Tensor,
    rstd: Tensor,
    dropout_p: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dresidual, dweight, dbias); h = dropout(x) + residual is recomputed (one add), the
    statistics are the forward's, the keep-mask is regenerated from the seed."""
    keep = _dropout_mask(x.shape, dropout_p, seed, x.device, keep)
    h = _dropout_add(x, residual, keep, dropout_p)
    dres, dw, db = _layer_norm_bwd(dy, h, weight, mean, rstd)
    if keep is None:
        dx = dres.clone()  # an op's outputs may not alias each other
    else:
        dx = dres * keep.to(dres.dtype) * (1.0 / (1.0 - dropout_p))
    return dx, dres, dw, db


# ----------------------------------------------------------------------------- attention core
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _use_flash(qkv: Tensor, keep: Optional[Tensor]) -> bool:
    """The flash CPU kernel serves: no dropout, CPU, and not float64 (its float64 log-sum-exp would
    not fit the ops' fp32 lse; float64 is for gradcheck, where the materialized path is exact)."""
    return keep is None and qkv.device.type == "cpu" and qkv.dtype != torch.float64 and _FLASH_CPU is not None


def _use_flash_bwd(qkv: Tensor, keep: Optional[Tensor]) -> bool:
    """The flash CPU backward serves fp32 only: in bf16 it measured ~5x slower than in fp32 and
    slower than the materialized backward (which needs neither out nor lse), so bf16/fp16 take that."""
    return _use_flash(qkv, keep) and qkv.dtype == torch.float32


def _key_bias(key_mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """Additive [B, 1, 1, S] bias (0 attend, -inf masked) in the query dtype, as the flash CPU
    kernel wants it (it rejects bool masks). A row whose keys are all masked comes out as zeros
    with zero gradients (the kernel's handling, pinned by tests/cpu/test_cpu_path.py)."""
    if key_mask is None:
        return None
    km = key_mask.to(torch.bool)
    bias = torch.zeros(km.shape, dtype=dtype, device=km.device).masked_fill_(~km, float("-inf"))
    return bias[:, None, None, :]


def _split_heads(qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v [B, h, S, d] as strided views of qkv [B, S, 3, h, d] (no copy)."""
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))


def _math_qkv(qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """q, k, v [B, h, S, d] for the materialized path: one copy of qkv into [3, B, h, S, d], so that
    every batched GEMM reads contiguous operands (a strided view would be copied by each matmul)."""
    return qkv.permute(2, 0, 3, 1, 4).contiguous().unbind(0)


def _math_probs(q: Tensor, k: Tensor, key_mask: Optional[Tensor], scale: float) -> Tuple[Tensor, Tensor]:
    """(probs, scores) of the materialized path: masked keys at finfo.min (finite: a row without
    keys stays uniform instead of NaN, and is zeroed), in the inputs' dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if key_mask is not None:
        km = key_mask.to(torch.bool)
        scores.masked_fill_(~km[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if key_mask is not None:
        probs.mul_(km.any(dim=-1)[:, None, None, None].to(probs.dtype))
    return probs, scores


def _dropout_scale(keep: Tensor, dropout_p: float, dtype: torch.dtype) -> Tensor:
    """keep / (1 - p) as a ``dtype`` tensor (one pass over the mask)."""
    return torch.where(
        keep,
        torch.tensor(1.0 / (1.0 - dropout_p), dtype=dtype, device=keep.device),
        torch.tensor(0.0, dtype=dtype, device=keep.device),
    )


# The materialized path streams the batch in chunks whose [chunk, h, S, S] score tensor fits in a
# core's L2 (2 MB on the measured CPU): its half-dozen elementwise passes over the scores then run
# from cache. One batched call over the whole batch (6 MB of scores at MiniLM b8 s128) was 1.3x
# slower than the reference's loop over single sequences (benchmarks/notes/2026-11-24-cpu-path.md).
MATH_CHUNK_BYTES = 1 << 20


def _math_chunks(qkv: Tensor):
    """Batch slices for the materialized path (the whole batch off the CPU: GPUs want big launches)."""
    b, s, _, h, _ = qkv.shape
    if qkv.device.type != "cpu":
        return [slice(0, b)]
    per_seq = max(1, h * s * s * qkv.element_size())
    step = max(1, MATH_CHUNK_BYTES // per_seq)
    return [slice(i, min(b, i + step)) for i in range(0, b, step)]


def _sel(t: Optional[Tensor], sl: slice) -> Optional[Tensor]:
    return None if t is None else t[sl]


def _math_fwd(qkv, key_mask, scale, keep, dropout_p):
    q, k, v = _math_qkv(qkv)
    probs, scores = _math_probs(q, k, key_mask, scale)
    lse = torch.logsumexp(scores.to(_acc(scores.dtype)), dim=-1).float()
    del scores
    if keep is not None:
        probs.mul_(_dropout_scale(keep, dropout_p, probs.dtype))
    return torch.matmul(probs, v).transpose(1, 2), lse


def _math_bwd(dout, qkv, key_mask, scale, keep, dropout_p):
    # P the masked softmax (zero rows without keys), Z the dropout scale mask, O = (P*Z) V:
    # dV = (P*Z)^T dO, dP = (dO V^T) * Z, dS = P * (dP - rowsum(dP * P)), dQ = scale dS K, dK = scale dS^T Q
    q, k, v = _math_qkv(qkv)
    do = dout.transpose(1, 2)
    probs, _ = _math_probs(q, k, key_mask, scale)
    dp = torch.matmul(do, v.transpose(-1, -2))
    if keep is not None:
        z = _dropout_scale(keep, dropout_p, probs.dtype)
        dv = torch.matmul((probs * z).transpose(-1, -2), do)
        dp.mul_(z)
        del z
    else:
        dv = torch.matmul(probs.transpose(-1, -2), do)
    ds = dp.sub_((dp * probs).sum(dim=-1, keepdim=True)).mul_(probs)  # in place: dp is ours
    dq = torch.matmul(ds, k).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), q).mul_(scale)
    return torch.stack([dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)], dim=2)


def materialized_fwd(
    qkv: Tensor, key_mask: Optional[Tensor], scale: float, keep: Optional[Tensor] = None, dropout_p: float = 0.0
) -> Tuple[Tensor, Tensor]:
    """The materialized path of _attn_fwd (chunked on the CPU): the oracle of fused_sdpa's self-check."""
    chunks = _math_chunks(qkv)
    if len(chunks) == 1:
        return _math_fwd(qkv, key_mask, scale, keep, dropout_p)
    b, s, _, h, d = qkv.shape
    out = qkv.new_empty((b, s, h, d))
    lse = torch.empty((b, h, s), dtype=torch.float32, device=qkv.device)
    for sl in chunks:
        out[sl], lse[sl] = _math_fwd(qkv[sl], _sel(key_mask, sl), scale, _sel(keep, sl), dropout_p)
    return out, lse


def materialized_bwd(
    dout: Tensor,
    qkv: Tensor,
    key_mask: Optional[Tensor],
    scale: float,
    keep: Optional[Tensor] = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """The materialized backward of _attn_bwd (needs neither out nor lse)."""
    chunks = _math_chunks(qkv)
    if len(chunks) == 1:
        return _math_bwd(dout, qkv, key_mask, scale, keep, dropout_p)
    dqkv = qkv.new_empty(qkv.shape)
    for sl in chunks:
        dqkv[sl] = _math_bwd(dout[sl], qkv[sl], _sel(key_mask, sl), scale, _sel(keep, sl), dropout_p)
    return dqkv


def _attn_fwd(
    qkv: Tensor, key_mask: Optional[Tensor], scale: float, keep: Optional[Tensor], dropout_p: float, fused: bool = True
) -> Tuple[Tensor, Tensor]:
    """qkv [B, S, 3, h, d], key_mask bool/uint8 [B, S] or None, keep [B, h, S, S] or None ->
    (out [B, S, h, d], lse fp32 [B, h, S]), either possibly strided (callers make them contiguous).
    CPU: the flash CPU kernel; CUDA without dropout: torch's fused memory-efficient kernel
    (bert_fast/ops/fused_sdpa.py, self-checked at first use; ``fused=False`` skips it); else the
    materialized path."""
    if _use_flash(qkv, keep):
        q, k, v = _split_heads(qkv)
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=_key_bias(key_mask, qkv.dtype), scale=scale)
        return out.transpose(1, 2), lse  # lse fp32 [B, h, S], strided: callers lay it out
    if fused and fused_sdpa.eligible(qkv, keep is not None):
        res = fused_sdpa.padded_fwd(qkv, key_mask, scale, _THIS_MODULE)
        if res is not None:
            return res
    return materialized_fwd(qkv, key_mask, scale, keep, dropout_p)


def _attn_bwd(
    dout: Tensor,
    qkv: Tensor,
    key_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    scale: float,
    keep: Optional[Tensor],
    dropout_p: float,
    fused: bool = True,
) -> Tensor:
    """d(qkv) [B, S, 3, h, d] of _attn_fwd."""
    if _use_flash_bwd(qkv, keep):
        q, k, v = _split_heads(qkv)
        dq, dk, dv = _FLASH_CPU_BWD(
            dout.transpose(1, 2),
            q,
            k,
            v,
            out.transpose(1, 2),
            lse,
            0.0,
            False,
            attn_mask=_key_bias(key_mask, qkv.dtype),
            scale=scale,
        )
        return torch.stack([dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)], dim=2)
    if fused and fused_sdpa.eligible(qkv, keep is not None):
        res = fused_sdpa.padded_bwd(dout, qkv, key_mask, out, lse, scale, _THIS_MODULE)
        if res is not None:
            return res
    return materialized_bwd(dout, qkv, key_mask, scale, keep, dropout_p)


# ----------------------------------------------------------------------------- padded attention
def attention_fwd(
    qkv: Tensor,
    key_mask: Optional[Tensor],
    dropout_p: float,
    softmax_scale: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    b, s, _, h, _ = qkv.shape
    keep = _dropout_mask((b, h, s, s), dropout_p, seed, qkv.device, keep)
    out, lse = _attn_fwd(qkv, key_mask, softmax_scale, keep, dropout_p)
    return out.contiguous(), lse.contiguous()


def attention_bwd(
    dout: Tensor,
    qkv: Tensor,
    key_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tensor:
    b, s, _, h, _ = qkv.shape
    keep = _dropout_mask((b, h, s, s), dropout_p, seed, qkv.device, keep)
    return _attn_bwd(dout, qkv, key_mask, out, lse, softmax_scale, keep, dropout_p)


# ----------------------------------------------------------------------------- varlen attention
# Grouping: sequences of one length run as one batched call (a view of qkv when they are all of
# them, in order). GROUP_WASTE_PER_CALL lets near-equal lengths share a call, padded to the group's
# longest with a key mask, while padding wastes at most that many (pairs x heads x d) multiply-adds
# per sequence. Measured on the CPU (benchmarks/notes/2026-11-24-cpu-path.md), padding never paid: exact
# groups were fastest at every threshold tried (b16 s256 ragged: 16 groups 4.5 ms, 7 padded groups
# 5.5 ms, one padded call 9.5 ms; b128 s128: 73 groups 18.6 ms, 17 groups 20.4 ms), because a call
# costs only ~20-40 us and the flash kernel pays for every masked score. So the default is 0; the
# padded grouping stays as the knob (and is tested) for machines where calls cost more.
GROUP_WASTE_PER_CALL = 0


class _Group:
    """Sequences run as one batched call: ``rows`` [n * L] token rows (padding rows repeat the
    sequence's first token), ``valid`` [n * L] bool or None (no padding), the key mask [n, L]."""

    __slots__ = ("n", "length", "seqs", "rows", "valid_pos", "dst", "key_mask", "contiguous_start")

    def __init__(self, n, length, seqs, rows, valid_pos, dst, key_mask, contiguous_start):
        self.n, self.length, self.seqs = n, length, seqs
        self.rows, self.valid_pos, self.dst = rows, valid_pos, dst
        self.key_mask, self.contiguous_start = key_mask, contiguous_start


def _plan_groups(lengths: Sequence[int], heads_x_d: int, waste: float) -> List[List[int]]:
    """Sequence indices per group (longest first): greedy over sequences sorted by length; a
    sequence joins the current group while padding it to the group's length wastes at most
    ``waste`` (pairs x heads x d)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: -lengths[i])
    groups: List[List[int]] = []
    top = 0
    for i in order:
        n = lengths[i]
        if groups and (top * top - n * n) * heads_x_d <= waste:
            groups[-1].append(i)
        else:
            groups.append([i])
            top = n
    return groups


_PLAN_CACHE: Dict[tuple, List[_Group]] = {}
_PLAN_CACHE_SIZE = 32


def _varlen_plan(cu_seqlens: Tensor, heads_x_d: int) -> List[_Group]:
    """The groups of one cu_seqlens, cached by (lengths, device, heads * d): every layer of a
    forward and its backward reuse them. Reading cu_seqlens here is the varlen path's host access."""
    cu = cu_seqlens.tolist()
    waste = GROUP_WASTE_PER_CALL
    key = (tuple(cu), cu_seqlens.device, heads_x_d, waste)
    plan = _PLAN_CACHE.get(key)
    if plan is not None:
        return plan
    starts, lengths = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
    dev = cu_seqlens.device
    plan = []
    for seqs in _plan_groups(lengths, heads_x_d, waste):
        n, length = len(seqs), lengths[seqs[0]]
        lens = [lengths[i] for i in seqs]
        st = [starts[i] for i in seqs]
        # one strided view of qkv when the group is every token, in order, all of one length
        contiguous = all(l == length for l in lens) and st == [st[0] + j * length for j in range(n)]
        ar = torch.arange(length, device=dev)
        st_t = torch.tensor(st, device=dev, dtype=torch.int64)[:, None]
        len_t = torch.tensor(lens, device=dev, dtype=torch.int64)[:, None]
        valid = ar[None, :] < len_t  # [n, L]
        rows = torch.where(valid, st_t + ar[None, :], st_t).reshape(-1)
        padded = not all(l == length for l in lens)
        valid_pos = valid.reshape(-1).nonzero().reshape(-1) if padded else None
        dst = rows if valid_pos is None else rows.index_select(0, valid_pos)
        plan.append(
            _Group(n, length, seqs, rows, valid_pos, dst, valid if padded else None, st[0] if contiguous else None)
        )
    if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
        _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[key] = plan
    return plan


def _gather(t: Tensor, g: _Group) -> Tensor:
    """Rows of t [T, ...] for group g as [n, L, ...] (a view when the group is contiguous)."""
    if g.contiguous_start is not None:
        return t[g.contiguous_start : g.contiguous_start + g.n * g.length].reshape(g.n, g.length, *t.shape[1:])
    return t.index_select(0, g.rows).reshape(g.n, g.length, *t.shape[1:])


def _scatter(dst: Tensor, src: Tensor, g: _Group) -> None:
    """dst[token rows of g] = the valid rows of src [n, L, ...] (dst [T, ...])."""
    flat = src.reshape(g.n * g.length, *src.shape[2:])
    if g.valid_pos is not None:
        flat = flat.index_select(0, g.valid_pos)
    if g.contiguous_start is not None:
        dst[g.contiguous_start : g.contiguous_start + flat.shape[0]] = flat
    else:
        dst.index_copy_(0, g.dst, flat)


def _group_keep(keep: Optional[Tensor], g: _Group) -> Optional[Tensor]:
    """The keep-mask of g's sequences: each uses the top-left L x L block of its [max, max] mask."""
    if keep is None:
        return None
    if g.seqs == list(range(g.n)):
        return keep[: g.n, :, : g.length, : g.length]
    idx = torch.tensor(g.seqs, device=keep.device)
    # index_select on uint8 (bool takes a slow generic path); the mask is not copied past L x L
    return keep[:, :, : g.length, : g.length].view(torch.uint8).index_select(0, idx).view(torch.bool)


def _single_view(qkv: Tensor, plan: List[_Group]) -> bool:
    return len(plan) == 1 and plan[0].contiguous_start == 0 and plan[0].n * plan[0].length == qkv.shape[0]


def varlen_attention_fwd(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float,
    softmax_scale: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """(out [T, h, d], lse fp32 [h, T]) of packed sequences: on CUDA without dropout one fused call
    (fused_sdpa: cu_seqlens read on the device, no grouping, no host access), else one batched call
    per length group."""
    keep = _dropout_mask(
        (cu_seqlens.numel() - 1, qkv.shape[2], max_seqlen, max_seqlen), dropout_p, seed, qkv.device, keep
    )
    if fused_sdpa.eligible(qkv, keep is not None):
        res = fused_sdpa.varlen_fwd(qkv, cu_seqlens, max_seqlen, softmax_scale, _THIS_MODULE)
        if res is not None:
            return res
    return varlen_fwd_grouped(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, keep)


def varlen_fwd_grouped(
    qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float, softmax_scale: float, keep: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    """The grouped varlen forward (``keep``: the [B, h, max, max] keep-mask or None): the flash CPU
    kernel per group on the CPU, else materialized groups (never fused_sdpa's padded call: off the
    CPU this is the materialized path of the varlen op, the oracle of its self-check)."""
    t, _, h, d = qkv.shape
    plan = _varlen_plan(cu_seqlens, h * d)
    if _single_view(qkv, plan):  # every sequence of one length: no copy at all
        g = plan[0]
        out, lse = _attn_fwd(
            qkv.view(g.n, g.length, 3, h, d), None, softmax_scale, _group_keep(keep, g), dropout_p, fused=False
        )
        return out.reshape(t, h, d), lse.transpose(0, 1).reshape(h, t)
    out = qkv.new_empty((t, h, d))
    lse_t = torch.empty((t, h), device=qkv.device, dtype=torch.float32)  # transposed once at the end
    for g in plan:
        o, l = _attn_fwd(_gather(qkv, g), g.key_mask, softmax_scale, _group_keep(keep, g), dropout_p, fused=False)
        _scatter(out, o, g)
        _scatter(lse_t, l.transpose(1, 2), g)
    return out, lse_t.t().contiguous()


def varlen_attention_bwd(
    dout: Tensor,
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tensor:
    keep = _dropout_mask(
        (cu_seqlens.numel() - 1, qkv.shape[2], max_seqlen, max_seqlen), dropout_p, seed, qkv.device, keep
    )
    if fused_sdpa.eligible(qkv, keep is not None):
        res = fused_sdpa.varlen_bwd(dout, qkv, cu_seqlens, max_seqlen, out, lse, softmax_scale, _THIS_MODULE)
        if res is not None:
            return res
    return varlen_bwd_grouped(dout, qkv, cu_seqlens, max_seqlen, out, lse, dropout_p, softmax_scale, keep)


def varlen_bwd_grouped(
    dout: Tensor,
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    keep: Optional[Tensor],
) -> Tensor:
    t, _, h, d = qkv.shape
    plan = _varlen_plan(cu_seqlens, h * d)
    if _single_view(qkv, plan):
        g = plan[0]
        shape = (g.n, g.length)
        lse_g = lse.reshape(h, g.n, g.length).transpose(0, 1)
        return _attn_bwd(
            dout.reshape(*shape, h, d),
            qkv.view(*shape, 3, h, d),
            None,
            out.reshape(*shape, h, d),
            lse_g,
            softmax_scale,
            _group_keep(keep, g),
            dropout_p,
            fused=False,
        ).view(t, 3, h, d)
    dqkv = qkv.new_empty(qkv.shape)
    lse_t = lse.t()
    for g in plan:
        do = _gather(dout, g)
        if g.key_mask is not None:  # padding query rows must add nothing to dK, dV
            do = do * g.key_mask[:, :, None, None].to(do.dtype)
        lse_g = _gather(lse_t, g).transpose(1, 2)
        dg = _attn_bwd(
            do,
            _gather(qkv, g),
            g.key_mask,
            _gather(out, g),
            lse_g,
            softmax_scale,
            _group_keep(keep, g),
            dropout_p,
            fused=False,
        )
        _scatter(dqkv, dg, g)
    return dqkv


# ----------------------------------------------------------------------------- embedding
def embedding_rows(
    input_ids: Tensor, position_ids: Optional[Tensor], token_type_ids: Optional[Tensor], indices: Optional[Tensor]
):
    """(word ids, position ids or None (= broadcast 0..S-1), type ids or None (= 0)) of every output row."""
    ids = input_ids.reshape(-1)
    pos = None if position_ids is None else position_ids.reshape(-1)
    tt = None if token_type_ids is None else token_type_ids.reshape(-1)
    if indices is not None:
        ids = ids.index_select(0, indices)
        seq = max(1, input_ids.shape[-1])
        pos = (indices % seq) if pos is None else pos.index_select(0, indices)
        tt = None if tt is None else tt.index_select(0, indices)
    return ids, pos, tt


def _embedding_sum(ids, pos, tt, word, pos_table, type_table, seqlen: int) -> Tensor:
    x = word.index_select(0, ids)
    if pos is None:  # rows in order: position = row % S, added by broadcast
        x.view(-1, seqlen, x.shape[-1]).add_(pos_table[:seqlen])
    else:
        x.add_(pos_table.index_select(0, pos))
    if tt is None:
        x.add_(type_table[0])
    else:
        x.add_(type_table.index_select(0, tt))
    return x


def embedding_fwd(
    input_ids: Tensor,
    position_ids: Optional[Tensor],
    token_type_ids: Optional[Tensor],
    indices: Optional[Tensor],
    word: Tensor,
    pos_table: Tensor,
    type_table: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    dropout_p: float,
    seed: Optional[Tensor],
    keep: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """(out, mean, rstd): out [T, H] with indices, else input_ids.shape + (H,)."""
    rows = indices.shape[0] if indices is not None else input_ids.numel()
    hidden = word.shape[1]
    out_shape = (rows, hidden) if indices is not None else tuple(input_ids.shape) + (hidden,)
    if rows == 0:
        stats = torch.empty((0,), dtype=_acc(word.dtype), device=word.device)
        return word.new_empty(out_shape), stats, stats.clone()
    ids, pos, tt = embedding_rows(input_ids, position_ids, token_type_ids, indices)
    x = _embedding_sum(ids, pos, tt, word, pos_table, type_table, max(1, input_ids.shape[-1]))
    y, mean, rstd = _layer_norm(x, weight, bias, eps)
    keep = _dropout_mask((rows, hidden), dropout_p, seed, word.device, keep)
    if keep is not None:
        y = y * keep.to(y.dtype) * (1.0 / (1.0 - dropout_p))
    return y.view(out_shape), mean, rstd


def _table_grad(table: Tensor, rows: Tensor, dx: Tensor, acc: torch.dtype, padding_idx: int) -> Tensor:
    """d(table) [V, H]: the rows of dx (``acc``, fp32) summed per table row, padding_idx zero.

    aten.embedding_dense_backward does the segment sum (sorted, parallel; index_add_ measured up
    to 5x slower). A table of another dtype than ``acc`` (bf16) sums into a [unique rows, H] fp32
    accumulator and scatters it once: an fp32 [V, H] accumulator (47 MB for a 30522 x 384
    vocabulary) is fresh memory at every step (glibc maps blocks over 32 MB anew: ~10 ms of page
    faults on the measured CPU), then a conversion pass, where the bf16 gradient reuses freed memory."""
    if table.dtype == acc:
        return torch.ops.aten.embedding_dense_backward(dx, rows, table.shape[0], padding_idx, False)
    uniq, inverse = torch.unique(rows, return_inverse=True)
    part = torch.ops.aten.embedding_dense_backward(dx, inverse, uniq.shape[0], -1, False)
    g = torch.zeros(table.shape, dtype=table.dtype, device=table.device)
    g.index_copy_(0, uniq, part.to(table.dtype))
    if padding_idx >= 0:
        g[padding_idx] = 0
    return g


def embedding_bwd(
    grad_out: Tensor,
    input_ids: Tensor,
    position_ids: Optional[Tensor],
    token_type_ids: Optional[Tensor],
    indices: Optional[Tensor],
    word: Tensor,
    pos_table: Tensor,
    type_table: Tensor,
    weight: Tensor,
    mean: Tensor,
    rstd: Tensor,
    dropout_p: float,
    seed: Optional[Tensor],
    padding_idx: int,
    need: Sequence[bool],
    keep: Optional[Tensor] = None,
    position_padding_idx: int = -1,
    token_type_padding_idx: int = -1,
) -> List[Optional[Tensor]]:
    """Gradients of (word, position, type tables, weight, bias), None where ``need`` is False.
    x is recomputed from the tables; table gradients accumulate in fp32 (float64 for float64).
    ``padding_idx`` / ``position_padding_idx`` / ``token_type_padding_idx``: the row of the word /
    position / type table that gets no gradient (nn.Embedding's padding_idx), -1 for none."""
    hidden = word.shape[1]
    rows = indices.shape[0] if indices is not None else input_ids.numel()
    acc = _acc(word.dtype)
    shapes = [word.shape, pos_table.shape, type_table.shape, weight.shape, weight.shape]
    if rows == 0 or not any(need):
        return [torch.zeros(shapes[i], dtype=word.dtype, device=word.device) if need[i] else None for i in range(5)]
    seqlen = max(1, input_ids.shape[-1])
    ids, pos, tt = embedding_rows(input_ids, position_ids, token_type_ids, indices)
    x = _embedding_sum(ids, pos, tt, word, pos_table, type_table, seqlen)
    dy = grad_out.reshape(rows, hidden)
    keep = _dropout_mask((rows, hidden), dropout_p, seed, word.device, keep)
    if keep is not None:
        dy = dy * keep.to(dy.dtype) * (1.0 / (1.0 - dropout_p))
    need_dx = need[0] or need[1] or need[2]
    dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd, (need_dx, need[3], need[4]))
    grads: List[Optional[Tensor]] = [None] * 5
    if need_dx:
        dx = dx.to(acc)
        if need[0]:
            grads[0] = _table_grad(word, ids, dx, acc, padding_idx)
        if need[1]:
            if pos is None:
                g = torch.zeros(pos_table.shape, dtype=acc, device=word.device)
                g[:seqlen] = dx.view(-1, seqlen, hidden).sum(0)
                if position_padding_idx >= 0:
                    g[position_padding_idx] = 0
                grads[1] = g.to(pos_table.dtype)
            else:
                grads[1] = _table_grad(pos_table, pos, dx, acc, position_padding_idx)
        if need[2]:
            if tt is None:
                g = torch.zeros(type_table.shape, dtype=acc, device=word.device)
                if token_type_padding_idx != 0:
                    g[0] = dx.sum(0)
                grads[2] = g.to(type_table.dtype)
            else:
                grads[2] = _table_grad(type_table, tt, dx, acc, token_type_padding_idx)
    if need[3]:
        grads[3] = dw
    if need[4]:
        grads[4] = db
    return grads
