"""Triton kernels of ``linear``: y = act(x @ W^T + b) and its backward.

Kernels
  _linear_fwd_kernel       tiled GEMM C = A @ B with fp32 accumulation and a fused epilogue
                           (+ bias, GELU erf / tanh, optional store of the pre-activation z).
                           A and B are read through arbitrary strides, so the same kernel computes
                             forward  y  = x  @ W^T   (B = W read as [K, N] by strides)
                             backward dX = dZ @ W
                             backward dW = dZ^T @ X   (A = dZ read transposed by strides, no copy)
                           On sm_90+ (fp16/bf16, TMA-readable operands) linear_tma.py's TMA /
                           persistent kernel computes the same three products instead.
  _linear_bwd_kernel       dZ = dY * act'(z) (the GELU derivative, fused, fp32 math) and per-row-block
                           partial column sums of dZ (fp32) for db
  _linear_bwd_db_kernel    second pass: db[n] = sum over row blocks of the partials (fp32). Two
                           passes and no atomics: db is bitwise deterministic.

Launchers (check shapes/strides/dtypes, pick configs, nothing else):
  linear_fwd(x2d, weight, bias, activation, save_z) -> (y, z or None)
  linear_bwd_dz(dy, z, activation, need_dz, need_db) -> (dz or None, db fp32 or None)
  gemm(a, b, out_dtype) -> a @ b           (any strides of a and b)

Precision. Accumulation is always fp32. For fp32 inputs ``tl.dot`` runs with
input_precision="ieee" (true fp32, parity with torch's default fp32 matmul) unless torch's
``torch.backends.cuda.matmul.allow_tf32`` is set, in which case "tf32" (what torch itself would
use then). fp16/bf16 inputs use the tensor cores' native precision with fp32 accumulate. The
interpreter also accepts fp64 (used by gradcheck on the CPU).

Tiling. Programs are ordered in groups of GROUP_M row-tiles (Triton tutorial 03's "grouped"
ordering): consecutive programs share the same B column-panel and a few A row-panels, which keeps
them in L2. Offsets are int64 (program ids are cast before multiplying by strides). Every load and
store is masked, so any M, N, K works; a heuristic drops the K mask when K % BLOCK_K == 0.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import linear_tma
from ._device import interpreting as _interpreting
from ._device import loop_bound
from ._linear_common import (  # noqa: F401
    KIND_DW,
    KIND_DX,
    KIND_FWD,
    KIND_OTHER,
    GemmCall,
    _act_fwd,
    _column_halves,
    _column_slabs,
    _dot_acc,
    _prune_configs,
    _tanh,
    _tile_coords,
)

ACT_NONE, ACT_GELU, ACT_GELU_TANH = 0, 1, 2
_ACT_CODES = {None: ACT_NONE, "none": ACT_NONE, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH}


# ----------------------------------------------------------------------------- configs
def _cfg(bm, bn, bk, warps, stages, group=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}, num_warps=warps, num_stages=stages
    )


def _gemm_configs():
    """Autotune space. In the interpreter: one config (autotuning would take forever there).

    Hopper (sm90) configs use BLOCK_K=64 and 3-4 stages (228 KB shared memory: 128x256x64 bf16 at
    3 stages is 144 KB); Ampere (sm80, 164 KB) favours BLOCK_K=32 with more stages. Configs that do
    not fit (e.g. fp32 inputs at 128x256) fail to compile with OutOfResources, which the autotuner
    treats as infinitely slow. Both lists are given on every GPU (the autotuner picks by
    measurement); early pruning removes tiles far larger than a small M.
    """
    if _interpreting():
        return [_cfg(32, 64, 64, 4, 1)]
    if os.environ.get("BERT_FAST_AUTOTUNE", "1") == "0":
        # One config that compiles everywhere (fp32 too: 72 KB of shared memory at 3 stages), for
        # runs that visit many shapes once (the CUDA test suite), where tuning 17 configs per shape
        # would cost more than the tests themselves.
        return [_cfg(64, 128, 32, 4, 3)]
    hopper = [
        _cfg(128, 256, 64, 8, 3),
        _cfg(256, 128, 64, 8, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 4, 4),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 64, 4, 4),
    ]
    ampere = [
        _cfg(128, 256, 32, 8, 3),
        _cfg(256, 128, 32, 8, 3),
        _cfg(128, 128, 32, 4, 4),
        _cfg(128, 64, 32, 4, 4),
        _cfg(64, 128, 32, 4, 4),
        _cfg(64, 32, 32, 4, 5),
        _cfg(32, 64, 32, 2, 5),
    ]
    small_m = [_cfg(16, 64, 128, 4, 4), _cfg(16, 128, 64, 4, 4), _cfg(32, 128, 64, 4, 4)]
    return hopper + ampere + small_m


def m_bucket(m: int, cap: int = 16384) -> int:
    """Next power of two of M, in [16, cap]: the autotune / dispatch-table key of M."""
    b = 16
    while b < m and b < cap:
        b *= 2
    return b


# ----------------------------------------------------------------------------- activations
@triton.jit
def _act_grad(z, ACTIVATION: tl.constexpr):
    """d act / dz at z (fp32)."""
    if ACTIVATION == 1:  # Phi(z) + z phi(z)
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        pdf = tl.exp(-0.5 * z * z) * 0.3989422804014327
        return cdf + z * pdf
    elif ACTIVATION == 2:
        z2 = z * z
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z2 * z))
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z2)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    else:
        return tl.full(z.shape, 1.0, z.dtype)


# ----------------------------------------------------------------------------- GEMM (+ epilogue)
@triton.jit
def _gemm_step(
    acc,
    a_ptrs,
    b_ptrs,
    k,
    K,
    mask_m,
    mask_n,
    offs_k,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One BLOCK_K slice of the main loop: masked loads of an A and a B tile, acc += A @ B."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
    else:
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
    return _dot_acc(a, b, acc, DOT_PRECISION)


# Autotune key: M bucketed (M is the token count T, which changes every batch), N, K and the GEMM
# kind. For the weight gradient (KIND_DW) K is the token count, so it is bucketed too
# (K_BUCKET): keyed on the raw K, every new batch size T would re-benchmark all configs.
# cache_results: the winners are also kept in Triton's cache directory, so the next process on the
# machine (the next benchmark stage, the next training run) skips the sweep.
@triton.autotune(
    configs=_gemm_configs(),
    key=["M_BUCKET", "N", "K_BUCKET", "KIND"],
    prune_configs_by={"early_config_prune": _prune_configs},
    cache_results=True,
)
@triton.heuristics(
    {
        "EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
        "EPILOGUE_SPLIT": lambda args: (
            2 if (args["BLOCK_N"] >= 128 and (args["ACTIVATION"] != 0 or args["SAVE_Z"])) else 1
        ),
    }
)
@triton.jit
def _linear_fwd_kernel(
    A,
    B,
    BIAS,
    Y,
    Z,
    M,
    N,
    K,
    M_BUCKET,
    K_BUCKET,
    KIND,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_ym,
    stride_yn,
    stride_zm,
    stride_zn,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_Z: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):
    """Y[M, N] = act(A[M, K] @ B[K, N] + BIAS[N]); Z = A @ B + BIAS (pre-activation) if SAVE_Z."""
    pid_m, pid_n = _tile_coords(tl.program_id(0).to(tl.int64), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    num_k = tl.cdiv(K, BLOCK_K)
    # fp32 "ieee" dots run on the FMA units, and tl.dot(a, b, acc) continues one FMA chain per
    # output element: carried through the whole K loop, every output was a sequential sum of K
    # products, whose rounding grows like sqrt(K). cuBLAS (split-K / blocked reductions) is ~6x more
    # accurate at K = 1000-3000: on an H200 dX and y failed the 2x rule there (tests/ops/test_linear.py,
    # e.g. 7.3e-6 vs 2 x 1.35e-6 + 3.2e-6 at K = 1152). So the "ieee" path sums IEEE_STEPS slices of
    # BLOCK_K (128 values of K) into a fresh partial and adds the partials: chains of 128, then of
    # K / 128 (about 4x less error at K = 1000, 6x at K = 3000), one tile add per 128 values of K.
    # (Not `acc += tl.dot(a, b)` per slice: Triton's CombineDotAddFPattern folds that back into
    # tl.dot(a, b, acc); the partial leaves an inner loop, which it cannot fold.) Tensor-core
    # precisions ("native", "tf32") keep the flat loop: their MMAs accumulate as they must.
    IEEE_STEPS: tl.constexpr = 128 // BLOCK_K if BLOCK_K < 128 else 1
    if DOT_PRECISION == "ieee":
        for k0 in range(0, loop_bound(num_k, INTERPRET), IEEE_STEPS):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
            for k in range(k0, loop_bound(tl.minimum(k0 + IEEE_STEPS, num_k), INTERPRET)):
                part = _gemm_step(part, a_ptrs, b_ptrs, k, K, mask_m, mask_n, offs_k, BLOCK_K, EVEN_K, DOT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            acc += part
    else:
        for k in range(0, loop_bound(num_k, INTERPRET)):
            acc = _gemm_step(acc, a_ptrs, b_ptrs, k, K, mask_m, mask_n, offs_k, BLOCK_K, EVEN_K, DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

    # EPILOGUE_SPLIT = 2: the two column halves one after the other (see linear_tma._tile_epilogue:
    # the erf GELU over a whole 128x256 / 256x128 / 128x128-on-4-warps tile spills, 200-530 B of
    # stack on sm_90 and sm_80; the halves do not)
    slabs = _column_slabs(acc, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)
    outputs = (Y, Z, stride_ym, stride_yn, stride_zm, stride_zn)
    WIDTH: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
    for i in tl.static_range(EPILOGUE_SPLIT):
        n0 = pid_n * BLOCK_N + i * WIDTH
        _epilogue_store(slabs[i], BIAS, outputs, offs_m, mask_m, n0, N, HAS_BIAS, ACTIVATION, SAVE_Z, ACC_DTYPE, WIDTH)


@triton.jit
def _epilogue_store(
    acc,
    BIAS,
    outputs,
    offs_m,
    mask_m,
    n0,
    N,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """+ bias, store z (pre-activation), activation, store y for columns [n0, n0 + WIDTH);
    ``outputs`` = (Y, Z, stride_ym, stride_yn, stride_zm, stride_zn)."""
    Y, Z, stride_ym, stride_yn, stride_zm, stride_zn = outputs
    offs_n = n0 + tl.arange(0, WIDTH).to(tl.int64)
    mask_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=mask_n, other=0.0).to(ACC_DTYPE)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SAVE_Z:
        z_ptrs = Z + offs_m[:, None] * stride_zm + offs_n[None, :] * stride_zn
        tl.store(z_ptrs, acc.to(Z.dtype.element_ty), mask=mask)
    y_ptrs = Y + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, _act_fwd(acc, ACTIVATION).to(Y.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- dZ and db
@triton.jit
def _linear_bwd_kernel(
    DY,
    Z,
    DZ,
    PARTIAL,
    M,
    N,
    stride_dym,
    stride_dyn,
    stride_zm,
    stride_zn,
    stride_dzm,
    stride_dzn,
    ACTIVATION: tl.constexpr,
    WRITE_DZ: tl.constexpr,
    WRITE_DB: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """DZ = DY * act'(Z) (fp32 math); PARTIAL[pid_m, n] = sum of DZ over this program's rows (fp32)."""
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    dz = tl.load(DY + offs_m[:, None] * stride_dym + offs_n[None, :] * stride_dyn, mask=mask, other=0.0).to(ACC_DTYPE)
    if ACTIVATION != 0:
        z = tl.load(Z + offs_m[:, None] * stride_zm + offs_n[None, :] * stride_zn, mask=mask, other=0.0).to(ACC_DTYPE)
        dz = dz * _act_grad(z, ACTIVATION)
    if WRITE_DZ:
        tl.store(
            DZ + offs_m[:, None] * stride_dzm + offs_n[None, :] * stride_dzn, dz.to(DZ.dtype.element_ty), mask=mask
        )
    if WRITE_DB:
        # masked rows loaded as 0 -> contribute 0 to the column sums
        tl.store(PARTIAL + pid_m * N + offs_n, tl.sum(dz, axis=0), mask=mask_n)


@triton.jit
def _db_partial_tile(PARTIAL, r0, R, N, offs_n, mask_n, BLOCK_R: tl.constexpr):
    offs_r = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
    return tl.load(
        PARTIAL + offs_r[:, None] * N + offs_n[None, :], mask=(offs_r < R)[:, None] & mask_n[None, :], other=0.0
    )


@triton.jit
def _linear_bwd_db_kernel(PARTIAL, DB, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """DB[n] = sum_r PARTIAL[r, n] in fp32, fixed order (deterministic)."""
    pid_n = tl.program_id(0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=PARTIAL.dtype.element_ty)
    for r0 in range(0, loop_bound(R, INTERPRET), BLOCK_R):
        acc += _db_partial_tile(PARTIAL, r0, R, N, offs_n, mask_n, BLOCK_R)
    tl.store(DB + offs_n, tl.sum(acc, axis=0).to(DB.dtype.element_ty), mask=mask_n)


# ----------------------------------------------------------------------------- launchers
_DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    if dtype == torch.float64:
        return "ieee"
    return "native"


def _acc_dtype(dtype: torch.dtype):
    """fp32 accumulation / epilogue math; fp64 only for fp64 inputs (gradcheck)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in _DOT_DTYPES:
        raise TypeError(f"{name}: unsupported dtype {t.dtype}")


