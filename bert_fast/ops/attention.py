"""Flash-style attention as torch ops: padded (key-padding mask) and varlen (cu_seqlens) layouts.

Ops (namespace ``bert_fast``), each with a fake (meta) implementation:
  * ``attention_fwd(qkv [B,S,3,h,d], key_mask uint8 [B,S]?, dropout_p, softmax_scale, seed?)
       -> (out [B,S,h,d], lse fp32 [B,h,S])``, backward op ``attention_bwd -> dqkv``;
  * ``varlen_attention_fwd(qkv [T,3,h,d], cu_seqlens int32 [B+1], max_seqlen, dropout_p,
       softmax_scale, seed?) -> (out [T,h,d], lse fp32 [h,T])``, backward ``varlen_attention_bwd``.
Autograd is registered on the forwards; the gradient w.r.t. qkv is one tensor of qkv's shape whose
q/k/v slices the kernels write directly (nothing is written into saved inputs).

Dispatch (``_dispatch.implementation(qkv, uses_dot=True)``): Triton kernels (kernels/attention.py) on
CUDA and in the CPU interpreter (fp32/fp16); otherwise, and for float64, the torch implementation
(bert_fast.ops.torch_impl: the SDPA flash CPU kernel with the key-padding mask as a bias, varlen
sequences grouped by length into batched calls; materialized softmax with dropout or off the CPU);
the pure-torch reference (backward: the analytic formulas in plain torch ops, recomputing the
probabilities) only when forced. Deterministic mode (torch.use_deterministic_algorithms) selects
the atomics-free dQ kernel. The kernels are checked against the torch implementation the first time
each specialization runs (bert_fast/ops/_verify.py; with dropout, on the kernel's own mask); a
forward that failed its check draws the torch implementation's mask, which ``return_dropout_mask``
then returns.

Dropout: the public functions draw one int64 seed from torch's CPU generator
(``_dispatch.draw_seed``), the op saves it, and backward regenerates the same keep-mask from it
(torch.utils.checkpoint restores the RNG state, so recomputation redraws the same seed). The
Triton path uses Philox with counter (key, query, b*heads + h, 0) (see kernels/attention.py); the
torch and reference paths ``_dispatch.reference_dropout_mask`` of shape [B, heads, S, S]. With
``return_dropout_mask=True`` the public functions also return the exact bool keep-mask used
([B, heads, S, S]; varlen: [B, heads, max_seqlen, max_seqlen], sequence b in its top-left corner),
or None when dropout is off.
"""

from __future__ import annotations

import math
import operator
import os
import warnings
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from bert_fast import reference
from bert_fast.ops import _dispatch, _verify, attention_bounds, cpu_attention, torch_impl

__all__ = ["attention", "varlen_attention"]

_DTYPES = _dispatch.FLOAT_DTYPES + (torch.float64,)


# Head dims the Triton kernels are built and tested for; others run the torch implementation.
KERNEL_HEAD_DIMS = (16, 128)
_WARNED_HEAD_DIMS: set = set()


def _impl(qkv: Tensor) -> str:
    """ "kernel", "torch" or "reference" for qkv (the kernels have no float64 and cover head dims
    16..128: torch runs the rest, the latter with one warning per head dim)."""
    impl = _dispatch.implementation(qkv, uses_dot=True)
    if impl != "kernel":
        return impl
    if qkv.dtype == torch.float64:
        return "torch"
    d = qkv.shape[-1]
    if not KERNEL_HEAD_DIMS[0] <= d <= KERNEL_HEAD_DIMS[1]:
        if d not in _WARNED_HEAD_DIMS:
            _WARNED_HEAD_DIMS.add(d)
            warnings.warn(
                f"bert_fast: head dim {d} is outside {KERNEL_HEAD_DIMS[0]}..{KERNEL_HEAD_DIMS[1]}, "
                "which the attention kernel covers; attention runs torch's implementation of "
                "the same op (SDPA / batched GEMMs, same layout), correct but slower",
                RuntimeWarning,
                stacklevel=2,
            )
        return "torch"
    return impl


