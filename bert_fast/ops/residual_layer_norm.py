"""residual_layer_norm: LayerNorm(dropout(x) + residual) * weight + bias as the torch ops
``bert_fast::residual_layer_norm_fwd`` -> (y, mean, rstd) and ``bert_fast::residual_layer_norm_bwd``.

Dropout: the public function draws one int64 seed from torch's CPU generator
(``_dispatch.draw_seed``) and passes it to the op, which saves it; backward rebuilds the mask from
it (the mask is never stored), and torch.utils.checkpoint, which restores the RNG state, redraws the
same seed and so recomputes the same mask. The Triton path draws its mask with Philox
(one Philox4x32-10 call per 4 columns of a row, int64 counters; see kernels/residual_layer_norm.py); the
torch and reference paths use ``_dispatch.reference_dropout_mask`` (the same bits for one seed).

Implementations (bert_fast/ops/_dispatch.py): the Triton kernel on CUDA and under the interpreter;
the torch implementation (bert_fast.ops.torch_impl: dropout + add, aten.native_layer_norm with fp32
statistics, backward aten.native_layer_norm_backward from the saved statistics) on the CPU and as
the CUDA fallback; the reference when forced. ``residual_layer_norm_dropout_mask``
returns the exact mask either path uses, for tests and debugging. The kernel is checked against the
torch implementation the first time each specialization runs (bert_fast/ops/_verify.py; with
dropout, on the kernel's own mask); a forward that failed its check draws the torch implementation's
mask, which ``return_dropout_mask=True`` then returns.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from bert_fast import reference
from bert_fast.ops import _dispatch, _verify, torch_impl

__all__ = ["residual_layer_norm", "residual_layer_norm_dropout_mask"]

_DTYPES = _dispatch.FLOAT_DTYPES + (torch.float64,)


def _as_2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def residual_layer_norm_dropout_mask(shape, dropout_p: float, seed: Optional[Tensor], device) -> Tensor:
    """The exact bool keep-mask residual_layer_norm applies to x (shape [..., N]) for this seed
    (the tensor ``draw_seed`` returned) on ``device``; all True when dropout is off."""
    shape = tuple(int(s) for s in shape)
    device = torch.device(device)
    if seed is None or dropout_p == 0.0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if _dispatch.implementation_for(device, torch.float32) == "kernel":
        from bert_fast.kernels.residual_layer_norm import dropout_keep_mask

        return dropout_keep_mask(shape, dropout_p, _dispatch.seed_value(seed), device)
    return _dispatch.reference_dropout_mask(shape, dropout_p, seed, device)


# ----------------------------------------------------------------------------- first-use check
KERNEL = "bert_fast.kernels.residual_layer_norm (Triton)"


def _spec(x: Tensor, residual: Tensor, dropout_p: float) -> tuple:
    """What the kernel is specialized on: dtype, dropout on/off, row bucket, hidden size, alignment.
    The backward has the same spec: it follows the forward's verdict (bert_fast/ops/_verify.py)."""
    n = x.shape[-1]
    return (x.dtype, dropout_p > 0.0, _verify.bucket(x.numel() // max(n, 1)), n, _verify.aligned(x, residual))


def _kernel_mask(x: Tensor, dropout_p: float, seed: Optional[Tensor]):
    """The kernel's exact keep-mask (None when dropout is off), for the check and the stand-in backward."""
    if seed is None or dropout_p == 0.0:
        return None

    def mask():
        from bert_fast.kernels.residual_layer_norm import dropout_keep_mask

        return dropout_keep_mask(x.shape, dropout_p, _dispatch.seed_value(seed), x.device)

    return mask


def _h(x: Tensor, residual: Tensor, dropout_p: float, keep: Optional[Tensor]):
    """(h, |h| terms) of LayerNorm's input, fp32 (float64 for float64), [rows, N]."""
    ax, ar = _verify.absf(x), _verify.absf(residual)
    xs, rs = x.detach().to(ax.dtype), residual.detach().to(ax.dtype)
    if keep is not None and dropout_p > 0.0:
        k = keep.to(ax.dtype) * (1.0 / (1.0 - dropout_p))
        xs, ax = xs * k, ax * k
    n = x.shape[-1]
    return (xs + rs).reshape(-1, n), (ax + ar).reshape(-1, n)


def _fwd_checks(x, residual, weight, bias, dropout_p, keep, k, t):
    h, hmag = _h(x, residual, dropout_p, keep)
    n = x.shape[-1]
    flat = lambda outs: (outs[0].reshape(-1, n), outs[1].reshape(-1), outs[2].reshape(-1))
    return _verify.with_rel(
        _verify.layer_norm_checks(h, hmag, weight, bias, flat(k), flat(t)), _verify.dropout_rel(x.dtype, dropout_p)
    )


def _bwd_checks(dy, x, residual, weight, mean, rstd, dropout_p, keep, k, t):
    h, hmag = _h(x, residual, dropout_p, keep)
    dh, dw_terms, ady = _verify.layer_norm_bwd_magnitudes(h, hmag, dy, weight, mean, rstd)
    rows, n = h.shape
    scale = 1.0 / (1.0 - dropout_p) if (keep is not None and dropout_p > 0.0) else 1.0
    shape = x.shape
    dres_t = _verify.absf(t[1]).reshape(rows, n)
    dw_sum, db_sum = dw_terms.sum(dim=0), ady.sum(dim=0)
    return _verify.with_rel(
        [
            _verify.Check("dres", k[1], t[1], mag=(2.0 * dh).reshape(shape), acc=(n * dh).reshape(shape)),
            _verify.Check(
                "dx", k[0], t[0], mag=(scale * (2.0 * dh + dres_t)).reshape(shape), acc=(scale * n * dh).reshape(shape)
            ),
            _verify.Check("dweight", k[2], t[2], mag=dw_sum, acc=(rows + 2) * dw_sum),
            _verify.Check("dbias", k[3], t[3], mag=db_sum, acc=(rows + 2) * db_sum),
        ],
        _verify.dropout_rel(x.dtype, dropout_p),
    )


def _applied_mask(x: Tensor, residual: Tensor, dropout_p: float, seed: Optional[Tensor]) -> Tensor:
    """The mask residual_layer_norm applied to x: the kernel's, unless its forward specialization
    failed its check and the torch implementation ran (with its own stream)."""
    if (
        seed is not None
        and dropout_p > 0.0
        and _dispatch.implementation(x) == "kernel"
        and not _verify.kernel_selected("residual_layer_norm", "fwd", _spec(x, residual, dropout_p), x.device)
    ):
        return _dispatch.reference_dropout_mask(x.shape, dropout_p, seed, x.device)
    return residual_layer_norm_dropout_mask(x.shape, dropout_p, seed, x.device)


def _reference_forward(x, residual, weight, bias, eps, dropout_p, seed):
    mask = _dispatch.reference_dropout_mask(x.shape, dropout_p, seed, x.device)
    y = reference.residual_layer_norm(x, residual, weight, bias, eps, dropout_p, mask)
    return y, mask


@torch.library.custom_op("bert_fast::residual_layer_norm_fwd", mutates_args=())
@_dispatch.op_impl
def residual_layer_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor, bias: Tensor, eps: float, dropout_p: float, seed: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor]:
    impl = _dispatch.implementation(x)
    if impl == "kernel":

        def kernel():
            from bert_fast.kernels.residual_layer_norm import residual_layer_norm_fwd as launch

            y, mean, rstd = launch(
                _as_2d(x), _as_2d(residual), weight, bias, eps, dropout_p, _dispatch.seed_value(seed)
            )
            return y.view(x.shape), mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])

        return _verify.run(
            "residual_layer_norm",
            "fwd",
            _spec(x, residual, dropout_p),
            x.device,
            label=KERNEL,
            dtype=x.dtype,
            kernel=kernel,
            kernel_mask=_kernel_mask(x, dropout_p, seed),
            fallback=lambda keep: torch_impl.residual_layer_norm_fwd(
                x, residual, weight, bias, eps, dropout_p, seed, keep=keep
            ),
            checks=lambda k, t, keep: _fwd_checks(x, residual, weight, bias, dropout_p, keep, k, t),
        )
    if impl == "torch":
        return torch_impl.residual_layer_norm_fwd(x, residual, weight, bias, eps, dropout_p, seed)
    y, mask = _reference_forward(x, residual, weight, bias, eps, dropout_p, seed)
    h = reference.apply_dropout(x, dropout_p, mask) + residual
    h = h.to(_stat_dtype(x.dtype))
    mean = h.mean(dim=-1)
    rstd = torch.rsqrt(h.var(dim=-1, unbiased=False) + eps)
    return y.contiguous(), mean.contiguous(), rstd.contiguous()


