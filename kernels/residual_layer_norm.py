"""Fused dropout + residual add + LayerNorm, forward and backward (Triton).

    h = dropout(x) + residual          dropout(x) = x * keep / (1 - p)
    y = (h - mean) * rstd * weight + bias,     mean, rstd per row in fp32 (fp64 for fp64 inputs)

Backward recomputes h from x, residual and the dropout seed (h and the mask are never stored):
    dh = rstd * (w*dy - mean(w*dy) - xhat * mean(xhat * w*dy)),   dres = dh,   dx = dh * keep / (1 - p)
    dweight = sum_rows(dy * xhat),   dbias = sum_rows(dy)
Each backward program walks a contiguous chunk of rows and writes its fp32 partial sums to
[P, N] buffers, folded by a second deterministic reduction (torch.sum over P). No atomics.

Dropout random stream (Philox4x32-10, one call per 4 elements):
    G = cdiv(N, 4);  group g = col // 4 of row ``row`` uses the int64 offset  row * G + g;
    r0, r1, r2, r3 = tl.randint4x(seed, row * G + g)      (offset computed in **int64**)
    keep[row, 4g + j] = tl.uint_to_uniform_float(r_j) >= p,   j = 0..3 (word j -> column 4g + j).
``tl.randint4x`` with an int64 offset feeds Philox4x32-10 the counter (lo32(offset), hi32(offset),
0, 0) and the 64-bit key ``seed`` (triton/language/random.py), so every group of 4 elements has
its own counter, also past 2^32 groups: no int32 wrap-around, no repeated masks for big tensors.
Using all four output words costs a quarter of ``tl.rand``'s one Philox per element (~40 SASS
instructions, 20 of them half-rate IMAD.WIDE), which benchmarks/notes/2026-11-21-gpu-kernels.md predicted would make the
dropout LN compute-bound at BERT shapes. The four words
are interleaved back into columns with ``tl.join`` + ``tl.reshape`` (tiles start at a multiple of
4 columns and have BLOCK_N >= 4, a power of 2). The mask depends only on
(seed, row, col, N), never on block sizes, tiles, strides or the number of programs, so forward,
backward and the debug helper ``dropout_keep_mask`` agree bit for bit, and
torch.utils.checkpoint (which redraws the same seed) recomputes the same mask.

Any hidden size: BLOCK_N = max(4, next_power_of_2(N)) with masked loads; int64 row offsets; rows
may have any stride (the last dimension must be contiguous; the launcher copies otherwise).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ._device import num_sms

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
MAX_HIDDEN = 65536


@triton.jit
def _dropout_keep(seed, rows, col0, N, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep-mask [BLOCK_M, BLOCK_N] of rows ``rows`` (int64) and columns col0 .. col0 + BLOCK_N - 1
    (col0 a multiple of 4, BLOCK_N a multiple of 4): one Philox4x32-10 per group of 4 columns at
    int64 offset row * cdiv(N, 4) + col // 4, its words r0..r3 -> columns 4g+0..4g+3, u >= p."""
    tl.static_assert(BLOCK_N % 4 == 0, "BLOCK_N must be a multiple of 4")
    groups = col0 // 4 + tl.arange(0, BLOCK_N // 4)
    offsets = rows[:, None] * ((N + 3) // 4) + groups[None, :]  # rows is int64 -> offsets int64
    r0, r1, r2, r3 = tl.randint4x(seed, offsets)
    k0 = (tl.uint_to_uniform_float(r0) >= dropout_p).to(tl.int8)
    k1 = (tl.uint_to_uniform_float(r1) >= dropout_p).to(tl.int8)
    k2 = (tl.uint_to_uniform_float(r2) >= dropout_p).to(tl.int8)
    k3 = (tl.uint_to_uniform_float(r3) >= dropout_p).to(tl.int8)
    # join(a, b)[..., 0] = a, [..., 1] = b, so [m, g, i, j] = k_(2i + j); the row-major reshape
    # sends (g, i, j) to column col0 + 4g + 2i + j: word j -> column 4g + j.
    keep = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), [BLOCK_M, BLOCK_N])
    return keep != 0


@triton.jit
def _residual_layer_norm_fwd_kernel(
    X,
    R,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    M,
    N,
    stride_xm,
    stride_rm,
    stride_ym,
    eps,
    dropout_p,
    dropout_scale,
    seed,
    HAS_DROPOUT: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, rows, 0, N, dropout_p, BLOCK_M, BLOCK_N)
        x = tl.where(keep, x * dropout_scale, 0.0)
    _layer_norm_store(x + r, rows, cols, rmask, cmask, W, B, Y, MEAN, RSTD, N, stride_ym, eps, COMPUTE)