def _use_triton(qkv: Tensor) -> bool:
    return _impl(qkv) == "kernel"


def _kernels():
    from bert_fast.kernels import attention as k

    return k


# ----------------------------------------------------------------------------- reference helpers
def _reference_lse_padded(qkv: Tensor, key_mask: Optional[Tensor], scale: float) -> Tensor:
    """fp32 natural-log lse [B, h, S] (+inf for a row without keys), as the kernel saves it."""
    acc = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    q, k = (t.transpose(1, 2).to(acc) for t in (qkv[:, :, 0], qkv[:, :, 1]))
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask.to(torch.bool)[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return lse.masked_fill(torch.isneginf(lse), float("inf")).float().contiguous()


def _reference_attention_bwd(
    qkv: Tensor,
    key_mask: Optional[Tensor],
    dout: Tensor,
    dropout_p: float,
    scale: float,
    dropout_mask: Optional[Tensor],
) -> Tensor:
    """d(qkv) of reference.attention in plain torch ops, in qkv's dtype (the CPU backward).

    (Not autograd: a custom op's implementation runs below the autograd dispatch key, where
    torch.enable_grad() records nothing.) With P the masked softmax (zero rows without keys),
    Z the dropout scale mask, O = (P*Z) V:  dV = (P*Z)^T dO, dP = (dO V^T) * Z,
    dS = P * (dP - rowsum(dP * P)), dQ = scale dS K, dK = scale dS^T Q.
    """
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # [B, h, S, d]
    do = dout.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if key_mask is not None:
        keep = key_mask.to(torch.bool)[:, None, None, :]
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if key_mask is not None:
        probs = probs * key_mask.to(torch.bool).any(dim=-1)[:, None, None, None].to(probs.dtype)
    dp = torch.matmul(do, v.transpose(-1, -2))
    if dropout_mask is not None and dropout_p > 0.0:
        z = dropout_mask.to(probs.dtype) * (1.0 / (1.0 - dropout_p))
        dv = torch.matmul((probs * z).transpose(-1, -2), do)
        dp = dp * z
    else:
        dv = torch.matmul(probs.transpose(-1, -2), do)
    ds = probs * (dp - (dp * probs).sum(dim=-1, keepdim=True))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return torch.stack([dq, dk, dv], dim=2).transpose(1, 3).contiguous()  # [B, S, 3, h, d]


def _reference_dropout_mask(batch, nheads, seqlen, dropout_p, seed, device):
    return _dispatch.reference_dropout_mask((batch, nheads, seqlen, seqlen), dropout_p, seed, device)


def _dropout_mask(
    qkv: Tensor,
    batch: int,
    nheads: int,
    seqlen: int,
    dropout_p: float,
    seed: Optional[Tensor],
    spec: Optional[tuple] = None,
) -> Optional[Tensor]:
    """The exact keep-mask of the path that runs on ``qkv`` (None when dropout is off); ``spec``:
    the forward's specialization, whose failed check means the torch implementation ran."""
    if seed is None or dropout_p == 0.0:
        return None
    if _use_triton(qkv) and (spec is None or _verify.kernel_selected("attention", "fwd", spec, qkv.device)):
        return _kernels().dropout_mask(batch, nheads, seqlen, dropout_p, _dispatch.seed_value(seed), qkv.device)
    return _reference_dropout_mask(batch, nheads, seqlen, dropout_p, seed, qkv.device)


# ----------------------------------------------------------------------------- first-use check
KERNEL = "bert_fast.kernels.attention (Triton)"


def _spec(qkv: Tensor, layout: str, has_mask: bool, seqlen: int, dropout_p: float) -> tuple:
    """What the kernels are specialized and tuned on: layout, dtype, key mask, dropout, heads, head
    dim, the sequence-length bucket (their autotune key), alignment. The backward adds its dQ path."""
    return (
        layout,
        qkv.dtype,
        has_mask,
        dropout_p > 0.0,
        qkv.shape[-2],
        qkv.shape[-1],
        _verify.bucket(seqlen),
        _verify.aligned(qkv),
    )


def _bwd_spec(fwd_spec: tuple, dout: Tensor) -> tuple:
    separate = _dispatch.deterministic() or os.environ.get("BERT_FAST_ATTN_DQ", "") == "separate"
    return fwd_spec + (separate, _verify.aligned(dout))


def _kernel_mask(qkv: Tensor, batch: int, seqlen: int, dropout_p: float, seed: Optional[Tensor]):
    if seed is None or dropout_p == 0.0:
        return None
    return lambda: _kernels().dropout_mask(
        batch, qkv.shape[-2], seqlen, dropout_p, _dispatch.seed_value(seed), qkv.device
    )


# The torch implementation as the backward's bounds use it, for P^T x (magnitudes, not a fallback
# call: bound at import, so whatever wraps torch_impl's functions later sees only fallback calls).
TORCH_ATTENTION = (
    torch_impl.attention_fwd,
    torch_impl.attention_bwd,
    torch_impl.varlen_attention_fwd,
    torch_impl.varlen_attention_bwd,
)
_fwd_checks = attention_bounds.fwd_checks


def _bwd_checks(dout, qkv, lay, dropout_p, scale, k, t):
    # varlen: seqlen is max_seqlen (the bounds read max_seqlen only with cu_seqlens)
    seqlen = lay.seqlen
    return attention_bounds.bwd_checks(
        dout, qkv, lay.cu_seqlens, seqlen, lay.key_mask, seqlen, dropout_p, scale, k, t, TORCH_ATTENTION
    )


# ----------------------------------------------------------------------------- the kernels, both layouts
class _Layout(NamedTuple):
    """Where one call's sequences lie, as the kernels take it: padded (a key mask or None, S) or
    varlen (cu_seqlens, max_seqlen); the other layout's tensor is None."""

    name: str  # "padded" or "varlen"
    key_mask: Optional[Tensor]
    cu_seqlens: Optional[Tensor]
    seqlen: int  # S, or max_seqlen
    batch: int

    def spec(self, qkv: Tensor, dropout_p: float) -> tuple:
        return _spec(qkv, self.name, self.key_mask is not None, self.seqlen, dropout_p)


def _padded(qkv: Tensor, key_mask: Optional[Tensor]) -> _Layout:
    return _Layout("padded", key_mask, None, qkv.shape[1], qkv.shape[0])


def _varlen(cu_seqlens: Tensor, max_seqlen: int) -> _Layout:
    return _Layout("varlen", None, cu_seqlens, max_seqlen, cu_seqlens.numel() - 1)


def _kernel_fwd(qkv: Tensor, lay: _Layout, dropout_p: float, scale: float, seed, fallback):
    """The Triton forward's (out, lse), checked at first use against ``fallback(keep)``: the torch
    implementation of the same op."""
    return _verify.run(
        "attention",
        "fwd",
        lay.spec(qkv, dropout_p),
        qkv.device,
        label=KERNEL,
        dtype=qkv.dtype,
        kernel=lambda: _kernels().attention_fwd(
            qkv, lay.key_mask, lay.cu_seqlens, lay.seqlen, scale, dropout_p, _dispatch.seed_value(seed)
        ),
        kernel_mask=_kernel_mask(qkv, lay.batch, lay.seqlen, dropout_p, seed),
        fallback=fallback,
        checks=lambda k, t, _keep: _fwd_checks(qkv, lay.cu_seqlens, lay.key_mask, lay.seqlen, dropout_p, scale, k, t),
    )


def _kernel_bwd(dout, qkv, lay: _Layout, out, lse, dropout_p: float, scale: float, seed, fallback):
    """The Triton backward's dqkv, checked at first use against ``fallback(keep)`` (as _kernel_fwd)."""
    spec = lay.spec(qkv, dropout_p)
    return _verify.run(
        "attention",
        "bwd",
        _bwd_spec(spec, dout),
        qkv.device,
        label=KERNEL,
        dtype=qkv.dtype,
        kernel=lambda: _kernels().attention_bwd(
            dout,
            qkv,
            lay.key_mask,
            lay.cu_seqlens,
            lay.seqlen,
            out,
            lse,
            scale,
            dropout_p,
            _dispatch.seed_value(seed),
            _dispatch.deterministic(),
        ),
        kernel_mask=_kernel_mask(qkv, lay.batch, lay.seqlen, dropout_p, seed),
        fallback=fallback,
        checks=lambda k, t, _keep: _bwd_checks(dout, qkv, lay, dropout_p, scale, k, t),
        follows=("fwd", spec),
    )


# ----------------------------------------------------------------------------- padded ops
@torch.library.custom_op("bert_fast::attention_fwd", mutates_args=())
@_dispatch.op_impl
def attention_fwd(
    qkv: Tensor, key_mask: Optional[Tensor], dropout_p: float, softmax_scale: float, seed: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    b, s, _, h, d = qkv.shape
    if qkv.numel() == 0:
        return qkv.new_empty((b, s, h, d)), torch.empty((b, h, s), device=qkv.device, dtype=torch.float32)
    impl = _impl(qkv)
    if impl == "kernel":
        fallback = lambda keep: torch_impl.attention_fwd(qkv, key_mask, dropout_p, softmax_scale, seed, keep=keep)
        return _kernel_fwd(qkv, _padded(qkv, key_mask), dropout_p, softmax_scale, seed, fallback)
    if impl == "torch":
        return torch_impl.attention_fwd(qkv, key_mask, dropout_p, softmax_scale, seed)
    mask = _reference_dropout_mask(b, h, s, dropout_p, seed, qkv.device)
    out = reference.attention(qkv, key_mask, dropout_p, softmax_scale, mask).contiguous()
    return out, _reference_lse_padded(qkv, key_mask, softmax_scale)


@attention_fwd.register_fake
def _(qkv, key_mask, dropout_p, softmax_scale, seed):
    b, s, _, h, d = qkv.shape
    return qkv.new_empty((b, s, h, d)), qkv.new_empty((b, h, s), dtype=torch.float32)


@torch.library.custom_op("bert_fast::attention_bwd", mutates_args=())
@_dispatch.op_impl
def attention_bwd(
    dout: Tensor,
    qkv: Tensor,
    key_mask: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    dropout_p: float,
    softmax_scale: float,
    seed: Optional[Tensor],
) -> Tensor:
    if qkv.numel() == 0:
        return torch.zeros(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    impl = _impl(qkv)
    if impl == "kernel":
        fallback = lambda keep: torch_impl.attention_bwd(
            dout, qkv, key_mask, out, lse, dropout_p, softmax_scale, seed, keep=keep
        )
        return _kernel_bwd(dout, qkv, _padded(qkv, key_mask), out, lse, dropout_p, softmax_scale, seed, fallback)
    if impl == "torch":
        return torch_impl.attention_bwd(dout, qkv, key_mask, out, lse, dropout_p, softmax_scale, seed)
    b, s, _, h, _ = qkv.shape
    mask = _reference_dropout_mask(b, h, s, dropout_p, seed, qkv.device)
    return _reference_attention_bwd(qkv, key_mask, dout, dropout_p, softmax_scale, mask)


@attention_bwd.register_fake
def _(dout, qkv, key_mask, out, lse, dropout_p, softmax_scale, seed):
    return qkv.new_empty(qkv.shape)


def _setup_context(ctx, inputs, output):
    qkv, key_mask, dropout_p, softmax_scale, seed = inputs
    out, lse = output
    ctx.save_for_backward(qkv, key_mask, out, lse, seed)
    ctx.dropout_p, ctx.softmax_scale = dropout_p, softmax_scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    qkv, key_mask, out, lse, seed = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    dqkv = torch.ops.bert_fast.attention_bwd(dout, qkv, key_mask, out, lse, ctx.dropout_p, ctx.softmax_scale, seed)
    return dqkv, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- varlen ops
def _reference_varlen(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed):
    batch = cu_seqlens.numel() - 1
    mask = _reference_dropout_mask(batch, qkv.shape[2], max_seqlen, dropout_p, seed, qkv.device)
    return reference.varlen_attention(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, mask)


@torch.library.custom_op("bert_fast::varlen_attention_fwd", mutates_args=())
@_dispatch.op_impl
def varlen_attention_fwd(
    qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float, softmax_scale: float, seed: Optional[Tensor]
) -> Tuple[Tensor, Tensor]:
    t, _, h, d = qkv.shape
    if qkv.numel() == 0:
        return qkv.new_empty((t, h, d)), torch.empty((h, t), device=qkv.device, dtype=torch.float32)
    impl = _impl(qkv)
    if impl == "kernel":
        fallback = lambda keep: torch_impl.varlen_attention_fwd(
            qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed, keep=keep
        )
        return _kernel_fwd(qkv, _varlen(cu_seqlens, max_seqlen), dropout_p, softmax_scale, seed, fallback)
    if impl == "torch":
        return torch_impl.varlen_attention_fwd(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed)
    out = _reference_varlen(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed).contiguous()
    lse = torch.empty((h, t), device=qkv.device, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            lse[:, lo:hi] = _reference_lse_padded(qkv[lo:hi].unsqueeze(0), None, softmax_scale)[0]
    return out, lse


@varlen_attention_fwd.register_fake
def _(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed):
    t, _, h, d = qkv.shape
    return qkv.new_empty((t, h, d)), qkv.new_empty((h, t), dtype=torch.float32)


@torch.library.custom_op("bert_fast::varlen_attention_bwd", mutates_args=())
@_dispatch.op_impl
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
) -> Tensor:
    if qkv.numel() == 0:
        return torch.zeros(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    impl = _impl(qkv)
    if impl == "kernel":
        fallback = lambda keep: torch_impl.varlen_attention_bwd(
            dout, qkv, cu_seqlens, max_seqlen, out, lse, dropout_p, softmax_scale, seed, keep=keep
        )
        lay = _varlen(cu_seqlens, max_seqlen)
        return _kernel_bwd(dout, qkv, lay, out, lse, dropout_p, softmax_scale, seed, fallback)
    if impl == "torch":
        return torch_impl.varlen_attention_bwd(
            dout, qkv, cu_seqlens, max_seqlen, out, lse, dropout_p, softmax_scale, seed
        )
    mask = _reference_dropout_mask(cu_seqlens.numel() - 1, qkv.shape[2], max_seqlen, dropout_p, seed, qkv.device)
    dqkv = torch.zeros(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    bounds = cu_seqlens.tolist()
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        if hi > lo:
            m = None if mask is None else mask[i : i + 1, :, : hi - lo, : hi - lo]
            dqkv[lo:hi] = _reference_attention_bwd(
                qkv[lo:hi].unsqueeze(0), None, dout[lo:hi].unsqueeze(0), dropout_p, softmax_scale, m
            )[0]
    return dqkv


@varlen_attention_bwd.register_fake
def _(dout, qkv, cu_seqlens, max_seqlen, out, lse, dropout_p, softmax_scale, seed):
    return qkv.new_empty(qkv.shape)


def _setup_context_varlen(ctx, inputs, output):
    qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, seed = inputs
    out, lse = output
    ctx.save_for_backward(qkv, cu_seqlens, out, lse, seed)
    ctx.max_seqlen, ctx.dropout_p, ctx.softmax_scale = max_seqlen, dropout_p, softmax_scale
    ctx.mark_non_differentiable(lse)


def _backward_varlen(ctx, dout, _dlse):
    qkv, cu_seqlens, out, lse, seed = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None, None
    dqkv = torch.ops.bert_fast.varlen_attention_bwd(
        dout, qkv, cu_seqlens, ctx.max_seqlen, out, lse, ctx.dropout_p, ctx.softmax_scale, seed
    )
    return dqkv, None, None, None, None, None


varlen_attention_fwd.register_autograd(_backward_varlen, setup_context=_setup_context_varlen)


# ----------------------------------------------------------------------------- validation
def _check_qkv(qkv, varlen: bool) -> None:
    layout = "[T, 3, heads, d]" if varlen else "[B, S, 3, heads, d]"
    _dispatch.check_tensor("qkv", qkv, dtypes=_DTYPES)
    if qkv.dim() != (4 if varlen else 5):
        raise ValueError(f"qkv must be {layout} ({4 if varlen else 5} dimensions), got shape {tuple(qkv.shape)}")
    if qkv.shape[-3] != 3:
        raise ValueError(
            f"qkv must be {layout}: dimension {qkv.dim() - 3} must be 3 (q, k, v), got shape {tuple(qkv.shape)}"
        )
    if qkv.shape[-1] < 1:
        raise ValueError(f"head dim (last dimension of qkv) must be >= 1, got shape {tuple(qkv.shape)}")


def _softmax_scale(softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if (
        not isinstance(softmax_scale, (int, float))
        or isinstance(softmax_scale, bool)
        or not math.isfinite(softmax_scale)
    ):
        raise ValueError(f"softmax_scale must be a finite float or None, got {softmax_scale!r}")
    return float(softmax_scale)


def _compact_mask(attention_mask: Tensor, qkv: Tensor) -> Tensor:
    """Validate a key-padding mask [B, S] (bool or integer, nonzero = attend) and convert it once
    to uint8 (a free view for bool)."""
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(
            f"attention_mask must be bool or integer (1 = attend), got {attention_mask.dtype}; "
            "additive float masks are not accepted"
        )
    b, s = qkv.shape[0], qkv.shape[1]
    if tuple(attention_mask.shape) != (b, s):
        raise ValueError(f"attention_mask must have shape [B, S] = {[b, s]}, got {list(attention_mask.shape)}")
    _dispatch.check_same_device(qkv=qkv, attention_mask=attention_mask)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask != 0
    return attention_mask.view(torch.uint8)


def _check_cu_seqlens(cu_seqlens, max_seqlen, qkv: Tensor, validate: bool = True) -> int:
    if not isinstance(cu_seqlens, Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [B+1] with B >= 0, got shape {tuple(cu_seqlens.shape)}")
    _dispatch.check_same_device(qkv=qkv, cu_seqlens=cu_seqlens)
    if isinstance(max_seqlen, bool):
        raise TypeError(f"max_seqlen must be an int, got {max_seqlen!r}")
    try:
        max_seqlen = operator.index(max_seqlen)
    except TypeError:
        raise TypeError(f"max_seqlen must be an int, got {type(max_seqlen).__name__}") from None
    if max_seqlen < 0:
        raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
    # The value checks read cu_seqlens on the host: skipped when asked, inside a CUDA-graph
    # capture (a sync there is illegal) and while torch.compile traces (a graph break).
    if not validate or not _dispatch.host_checks_allowed(qkv) or torch.compiler.is_compiling():
        return max_seqlen
    t = qkv.shape[0]
    cu = cu_seqlens
    if cu.numel() > 1:
        diffs = cu[1:] - cu[:-1]
        stats = torch.stack([cu[0], cu[-1], (diffs < 0).any().to(torch.int32), diffs.max()])
    else:
        stats = torch.stack([cu[0], cu[0], cu[0] * 0, cu[0] * 0])
    first, last, decreasing, longest = (int(v) for v in stats.tolist())  # the one host sync
    if first != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {first}")
    if decreasing:
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
    if last != t:
        raise ValueError(f"cu_seqlens[-1] must equal the token count T = {t}, got {last}")
    if longest > max_seqlen:
        raise ValueError(f"max_seqlen = {max_seqlen} is smaller than the longest sequence ({longest})")
    return max_seqlen


# ----------------------------------------------------------------------------- public API
def backend(device, dtype) -> str:
    """What runs for tensors of ``dtype`` on ``device`` (``bert-fast info``)."""
    device = torch.device(device)
    impl = _dispatch.implementation_for(device, dtype, uses_dot=True)
    if impl == "kernel" and dtype == torch.float64:
        impl = "torch"
    if device.type != "cpu":
        label = "materialized softmax (batched GEMMs)"
    elif dtype == torch.float32:
        label = "SDPA flash CPU kernel (materialized with dropout)"
    else:
        label = "SDPA flash CPU forward, materialized backward"
    if device.type == "cpu" and dtype in cpu_attention.DTYPES and cpu_attention.available(dtype):
        # no-grad inference (model/direct_ops.py) may run our kernel instead, where it measured faster
        label += "; inference: bert_fast's kernel where timed faster"
    return _dispatch.describe(impl, device, label)


def attention(
    qkv: Tensor,
    attention_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    return_dropout_mask: bool = False,
):
    """softmax(q k^T * scale, padded keys masked) v for qkv [B, S, 3, heads, d] -> [B, S, heads, d].

    attention_mask: None or bool/integer [B, S], nonzero = real token. It masks keys only: every
    query position (pads included) attends to the real keys of its row, as in transformers; a row
    without real keys gives zeros (zero gradients). q, k, v are read by stride from qkv (any
    strides). dropout_p in [0, 1) on the probabilities, seeded from torch's CPU generator (or
    ``generator``). softmax_scale defaults to 1/sqrt(d). Any head dim (the kernel
    covers 16..128; others run the torch implementation with a warning); fp16, bf16, fp32
    (float64 runs the reference). ``return_dropout_mask=True`` returns ``(out, keep_mask)`` with the
    exact bool mask [B, heads, S, S] used (None when dropout_p == 0).
    """
    _check_qkv(qkv, varlen=False)
    key_mask = None if attention_mask is None else _compact_mask(attention_mask, qkv)
    p = _dispatch.check_dropout_p(dropout_p)
    scale = _softmax_scale(softmax_scale, qkv.shape[-1])
    seed = _dispatch.draw_seed(p, generator)
    out, _ = _dispatch.call_op("attention_fwd", qkv, key_mask, p, scale, seed)
    if return_dropout_mask:
        b, s, _, h, _ = qkv.shape
        return out, _dropout_mask(qkv, b, h, s, p, seed, _padded(qkv, key_mask).spec(qkv, p))
    return out


def varlen_attention(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    return_dropout_mask: bool = False,
    validate: bool = True,
):
    """Attention over packed sequences: qkv [T, 3, heads, d], cu_seqlens int32 [B+1] -> [T, heads, d].

    Sequence b is rows cu_seqlens[b]:cu_seqlens[b+1] (empty sequences allowed); tokens attend
    within their sequence. max_seqlen >= the longest sequence (checked: one host sync). Other
    arguments as in ``attention``; the dropout keep-mask is [B, heads, max_seqlen, max_seqlen],
    sequence b using its top-left L x L block (the same bits ``attention`` draws for row b of a
    padded batch with the same seed). ``validate=False`` skips the value checks of cu_seqlens
    (start, order, total, max_seqlen), which cost one host sync: for callers that built
    cu_seqlens themselves (the model, benchmarks); dtype, shape and device are still checked.
    With validate=False, invalid cu_seqlens are undefined behaviour (out-of-range reads).
    """
    _check_qkv(qkv, varlen=True)
    max_seqlen = _check_cu_seqlens(cu_seqlens, max_seqlen, qkv, validate)
    p = _dispatch.check_dropout_p(dropout_p)
    scale = _softmax_scale(softmax_scale, qkv.shape[-1])
    seed = _dispatch.draw_seed(p, generator)
    out, _ = _dispatch.call_op("varlen_attention_fwd", qkv, cu_seqlens, max_seqlen, p, scale, seed)
    if return_dropout_mask:
        lay = _varlen(cu_seqlens, max_seqlen)
        return out, _dropout_mask(qkv, lay.batch, qkv.shape[2], max_seqlen, p, seed, lay.spec(qkv, p))
    return out
