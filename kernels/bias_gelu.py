"""Fused bias + GELU, forward and backward (Triton).

    y  = gelu(x + b)                       approximate "none" (erf) or "tanh"
    dx = dy * gelu'(x + b),  db = sum_rows(dx)

Memory-bound: the forward reads x once (bias once per tile, from L2), writes y once; the backward
reads dy and x once, writes dx once, plus a tiny [row_programs, N] fp32 partial-sum buffer for db
which a second, deterministic reduction (torch.sum over dim 0) folds. No atomics anywhere.

Math is fp32 inside (fp64 when the inputs are fp64, for gradcheck); loads/stores in the input dtype.
Rows may be strided (any row stride); the last dimension must be contiguous (the launcher copies
otherwise). Offsets are int64 (program ids are cast before multiplying by strides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import num_sms

APPROXIMATIONS = ("none", "tanh")

# Constants of the GELU formulas are literals inside the @triton.jit functions below (so are
# linear.py's): the compiler (unlike the interpreter) rejects plain-Python-float globals inside a
# kernel ("Cannot access global variable ... from within @jit'ed function").
#   0.7071067811865476 = 1/sqrt(2),  0.3989422804014327 = 1/sqrt(2*pi),
#   0.7978845608028654 = sqrt(2/pi), 0.044715 = the tanh approximation's cubic coefficient

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@triton.jit
def _sigmoid_pair(v):
    """(sigmoid(v), sigmoid(-v)), both without cancellation or overflow (one exp)."""
    e = tl.exp(-tl.abs(v))
    big = 1.0 / (1.0 + e)
    small = e * big
    pos = v >= 0
    return tl.where(pos, big, small), tl.where(pos, small, big)


@triton.jit
def _gelu(z, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no 1 + tanh cancellation for negative z.
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        s, _ = _sigmoid_pair(2.0 * u)
        y = z * s
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    return y


@triton.jit
def _gelu_grad(z, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        # d/dz [z * s(2u)] = s + z * 2 s (1 - s) * u';  1 - tanh^2 = 4 s (1 - s), both factors exact-ish
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        s, ns = _sigmoid_pair(2.0 * u)
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        g = s + 2.0 * z * s * ns * du
    else:
        g = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    return g


@triton.jit
def _bias_gelu_fwd_kernel(
    X,
    B,
    Y,
    M,
    N,
    stride_xm,
    stride_ym,
    APPROX_TANH: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = (rows < M)[:, None] & cmask[None, :]
    b = tl.load(B + cols, mask=cmask, other=0.0).to(COMPUTE)
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    y = _gelu(x + b[None, :], APPROX_TANH)
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY,
    X,
    B,
    DX,
    DB_PARTIAL,
    M,
    N,
    stride_dym,
    stride_xm,
    stride_dxm,
    rows_per_prog,
    n_iters,
    APPROX_TANH: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # program (pid_m, pid_n): rows [pid_m * rows_per_prog, +rows_per_prog) x columns block pid_n;
    # db partial of that row range goes to DB_PARTIAL[pid_m, cols] (fp32 / fp64).
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    b = tl.load(B + cols, mask=cmask, other=0.0).to(COMPUTE)
    row_start = pid_m * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    # A while loop, not `for i in range(n_iters)`: Triton 3.6's interpreter cannot take a runtime
    # scalar as a range bound under numpy 2.x (int() of a 1-element array); compiled code is the same.
    i = 0
    while i < n_iters:
        rows = row_start + i * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < row_end)[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        dx = dy * _gelu_grad(x + b[None, :], APPROX_TANH)
        dx = tl.where(mask, dx, 0.0)
        tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        acc += tl.sum(dx, axis=0)
        i += 1
    tl.store(DB_PARTIAL + pid_m * N + cols, acc, mask=cmask)


# ----------------------------------------------------------------------------- launchers
def _compute_dtype(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _tile(n: int):
    """(BLOCK_M, BLOCK_N, num_warps): ~4096-element tiles, columns up to 1024 wide."""
    block_n = min(triton.next_power_of_2(max(n, 1)), 1024)
    block_m = max(1, 4096 // block_n)
    num_warps = 8 if block_m * block_n >= 4096 else 4
    return block_m, block_n, num_warps


def _row_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _check(name: str, t: torch.Tensor, ref: torch.Tensor | None = None) -> None:
    if t.dtype not in _SUPPORTED:
        raise TypeError(f"bias_gelu: {name} has unsupported dtype {t.dtype}")
    if ref is not None and (t.dtype != ref.dtype or t.device != ref.device):
        raise TypeError(f"bias_gelu: {name} is {t.dtype} on {t.device}, expected {ref.dtype} on {ref.device}")


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * num_sms(device)
    return 8  # interpreter: few programs, but still more than one partial sum


def bias_gelu_fwd(x2d: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    """y = gelu(x2d + bias) for x2d [M, N] (any row stride), bias [N]; y is contiguous [M, N]."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x2d.dim() != 2 or bias.dim() != 1 or bias.shape[0] != x2d.shape[1]:
        raise ValueError(f"bias_gelu: x2d {tuple(x2d.shape)} and bias {tuple(bias.shape)} do not match")
    _check("x2d", x2d)
    _check("bias", bias, x2d)
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if M == 0 or N == 0:
        return y
    x2d = _row_contiguous(x2d)
    bias = bias.contiguous()
    block_m, block_n, num_warps = _tile(N)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _bias_gelu_fwd_kernel[grid](
        x2d,
        bias,
        y,
        M,
        N,
        x2d.stride(0),
        y.stride(0),
        APPROX_TANH=approximate == "tanh",
        COMPUTE=_compute_dtype(x2d.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y


def bias_gelu_bwd(dy2d: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor, approximate: str):
    """(dx, dbias) of y = gelu(x2d + bias) given dy2d; dx contiguous [M, N], dbias [N] in bias.dtype.

    dbias is reduced deterministically: per-program fp32 partials [P, N], then torch.sum over P.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if x2d.dim() != 2 or dy2d.shape != x2d.shape or bias.dim() != 1 or bias.shape[0] != x2d.shape[1]:
        raise ValueError(
            f"bias_gelu_bwd: dy2d {tuple(dy2d.shape)}, x2d {tuple(x2d.shape)} and bias {tuple(bias.shape)} do not match"
        )
    _check("x2d", x2d)
    _check("dy2d", dy2d, x2d)
    _check("bias", bias, x2d)
    M, N = x2d.shape
    dx = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if M == 0 or N == 0:
        return dx, torch.zeros_like(bias)
    x2d = _row_contiguous(x2d)
    dy2d = _row_contiguous(dy2d)
    bias = bias.contiguous()
    block_m, block_n, num_warps = _tile(N)
    n_col = triton.cdiv(N, block_n)
    n_row_progs = max(1, min(triton.cdiv(M, block_m), _target_programs(x2d.device) // n_col))
    rows_per_prog = triton.cdiv(triton.cdiv(M, n_row_progs), block_m) * block_m
    n_row_progs = triton.cdiv(M, rows_per_prog)
    acc_dtype = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    partial = torch.empty((n_row_progs, N), dtype=acc_dtype, device=x2d.device)
    _bias_gelu_bwd_kernel[(n_row_progs, n_col)](
        dy2d,
        x2d,
        bias,
        dx,
        partial,
        M,
        N,
        dy2d.stride(0),
        x2d.stride(0),
        dx.stride(0),
        rows_per_prog,
        rows_per_prog // block_m,
        APPROX_TANH=approximate == "tanh",
        COMPUTE=_compute_dtype(x2d.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    dbias = partial.sum(dim=0).to(bias.dtype)
    return dx, dbias
