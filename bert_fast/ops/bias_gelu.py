"""bias_gelu: gelu(x + bias) as the torch ops ``bert_fast::bias_gelu_fwd`` / ``bert_fast::bias_gelu_bwd``.

Implementations (chosen by bert_fast/ops/_dispatch.py): the Triton kernel (bert_fast.kernels.bias_gelu)
on CUDA and under the interpreter; the torch implementation (bert_fast.ops.torch_impl: aten GELU in
place on x + b, backward aten.gelu_backward) on the CPU and as the CUDA fallback; the pure-torch
reference when forced. Outputs are always contiguous. The kernel is checked against the torch
implementation the first time each specialization runs (bert_fast/ops/_verify.py).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from bert_fast import reference
from bert_fast.ops import _dispatch, _verify, torch_impl

__all__ = ["bias_gelu"]

_DTYPES = _dispatch.FLOAT_DTYPES + (torch.float64,)


def _as_2d(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


# ----------------------------------------------------------------------------- first-use check
KERNEL = "bert_fast.kernels.bias_gelu (Triton)"


def _spec(approximate: str, x: Tensor, *tensors) -> tuple:
    """What the kernel is specialized on: dtype, GELU form, row bucket, width (its tile), alignment."""
    n = x.shape[-1]
    return (x.dtype, approximate, _verify.bucket(x.numel() // max(n, 1)), n, _verify.aligned(x, *tensors))


def _fwd_checks(x, bias, y_k, y_t):
    # the torch implementation rounds z = x + b in the dtype; |gelu'| <= 1.13 carries that to y
    zmag = _verify.absf(x) + _verify.absf(bias)
    return [_verify.Check("y", y_k, y_t, mag=_verify.GELU_SLOPE * zmag)]


def _bwd_checks(dy, x, bias, k, t):
    # dx = dy gelu'(z): |gelu'| <= 1.13, and the rounding of z moves gelu' by |gelu''| <= 0.8 times it
    g = _verify.absf(dy) * (_verify.GELU_SLOPE + _verify.absf(x) + _verify.absf(bias))
    rows = g.numel() // max(g.shape[-1], 1)
    gsum = g.reshape(rows, -1).sum(dim=0)
    return [_verify.Check("dx", k[0], t[0], mag=g), _verify.Check("dbias", k[1], t[1], mag=gsum, acc=(rows + 2) * gsum)]


def verified_fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    """The kernel's gelu(x + bias), checked at first use against the torch implementation
    (bert_fast/ops/_verify.py); also the GELU epilogue of linear's cuBLAS path."""

    def kernel():
        from bert_fast.kernels.bias_gelu import bias_gelu_fwd as launch

        return launch(_as_2d(x), bias, approximate).view(x.shape)

    return _verify.run(
        "bias_gelu",
        "fwd",
        _spec(approximate, x, bias),
        x.device,
        label=KERNEL,
        dtype=x.dtype,
        kernel=kernel,
        fallback=lambda _keep: torch_impl.bias_gelu_fwd(x, bias, approximate).contiguous(),
        checks=lambda k, t, _keep: _fwd_checks(x, bias, k, t),
    )


def verified_bwd(dy: Tensor, x: Tensor, bias: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    """The kernel's (dx, dbias) of gelu(x + bias), checked at first use."""

    def kernel():
        from bert_fast.kernels.bias_gelu import bias_gelu_bwd as launch

        dx, dbias = launch(_as_2d(dy), _as_2d(x), bias, approximate)
        return dx.view(x.shape), dbias

    return _verify.run(
        "bias_gelu",
        "bwd",
        _spec(approximate, x, dy, bias),
        x.device,
        label=KERNEL,
        dtype=x.dtype,
        kernel=kernel,
        fallback=lambda _keep: torch_impl.bias_gelu_bwd(dy, x, bias, approximate),
        checks=lambda k, t, _keep: _bwd_checks(dy, x, bias, k, t),
    )


@torch.library.custom_op("bert_fast::bias_gelu_fwd", mutates_args=())
@_dispatch.op_impl
def bias_gelu_fwd(x: Tensor, bias: Tensor, approximate: str) -> Tensor:
    impl = _dispatch.implementation(x)
    if impl == "kernel":
        return verified_fwd(x, bias, approximate)
    if impl == "torch":
        return torch_impl.bias_gelu_fwd(x, bias, approximate).contiguous()
    return reference.bias_gelu(x, bias, approximate).contiguous()


@bias_gelu_fwd.register_fake
def _(x, bias, approximate):
    return x.new_empty(x.shape)


@torch.library.custom_op("bert_fast::bias_gelu_bwd", mutates_args=())
@_dispatch.op_impl
def bias_gelu_bwd(dy: Tensor, x: Tensor, bias: Tensor, approximate: str) -> Tuple[Tensor, Tensor]:
    impl = _dispatch.implementation(x)
    if impl == "kernel":
        return verified_bwd(dy, x, bias, approximate)
    if impl == "torch":
        return torch_impl.bias_gelu_bwd(dy, x, bias, approximate)
    # Reference backward = autograd's own GELU derivative (aten.gelu_backward) on the recomputed x + bias.
    # (torch.autograd.grad records nothing here: a custom op's implementation runs below the Autograd
    # key; torch.func.vjp works but trips opcheck's schema check.)
    dx = torch.ops.aten.gelu_backward(dy, x + bias, approximate=approximate)
    dbias = dx.reshape(-1, x.shape[-1]).sum(dim=0)
    return dx.contiguous(), dbias.contiguous()


@bias_gelu_bwd.register_fake
def _(dy, x, bias, approximate):
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward(ctx, dy):
    x, bias = ctx.saved_tensors
    need_x, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_x or need_b):
        return None, None, None
    dx, dbias = torch.ops.bert_fast.bias_gelu_bwd(dy, x, bias, ctx.approximate)
    return (dx if need_x else None), (dbias if need_b else None), None


bias_gelu_fwd.register_autograd(_backward, setup_context=_setup_context)


def backend(device, dtype) -> str:
    """What runs for tensors of ``dtype`` on ``device`` (``bert-fast info``)."""
    return _dispatch.describe(_dispatch.implementation_for(device, dtype), device, "aten GELU")


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """gelu(x + bias) over the last dimension. x [..., N], bias [N]; approximate "none" (erf) or "tanh".

    Raises TypeError (non-tensor, non-float or mismatched dtypes) and ValueError (shapes,
    devices, unknown ``approximate``). Zero rows give an empty output.
    """
    _dispatch.check_tensor("x", x, dtypes=_DTYPES)
    _dispatch.check_tensor("bias", bias, ndim=1, dtypes=_DTYPES)
    if x.dim() < 1 or x.shape[-1] != bias.shape[0]:
        raise ValueError(
            f"bias_gelu: bias shape {tuple(bias.shape)} does not match the last dimension of x shape {tuple(x.shape)}"
        )
    _dispatch.check_same_dtype(x=x, bias=bias)
    _dispatch.check_same_device(x=x, bias=bias)
    if approximate not in reference.GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {reference.GELU_APPROXIMATIONS}, got {approximate!r}")
    return _dispatch.call_op("bias_gelu_fwd", x, bias, approximate)