@residual_layer_norm_fwd.register_fake
def _(x, residual, weight, bias, eps, dropout_p, seed):
    stats = x.new_empty(x.shape[:-1], dtype=_stat_dtype(x.dtype))
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@torch.library.custom_op("bert_fast::residual_layer_norm_bwd", mutates_args=())
@_dispatch.op_impl
def residual_layer_norm_bwd(
    dy: Tensor,
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor,
    mean: Tensor,
    rstd: Tensor,
    eps: float,
    dropout_p: float,
    seed: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = _dispatch.implementation(x)
    if impl == "kernel":

        def kernel():
            from bert_fast.kernels.residual_layer_norm import residual_layer_norm_bwd as launch

            dx, dres, dw, db = launch(
                _as_2d(dy),
                _as_2d(x),
                _as_2d(residual),
                weight,
                bias,
                mean.reshape(-1),
                rstd.reshape(-1),
                dropout_p,
                _dispatch.seed_value(seed),
            )
            return dx.view(x.shape), dres.view(x.shape), dw, db

        def fallback(keep):
            grads = torch_impl.residual_layer_norm_bwd(
                dy, x, residual, weight, bias, mean, rstd, dropout_p, seed, keep=keep
            )
            return tuple(g.contiguous() for g in grads)

        spec = _spec(x, residual, dropout_p)
        return _verify.run(
            "residual_layer_norm",
            "bwd",
            spec + (_verify.aligned(dy),),
            x.device,
            label=KERNEL,
            dtype=x.dtype,
            kernel=kernel,
            kernel_mask=_kernel_mask(x, dropout_p, seed),
            fallback=fallback,
            checks=lambda k, t, keep: _bwd_checks(dy, x, residual, weight, mean, rstd, dropout_p, keep, k, t),
            follows=("fwd", spec),
        )
    if impl == "torch":
        grads = torch_impl.residual_layer_norm_bwd(dy, x, residual, weight, bias, mean, rstd, dropout_p, seed)
        return tuple(g.contiguous() for g in grads)
    # Reference backward = autograd's own LayerNorm backward (aten native_layer_norm_backward) on
    # h recomputed from x, residual and the seed's mask. (torch.autograd.grad records nothing here: a
    # custom op's implementation runs below the Autograd key; torch.func.vjp trips opcheck.)
    mask = _dispatch.reference_dropout_mask(x.shape, dropout_p, seed, x.device)
    h = reference.apply_dropout(x, dropout_p, mask) + residual
    n = [x.shape[-1]]
    _, mean_r, rstd_r = torch.ops.aten.native_layer_norm(h, n, weight, bias, eps)
    dres, dw, db = torch.ops.aten.native_layer_norm_backward(dy, h, n, mean_r, rstd_r, weight, bias, [True, True, True])
    dx = reference.apply_dropout(dres, dropout_p, mask) if mask is not None else dres.clone()
    grads = (dx, dres, dw, db)
    return tuple(g.contiguous() for g in grads)


@residual_layer_norm_bwd.register_fake
def _(dy, x, residual, weight, bias, mean, rstd, eps, dropout_p, seed):
    return x.new_empty(x.shape), x.new_empty(x.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, dropout_p, seed = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, residual, weight, bias, mean, rstd, seed)
    ctx.eps, ctx.dropout_p = eps, dropout_p
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, residual, weight, bias, mean, rstd, seed = ctx.saved_tensors
    need = ctx.needs_input_grad[:4]
    if not any(need):
        return None, None, None, None, None, None, None
    grads = torch.ops.bert_fast.residual_layer_norm_bwd(
        dy, x, residual, weight, bias, mean, rstd, ctx.eps, ctx.dropout_p, seed
    )
    return tuple(g if n else None for g, n in zip(grads, need)) + (None, None, None)


residual_layer_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def backend(device, dtype) -> str:
    """What runs for tensors of ``dtype`` on ``device`` (``bert-fast info``)."""
    return _dispatch.describe(_dispatch.implementation_for(device, dtype), device, "add + aten native_layer_norm")


def residual_layer_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor,
    bias: Tensor,
    eps: float = 1e-12,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    return_dropout_mask: bool = False,
):
    """LayerNorm(dropout(x) + residual) * weight + bias over the last dimension.

    x, residual [..., N] (same shape); weight, bias [N]; one float dtype for all four. Dropout
    (p in [0, 1)) is drawn inside the kernel from a seed taken from torch's CPU generator
    (or ``generator``), so torch.manual_seed reproduces it. ``return_dropout_mask=True`` returns
    ``(y, keep_mask)``, the exact bool mask applied to x (debugging/tests).
    """
    for name, t in (("x", x), ("residual", residual)):
        _dispatch.check_tensor(name, t, dtypes=_DTYPES)
    for name, t in (("weight", weight), ("bias", bias)):
        _dispatch.check_tensor(name, t, ndim=1, dtypes=_DTYPES)
    if x.dim() < 1 or residual.shape != x.shape:
        raise ValueError(
            f"residual_layer_norm: x shape {tuple(x.shape)} and residual shape "
            f"{tuple(residual.shape)} must be equal and at least 1-D"
        )
    n = x.shape[-1]
    if weight.shape[0] != n or bias.shape[0] != n:
        raise ValueError(
            f"residual_layer_norm: weight {tuple(weight.shape)} and bias {tuple(bias.shape)} "
            f"must have the size of the last dimension of x {tuple(x.shape)}"
        )
    _dispatch.check_same_dtype(x=x, residual=residual, weight=weight, bias=bias)
    _dispatch.check_same_device(x=x, residual=residual, weight=weight, bias=bias)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    p = _dispatch.check_dropout_p(dropout_p)
    seed = _dispatch.draw_seed(p, generator)
    y, _, _ = _dispatch.call_op("residual_layer_norm_fwd", x, residual, weight, bias, float(eps), p, seed)
    if return_dropout_mask:
        return y, _applied_mask(x, residual, p, seed)
    return y