def _launch_gemm(a, b, y, z, bias, activation_code, kind):
    """y (and z) = epilogue(a @ b); a [M, K], b [K, N] with any strides.

    On Hopper the TMA / persistent kernel of linear_tma.py takes every call whose operands TMA can
    read (fp16/bf16, 16-byte aligned rows: all of BERT's GEMMs); this pointer kernel takes the rest.
    """
    M, K = a.shape
    N = b.shape[1]
    k_bucket = m_bucket(K) if kind == KIND_DW else K
    call = GemmCall(
        a, b, y, z, bias, activation_code, kind, m_bucket(M), k_bucket, _dot_precision(a.dtype), _acc_dtype(a.dtype)
    )
    views = linear_tma.tma_views(a, b, y)
    if views is not None:
        linear_tma.launch(*call, views)
        return
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    _linear_fwd_kernel[grid](*_pointer_kernel_args(call), **call.epilogue_meta())


def _pointer_kernel_args(call: GemmCall) -> tuple:
    """_linear_fwd_kernel's run-time arguments; y stands in for an absent bias or z (never read)."""
    a, b, y, z, bias = call.a, call.b, call.y, call.z, call.bias
    M, K = a.shape
    pointers = (a, b, bias if bias is not None else y, y, z if z is not None else y)
    sizes = (M, b.shape[1], K, call.m_bucket, call.k_bucket, call.kind)
    return (*pointers, *sizes, *a.stride(), *b.stride(), *y.stride(), *(z.stride() if z is not None else (0, 0)))


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias, activation=None, save_z: bool = False):
    """y = act(x @ weight^T + bias) for x [M, K] (any strides), weight [N, K] (any strides).

    Returns (y, z): z = x @ weight^T + bias (pre-activation) when ``save_z`` and an activation is
    set, else None. Outputs are contiguous, in x's dtype.
    """
    _check_2d("x", x)
    _check_2d("weight", weight)
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: K mismatch")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError("x, weight, bias must share one dtype")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != N):
        raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    act = _ACT_CODES[activation]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    z = torch.empty_like(y) if (save_z and act != ACT_NONE) else None
    if M == 0 or N == 0:
        return y, z
    if K == 0:  # empty reduction: the product is 0
        zz = torch.zeros_like(y) if bias is None else bias.expand(M, N).clone()
        if z is not None:
            z.copy_(zz)
        y.copy_(
            zz
            if act == ACT_NONE
            else torch.nn.functional.gelu(zz.float(), approximate="tanh" if act == ACT_GELU_TANH else "none").to(
                y.dtype
            )
        )
        return y, z
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    # B = weight^T viewed as [K, N] by strides: no copy
    _launch_gemm(x, weight.t(), y, z, bias, act, KIND_FWD)
    return y, z


