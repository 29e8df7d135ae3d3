"""What the two Triton GEMMs of ``linear`` share: kernels/linear.py (the pointer-based GEMM and
the launchers) and kernels/linear_tma.py (the TMA / persistent GEMM on sm_90+).

Kept here so that the dependency runs one way: linear.py imports linear_tma.py (its launcher hands
TMA-readable operands to it), and both import this module; linear_tma.py never imports linear.py.
Contents: the GEMM kinds (part of both autotune keys), the record of one GEMM launch, the config
pruning rule, and the jit helpers both kernels' bodies call (the forward activations, the dot with its
precision, the column slabs of an epilogue, the grouped tile order).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._device import interpreting

# GEMM kinds, part of the autotune key: the three GEMMs of one layer have different layouts
# (x row-major, W^T column-major, dZ^T column-major) and may want different tiles.
KIND_FWD, KIND_DX, KIND_DW, KIND_OTHER = 0, 1, 2, 3


class GemmCall(NamedTuple):
    """One GEMM, y (and z) = epilogue(a @ b) for a [M, K] and b [K, N], as both kernels take it:
    the operands, the epilogue (bias, activation code, z: the pre-activation output), the autotune
    key's GEMM kind and buckets, and the dot's precision and accumulator type. The fields are, in
    order, the first parameters of linear_tma.launch (linear.py hands a call on as ``*call``)."""

    a: torch.Tensor
    b: torch.Tensor
    y: torch.Tensor
    z: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    activation: int
    kind: int
    m_bucket: int
    k_bucket: int
    dot_precision: str
    acc_dtype: tl.dtype

    def epilogue_meta(self) -> dict:
        """The constexprs both kernels take: the epilogue's, the dot's and the interpreter switch."""
        return dict(
            HAS_BIAS=self.bias is not None,
            ACTIVATION=self.activation,
            SAVE_Z=self.z is not None,
            DOT_PRECISION=self.dot_precision,
            ACC_DTYPE=self.acc_dtype,
            INTERPRET=interpreting(),
        )


# ----------------------------------------------------------------------------- configs
def _prune_configs(configs, named_args, **kwargs):
    """Drop tiles whose BLOCK_M is more than 2x the (bucketed) M; keep at least one config."""
    m = named_args.get("M_BUCKET", named_args.get("M", 1 << 30))
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, 2 * m)]
    return kept or configs[:1]


# ----------------------------------------------------------------------------- jit helpers
@triton.jit
def _tanh(u):
    # tanh(u) = 1 - 2 / (1 + exp(2u)). |u| is clamped at 20 (tanh(20) is 1 to 4e-18, beyond
    # fp64's eps) so exp never overflows. The cancellation near u = 0 costs ~1 ulp *absolutely*,
    # which is all GELU needs (t enters as 1 + t and 1 - t^2).
    u = tl.minimum(tl.maximum(u, -20.0), 20.0)
    return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * u))


@triton.jit
def _act_fwd(z, ACTIVATION: tl.constexpr):
    if ACTIVATION == 1:  # exact GELU: z * Phi(z)
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACTIVATION == 2:  # tanh approximation
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        return 0.5 * z * (1.0 + t)
    else:
        return z


@triton.jit
def _dot_acc(a, b, acc, DOT_PRECISION: tl.constexpr):
    """acc += a @ b; "native" lets the tensor cores take 16-bit operands as they are."""
    if DOT_PRECISION == "native":
        acc = tl.dot(a, b, acc, out_dtype=acc.dtype)
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=acc.dtype)
    return acc


@triton.jit
def _column_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc[:, :BLOCK_N/2], acc[:, BLOCK_N/2:] (for epilogues that run on one half at a time)."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _column_slabs(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    """acc as EPILOGUE_SPLIT column slabs, for an epilogue that runs on one slab at a time: (acc,),
    or its two halves; slab i holds columns [i * BLOCK_N / EPILOGUE_SPLIT, (i + 1) * ...)."""
    if EPILOGUE_SPLIT == 2:
        slabs = _column_halves(acc, BLOCK_M, BLOCK_N)
    else:
        slabs = (acc,)
    return slabs


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row-tile, column-tile) of output tile number ``tile`` in grouped ordering: GROUP_M
    row-tiles walk the N dimension together, so consecutive tiles share one B column-panel and a
    few A row-panels, which stay in L2 (Triton tutorial 03)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n
