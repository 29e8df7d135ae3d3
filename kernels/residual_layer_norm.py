"""Fused dropout + residual add + LayerNorm, forward and backward (Triton).

    h = dropout(x) + residual          dropout(x) = x * keep / (1 - p)
    y = (h - mean) * rstd * weight + bias,     mean, rstd per row in fp32 (fp64 for fp64 inputs)

Backward recomputes h from x, residual and the dropout seed (h and the mask are never stored):
    dh = rstd * (w*dy - mean(w*dy) - xhat * mean(xhat * w*dy)),   dres = dh,   dx = dh * keep / (1 - p)
    dweight = sum_rows(dy * xhat),   dbias = sum_rows(dy)
Each backward program walks a contiguous chunk of rows and writes its fp32 partial sums to
[P, N] buffers, folded by a second deterministic reduction (torch.sum over P). No atomics.

Dropout random stream (Philox, Triton's ``tl.rand``):
    u[row, col] = tl.rand(seed, row * N + col)   with the offset computed in **int64**;
    keep = u >= p.
``tl.rand`` with an int64 offset feeds Philox4x32-10 the counter (lo32(offset), hi32(offset), 0, 0)
and the 64-bit key ``seed`` (triton/language/random.py, randint4x), so every element of a tensor
with up to 2^64 elements has its own counter: no int32 wrap-around, no repeated masks for big
tensors. The mask depends only on (seed, row, col, N), never on block sizes, strides or the
number of programs, so forward, backward and the debug helper ``dropout_keep_mask`` agree bit for
bit, and torch.utils.checkpoint (which redraws the same seed) recomputes the same mask.

Any hidden size: BLOCK_N = next_power_of_2(N) with masked loads; int64 row offsets; rows may have
any stride (the last dimension must be contiguous; the launcher copies otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_HIDDEN = 65536


@triton.jit
def _dropout_keep(seed, rows, cols, N, dropout_p):
    """Keep-mask of the rows x cols tile: Philox uniform at int64 offset row * N + col, >= p."""
    offsets = rows[:, None] * N + cols[None, :]          # rows is int64 -> offsets int64
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _residual_layer_norm_fwd_kernel(X, R, W, B, Y, MEAN, RSTD, M, N,
                                    stride_xm, stride_rm, stride_ym, eps, dropout_p, dropout_scale, seed,
                                    HAS_DROPOUT: tl.constexpr, COMPUTE: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, rows, cols, N, dropout_p)
        x = tl.where(keep, x * dropout_scale, 0.0)
    h = x + r
    mean = tl.sum(h, axis=1) / N
    d = tl.where(mask, h - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(COMPUTE)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(COMPUTE)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean.to(MEAN.dtype.element_ty), mask=rmask)
    tl.store(RSTD + rows, rstd.to(RSTD.dtype.element_ty), mask=rmask)


@triton.jit
def _residual_layer_norm_bwd_kernel(DY, X, R, W, MEAN, RSTD, DX, DRES, DW_PARTIAL, DB_PARTIAL, M, N,
                                    stride_dym, stride_xm, stride_rm, stride_dxm, stride_drm,
                                    dropout_p, dropout_scale, seed, rows_per_prog, n_iters,
                                    HAS_DROPOUT: tl.constexpr, COMPUTE: tl.constexpr,
                                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(COMPUTE)
    dw_acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    db_acc = tl.zeros([BLOCK_N], dtype=COMPUTE)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, M)
    # while, not `for i in range(n_iters)`: Triton 3.6's interpreter cannot use a runtime scalar
    # as a range bound under numpy 2.x; the compiled loop is equivalent.
    i = 0
    while i < n_iters:
        rows = row_start + i * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(DY + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0).to(COMPUTE)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0).to(COMPUTE)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, rows, cols, N, dropout_p)
            x = tl.where(keep, x * dropout_scale, 0.0)
        xhat = tl.where(mask, (x + r - mean[:, None]) * rstd[:, None], 0.0)
        wdy = tl.where(mask, w[None, :] * dy, 0.0)
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dh = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        tl.store(DRES + rows[:, None] * stride_drm + cols[None, :], dh.to(DRES.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            dx = tl.where(keep, dh * dropout_scale, 0.0)
        else:
            dx = dh
        tl.store(DX + rows[:, None] * stride_dxm + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += tl.sum(dy * xhat, axis=0)
        db_acc += tl.sum(dy, axis=0)
        i += 1
    tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=cmask)
    tl.store(DB_PARTIAL + pid * N + cols, db_acc, mask=cmask)


@triton.jit
def _dropout_keep_mask_kernel(OUT, M, N, row_start, dropout_p, seed,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Debug: OUT[i, j] = keep-mask of row (row_start + i), column j, exactly as the kernels draw it."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (local < M)[:, None] & (cols < N)[None, :]
    keep = _dropout_keep(seed, local + row_start, cols, N, dropout_p)
    tl.store(OUT + local[:, None] * N + cols[None, :], keep.to(tl.int8), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _compute(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _config(n: int):
    """(BLOCK_M, BLOCK_N, num_warps): whole rows, ~4096-element tiles (several rows when N is small)."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, min(16, 4096 // block_n))
    tile = block_m * block_n
    num_warps = 4 if tile <= 2048 else (8 if tile <= 8192 else 16)
    return block_m, block_n, num_warps


