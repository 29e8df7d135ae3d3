"""Hopper GEMM of ``linear``: the same product and epilogue as ``_linear_fwd_kernel``, but its tiles
move through the tensor memory accelerator (TMA) and one program per SM walks many output tiles.

Why a second kernel. The pointer kernel in linear.py compiles to wgmma on sm_90, but its operands
arrive through cp.async: every thread computes addresses and masks for its share of each tile, and
each program computes exactly one output tile, so the epilogue's stores of one tile cannot overlap
the main loop of the next (benchmarks/notes/2026-11-21-gpu-kernels.md predicts it at ~65-85% of cuBLAS on H100, below
issue #3's 95% target for the fused QKV GEMM). Here
  * operands are loaded by TMA from host-built descriptors (one instruction per tile, bounds
    handled by the hardware: out-of-range rows / columns / K read as zero, so no masks at all);
  * the grid is persistent (min(#SM, #tiles) programs, tile = pid, pid + #SM, ...) and the tile loop
    is flattened with the K loop (``tl.range(flatten=True)``), so the software pipeline runs across
    tile boundaries and the next tile's loads are in flight during this tile's epilogue;
  * the epilogue (bias, GELU, optional pre-activation z) stores through TMA too;
  * the weight gradient, whose output (a weight matrix) can have fewer tiles than the GPU has SMs
    while its K (the token count) is long, is split into K-slices (``_split_k``): fp32 partials
    in a workspace, summed afterwards in a fixed order.

Layouts. As in linear.py one kernel computes the forward and both backward GEMMs, which read their
operands in different orientations. TMA needs a unit stride in the last dimension, so instead of
arbitrary strides each operand is either "as is" or stored transposed:
    forward  y  = x @ W^T   A = x  [M, K]             B = W   stored [N, K] (B_T)
    backward dX = dZ @ W    A = dZ [M, K]             B = W   [K, N]
    backward dW = dZ^T @ X  A = dZ stored [K, M] (A_T) B = X   [K, N]
wgmma reads either orientation of 16-bit operands from shared memory, so the transposes cost
nothing at run time.

When it is used: see ``tma_views``: CUDA with compute capability >= 9 and 227 KB of shared memory,
fp16/bf16, every operand with one unit stride, 16-byte aligned base and row pitch (TMA's rules) and
no overlapping rows, unless BERT_FAST_GEMM_TMA=0.
BERT_FAST_GEMM_TMA=1 also enables it in the Triton CPU interpreter (any dtype), which is how the
CPU tests run it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._device import interpreting as _interpreting
from ._device import loop_bound, smem_per_block
from ._device import num_sms as _num_sms  # (a module name: tests patch it)
from ._linear_common import KIND_DW, KIND_FWD, GemmCall, _act_fwd, _column_slabs, _dot_acc, _prune_configs, _tile_coords
from .tuned_configs import TunedConfigs

_ENV = "BERT_FAST_GEMM_TMA"


def _set_block_shapes(nargs):
    """Autotune pre-hook: a host descriptor carries its box (block) shape, which depends on the
    config being tried, so each config writes its own into the descriptors before launch."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]
    out_box = [bm, bn // nargs["EPILOGUE_SPLIT"]]
    # with SPLIT_K > 1 y_desc is the [SPLIT_K, M, N] workspace (and there is no z)
    nargs["y_desc"].block_shape = out_box if nargs["SPLIT_K"] == 1 else [1] + out_box
    if nargs["z_desc"] is not nargs["y_desc"]:
        nargs["z_desc"].block_shape = out_box


def _cfg(bm, bn, bk, warps, stages, split=1, group=8):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "EPILOGUE_SPLIT": split},
        num_warps=warps,
        num_stages=stages,
        pre_hook=_set_block_shapes,
    )


