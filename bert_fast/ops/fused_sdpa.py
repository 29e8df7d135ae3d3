"""CUDA attention of the torch implementation through torch's fused memory-efficient kernel (issue 16).

bert_fast/ops/torch_impl.py runs attention on CUDA (the fallback of a Triton kernel that failed its
first-use check, or ``BERT_FAST_BACKEND=torch``) through this module when dropout is off:

  * padded (qkv [B, S, 3, h, d], key_mask [B, S]): ``aten._scaled_dot_product_efficient_attention``
    and its ``_backward``, the key mask as an additive bias (0 / -inf) of the query dtype;
  * varlen (qkv [T, 3, h, d], cu_seqlens int32 [B + 1]): ``aten._efficient_attention_forward`` /
    ``_efficient_attention_backward`` with cu_seqlens_q = cu_seqlens_k (custom_mask_type 0): one
    call for the whole batch, no grouping by length and no host read of cu_seqlens.

What the kernel wants that the CPU never shows (torch's sources, aten/src/ATen/native/transformers/
cuda/attention.cu, attention_backward.cu, mem_eff_attention/kernel_forward.h, kernel_backward.h):
  * the bias must be 4-d [B, h, S, S] (expanded views are fine) in the query dtype, last dim
    contiguous, its row pitch aligned (the bias tile loader reads 128-bit vectors): like torch's
    public SDPA (pad_bias) we allocate the key axis padded to a multiple of 16 and slice it;
  * the log-sum-exp comes back padded along the query axis to a multiple of 32 (kAlignLSE, the
    backward's block size): [B, h, ceil32(S)]; varlen: [B, h, ceil32(max_seqlen)], sequence b's
    query i at [b, :, i]. The backward reads lse through its strides, which must be multiples of
    8: we hand it a contiguous [B, h, ceil32(.)] buffer;
  * ``out`` handed to the backward must be [B, S, h, d]-contiguous (BMHK), q/k/v pitches aligned
    (16 bytes, bf16 has no unaligned kernel at all): head dims not a multiple of 8 and strided qkv
    views whose pitches are not take the materialized path;
  * a row whose keys are all masked: the kernel's running max is -inf and its output and lse are
    not defined by us; the op's rule (zeros, never NaN, forward and backward) is applied here
    explicitly: those rows are zeroed (torch.where, so a NaN cannot leak), their lse is +inf (the
    Triton kernel's convention) and the backward is handed lse = +inf there (P = exp(-inf) = 0),
    then their gradients are zeroed too.

Not with dropout: the fused kernels draw their own Philox mask, so they could neither apply the
op's seed mask (``_dispatch.reference_dropout_mask``, or the Triton kernel's mask when checking it)
nor regenerate it in a backward that runs under another kernel: dropout keeps the materialized path.
float64 (gradcheck), head dims not a multiple of 8 and misaligned views keep it too.

Self-check. Nothing here can run on the machine this was written on (no GPU), so the first use of
each (device, dtype, head dim, padded/varlen, fwd/bwd) in a process runs the fused call and the
materialized path (the code the whole CPU suite exercises, hence the oracle) on a small
deterministic problem built on that device (lengths 5 and 17, plus a fully masked sequence in the
padded case) and compares them with bert_fast/ops/_verify.py's bound (the attention op's own
checks). An exception, NaN/Inf or a difference over the bound marks that key "materialized" for the
rest of the process, with one :class:`FusedAttentionWarning`; any later exception of a fused call
does the same. During CUDA-graph capture no check runs (it synchronizes): a kept verdict is used,
an unchecked key takes the materialized path. Meta plumbing and the selection logic are tested on
the CPU (tests/ops/test_fused_sdpa.py); the kernels themselves only where a GPU runs the suite.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from bert_fast.ops import _verify, attention_bounds

__all__ = ["FusedAttentionWarning", "padded_fwd", "padded_bwd", "varlen_fwd", "varlen_bwd", "reset", "verdicts"]

# The aten ops, looked up at call time through these names (tests substitute CPU emulations).
EFF_FWD = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)
EFF_BWD = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", None)
VARLEN_FWD = getattr(torch.ops.aten, "_efficient_attention_forward", None)
VARLEN_BWD = getattr(torch.ops.aten, "_efficient_attention_backward", None)

LSE_ALIGN = 32  # kAlignLSE of the memory-efficient kernels: lse's query axis is padded to it
BIAS_ALIGN = 16  # the bias's key axis is allocated padded to it (torch's pad_bias)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class FusedAttentionWarning(UserWarning):
    """torch's fused attention failed its self-check (or raised): the materialized path runs instead."""