def _row_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _check_2d(x2d, res2d, weight, bias, extra=()):
    if x2d.dim() != 2 or res2d.shape != x2d.shape:
        raise ValueError(f"residual_layer_norm: x2d {tuple(x2d.shape)} and res2d {tuple(res2d.shape)} must be "
                         "equal 2-D shapes")
    n = x2d.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (n,):
            raise ValueError(f"residual_layer_norm: {name} {tuple(t.shape)} must be ({n},)")
    if n > MAX_HIDDEN:
        raise ValueError(f"residual_layer_norm: hidden size {n} > {MAX_HIDDEN} (whole rows live in registers)")
    if x2d.dtype not in _SUPPORTED:
        raise TypeError(f"residual_layer_norm: unsupported dtype {x2d.dtype}")
    for name, t in (("res2d", res2d), ("weight", weight), ("bias", bias)) + tuple(extra):
        if t.dtype != x2d.dtype or t.device != x2d.device:
            raise TypeError(f"residual_layer_norm: {name} is {t.dtype} on {t.device}, "
                            f"expected {x2d.dtype} on {x2d.device}")


def _dropout_args(dropout_p: float, seed: int):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    has = dropout_p > 0.0
    return has, float(dropout_p), (1.0 / (1.0 - dropout_p) if has else 1.0), int(seed) if has else 0