def _configs():
    """Hopper tiles (wgmma wants BLOCK_M >= 64 per warpgroup). Shared memory per config, bf16:
    stages * (BM + BN) * BK * 2 bytes for the operand ring plus the TMA store's staging box,
    BM * BN / EPILOGUE_SPLIT * 2 (offline sm_90 compile, with or without z: 128x256x64 takes
    180 KB at 3 stages, 224 KB at 4, of the 227 KB). Tiles at least 128 wide split their epilogue
    in two: with the erf GELU the whole tile at once spills (255 registers and 72-128 B of stack at
    128x256, 256x128 and 128x128 / 4 warps), the halves do not (237-251 registers, no stack), and
    the halved staging box is what lets 128x256 run 4 stages deep."""
    if _interpreting():
        return [_cfg(32, 32, 32, 4, 1, split=2)]
    if _fixed():
        # one tile per GEMM, no sweep: the large one, or at small M (see _prune) 64x64, which gives
        # BERT-base's 128-token GEMMs 24-96 tiles for 132 SMs where 128x128 gives 6-24
        return [_cfg(128, 128, 64, 8, 3, split=2), _cfg(64, 64, 64, 4, 4)]
    return [
        _cfg(128, 256, 64, 8, 4, split=2),
        _cfg(128, 256, 64, 8, 3, split=2),
        _cfg(256, 128, 64, 8, 3, split=2),
        _cfg(128, 128, 64, 8, 4, split=2),
        _cfg(128, 128, 64, 4, 4, split=2),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 128, 64, 4, 4, split=2),
        _cfg(64, 64, 64, 4, 4),
    ]


_SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block: what the configs are sized for


def fits_shared_memory(cfg: triton.Config, split_k: int) -> bool:
    """Shared memory of ``cfg``: the operand ring, stages * (BM + BN) * BK * 2 bytes, plus one
    staging box for the TMA stores (y and z share it), BM * BN / EPILOGUE_SPLIT elements of the
    output: 16-bit, or the fp32 workspace under split-K. Matches the offline sm_90 compile within
    ~100 bytes of barriers (180,224 + 32 B for 128x256x64 at 3 stages)."""
    kw = cfg.kwargs
    ring = cfg.num_stages * (kw["BLOCK_M"] + kw["BLOCK_N"]) * kw["BLOCK_K"] * 2
    box = kw["BLOCK_M"] * kw["BLOCK_N"] // kw["EPILOGUE_SPLIT"] * (4 if split_k > 1 else 2)
    return ring + box + 1024 <= _SMEM_LIMIT


def _fixed() -> bool:
    """BERT_FAST_AUTOTUNE=0: fixed tiles, no autotune sweep (runs that visit many shapes once)."""
    return os.environ.get("BERT_FAST_AUTOTUNE", "1") == "0"


SMALL_M = 256  # M_BUCKET up to which the fixed choice is the 64x64 tile


def _prune(configs, named_args, **kwargs):
    """_prune_configs' small-M rule, and under split-K the tiles whose fp32 staging box no longer
    fits (128x256 at 4 stages: 262 KB). Fixed tiles (BERT_FAST_AUTOTUNE=0): exactly one, by M."""
    if _fixed() and len(configs) == 2:
        return configs[1:] if named_args.get("M_BUCKET", 1 << 30) <= SMALL_M else configs[:1]
    split_k = kwargs.get("SPLIT_K", 1)
    kept = [c for c in _prune_configs(configs, named_args, **kwargs) if fits_shared_memory(c, split_k)]
    return kept or configs[-1:]


@triton.jit
def _load_a(a_desc, m0, k0, A_T: tl.constexpr):
    """A's [BLOCK_M, BLOCK_K] tile; stored transposed ([K, M]) it is read as a [BLOCK_K, BLOCK_M]
    box and transposed in shared memory (free: wgmma takes either orientation)."""
    if A_T:
        return tl.trans(a_desc.load([k0, m0]))
    else:
        return a_desc.load([m0, k0])


@triton.jit
def _load_b(b_desc, n0, k0, B_T: tl.constexpr):
    """B's [BLOCK_K, BLOCK_N] tile; stored transposed ([N, K], the weight in the forward) it is
    read as a [BLOCK_N, BLOCK_K] box."""
    if B_T:
        return tl.trans(b_desc.load([n0, k0]))
    else:
        return b_desc.load([k0, n0])