def linear_fwd_partials(x: torch.Tensor, weight: torch.Tensor, split_k: int):
    """A launcher of the partial products [split_k, M, N] (fp32; fp64 for fp64) of x [M, K] @
    weight[N, K]^T over split_k K-slices, for an epilogue the next kernel applies (a GEMM at small M
    that fills the GPU: linear_tma.forward_splits): a function that runs the TMA kernel and returns
    them, or None where the TMA kernel does not take these operands (decided without a launch)."""
    _check_2d("x", x)
    _check_2d("weight", weight)
    M, K = x.shape
    N = weight.shape[0]
    part = torch.empty((split_k, M, N), device=x.device, dtype=linear_tma.partial_dtype(x.dtype))
    b = weight.t()
    views = linear_tma.tma_views(x, b, part[0])
    if views is None or M == 0 or N == 0 or K == 0:
        return None

    def run() -> torch.Tensor:
        linear_tma.partials(x, b, part, views, m_bucket(M), _dot_precision(x.dtype), _acc_dtype(x.dtype))
        return part

    return run


def gemm(a: torch.Tensor, b: torch.Tensor, kind: int = KIND_OTHER) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> contiguous [M, N] in a's dtype, any strides of a and b, fp32 accumulate."""
    _check_2d("a", a)
    _check_2d("b", b)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: a {tuple(a.shape)} and b {tuple(b.shape)} do not chain")
    if a.dtype != b.dtype:
        raise TypeError(f"gemm: dtype {a.dtype} != {b.dtype}")
    M, K = a.shape
    N = b.shape[1]
    if K == 0:
        return torch.zeros((M, N), device=a.device, dtype=a.dtype)
    y = torch.empty((M, N), device=a.device, dtype=a.dtype)
    if M == 0 or N == 0:
        return y
    _launch_gemm(a, b, y, None, None, ACT_NONE, kind)
    return y