@triton.jit
def _layer_norm_store(h, rows, cols, rmask, cmask, W, B, Y, MEAN, RSTD, N, stride_ym, eps, COMPUTE: tl.constexpr):
    """Y[rows] = LayerNorm(h) * W + B over the N columns (h [BLOCK_M, BLOCK_N], zero where masked),
    and each row's mean and rstd."""
    mask = rmask[:, None] & cmask[None, :]
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
def _partials_residual_layer_norm_kernel(
    P,
    XB,
    R,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    M,
    N,
    stride_rm,
    stride_ym,
    eps,
    SLICES: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Y = LayerNorm(sum_s P[s] + XB + R) * W + B: the epilogue of a split-K GEMM (P: its SLICES fp32
    partials [SLICES, M, N], contiguous, summed in slice order; XB: its bias [N]) with the residual
    add and the LayerNorm of a BERT output projection (inference: no dropout)."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * N + cols[None, :]
    x = tl.load(P + offs, mask=mask, other=0.0).to(COMPUTE)
    for s in tl.static_range(1, SLICES):
        x += tl.load(P + s * tl.cast(M, tl.int64) * N + offs, mask=mask, other=0.0).to(COMPUTE)
    x += tl.load(XB + cols, mask=cmask, other=0.0).to(COMPUTE)[None, :]
    r = tl.load(R + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    _layer_norm_store(x + r, rows, cols, rmask, cmask, W, B, Y, MEAN, RSTD, N, stride_ym, eps, COMPUTE)


@triton.jit
def _residual_layer_norm_bwd_kernel(
    DY,
    X,
    R,
    W,
    MEAN,
    RSTD,
    DX,
    DRES,
    DW_PARTIAL,
    DB_PARTIAL,
    M,
    N,
    stride_dym,
    stride_xm,
    stride_rm,
    stride_dxm,
    stride_drm,
    dropout_p,
    dropout_scale,
    seed,
    rows_per_prog,
    n_iters,
    HAS_DROPOUT: tl.constexpr,
    COMPUTE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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
            keep = _dropout_keep(seed, rows, 0, N, dropout_p, BLOCK_M, BLOCK_N)
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
def _dropout_keep_mask_kernel(OUT, M, N, row_start, dropout_p, seed, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Debug: OUT[i, j] = keep-mask of row (row_start + i), column j, exactly as the kernels draw it."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (local < M)[:, None] & (cols < N)[None, :]
    keep = _dropout_keep(seed, local + row_start, pid_n * BLOCK_N, N, dropout_p, BLOCK_M, BLOCK_N)
    tl.store(OUT + local[:, None] * N + cols[None, :], keep.to(tl.int8), mask=mask)


# ----------------------------------------------------------------------------- launchers
def _compute(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _config(n: int):
    """(BLOCK_M, BLOCK_N, num_warps): whole rows, ~4096-element tiles (several rows when N is small).
    BLOCK_N >= 4: the dropout stream draws whole groups of 4 columns."""
    block_n = max(4, triton.next_power_of_2(n))
    block_m = max(1, min(16, 4096 // block_n))
    tile = block_m * block_n
    num_warps = 4 if tile <= 2048 else (8 if tile <= 8192 else 16)
    return block_m, block_n, num_warps


def _row_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(1) == 1 else t.contiguous()


def _check_2d(x2d, res2d, weight, bias, extra=()):
    if x2d.dim() != 2 or res2d.shape != x2d.shape:
        raise ValueError(
            f"residual_layer_norm: x2d {tuple(x2d.shape)} and res2d {tuple(res2d.shape)} must be equal 2-D shapes"
        )
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
            raise TypeError(
                f"residual_layer_norm: {name} is {t.dtype} on {t.device}, expected {x2d.dtype} on {x2d.device}"
            )


def _dropout_args(dropout_p: float, seed: int):
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    has = dropout_p > 0.0
    return has, float(dropout_p), (1.0 / (1.0 - dropout_p) if has else 1.0), int(seed) if has else 0


def _fwd_outputs(like: torch.Tensor):
    """A forward's outputs for rows like ``like`` [M, N]: y [M, N] in its dtype, mean and rstd [M]
    (fp32; fp64 for fp64). Left unfilled: every program stores all three for each of its rows
    (_layer_norm_store), and zero-filling mean and rstd cost two launches per call (48 of the 150
    kernels of a graphed bert-base 1 x 128 forward on the H200, 41 us of its 470)."""
    M, N = like.shape
    stat = dict(dtype=_stat_dtype(like.dtype), device=like.device)
    return torch.empty((M, N), dtype=like.dtype, device=like.device), torch.empty(M, **stat), torch.empty(M, **stat)


def residual_layer_norm_fwd(
    x2d: torch.Tensor,
    res2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout_p: float,
    seed: int,
):
    """(y, mean, rstd): y = LayerNorm(dropout(x2d) + res2d) contiguous [M, N] in x2d.dtype; mean, rstd [M]
    fp32 (fp64 for fp64 inputs). ``seed``: int, the Philox key (ignored when dropout_p == 0)."""
    _check_2d(x2d, res2d, weight, bias)
    has_dropout, p, scale, seed = _dropout_args(dropout_p, seed)
    M, N = x2d.shape
    y, mean, rstd = _fwd_outputs(x2d)
    if M == 0 or N == 0:
        return y, mean, rstd
    x2d, res2d = _row_contiguous(x2d), _row_contiguous(res2d)
    weight, bias = weight.contiguous(), bias.contiguous()
    block_m, block_n, num_warps = _config(N)
    _residual_layer_norm_fwd_kernel[(triton.cdiv(M, block_m),)](
        x2d,
        res2d,
        weight,
        bias,
        y,
        mean,
        rstd,
        M,
        N,
        x2d.stride(0),
        res2d.stride(0),
        y.stride(0),
        float(eps),
        p,
        scale,
        seed,
        HAS_DROPOUT=has_dropout,
        COMPUTE=_compute(x2d.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, mean, rstd


def partials_residual_layer_norm_fwd(part, x_bias, res2d, weight, bias, eps: float):
    """(y, mean, rstd): y = LayerNorm(part.sum(0) + x_bias + res2d) for a split-K GEMM's fp32
    partials ``part`` [S, M, N] and its bias ``x_bias`` [N] (kernels/linear.py, linear_fwd_partials);
    y contiguous [M, N] in res2d's dtype, mean and rstd [M] fp32 (fp64 for fp64)."""
    _check_2d(res2d, res2d, weight, bias, extra=(("x_bias", x_bias),))
    S, M, N = part.shape
    if (M, N) != tuple(res2d.shape) or tuple(x_bias.shape) != (N,) or not part.is_contiguous():
        raise ValueError(f"partials {tuple(part.shape)} must be contiguous [S, M, N] over res2d {tuple(res2d.shape)}")
    y, mean, rstd = _fwd_outputs(res2d)
    if M == 0 or N == 0:
        return y, mean, rstd
    res2d = _row_contiguous(res2d)
    block_m, block_n, num_warps = _config(N)
    _partials_residual_layer_norm_kernel[(triton.cdiv(M, block_m),)](
        part,
        x_bias.contiguous(),
        res2d,
        weight.contiguous(),
        bias.contiguous(),
        y,
        mean,
        rstd,
        M,
        N,
        res2d.stride(0),
        y.stride(0),
        float(eps),
        SLICES=S,
        COMPUTE=_compute(res2d.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, mean, rstd


def _bwd_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * num_sms(device)
    return 4  # interpreter: few programs, still several partial sums


def residual_layer_norm_bwd(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    res2d: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    dropout_p: float,
    seed: int,
):
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
        dy2d,
        x2d,
        res2d,
        weight,
        mean,
        rstd,
        dx,
        dres,
        dw_partial,
        db_partial,
        M,
        N,
        dy2d.stride(0),
        x2d.stride(0),
        res2d.stride(0),
        dx.stride(0),
        dres.stride(0),
        p,
        scale,
        seed,
        rows_per_prog,
        rows_per_prog // block_m,
        HAS_DROPOUT=has_dropout,
        COMPUTE=_compute(x2d.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
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
        bn = min(max(4, triton.next_power_of_2(n)), 1024)  # a multiple of 4: whole Philox groups
        bm = max(1, min(16, 8192 // bn))
        # Triton launches on the current device: make it out's (a model on cuda:1, say)
        guard = torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext()
        with guard:
            _dropout_keep_mask_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
                out, m, n, int(row_start), float(dropout_p), int(seed), BLOCK_M=bm, BLOCK_N=bn, num_warps=8
            )
    return out.view(shape).bool()