@triton.jit
def _tile_main_loop(
    a_desc,
    b_desc,
    m0,
    n0,
    k_lo,
    k_steps,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc = A[m0:m0+BM, K-tiles k_lo .. k_lo+k_steps) @ B[same, n0:n0+BN]; the K tail, K-tiles
    past the end and out-of-range rows read as zeros (TMA).
    The loop runs from 0 to ``k_steps``, which must not depend on the work unit: Triton fuses this
    loop with the persistent unit loop (flatten=True) only when its bounds are the same for every
    unit; with per-unit bounds it silently leaves the two loops nested, and the next unit's loads no
    longer overlap this unit's epilogue."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for step in range(0, loop_bound(k_steps, INTERPRET)):
        k0 = (k_lo + step) * BLOCK_K
        acc = _dot_acc(_load_a(a_desc, m0, k0, A_T), _load_b(b_desc, n0, k0, B_T), acc, DOT_PRECISION)
    return acc


@triton.jit
def _epilogue_store(
    acc,
    BIAS,
    y_desc,
    z_desc,
    m0,
    n0,
    N,
    split,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """Bias, pre-activation store, activation, output store of a [BLOCK_M, WIDTH] accumulator slab;
    with SPLIT_K > 1 (no bias, activation or z then) the fp32 partial sum of K-slice ``split``
    goes to slab ``split`` of the [SPLIT_K, M, N] workspace instead."""
    if SPLIT_K > 1:
        y_desc.store([split, m0, n0], tl.reshape(acc, (1, BLOCK_M, WIDTH)).to(y_desc.dtype))
    else:
        if HAS_BIAS:
            offs_n = n0 + tl.arange(0, WIDTH)
            acc += tl.load(BIAS + offs_n, mask=offs_n < N, other=0.0).to(ACC_DTYPE)[None, :]
        if SAVE_Z:
            z_desc.store([m0, n0], acc.to(z_desc.dtype))
        y_desc.store([m0, n0], _act_fwd(acc, ACTIVATION).to(y_desc.dtype))


@triton.jit
def _tile_epilogue(
    acc,
    BIAS,
    y_desc,
    z_desc,
    m0,
    n0,
    N,
    split,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_Z: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):
    """EPILOGUE_SPLIT = 2 runs the epilogue on the two column halves of the tile one after the
    other: the GELU's fp32 temporaries then exist for half the accumulator at a time (at 128x256
    with erf, the whole tile at once needs more than 255 registers and spills, sm_90 offline
    compile), and the TMA store box (the shared-memory staging buffer) is half as big."""
    slabs = _column_slabs(acc, BLOCK_M, BLOCK_N, EPILOGUE_SPLIT)
    WIDTH: tl.constexpr = BLOCK_N // EPILOGUE_SPLIT
    for i in tl.static_range(EPILOGUE_SPLIT):
        _epilogue_store(
            slabs[i],
            BIAS,
            y_desc,
            z_desc,
            m0,
            n0 + i * WIDTH,
            N,
            split,
            HAS_BIAS,
            ACTIVATION,
            SAVE_Z,
            ACC_DTYPE,
            SPLIT_K,
            BLOCK_M,
            WIDTH,
        )


@triton.jit
def _work_unit(
    unit,
    a_desc,
    b_desc,
    y_desc,
    z_desc,
    BIAS,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_Z: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):
    """Work unit = (K-slice, output tile), slice-major: consecutive programs take neighbouring
    tiles of the same K-slice, so grouped ordering still shares their A/B panels in L2."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    if SPLIT_K == 1:  # the usual case, with no run-time division for the compiler to carry
        split = 0
        pid_m, pid_n = _tile_coords(unit, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_lo = 0
        k_steps = k_tiles
    else:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        split = unit // num_tiles
        pid_m, pid_n = _tile_coords(unit % num_tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        # Every slice walks per_split K-tiles (the same count for every unit, so the loops still
        # fuse); the last slices' steps past K read zeros from TMA, and a slice that starts past K
        # stores zeros. That costs at most SPLIT_K - 1 wasted steps per tile (2 of 258 for BERT-base's
        # 16384-token dW in 3 slices).
        k_steps = tl.cdiv(k_tiles, SPLIT_K)
        k_lo = split * k_steps
    acc = _tile_main_loop(
        a_desc,
        b_desc,
        pid_m * BLOCK_M,
        pid_n * BLOCK_N,
        k_lo,
        k_steps,
        A_T,
        B_T,
        DOT_PRECISION,
        ACC_DTYPE,
        INTERPRET,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    _tile_epilogue(
        acc,
        BIAS,
        y_desc,
        z_desc,
        pid_m * BLOCK_M,
        pid_n * BLOCK_N,
        N,
        split,
        HAS_BIAS,
        ACTIVATION,
        SAVE_Z,
        ACC_DTYPE,
        SPLIT_K,
        BLOCK_M,
        BLOCK_N,
        EPILOGUE_SPLIT,
    )


# (cache_results would be ignored: Triton does not cache kernels with config pre-hooks; _TUNED does)
@triton.autotune(
    configs=_configs(),
    key=["M_BUCKET", "N", "K_BUCKET", "KIND", "SPLIT_K"],
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _linear_tma_kernel(
    a_desc,
    b_desc,
    y_desc,
    z_desc,
    BIAS,
    M,
    N,
    K,
    M_BUCKET,
    K_BUCKET,
    KIND,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SAVE_Z: tl.constexpr,
    A_T: tl.constexpr,
    B_T: tl.constexpr,
    SPLIT_K: tl.constexpr,
    NUM_SMS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EPILOGUE_SPLIT: tl.constexpr,
):
    """Y[M, N] = act(A @ B + BIAS); Z = A @ B + BIAS if SAVE_Z. Persistent: program p computes
    work units p, p + NUM_SMS, ... (a unit is one output tile, or with SPLIT_K > 1 one K-slice of
    one, whose fp32 partial goes to the [SPLIT_K, M, N] workspace y_desc then describes).
    (Descriptors carry no dtype the autotuner can see; BIAS, always a tensor of the output dtype,
    puts the dtype into its key.)"""
    num_units = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) * SPLIT_K
    # flatten=True merges this loop with the K loop into one software-pipelined loop, so TMA
    # loads of the next unit are issued while this one's epilogue runs.
    for unit in tl.range(
        loop_bound(tl.program_id(0), INTERPRET), loop_bound(num_units, INTERPRET), NUM_SMS, flatten=True
    ):
        _work_unit(
            unit,
            a_desc,
            b_desc,
            y_desc,
            z_desc,
            BIAS,
            M,
            N,
            K,
            HAS_BIAS,
            ACTIVATION,
            SAVE_Z,
            A_T,
            B_T,
            SPLIT_K,
            DOT_PRECISION,
            ACC_DTYPE,
            INTERPRET,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GROUP_M,
            EPILOGUE_SPLIT,
        )


# ----------------------------------------------------------------------------- host side
# Winners on disk: Triton's own autotune cache skips kernels with config pre-hooks (see tuned_configs).
_TUNED = TunedConfigs(_linear_tma_kernel, "linear_tma", persist=not _interpreting())


def _mode() -> str:
    mode = os.environ.get(_ENV, "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{_ENV} must be auto, 0 or 1, got {mode!r}")
    return mode


def _tma_view(t: torch.Tensor):
    """(storage-order 2-D shape, strides, transposed?) of ``t`` if TMA can read it, else None.
    TMA needs a unit last stride, a 16-byte aligned base and 16-byte aligned row pitch."""
    esize = t.element_size()
    if t.data_ptr() % 16:
        return None
    rows, cols = t.shape
    # The row pitch must also cover a row: a broadcast operand (pitch 0, e.g. the gradient of a
    # sum) or overlapping rows are not something a tensor map describes; the pointer kernel reads them.
    if t.stride(1) == 1 and (t.stride(0) * esize) % 16 == 0 and t.stride(0) >= cols:
        return (rows, cols), (t.stride(0), 1), False
    if t.stride(0) == 1 and (t.stride(1) * esize) % 16 == 0 and t.stride(1) >= rows:
        return (cols, rows), (t.stride(1), 1), True
    return None


def enabled_for(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GEMMs on ``device`` in ``dtype`` take the TMA kernel when their operands allow it."""
    mode = _mode()
    if mode == "0":
        return False
    if _interpreting():
        return mode == "1"
    # Hopper and datacenter Blackwell. Parts with ~99 KB of shared memory (sm_120) have TMA too,
    # but the configs here are sized for 227 KB: there the pointer kernel, whose configs fit, runs.
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and _tma_device(device)


@functools.lru_cache(maxsize=None)
def _tma_device(device: torch.device) -> bool:
    """A CUDA device with TMA and the shared memory these configs need (asked at every GEMM: cached)."""
    return torch.cuda.get_device_capability(device)[0] >= 9 and smem_per_block(device) >= _SMEM_LIMIT


def tma_views(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
    """(a's, b's) ``_tma_view`` if the TMA kernel takes a [M, K] @ b [K, N] -> y (see the module
    docstring), else None; ``launch`` takes them, so each operand is inspected once per GEMM."""
    if not enabled_for(a.device, a.dtype):
        return None
    a_view, b_view, y_view = _tma_view(a), _tma_view(b), _tma_view(y)
    if a_view is None or b_view is None or y_view is None or y_view[2]:  # y must be row-major
        return None
    return a_view, b_view


def usable(a: torch.Tensor, b: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the TMA kernel takes a [M, K] @ b [K, N] -> y."""
    return tma_views(a, b, y) is not None


def _split_k(kind: int, M: int, N: int, K: int, num_sms: int) -> int:
    """K-slices for a GEMM whose output has too few tiles to fill the GPU: the weight gradient
    (KIND_DW), whose output is a weight matrix (768 x 768 for BERT-base's attention output: 36
    tiles of 128 x 128 on 132 SMs) while K is the token count (16384). Each slice's fp32 partial
    sum goes to a [slices, M, N] workspace, summed afterwards in a fixed order (deterministic).
    Slices keep >= 2048 of K, so the workspace traffic (2 * slices * M * N * 4 bytes) stays small
    next to the slice's own GEMM. (The caller asks only for GEMMs without an epilogue: dW has none.)"""
    if kind != KIND_DW:
        return 1
    tiles = triton.cdiv(M, 128) * triton.cdiv(N, 128)
    if 2 * tiles > num_sms:
        return 1
    return max(1, min(num_sms // tiles, 8, K // 2048))


def forward_splits(M: int, N: int, K: int, device: torch.device) -> int:
    """K-slices for a forward GEMM at small M whose epilogue another kernel applies to the fp32
    partials (kernels/residual_layer_norm.py, partials_residual_layer_norm_fwd): 1 where its
    64 x 64 tiles already fill half the SMs, else enough slices to fill them, each >= 256 of K, at
    most 8. BERT-base at 128 tokens: the attention output (N = K = 768) 3 slices (72 units), the
    FFN down-projection (K = 3072) 5 (120 units), on 132 SMs."""
    num_sms = _num_sms(device)
    tiles = triton.cdiv(M, 64) * triton.cdiv(N, 64)
    if tiles == 0 or 2 * tiles > num_sms:
        return 1
    return max(1, min(num_sms // tiles, K // 256, 8))


def partials(a, b, part, views, m_bucket_: int, dot_precision: str, acc_dtype) -> None:
    """part [S, M, N] (fp32, contiguous) = the partial products of a [M, K] @ b [K, N] over S
    K-slices (slice s: K-tiles s * ceil(tiles / S) onwards), no epilogue; ``views`` =
    tma_views(a, b, part[0])."""
    y = part[0]  # stands in for the output: the descriptors and the key read its dtype only
    launch(a, b, y, None, None, 0, KIND_FWD, m_bucket_, a.shape[1], dot_precision, acc_dtype, views, part)


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of split-K partial sums of ``dtype`` operands: fp32 (fp64 for fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def launch(
    a, b, y, z, bias, activation_code, kind, m_bucket_, k_bucket, dot_precision, acc_dtype, views, workspace=None
):
    """y (and z) = epilogue(a @ b) through TMA; ``views`` = tma_views(a, b, y), not None. With a
    ``workspace`` [S, M, N] the S K-slices' fp32 partials go there instead (no epilogue, y unused)."""
    M, K = a.shape
    N = b.shape[1]
    num_sms = _num_sms(a.device)
    plain = bias is None and activation_code == 0 and z is None  # the split path has no epilogue
    split_k = _split_k(kind, M, N, K, num_sms) if plain else 1
    (a_shape, a_strides, a_t), (b_shape, b_strides, b_t) = views
    # block shapes are placeholders: the config's pre-hook sets the real ones
    a_desc = TensorDescriptor(a, a_shape, a_strides, [16, 16])
    b_desc = TensorDescriptor(b, b_shape, b_strides, [16, 16])
    part = workspace
    if part is None and split_k > 1:
        part = torch.empty((split_k, M, N), device=y.device, dtype=partial_dtype(y.dtype))
    if part is not None:
        split_k = part.shape[0]
        y_desc = TensorDescriptor(part, [split_k, M, N], [M * N, N, 1], [1, 16, 16])
    else:
        y_desc = TensorDescriptor(y, [M, N], [y.stride(0), 1], [16, 16])
    z_desc = TensorDescriptor(z, [M, N], [z.stride(0), 1], [16, 16]) if z is not None else y_desc
    grid = lambda meta: (min(num_sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]) * split_k),)
    args = (a_desc, b_desc, y_desc, z_desc, bias if bias is not None else y, M, N, K, m_bucket_, k_bucket, kind)
    call = GemmCall(a, b, y, z, bias, activation_code, kind, m_bucket_, k_bucket, dot_precision, acc_dtype)
    meta = dict(call.epilogue_meta(), A_T=a_t, B_T=b_t, SPLIT_K=split_k, NUM_SMS=num_sms)
    # the autotuner's key, plus the epilogue and layout (they change the best tile too)
    key = (
        m_bucket_,
        N,
        k_bucket,
        kind,
        split_k,
        str(y.dtype),
        bias is not None,
        activation_code,
        z is not None,
        a_t,
        b_t,
    )
    _TUNED.launch(grid, a.device, key, args, **meta)
    if part is not None and workspace is None:
        y.copy_(part.sum(dim=0))  # torch's reduction: fixed order, fp32, no atomics