# (BLOCK_M, BLOCK_N) of the dZ kernel and BLOCK_N of the db fold, compiled and in the interpreter
_DZ_TILES = {False: (64, 128, 128), True: (64, 64, 256)}


def linear_bwd_dz(dy: torch.Tensor, z, activation=None, need_dz: bool = True, need_db: bool = True):
    """dz = dy * act'(z) (contiguous, dy's dtype) and db = dz.sum(0) (fp32), each only if asked.

    dy and z: [M, N], any strides. Without an activation dz is dy itself (returned as is, not
    copied) and only db is computed.
    """
    _check_2d("dy", dy)
    M, N = dy.shape
    act = _ACT_CODES[activation]
    if act != ACT_NONE:
        if z is None or tuple(z.shape) != (M, N):
            raise ValueError(f"z must have shape {(M, N)} when an activation is set")
    write_dz = need_dz and act != ACT_NONE
    dz = torch.empty((M, N), device=dy.device, dtype=dy.dtype) if write_dz else None
    if not write_dz and not need_db:
        return (dy if need_dz else None), None
    BLOCK_M, BLOCK_N, FOLD_N = _DZ_TILES[_interpreting()]
    R = triton.cdiv(M, BLOCK_M)
    acc_torch = torch.float64 if dy.dtype == torch.float64 else torch.float32
    db = torch.zeros((N,), device=dy.device, dtype=acc_torch) if need_db else None
    if M > 0 and N > 0:
        partial = torch.empty((R, N), device=dy.device, dtype=acc_torch) if need_db else dy
        zz = z if act != ACT_NONE else dy
        dzz = dz if write_dz else dy
        _linear_bwd_kernel[(R, triton.cdiv(N, BLOCK_N))](
            dy,
            zz,
            dzz,
            partial,
            M,
            N,
            *dy.stride(),
            *zz.stride(),
            *dzz.stride(),
            ACTIVATION=act,
            WRITE_DZ=write_dz,
            WRITE_DB=need_db,
            ACC_DTYPE=_acc_dtype(dy.dtype),
            # 8 warps (32 elements a thread): with 4 the fp32 GELU-derivative math of a 64x128
            # tile needs more than 255 registers and spills (ptxas, sm_80 and sm_90)
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            num_warps=8,
        )
        if need_db:
            _linear_bwd_db_kernel[(triton.cdiv(N, FOLD_N),)](
                partial, db, R, N, BLOCK_R=32, BLOCK_N=FOLD_N, INTERPRET=_interpreting(), num_warps=4
            )
    if not need_dz:
        dz = None
    elif not write_dz:
        dz = dy
    return dz, db