def residual_layer_norm_fwd(x2d: torch.Tensor, res2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            eps: float, dropout_p: float, seed: int):
    """(y, mean, rstd): y = LayerNorm(dropout(x2d) + res2d) contiguous [M, N] in x2d.dtype; mean, rstd [M]
    fp32 (fp64 for fp64 inputs). ``seed``: int, the Philox key (ignored when dropout_p == 0)."""
    _check_2d(x2d, res2d, weight, bias)
    has_dropout, p, scale, seed = _dropout_args(dropout_p, seed)
    M, N = x2d.shape
    y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    mean = torch.zeros((M,), dtype=_stat_dtype(x2d.dtype), device=x2d.device)
    rstd = torch.zeros((M,), dtype=_stat_dtype(x2d.dtype), device=x2d.device)
    if M == 0 or N == 0:
        return y, mean, rstd
    x2d, res2d = _row_contiguous(x2d), _row_contiguous(res2d)
    weight, bias = weight.contiguous(), bias.contiguous()
    block_m, block_n, num_warps = _config(N)
    _residual_layer_norm_fwd_kernel[(triton.cdiv(M, block_m),)](
        x2d, res2d, weight, bias, y, mean, rstd, M, N, x2d.stride(0), res2d.stride(0), y.stride(0),
        float(eps), p, scale, seed,
        HAS_DROPOUT=has_dropout, COMPUTE=_compute(x2d.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps)
    return y, mean, rstd


def _bwd_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4   # interpreter: few programs, still several partial sums


def residual_layer_norm_bwd(dy2d: torch.Tensor, x2d: torch.Tensor, res2d: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                            dropout_p: float, seed: int):
    """(dx, dres, dweight, dbias) of residual_layer_norm_fwd. dx/dres contiguous [M, N]; dweight/dbias
    [N] in weight.dtype, reduced deterministically from per-program fp32 partials [P, N]."""
    _check_2d(x2d, res2d, weight, bias, extra=(("dy2d", dy2d),))
    if dy2d.shape != x2d.shape:
        raise ValueError(f"residual_layer_norm_bwd: dy2d {tuple(dy2d.shape)} != x2d {tuple(x2d.shape)}")
    M, N = x2d.shape
    if mean.shape != (M,) or rstd.shape != (M,):
        raise ValueError(f"residual_layer_norm_bwd: mean {tuple(mean.shape)} / rstd {tuple(rstd.shape)} must be ({M},)")
    has_dropout, p, scale, seed = _dropout_args(dropout_p, seed)
    dx = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    dres = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if M == 0 or N == 0:
        return dx, dres, torch.zeros_like(weight), torch.zeros_like(bias)
    dy2d, x2d, res2d = _row_contiguous(dy2d), _row_contiguous(x2d), _row_contiguous(res2d)
    weight = weight.contiguous()
    mean, rstd = mean.contiguous(), rstd.contiguous()
    block_m, block_n, num_warps = _config(N)
    n_progs = max(1, min(triton.cdiv(M, block_m), _bwd_programs(x2d.device)))
    rows_per_prog = triton.cdiv(triton.cdiv(M, n_progs), block_m) * block_m
    n_progs = triton.cdiv(M, rows_per_prog)
    acc = _stat_dtype(x2d.dtype)
    dw_partial = torch.empty((n_progs, N), dtype=acc, device=x2d.device)
    db_partial = torch.empty((n_progs, N), dtype=acc, device=x2d.device)
    _residual_layer_norm_bwd_kernel[(n_progs,)](
        dy2d, x2d, res2d, weight, mean, rstd, dx, dres, dw_partial, db_partial, M, N,
        dy2d.stride(0), x2d.stride(0), res2d.stride(0), dx.stride(0), dres.stride(0),
        p, scale, seed, rows_per_prog, rows_per_prog // block_m,
        HAS_DROPOUT=has_dropout, COMPUTE=_compute(x2d.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps)
    return dx, dres, dw_partial.sum(dim=0).to(weight.dtype), db_partial.sum(dim=0).to(bias.dtype)


def dropout_keep_mask(shape, dropout_p: float, seed: int, device, row_start: int = 0) -> torch.Tensor:
    """Debug/tests: the exact bool keep-mask the kernels draw for a [..., N] tensor of ``shape``
    (rows flattened), with (seed, p). ``row_start`` shifts the row index (to probe offsets past
    2^32 without allocating such a tensor)."""
    shape = tuple(int(s) for s in shape)
    n = shape[-1] if shape else 1
    m = 1
    for s in shape[:-1]:
        m *= s
    out = torch.empty((m, n), dtype=torch.int8, device=device)
    if m and n:
        # <= 8x1024 tiles on 8 warps: Philox is register-hungry (a 16x1024 tile on 4 warps spills
        # over 1 KB a thread on sm_80/sm_90). The mask does not depend on the tile.
        bn = min(triton.next_power_of_2(n), 1024)
        bm = max(1, min(16, 8192 // bn))
        _dropout_keep_mask_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            out, m, n, int(row_start), float(dropout_p), int(seed), BLOCK_M=bm, BLOCK_N=bn,
            num_warps=8)
    return out.view(shape).bool()