def _ceil(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def on_cuda(t: Tensor) -> bool:
    """The device test of the dispatch (tests replace it to drive the logic with CPU tensors)."""
    return t.device.type == "cuda"


def _capturing(t: Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _aligned(qkv: Tensor) -> bool:
    """Head dim a multiple of 8, q/k/v rows contiguous and every pitch / the base 16-byte aligned."""
    d = qkv.shape[-1]
    if d % 8 != 0 or qkv.stride(-1) != 1:
        return False
    el = qkv.element_size()
    if any((s * el) % 16 for s in qkv.stride()[:-1]):
        return False
    return qkv.device.type == "meta" or qkv.data_ptr() % 16 == 0


_SUSPENDED = threading.local()


def eligible(qkv: Tensor, dropout: bool) -> bool:
    """The fused path may serve this call: CUDA (``on_cuda``), no dropout, fp16/bf16/fp32, aligned
    (and not while a self-check computes its bounds with the torch implementation)."""
    return (
        not dropout
        and not getattr(_SUSPENDED, "on", False)
        and on_cuda(qkv)
        and qkv.dtype in _DTYPES
        and qkv.numel() > 0
        and _aligned(qkv)
        and None not in (EFF_FWD, EFF_BWD, VARLEN_FWD, VARLEN_BWD)
    )


# ----------------------------------------------------------------------------- plumbing: padded
def key_bias(key_mask: Tensor, heads: int, dtype: torch.dtype) -> Tensor:
    """[B, h, S, S] additive bias (0 attend, -inf masked), a broadcast view of [B, 1, 1, S_pad16]
    storage sliced to S keys: the row pitch is a multiple of 16 elements, as the kernel needs."""
    b, s = key_mask.shape
    store = torch.zeros((b, 1, 1, _ceil(max(s, 1), BIAS_ALIGN)), dtype=dtype, device=key_mask.device)
    bias = store[..., :s]
    bias.masked_fill_(~key_mask.to(torch.bool)[:, None, None, :], float("-inf"))
    return bias.expand(b, heads, s, s)


def _heads(qkv: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    return tuple(t.transpose(1, 2) for t in qkv.unbind(2))  # [B, h, S, d] views


def _has_keys(key_mask: Optional[Tensor]) -> Optional[Tensor]:
    return None if key_mask is None else key_mask.to(torch.bool).any(dim=-1)  # [B]


def _padded_fwd_raw(qkv: Tensor, key_mask: Optional[Tensor], scale: float) -> Tuple[Tensor, Tensor]:
    """(out [B, S, h, d] contiguous, lse fp32 [B, h, S] contiguous) of the fused kernel."""
    b, s, _, h, _ = qkv.shape
    q, k, v = _heads(qkv)
    bias = None if key_mask is None else key_bias(key_mask, h, qkv.dtype)
    out, lse, _seed, _off = EFF_FWD(q, k, v, bias, True, 0.0, False, scale=scale)
    out = out.transpose(1, 2)  # [B, S, h, d]
    lse = lse[:, :, :s]  # padded to ceil32(S) along the queries
    keys = _has_keys(key_mask)
    if keys is not None:  # rows without keys: zeros, lse +inf
        out = torch.where(keys[:, None, None, None], out, out.new_zeros(()))
        lse = torch.where(keys[:, None, None], lse, lse.new_full((), float("inf")))
    return out.contiguous(), lse.float().contiguous()


def _lse_for_bwd(lse_bhs: Tensor, keys: Optional[Tensor]) -> Tensor:
    """[B, h, S] -> contiguous [B, h, ceil32(S)] fp32, +inf on the padding and on rows without keys."""
    b, h, s = lse_bhs.shape
    buf = torch.full((b, h, _ceil(max(s, 1), LSE_ALIGN)), float("inf"), dtype=torch.float32, device=lse_bhs.device)
    val = lse_bhs.float()
    if keys is not None:
        val = torch.where(keys[:, None, None], val, val.new_full((), float("inf")))
    buf[:, :, :s] = val
    return buf


def _seed_offset(device) -> Tuple[Tensor, Tensor]:
    z = torch.zeros((), dtype=torch.int64, device=device)  # unused with dropout_p = 0
    return z, z.clone()


def _padded_bwd_raw(
    dout: Tensor, qkv: Tensor, key_mask: Optional[Tensor], out: Tensor, lse: Tensor, scale: float
) -> Tensor:
    """d(qkv) [B, S, 3, h, d] of the fused kernel; out [B, S, h, d], lse fp32 [B, h, S] (ours, the
    materialized path's or the Triton kernel's: only its values on rows with keys are read)."""
    b, s, _, h, _ = qkv.shape
    q, k, v = _heads(qkv)
    bias = None if key_mask is None else key_bias(key_mask, h, qkv.dtype)
    keys = _has_keys(key_mask)
    seed, off = _seed_offset(qkv.device)
    dq, dk, dv, _db = EFF_BWD(
        dout.contiguous().transpose(1, 2),
        q,
        k,
        v,
        bias,
        out.contiguous().transpose(1, 2),
        _lse_for_bwd(lse, keys),
        seed,
        off,
        0.0,
        [True, True, True, False],
        False,
        scale=scale,
    )
    dqkv = torch.stack([dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)], dim=2)
    if keys is not None:
        dqkv = torch.where(keys[:, None, None, None, None], dqkv, dqkv.new_zeros(()))
    return dqkv


# ----------------------------------------------------------------------------- plumbing: varlen
def _token_index(cu_seqlens: Tensor, t: int, max_seqlen: int) -> Tuple[Tensor, Tensor]:
    """(sequence, position) of every token, on the device (no host read); clamped into range, so
    tokens past cu_seqlens[-1] (outside the op's contract) can never index out of bounds."""
    cu = cu_seqlens.to(torch.int64)
    tok = torch.arange(t, device=cu.device)
    seq = torch.searchsorted(cu[1:], tok, right=True).clamp_(max=cu.numel() - 2)
    pos = (tok - cu[seq]).clamp_(0, max(_ceil(max(max_seqlen, 1), LSE_ALIGN) - 1, 0))
    return seq, pos


def _varlen_fwd_raw(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tuple[Tensor, Tensor]:
    """(out [T, h, d] contiguous, lse fp32 [h, T] contiguous) of the fused varlen kernel."""
    t, _, h, d = qkv.shape
    q, k, v = (x.unsqueeze(0) for x in qkv.unbind(1))  # [1, T, h, d]
    cu = cu_seqlens.to(torch.int32)
    res = VARLEN_FWD(q, k, v, None, cu, cu, max_seqlen, max_seqlen, 0.0, 0, True, scale=scale)
    out, lse = res[0], res[1]  # [1, T, h, d], [B, h, ceil32(max)]
    seq, pos = _token_index(cu_seqlens, t, max_seqlen)
    lse_th = lse[seq, :, pos]  # [T, h]
    return out.reshape(t, h, d).contiguous(), lse_th.t().float().contiguous()


def _varlen_bwd_raw(
    dout: Tensor, qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, out: Tensor, lse: Tensor, scale: float
) -> Tensor:
    """d(qkv) [T, 3, h, d] of the fused varlen kernel; lse fp32 [h, T] (the op's layout)."""
    t, _, h, d = qkv.shape
    nseq = cu_seqlens.numel() - 1
    q, k, v = (x.unsqueeze(0) for x in qkv.unbind(1))
    cu = cu_seqlens.to(torch.int32)
    seq, pos = _token_index(cu_seqlens, t, max_seqlen)
    lse_b = torch.full(
        (nseq, h, _ceil(max(max_seqlen, 1), LSE_ALIGN)), float("inf"), dtype=torch.float32, device=qkv.device
    )
    lse_b[seq, :, pos] = lse.t().float()
    seed, off = _seed_offset(qkv.device)
    dq, dk, dv, _db = VARLEN_BWD(
        dout.contiguous().reshape(1, t, h, d),
        q,
        k,
        v,
        None,
        out.contiguous().reshape(1, t, h, d),
        cu,
        cu,
        max_seqlen,
        max_seqlen,
        lse_b,
        0.0,
        seed,
        off,
        0,
        False,
        scale=scale,
    )
    return torch.stack([dq[0], dk[0], dv[0]], dim=1)  # [T, 3, h, d]


# ----------------------------------------------------------------------------- selection + self-check
_LOCK = threading.Lock()
_VERDICTS: Dict[tuple, str] = {}  # key -> "fused" | "materialized"
_CHECKING: set = set()


def reset() -> None:
    """Forget every verdict (tests)."""
    with _LOCK:
        _VERDICTS.clear()
        _CHECKING.clear()


def verdicts() -> Dict[tuple, str]:
    return dict(_VERDICTS)


def _key(qkv: Tensor, layout: str, direction: str) -> tuple:
    dev = qkv.device
    return (dev.type, dev.index, qkv.dtype, qkv.shape[-1], layout, direction)


def _fail(key: tuple, reason: str) -> None:
    with _LOCK:
        first = _VERDICTS.get(key) != "materialized"
        _VERDICTS[key] = "materialized"
    if first:
        warnings.warn(
            f"bert_fast: torch's fused attention ({key[4]} {key[5]}, {key[2]}, head dim {key[3]}, "
            f"{key[0]}{'' if key[1] is None else ':' + str(key[1])}) is not used in this process: {reason}. "
            "The torch implementation runs the materialized attention instead.",
            FusedAttentionWarning,
            stacklevel=4,
        )


def _selected(key: tuple, qkv: Tensor, check: Callable[[], Optional[str]]) -> bool:
    v = _VERDICTS.get(key)
    if v is not None:
        return v == "fused"
    if key in _CHECKING or _capturing(qkv):
        return False  # its own check in progress, or a capture: unchecked -> materialized
    _CHECKING.add(key)
    try:
        try:
            reason = check()
        except Exception as exc:  # noqa: BLE001 - any failure of the fused call rejects it
            reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    finally:
        _CHECKING.discard(key)
    if reason is None:
        with _LOCK:
            _VERDICTS.setdefault(key, "fused")
        return _VERDICTS[key] == "fused"
    _fail(key, "self-check failed: " + reason)
    return False


def _run(qkv: Tensor, layout: str, direction: str, ti, call):
    """``call()`` when the key of (qkv, layout, direction) is selected (checking it first, against
    ``ti``), else None; an exception of the fused call marks the key materialized and returns None."""
    key = _key(qkv, layout, direction)
    if not _selected(key, qkv, lambda: _check(qkv, layout, direction, ti)):
        return None
    try:
        return call()
    except Exception as exc:  # noqa: BLE001
        _fail(key, f"{type(exc).__name__} at a call: {str(exc).strip()[:300]}")
        return None


# The small deterministic problem of the self-check: lengths 5 and 17 (+ one sequence with no key
# in the padded case), 2 heads, the key's head dim and dtype, built on the key's device.
_CHECK_LENGTHS = (5, 17)
_CHECK_HEADS = 2


def _problem(qkv: Tensor, padded: bool):
    g = torch.Generator().manual_seed(1234)
    d = qkv.shape[-1]
    s = max(_CHECK_LENGTHS)
    scale = 1.0 / math.sqrt(d)
    mk = lambda shape: torch.randn(shape, generator=g, dtype=torch.float32).to(device=qkv.device, dtype=qkv.dtype)
    if padded:
        b = len(_CHECK_LENGTHS) + 1
        x = mk((b, s, 3, _CHECK_HEADS, d))
        mask = torch.zeros(b, s, dtype=torch.bool)
        for i, n in enumerate(_CHECK_LENGTHS):
            mask[i, :n] = True  # the last sequence: no key at all
        dout = mk((b, s, _CHECK_HEADS, d))
        return x, mask.to(qkv.device), None, s, dout, scale
    t = sum(_CHECK_LENGTHS)
    x = mk((t, 3, _CHECK_HEADS, d))
    cu = torch.tensor(
        [0] + [sum(_CHECK_LENGTHS[: i + 1]) for i in range(len(_CHECK_LENGTHS))], dtype=torch.int32, device=qkv.device
    )
    dout = mk((t, _CHECK_HEADS, d))
    return x, None, cu, s, dout, scale


def _compare(direction: str, x, mask, cu, s, dout, scale, fused, ref, ti) -> Optional[str]:
    """_verify.compare with the attention op's own checks, computed on CPU copies (the bounds of the
    backward run the torch implementation, which must not be the path under check)."""
    cpu = lambda t: None if t is None else t.detach().cpu()
    fused = tuple(cpu(t) for t in fused) if isinstance(fused, tuple) else cpu(fused)
    ref = tuple(cpu(t) for t in ref) if isinstance(ref, tuple) else cpu(ref)
    _SUSPENDED.on = True
    try:
        if direction == "fwd":
            checks = attention_bounds.fwd_checks(cpu(x), cpu(cu), cpu(mask), s, 0.0, scale, fused, ref)
        else:
            pt = (ti.attention_fwd, ti.attention_bwd, ti.varlen_attention_fwd, ti.varlen_attention_bwd)
            checks = attention_bounds.bwd_checks(
                cpu(dout), cpu(x), cpu(cu), s if cu is not None else None, cpu(mask), s, 0.0, scale, fused, ref, pt
            )
    finally:
        _SUSPENDED.on = False
    reason, _worst = _verify.compare(checks, x.dtype, x.device)
    return reason


def _check(qkv: Tensor, layout: str, direction: str, ti) -> Optional[str]:
    padded = layout == "padded"
    x, mask, cu, s, dout, scale = _problem(qkv, padded)
    if padded:
        ref_fwd = ti.materialized_fwd(x, mask, scale)
        ref_fwd = (ref_fwd[0].contiguous(), ref_fwd[1].contiguous())
        if direction == "fwd":
            return _compare("fwd", x, mask, None, s, None, scale, _padded_fwd_raw(x, mask, scale), ref_fwd, ti)
        fused = _padded_bwd_raw(dout, x, mask, ref_fwd[0], ref_fwd[1], scale)
        return _compare("bwd", x, mask, None, s, dout, scale, fused, ti.materialized_bwd(dout, x, mask, scale), ti)
    ref_fwd = ti.varlen_fwd_grouped(x, cu, s, 0.0, scale, None)
    if direction == "fwd":
        return _compare("fwd", x, None, cu, s, None, scale, _varlen_fwd_raw(x, cu, s, scale), ref_fwd, ti)
    fused = _varlen_bwd_raw(dout, x, cu, s, ref_fwd[0], ref_fwd[1], scale)
    ref = ti.varlen_bwd_grouped(dout, x, cu, s, ref_fwd[0], ref_fwd[1], 0.0, scale, None)
    return _compare("bwd", x, None, cu, s, dout, scale, fused, ref, ti)


# ----------------------------------------------------------------------------- entry points
# Each takes ``ti``: the torch implementation its first-use check compares with, i.e. the module
# bert_fast.ops.torch_impl, which calls these (so this module cannot import it). Used from it:
# materialized_fwd/bwd and varlen_fwd/bwd_grouped (the references), and attention_fwd/bwd and
# varlen_attention_fwd/bwd (P^T x in the backward's bounds). Read at call time: a test that
# wraps one of them sees it wrapped.
def padded_fwd(qkv: Tensor, key_mask: Optional[Tensor], scale: float, ti) -> Optional[Tuple[Tensor, Tensor]]:
    """(out, lse) of the fused kernel, or None: the caller runs the materialized path."""
    return _run(qkv, "padded", "fwd", ti, lambda: _padded_fwd_raw(qkv, key_mask, scale))


def padded_bwd(
    dout: Tensor, qkv: Tensor, key_mask: Optional[Tensor], out: Tensor, lse: Tensor, scale: float, ti
) -> Optional[Tensor]:
    return _run(qkv, "padded", "bwd", ti, lambda: _padded_bwd_raw(dout, qkv, key_mask, out, lse, scale))


def varlen_fwd(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float, ti) -> Optional[Tuple[Tensor, Tensor]]:
    return _run(qkv, "varlen", "fwd", ti, lambda: _varlen_fwd_raw(qkv, cu_seqlens, max_seqlen, scale))


def varlen_bwd(
    dout: Tensor, qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, out: Tensor, lse: Tensor, scale: float, ti
) -> Optional[Tensor]:
    return _run(qkv, "varlen", "bwd", ti, lambda: _varlen_bwd_raw(dout, qkv, cu_seqlens, max_seqlen, out, lse, scale))
