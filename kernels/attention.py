"""Flash-attention-2 style fused attention: forward, backward (dK/dV + dQ), dropout-mask debug kernel.

One kernel family serves both layouts of bert_fast:
  * padded: qkv [B, S, 3, heads, d] with an optional key-padding mask [B, S] (any pattern),
            out [B, S, heads, d], lse [B, heads, S];
  * varlen: packed qkv [T, 3, heads, d] with cu_seqlens int32 [B+1] and max_seqlen,
            out [T, heads, d], lse [heads, T].
q, k and v are read by strides straight from the fused QKV tensor (no transposes, no copies);
dQ, dK and dV are written by strides into the slices of one dqkv buffer.

Algorithm (FlashAttention-2): the S x S score matrix is never materialized. The forward streams key
blocks through an online softmax with fp32 running max / sum / accumulator and saves the fp32
log-sum-exp (natural log) of every query row. The backward recomputes P = exp(S - lse) tile by tile:
  1. ``_attention_bwd_preprocess_kernel``: delta = rowsum(dO * O) (fp32, lse's layout);
  2. ``_attention_bwd_dkdv_kernel``: one program per key block, loop over query blocks, dK and dV in
     fp32 registers; with ATOMIC_DQ it also adds each tile's dQ contribution into an fp32 buffer
     with atomics (fast path, order of additions not reproducible);
  3. ``_attention_bwd_dq_kernel``: deterministic dQ, one program per query block, loop over key
     blocks (used when torch.are_deterministic_algorithms_enabled()).

Masking: every load is bounded by the sequence length (no multiple-of-block assumption) and by the
head dim (BLOCK_D = next_power_of_2(d) >= 16). A masked key gets score -inf in the forward; the
running max starts at a large finite negative (-1e30) instead of -inf so that a row whose keys are
all masked never computes (-inf) - (-inf): it ends with l = 0, output 0 and lse = +inf, and
+inf makes the backward's recomputed P exactly 0 for it (zero gradients, never NaN). In the backward,
a masked key's recomputed P is selected to exactly 0 and its dK/dV rows are written as zeros.

Dropout (on the probabilities, as in BERT): Philox-4x32-10 (``tl.philox``) keyed by the 64-bit seed.
One call per 4 consecutive keys of a query row, with the 4 x 32-bit *counter*
        (c0, c1, c2, c3) = (key position // 4, query position, b * heads + h, 0);
its output word j serves key 4 * c0 + j (a quarter of the integer work of one call per score
element). Positions count from the start of the element's own sequence. Nothing is folded into one
linear offset, so no counter can overflow int32 whatever the sequence length (each word < 2**32),
and the padded and varlen layouts draw the same bits for the same (sequence, head, query, key).
keep = uniform(word) >= p; kept probabilities are scaled by 1/(1-p). The backward and the debug
kernel ``_attention_dropout_mask_kernel`` call the same ``_dropout_keep``, so the mask it returns is
exactly the one the forward and backward used.

Offsets: program ids, sequence starts and row indices are widened to int64 before they multiply a
stride; pointers then advance by pointer arithmetic, so tensors over 2**31 elements are safe.

Launch configs: fp16/bf16 on CUDA autotune (``_TUNE_SPACE``, keyed on the sequence-length bucket, head
dim, mask, dropout and layout); with BERT_FAST_AUTOTUNE=0, for fp32 and on the GPU check's test stage,
one config per head dim, dtype, dropout and the GPU's shared memory (``_configs``); under
TRITON_INTERPRET=1 a single small config (asymmetric blocks, to exercise the tails).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ._device import interpreting as _interpreting
from ._device import loop_bound
from ._device import num_sms as _num_sms  # (a module name: tests patch it)
from ._device import smem_per_block as _smem_per_block

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _dropout_keep(seed, bh, q_pos, k0, dropout_p, BLOCK_N: tl.constexpr):
    """Keep-mask [BLOCK_M, BLOCK_N] (True = keep) of sequence-head ``bh`` = b * heads + h for the
    queries at positions ``q_pos`` (int32 [BLOCK_M]) and the BLOCK_N keys from position ``k0`` (a
    multiple of 4: every key block starts at a multiple of BLOCK_N >= 16).

    One Philox call serves 4 consecutive keys (its 4 output words), a quarter of the integer work of
    one call per score element (~40 SASS, 20 of them half-rate IMAD.WIDE: at d = 64 that alone would
    take ~5x the forward's tensor-core time; benchmarks/notes/2026-11-21-gpu-kernels.md). tl.join appends a
    trailing axis and tl.reshape is row-major, so join(join(w0, w2), join(w1, w3)) flattens to
    w0, w1, w2, w3: key 4g + j gets word j."""
    zero = q_pos[:, None] * 0
    group = k0 // 4 + tl.arange(0, BLOCK_N // 4)
    c0 = (group[None, :] + zero).to(tl.uint32, bitcast=True)
    c1 = (q_pos[:, None] + group[None, :] * 0).to(tl.uint32, bitcast=True)
    c2 = (zero + bh).to(tl.uint32, bitcast=True)
    c3 = c2 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, c2, c3)
    k0_ = (tl.uint_to_uniform_float(w0) >= dropout_p).to(tl.int8)
    k1_ = (tl.uint_to_uniform_float(w1) >= dropout_p).to(tl.int8)
    k2_ = (tl.uint_to_uniform_float(w2) >= dropout_p).to(tl.int8)
    k3_ = (tl.uint_to_uniform_float(w3) >= dropout_p).to(tl.int8)
    keep = tl.reshape(tl.join(tl.join(k0_, k2_), tl.join(k1_, k3_)), [q_pos.shape[0], BLOCK_N])
    return keep != 0


@triton.jit
def _seq_bounds(CU_SEQLENS, off_b, seqlen, IS_VARLEN: tl.constexpr):
    """(first row of the sequence as int64, its length as int32)."""
    if IS_VARLEN:
        start32 = tl.load(CU_SEQLENS + off_b)
        length = tl.load(CU_SEQLENS + off_b + 1) - start32
        start = start32.to(tl.int64)
    else:
        start = off_b.to(tl.int64) * 0
        length = seqlen + off_b * 0
    return start, length


@triton.jit
def _program_coords(CU_SEQLENS, nheads, seqlen, BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Where this program works on the 1-D grid of cdiv(seqlen, BLOCK) blocks x B x heads (no 65535
    limit on B * heads): (block index, bh = b * heads + h, b and h as int64, first row of the
    sequence as int64, its length). The block count is derived here, not passed, because BLOCK may
    come from the autotuner."""
    num_blocks = tl.cdiv(seqlen, BLOCK)
    pid = tl.program_id(0)
    start = pid % num_blocks
    bh = pid // num_blocks
    off_b = bh // nheads
    seq_start, seq_len = _seq_bounds(CU_SEQLENS, off_b, seqlen, IS_VARLEN)
    return start, bh, off_b.to(tl.int64), (bh % nheads).to(tl.int64), seq_start, seq_len


# ----------------------------------------------------------------------------- forward
@triton.jit
def _fwd_step(
    acc,
    l_i,
    m_i,
    queries,
    keys,
    n0,
    BOUNDS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCALE_POS: tl.constexpr,
):
    """One key block at n0: BOUNDS=False for a full block (no length check), True for the tail.

    SCALE_POS (qk_scale > 0, every real use): the row max is taken on the raw scores and scaled
    once per row, max(s * c) = max(s) * c for c > 0, so each score needs a single FFMA,
    s * c - m, before its exp2 instead of an FMUL (kept for the max) and an FADD: offline sm_90,
    d = 64, 128x128 tile, 538 -> 414 FP32 instructions in the kernel. A zero or negative scale
    keeps the scaled scores (the identity fails, and -inf * 0 would be NaN for masked keys).

    ``queries`` and ``keys`` are what every step of the program shares (see _attention_fwd_kernel)."""
    q, q_pos, seq_len, bh, qk_scale, dropout_p, seed, offs_n, d_valid = queries
    k_ptrs, v_ptrs, mask_ptrs, stride_ks, stride_vs, stride_ms = keys
    k_pos = n0 + offs_n
    n0_64 = tl.cast(n0, tl.int64)  # n0 * stride in int64: one sequence may span > 2**31 elements
    if BOUNDS:
        n_in = k_pos < seq_len
        if EVEN_D:
            kv_mask = n_in[:, None]
        else:
            kv_mask = n_in[:, None] & d_valid[None, :]
    else:
        kv_mask = d_valid[None, :]
    if BOUNDS or not EVEN_D:
        k = tl.load(k_ptrs + n0_64 * stride_ks, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs + n0_64 * stride_ks)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if not SCALE_POS:
        s = s * qk_scale
    if HAS_MASK:
        if BOUNDS:
            key_ok = tl.load(mask_ptrs + n0_64 * stride_ms, mask=n_in, other=0) != 0
        else:
            key_ok = tl.load(mask_ptrs + n0_64 * stride_ms) != 0
        s = tl.where(key_ok[None, :], s, float("-inf"))
    elif BOUNDS:
        s = tl.where(n_in[None, :], s, float("-inf"))
    if SCALE_POS:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh, q_pos, n0, dropout_p, BLOCK_N)
        p = tl.where(keep, p, 0.0)
    if BOUNDS or not EVEN_D:
        v = tl.load(v_ptrs + n0_64 * stride_vs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs + n0_64 * stride_vs)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    KEY_MASK,
    CU_SEQLENS,
    qk_scale,
    dropout_p,
    seed,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_ms,
    nheads,
    seqlen,
    seq_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
    SCALE_POS: tl.constexpr,
):
    """One program per (query block, sequence, head); 1-D grid (no 65535 limit on B * heads).
    qk_scale = softmax_scale * log2(e) (exp2 domain); LSE stores the natural-log lse."""
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    start_m, bh, off_b64, off_h64, seq_start, seq_len = _program_coords(CU_SEQLENS, nheads, seqlen, BLOCK_M, IS_VARLEN)
    if start_m * BLOCK_M >= seq_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = start_m * BLOCK_M + offs_m  # query positions within the sequence
    m_valid = q_pos < seq_len
    d_valid = offs_d < HEAD_DIM
    rows_q = (seq_start + q_pos.to(tl.int64))[:, None]
    q_ptrs = Q + off_b64 * stride_qb + off_h64 * stride_qh + rows_q * stride_qs + offs_d[None, :] * stride_qd
    if EVEN_D:
        q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    rows_k = (seq_start + offs_n.to(tl.int64))[:, None]
    k_ptrs = K + off_b64 * stride_kb + off_h64 * stride_kh + rows_k * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b64 * stride_vb + off_h64 * stride_vh + rows_k * stride_vs + offs_d[None, :] * stride_vd
    mask_ptrs = KEY_MASK + off_b64 * stride_mb + offs_n * stride_ms

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # what every step shares: this program's queries (and how their scores are made), and where
    # the key blocks are (pointers at key 0 and the strides of one key)
    queries = (q, q_pos, seq_len, bh, qk_scale, dropout_p, seed, offs_n, d_valid)
    keys = (k_ptrs, v_ptrs, mask_ptrs, stride_ks, stride_vs, stride_ms)
    # Full key blocks without length checks, then one masked tail block.
    n_full = (seq_len // BLOCK_N) * BLOCK_N
    for n0 in range(0, loop_bound(n_full, INTERPRET), BLOCK_N):
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, queries, keys, n0, False, HAS_MASK, HAS_DROPOUT, EVEN_D, DOT_PREC, BLOCK_N, SCALE_POS
        )
    if n_full < seq_len:
        acc, l_i, m_i = _fwd_step(
            acc, l_i, m_i, queries, keys, n_full, True, HAS_MASK, HAS_DROPOUT, EVEN_D, DOT_PREC, BLOCK_N, SCALE_POS
        )
    empty = l_i == 0.0  # no key at all: output 0, lse +inf
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l * (1.0 / (1.0 - dropout_p))
    acc = acc * inv_l[:, None]
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    lse_ptrs = LSE + off_b64 * stride_lb + off_h64 * stride_lh + (seq_start + q_pos.to(tl.int64))
    tl.store(lse_ptrs, lse, mask=m_valid)
    o_ptrs = O + off_b64 * stride_ob + off_h64 * stride_oh + rows_q * stride_os + offs_d[None, :] * stride_od
    if EVEN_D:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_valid[:, None])
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


# ----------------------------------------------------------------------------- backward
@triton.jit
def _attention_bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    CU_SEQLENS,
    stride_ob,
    stride_os,
    stride_oh,
    stride_od,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dod,
    stride_lb,
    stride_lh,
    nheads,
    seqlen,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """delta = rowsum(dO * O) in fp32 (lse's layout)."""
    start_m, bh, off_b64, off_h64, seq_start, seq_len = _program_coords(CU_SEQLENS, nheads, seqlen, BLOCK_M, IS_VARLEN)
    if start_m * BLOCK_M >= seq_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_pos = start_m * BLOCK_M + offs_m
    m_valid = q_pos < seq_len
    rows = (seq_start + q_pos.to(tl.int64))[:, None]
    mask = m_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        O + off_b64 * stride_ob + off_h64 * stride_oh + rows * stride_os + offs_d[None, :] * stride_od,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    do = tl.load(
        DO + off_b64 * stride_dob + off_h64 * stride_doh + rows * stride_dos + offs_d[None, :] * stride_dod,
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + off_b64 * stride_lb + off_h64 * stride_lh + (seq_start + q_pos.to(tl.int64)), delta, mask=m_valid)


@triton.jit
def _dkdv_step(
    dk,
    dv,
    m0,
    keys,
    queries,
    scores,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block at m0 for the key block (k, v) of _attention_bwd_dkdv_kernel; ``keys``,
    ``queries`` and ``scores`` are what every step of the program shares (see the kernel)."""
    k, v, key_ok, k0, offs_n, d_valid, seq_len = keys
    q_ptrs, do_ptrs, dq_ptrs, lse_ptrs, delta_ptrs, stride_qs, stride_dos, stride_dqs, offs_m = queries
    softmax_scale, qk_scale, dropout_p, seed, bh = scores
    q_pos = m0 + offs_m
    m0_64 = tl.cast(m0, tl.int64)  # m0 * stride in int64 (see _fwd_step)
    m_valid = q_pos < seq_len
    qd_mask = m_valid[:, None] & d_valid[None, :]
    q = tl.load(q_ptrs + m0_64 * stride_qs, mask=qd_mask, other=0.0)
    do = tl.load(do_ptrs + m0_64 * stride_dos, mask=qd_mask, other=0.0)
    lse2 = tl.load(lse_ptrs + m0_64, mask=m_valid, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_ptrs + m0_64, mask=m_valid, other=0.0)
    qkT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_M]
    # select, not only zero K rows: exp2(0 - lse) of a masked key may overflow for extreme lse
    pT = tl.where(key_ok[:, None], tl.math.exp2(qkT * qk_scale - lse2[None, :]), 0.0)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
    if HAS_DROPOUT:
        # drawn in its [query, key] orientation and transposed to this tile's (a mask built directly
        # key-major compiles to the same SASS on sm_90: 56 B of spill at 255 registers either way)
        keep = tl.trans(_dropout_keep(seed, bh, q_pos, k0, dropout_p, BLOCK_N))
        inv_keep = 1.0 / (1.0 - dropout_p)
        pdT = tl.where(keep, pT * inv_keep, 0.0)
        dpT = tl.where(keep, dpT * inv_keep, 0.0)
    else:
        pdT = pT
    dv = tl.dot(pdT.to(do.dtype), do, dv, input_precision=DOT_PREC)
    dsT = pT * (dpT - delta[None, :])
    dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=DOT_PREC)
    if ATOMIC_DQ:
        dq = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=DOT_PREC) * softmax_scale
        tl.atomic_add(dq_ptrs + m0_64 * stride_dqs, dq, mask=qd_mask, sem="relaxed")
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
    KEY_MASK,
    CU_SEQLENS,
    softmax_scale,
    qk_scale,
    dropout_p,
    seed,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dod,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dqd,
    stride_dkb,
    stride_dks,
    stride_dkh,
    stride_dkd,
    stride_dvb,
    stride_dvs,
    stride_dvh,
    stride_dvd,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_ms,
    nheads,
    seqlen,
    seq_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One program per (key block, sequence, head): loop over query blocks, accumulate dK and dV in
    fp32; with ATOMIC_DQ also atomically add scale * dS K into the fp32 buffer DQ."""
    start_n, bh, off_b64, off_h64, seq_start, seq_len = _program_coords(CU_SEQLENS, nheads, seqlen, BLOCK_N, IS_VARLEN)
    if start_n * BLOCK_N >= seq_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    k_pos = start_n * BLOCK_N + offs_n
    n_in = k_pos < seq_len
    key_ok = n_in
    if HAS_MASK:
        key_ok = key_ok & (tl.load(KEY_MASK + off_b64 * stride_mb + k_pos * stride_ms, mask=n_in, other=0) != 0)
    rows_k = (seq_start + k_pos.to(tl.int64))[:, None]
    # Masked keys: zero rows of K and V, P = 0 (so dS = 0 and no dQ contribution), dK/dV rows zeroed.
    k = tl.load(
        K + off_b64 * stride_kb + off_h64 * stride_kh + rows_k * stride_ks + offs_d[None, :] * stride_kd,
        mask=key_ok[:, None] & d_valid[None, :],
        other=0.0,
    )
    v = tl.load(
        V + off_b64 * stride_vb + off_h64 * stride_vh + rows_k * stride_vs + offs_d[None, :] * stride_vd,
        mask=key_ok[:, None] & d_valid[None, :],
        other=0.0,
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    rows_q0 = (seq_start + offs_m.to(tl.int64))[:, None]
    q_ptrs = Q + off_b64 * stride_qb + off_h64 * stride_qh + rows_q0 * stride_qs + offs_d[None, :] * stride_qd
    do_ptrs = DO + off_b64 * stride_dob + off_h64 * stride_doh + rows_q0 * stride_dos + offs_d[None, :] * stride_dod
    dq_ptrs = DQ + off_b64 * stride_dqb + off_h64 * stride_dqh + rows_q0 * stride_dqs + offs_d[None, :] * stride_dqd
    lse_ptrs = LSE + off_b64 * stride_lb + off_h64 * stride_lh + (seq_start + offs_m.to(tl.int64))
    delta_ptrs = DELTA + off_b64 * stride_lb + off_h64 * stride_lh + (seq_start + offs_m.to(tl.int64))

    # A key block with no real key has zero gradients: skip its loop.
    hi = tl.where(tl.max(key_ok.to(tl.int32), 0) > 0, seq_len, 0)
    # what every step shares: this key block, the query stream (pointers at query 0 and the
    # strides of one query), and how scores are made
    keys = (k, v, key_ok, start_n * BLOCK_N, offs_n, d_valid, seq_len)
    queries = (q_ptrs, do_ptrs, dq_ptrs, lse_ptrs, delta_ptrs, stride_qs, stride_dos, stride_dqs, offs_m)
    scores = (softmax_scale, qk_scale, dropout_p, seed, bh)
    for m0 in range(0, loop_bound(hi, INTERPRET), BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, m0, keys, queries, scores, HAS_DROPOUT, ATOMIC_DQ, DOT_PREC, BLOCK_N)
    dk = tl.where(key_ok[:, None], dk * softmax_scale, 0.0)
    dv = tl.where(key_ok[:, None], dv, 0.0)
    st_mask = n_in[:, None] & d_valid[None, :]
    tl.store(
        DK + off_b64 * stride_dkb + off_h64 * stride_dkh + rows_k * stride_dks + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty),
        mask=st_mask,
    )
    tl.store(
        DV + off_b64 * stride_dvb + off_h64 * stride_dvh + rows_k * stride_dvs + offs_d[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty),
        mask=st_mask,
    )


@triton.jit
def _dq_step(
    dq,
    n0,
    queries,
    keys,
    HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block at n0 for the query block of _attention_bwd_dq_kernel; ``queries`` and
    ``keys`` are what every step of the program shares (see the kernel)."""
    q, do, lse2, delta, q_pos, seq_len, qk_scale, dropout_p, seed, bh, offs_n, d_valid = queries
    k_ptrs, v_ptrs, mask_ptrs, stride_ks, stride_vs, stride_ms = keys
    k_pos = n0 + offs_n
    n0_64 = tl.cast(n0, tl.int64)  # see _fwd_step
    key_ok = k_pos < seq_len
    if HAS_MASK:
        key_ok = key_ok & (tl.load(mask_ptrs + n0_64 * stride_ms, mask=key_ok, other=0) != 0)
    kv_mask = key_ok[:, None] & d_valid[None, :]
    k = tl.load(k_ptrs + n0_64 * stride_ks, mask=kv_mask, other=0.0)  # masked keys: zero rows
    v = tl.load(v_ptrs + n0_64 * stride_vs, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    p = tl.where(key_ok[None, :], tl.math.exp2(qk * qk_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh, q_pos, n0, dropout_p, BLOCK_N)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _attention_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    KEY_MASK,
    CU_SEQLENS,
    softmax_scale,
    qk_scale,
    dropout_p,
    seed,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_dob,
    stride_dos,
    stride_doh,
    stride_dod,
    stride_dqb,
    stride_dqs,
    stride_dqh,
    stride_dqd,
    stride_lb,
    stride_lh,
    stride_mb,
    stride_ms,
    nheads,
    seqlen,
    seq_bucket,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Deterministic dQ: one program per (query block, sequence, head), loop over key blocks."""
    start_m, bh, off_b64, off_h64, seq_start, seq_len = _program_coords(CU_SEQLENS, nheads, seqlen, BLOCK_M, IS_VARLEN)
    if start_m * BLOCK_M >= seq_len:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q_pos = start_m * BLOCK_M + offs_m
    m_valid = q_pos < seq_len
    qd_mask = m_valid[:, None] & d_valid[None, :]
    rows_q = (seq_start + q_pos.to(tl.int64))[:, None]
    q = tl.load(
        Q + off_b64 * stride_qb + off_h64 * stride_qh + rows_q * stride_qs + offs_d[None, :] * stride_qd,
        mask=qd_mask,
        other=0.0,
    )
    do = tl.load(
        DO + off_b64 * stride_dob + off_h64 * stride_doh + rows_q * stride_dos + offs_d[None, :] * stride_dod,
        mask=qd_mask,
        other=0.0,
    )
    row_off = off_b64 * stride_lb + off_h64 * stride_lh + (seq_start + q_pos.to(tl.int64))
    lse2 = tl.load(LSE + row_off, mask=m_valid, other=float("inf")) * 1.4426950408889634
    delta = tl.load(DELTA + row_off, mask=m_valid, other=0.0)

    rows_k0 = (seq_start + offs_n.to(tl.int64))[:, None]
    k_ptrs = K + off_b64 * stride_kb + off_h64 * stride_kh + rows_k0 * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b64 * stride_vb + off_h64 * stride_vh + rows_k0 * stride_vs + offs_d[None, :] * stride_vd
    mask_ptrs = KEY_MASK + off_b64 * stride_mb + offs_n * stride_ms
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # what every step shares: this program's queries (and how their scores are made), and where
    # the key blocks are (pointers at key 0 and the strides of one key)
    queries = (q, do, lse2, delta, q_pos, seq_len, qk_scale, dropout_p, seed, bh, offs_n, d_valid)
    keys = (k_ptrs, v_ptrs, mask_ptrs, stride_ks, stride_vs, stride_ms)
    for n0 in range(0, loop_bound(seq_len, INTERPRET), BLOCK_N):
        dq = _dq_step(dq, n0, queries, keys, HAS_MASK, HAS_DROPOUT, DOT_PREC, BLOCK_N)
    dq = dq * softmax_scale
    tl.store(
        DQ + off_b64 * stride_dqb + off_h64 * stride_dqh + rows_q * stride_dqs + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty),
        mask=qd_mask,
    )


# ----------------------------------------------------------------------------- dropout debug
@triton.jit
def _attention_dropout_mask_kernel(
    OUT, dropout_p, seed, stride_ob, stride_om, stride_on, seqlen, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Writes the keep-mask (1 = keep) the attention kernels use, for OUT [B * heads, S, S] (uint8)."""
    bh = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed, bh, offs_m, tl.program_id(2) * BLOCK_N, dropout_p, BLOCK_N)
    ptrs = OUT + bh.to(tl.int64) * stride_ob + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(ptrs, keep.to(tl.uint8), mask=(offs_m[:, None] < seqlen) & (offs_n[None, :] < seqlen))


# ----------------------------------------------------------------------------- launch configs
def _configs(kind: str, block_d: int, dtype: torch.dtype, device: torch.device, dropout: bool = False) -> dict:
    """Block sizes / warps / stages per kernel ``kind`` ("fwd", "dkdv", "dq"), head dim, dtype, GPU.

    Chosen by the device's opt-in shared memory per block, not by its generation alone: H100/H200
    and B200 (sm_90/sm_100, 227 KB), A100 (sm_80) and Orin (sm_87, 163 KB) get the big tiles;
    sm_86/89 and consumer Blackwell sm_120 (99 KB) get small ones (a big-tile config there fails
    at launch with "out of resources: shared memory"). Every config was compiled offline for
    sm_90 and sm_80 (fp16/bf16/fp32, head dims 16..128, mask, dropout, varlen, both dQ paths) and
    fits with margin; see tests/ops/test_attention.py::test_configs_fit_shared_memory.
    fp32 (tests only) uses small tiles. ``dropout``: the forward's Philox draw needs registers, so
    the forward uses BLOCK_N = 64 with it (128 x 128 needed 1 KB of stack per thread on sm_90 with one
    Philox call per score element, 8 B with one per 4).
    This is the config with BERT_FAST_AUTOTUNE=0, under the interpreter and for fp32; otherwise
    fp16/bf16 on CUDA autotune over _TUNE_SPACE, which contains these choices.
    """
    if device.type != "cuda":  # Triton interpreter: one small config, asymmetric on purpose
        return {
            "fwd": dict(BLOCK_M=32, BLOCK_N=64),
            "dkdv": dict(BLOCK_M=64, BLOCK_N=32),
            "dq": dict(BLOCK_M=32, BLOCK_N=64),
        }[kind] | dict(num_warps=4, num_stages=1)
    major, _ = torch.cuda.get_device_capability(device)
    if dtype == torch.float32:
        bm, bn = (32, 32) if block_d > 64 else (64, 32)
        return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1)
    smem = _smem_per_block(device)
    big_smem = smem >= 160 * 1024
    if kind == "fwd":
        if major >= 9 and smem >= 200 * 1024:
            return (
                dict(BLOCK_M=128, BLOCK_N=64 if dropout else 128, num_warps=8, num_stages=3)
                if block_d <= 64
                else dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
            )
        if big_smem:
            # 8 warps: with 4 the 128 x 64 tile spills on sm_80 (64..500 B/thread, more with dropout)
            return (
                dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
                if block_d <= 64
                else dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
            )
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    if kind == "dkdv":
        if big_smem:
            return (
                dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)
                if block_d <= 64
                else dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)
            )
        return dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)
    # dq
    if big_smem:
        return (
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
            if block_d <= 64
            else dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
        )
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)


# Autotune space on CUDA for fp16/bf16: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel kind. It
# contains _configs' big-shared-memory choices plus the tiles benchmarks/notes/2026-11-21-gpu-kernels.md names
# as the candidates: BLOCK_M = 64 for short sequences (more CTAs), BLOCK_N = 128 keys, 2-3 stages; and
# for dK/dV the 32 x 128 / 8-warp tile, the one that compiles without spills on sm_90 with dropout
# (64 x 128 sits at 255 registers). Tiles that do not fit the device (head dim 128) are pruned by
# _tune_candidates before compiling; the winner is cached per key (sequence-length bucket, head dim,
# mask, dropout, layout, dQ path, dtypes), in memory and in Triton's cache directory (cache_results:
# the next process on the machine skips the sweep). BERT_FAST_AUTOTUNE=0 keeps the single _configs
# choice.
# Kept small on purpose: every candidate is one compile (~1-2 s) per key the first time a key is seen.
_TUNE_SPACE = {
    "fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3)],
    "dq": [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (64, 128, 4, 2)],
}


def _smem_estimate(kind: str, bm: int, bn: int, stages: int, block_d: int, elt: int = 2) -> int:
    """Shared memory (bytes) of a config, from what its loop pipelines: the forward keeps Q and
    streams K and V; dK/dV keeps K and V and streams Q and dO; dQ keeps Q and dO and streams K and V.
    Matches Triton's allocation for the forward at d = 64 (114688 B for 128 x 128 x 3 stages); the
    other kernels add ~10-25% of layout-conversion scratch, hence the margin in _tune_candidates."""
    if kind == "fwd":
        return (bm + stages * 2 * bn) * block_d * elt
    if kind == "dkdv":
        return (2 * bn + stages * 2 * bm) * block_d * elt
    return (2 * bm + stages * 2 * bn) * block_d * elt


def _tune_candidates(kind: str, block_d: int, smem: int) -> list:
    """The autotune configs of ``kind`` that fit ``smem`` bytes at head dim ``block_d``."""
    fits = [c for c in _TUNE_SPACE[kind] if _smem_estimate(kind, c[0], c[1], c[3], block_d) * 1.3 <= smem]
    return [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in fits]


def _tuned(kind: str, kernel, reset_to_zero=None):
    """``kernel`` under triton.autotune over _TUNE_SPACE[kind], pruned to what fits the device."""

    def prune(configs, named_args, **kwargs):
        smem = _smem_per_block(torch.device("cuda", torch.cuda.current_device()))
        ok = {
            (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"])
            for c in _tune_candidates(kind, kwargs["BLOCK_D"], smem)
        }
        kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in ok]
        return kept or configs[-1:]

    configs = [
        triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn), num_warps=w, num_stages=st) for bm, bn, w, st in _TUNE_SPACE[kind]
    ]
    key = ["seq_bucket", "BLOCK_D", "IS_VARLEN", "HAS_MASK", "HAS_DROPOUT"] + (["ATOMIC_DQ"] if kind == "dkdv" else [])
    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": prune},
        reset_to_zero=reset_to_zero,
        cache_results=True,
    )(kernel)


_attention_fwd_kernel_tuned = _tuned("fwd", _attention_fwd_kernel)
# The atomic dQ path accumulates into DQ: every benchmarked run must start from zeros.
_attention_bwd_dkdv_kernel_tuned = _tuned("dkdv", _attention_bwd_dkdv_kernel, reset_to_zero=["DQ"])
_attention_bwd_dq_kernel_tuned = _tuned("dq", _attention_bwd_dq_kernel)


def _autotuning(t: torch.Tensor) -> bool:
    """Autotune on CUDA for fp16/bf16 unless BERT_FAST_AUTOTUNE=0 (fp32 is for tests: fixed small
    tiles), on parts with the big shared memory _TUNE_SPACE is made for (A100/H100/H200/B200, >= 160
    KB per block: every kind keeps a candidate at head dim 128). The ~99 KB parts (sm_86/89/120)
    keep _configs' small tiles: the space has nothing that fits them at head dim 128."""
    return (
        t.is_cuda
        and t.dtype in (torch.float16, torch.bfloat16)
        and not _interpreting()
        and os.environ.get("BERT_FAST_AUTOTUNE", "1") != "0"
        and _smem_per_block(t.device) >= 160 * 1024
    )


def _seq_bucket(seqlen: int) -> int:
    """Autotune key of the (max) sequence length: next power of two, at least 16. Keyed on the raw
    length, every new max_seqlen of a varlen batch would re-benchmark every config."""
    return max(16, triton.next_power_of_2(int(seqlen)))


def _dot_prec(dtype: torch.dtype):
    return "ieee" if dtype == torch.float32 else None


class _Device:
    """Context: the CUDA device of ``t`` (no-op on the CPU / interpreter)."""

    def __init__(self, t: torch.Tensor):
        self.ctx = torch.cuda.device(t.device) if t.is_cuda else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _check_layout(qkv: torch.Tensor, varlen: bool) -> None:
    if qkv.dim() != (4 if varlen else 5) or qkv.shape[-3] != 3:
        raise ValueError(
            f"qkv has shape {tuple(qkv.shape)}, expected {'[T, 3, heads, d]' if varlen else '[B, S, 3, heads, d]'}"
        )
    if not 16 <= qkv.shape[-1] <= 128:
        raise ValueError(f"head dim must be in 16..128, got {qkv.shape[-1]}")


# ----------------------------------------------------------------------------- launch records
class _Launch(NamedTuple):
    """One launch of an attention kernel: ``kind`` names its configs ("fwd", "dkdv", "dq": _configs,
    _TUNE_SPACE; "pre": fixed), ``args`` are its run-time arguments in the kernel's order, ``meta``
    its constexprs. One program per block of ``tile`` ("BLOCK_M": queries, "BLOCK_N": keys) of
    each of the ``sequences`` (B * heads) of length ``seqlen``."""

    kind: str
    args: tuple
    meta: dict
    tile: str
    sequences: int
    seqlen: int

    def grid(self, cfg: dict) -> tuple:
        """The 1-D grid for the block sizes in ``cfg`` (a config, or the autotuner's meta)."""
        return (triton.cdiv(self.seqlen, cfg[self.tile]) * self.sequences,)


@dataclass(frozen=True)
class _Call:
    """One attention call as its kernels take it: padded or varlen, the sizes (``seqlen``: the
    longest sequence for varlen), the key mask and cu_seqlens (None when absent), the dropout draw.
    Its methods give each kernel's launch record, in the parameter order all the kernels share:
    tensors, KEY_MASK, CU_SEQLENS, scalars, the 4 strides of each [.., heads, d] tensor, lse's
    (batch, head) strides, the mask's strides, nheads, seqlen, seq_bucket."""

    varlen: bool
    batch: int
    seqlen: int
    nheads: int
    d: int
    key_mask: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    softmax_scale: float
    dropout_p: float
    seed: int

    @classmethod
    def of(cls, qkv, key_mask, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed) -> _Call:
        if cu_seqlens is not None:
            _, _, nheads, d = qkv.shape
            sizes = (True, cu_seqlens.numel() - 1, int(max_seqlen), nheads, d)
        else:
            batch, seqlen, _, nheads, d = qkv.shape
            sizes = (False, batch, seqlen, nheads, d)
        return cls(*sizes, key_mask, cu_seqlens, softmax_scale, dropout_p, seed)

    def outputs(self, qkv: torch.Tensor):
        """New (out, lse) of the forward, in the layouts of the module docstring."""
        if self.varlen:
            t = qkv.shape[0]
            shapes = (t, self.nheads, self.d), (self.nheads, t)
        else:
            shapes = (self.batch, self.seqlen, self.nheads, self.d), (self.batch, self.nheads, self.seqlen)
        return qkv.new_empty(shapes[0]), torch.empty(shapes[1], device=qkv.device, dtype=torch.float32)

    def _pointers(self, lse: torch.Tensor, mask_stand_in: torch.Tensor) -> tuple:
        """KEY_MASK and CU_SEQLENS, or stand-ins where absent (never read)."""
        return (self.key_mask if self.key_mask is not None else mask_stand_in, self.cu_seqlens if self.varlen else lse)

    def _strides(self, *tensors: torch.Tensor) -> tuple:
        """(batch, seq, head, dim) strides of each [B, S, h, d] (or varlen [T, h, d], batch stride 0) view."""
        return tuple(s for t in tensors for s in ((0,) if self.varlen else ()) + tuple(t.stride()))

    def _lse_strides(self, lse: torch.Tensor) -> tuple:
        return (0, lse.stride(0)) if self.varlen else (lse.stride(0), lse.stride(1))

    def _tail(self, lse: torch.Tensor) -> tuple:
        """The arguments after the [.., heads, d] tensors' strides."""
        mask_strides = self.key_mask.stride() if self.key_mask is not None else (0, 0)
        return (*self._lse_strides(lse), *mask_strides, self.nheads, self.seqlen, _seq_bucket(self.seqlen))

    def _launch(self, kind: str, tile: str, args: tuple, meta: dict) -> _Launch:
        return _Launch(kind, args, meta, tile, self.batch * self.nheads, self.seqlen)

    def _shape_meta(self) -> dict:
        """The constexprs of the layout, which every kernel takes."""
        return dict(HEAD_DIM=self.d, BLOCK_D=max(16, triton.next_power_of_2(self.d)), IS_VARLEN=self.varlen)

    def _meta(self, dtype: torch.dtype, **extra) -> dict:
        """The constexprs of the forward, dK/dV and dQ kernels (+ ``extra``)."""
        return dict(
            **self._shape_meta(),
            HAS_MASK=self.key_mask is not None,
            HAS_DROPOUT=self.dropout_p > 0.0,
            DOT_PREC=_dot_prec(dtype),
            INTERPRET=_interpreting(),
            **extra,
        )

    def fwd(self, qkv, out, lse) -> _Launch:
        q, k, v = qkv.unbind(-3)
        args = (q, k, v, out, lse, *self._pointers(lse, out), self.softmax_scale * LOG2E, self.dropout_p, self.seed)
        args += (*self._strides(q, k, v, out), *self._tail(lse))
        return self._launch("fwd", "BLOCK_M", args, self._meta(qkv.dtype, SCALE_POS=self.softmax_scale > 0.0))

    def preprocess(self, out, dout, delta, lse) -> _Launch:
        args = (out, dout, delta, self._pointers(lse, lse)[1], *self._strides(out, dout), *self._lse_strides(lse))
        meta = dict(self._shape_meta(), BLOCK_M=64, num_warps=4)
        return self._launch("pre", "BLOCK_M", args + (self.nheads, self.seqlen), meta)

    def _bwd_scalars(self) -> tuple:
        return (self.softmax_scale, self.softmax_scale * LOG2E, self.dropout_p, self.seed)

    def dkdv(self, qkv, dout, lse, delta, dq_buf, dqkv, atomic_dq: bool) -> _Launch:
        (q, k, v), (_, dk, dv) = qkv.unbind(-3), dqkv.unbind(-3)
        args = (q, k, v, dout, lse, delta, dq_buf, dk, dv, *self._pointers(lse, lse), *self._bwd_scalars())
        args += (*self._strides(q, k, v, dout, dq_buf, dk, dv), *self._tail(lse))
        return self._launch("dkdv", "BLOCK_N", args, self._meta(qkv.dtype, ATOMIC_DQ=atomic_dq))

    def dq(self, qkv, dout, lse, delta, dq) -> _Launch:
        q, k, v = qkv.unbind(-3)
        args = (q, k, v, dout, lse, delta, dq, *self._pointers(lse, lse), *self._bwd_scalars())
        args += (*self._strides(q, k, v, dout, dq), *self._tail(lse))
        return self._launch("dq", "BLOCK_M", args, self._meta(qkv.dtype))


def _launch(kernel, tuned, launch: _Launch, qkv: torch.Tensor) -> None:
    """Launch ``kernel`` with _configs' fixed choice, or its autotuned twin ``tuned`` (the grid
    depends on the config the autotuner picks)."""
    if _autotuning(qkv):
        tuned[launch.grid](*launch.args, **launch.meta)
    else:
        cfg = _fixed_config(launch, qkv)
        kernel[launch.grid(cfg)](*launch.args, **launch.meta, **cfg)


def _fixed_config(launch: _Launch, qkv: torch.Tensor) -> dict:
    """_configs' choice for this launch; for a forward whose 128-row query tiles would leave more
    than half the SMs idle (batch 1 at 128 tokens: 12 heads x 1 tile = 12 CTAs on 132 SMs), 64-row
    tiles on 4 warps instead, twice the CTAs (a _TUNE_SPACE tile, compiled offline for sm_80/sm_90)."""
    meta = launch.meta
    cfg = _configs(launch.kind, meta["BLOCK_D"], qkv.dtype, qkv.device, meta["HAS_DROPOUT"])
    if launch.kind == "fwd" and cfg["BLOCK_M"] == 128 and 2 * launch.grid(cfg)[0] < _num_sms(qkv.device):
        cfg = dict(cfg, BLOCK_M=64, num_warps=4)
    return cfg


# ----------------------------------------------------------------------------- launchers
def attention_fwd(
    qkv: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    max_seqlen: int,
    softmax_scale: float,
    dropout_p: float,
    seed: int,
):
    """Forward launcher. Padded (cu_seqlens None): qkv [B, S, 3, h, d], key_mask None or uint8 [B, S];
    varlen: qkv [T, 3, h, d], cu_seqlens int32 [B+1]. Returns (out, lse) as described above."""
    _check_layout(qkv, cu_seqlens is not None)
    call = _Call.of(qkv, key_mask, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed)
    out, lse = call.outputs(qkv)
    if out.numel() == 0 or call.batch == 0 or call.seqlen == 0:
        return out, lse
    with _Device(qkv):
        _launch(_attention_fwd_kernel, _attention_fwd_kernel_tuned, call.fwd(qkv, out, lse), qkv)
    return out, lse


def attention_bwd(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    max_seqlen: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    dropout_p: float,
    seed: int,
    deterministic: bool = False,
) -> torch.Tensor:
    """Backward launcher: returns dqkv, a new buffer of qkv's shape whose q/k/v slices the kernels
    write directly (never the saved qkv). ``deterministic`` picks the atomics-free dQ kernel."""
    _check_layout(qkv, cu_seqlens is not None)
    # BERT_FAST_ATTN_DQ=separate: the atomics-free dQ kernel also outside deterministic mode (for
    # measuring which is faster per shape: the atomic path moves an fp32 dQ buffer through DRAM).
    deterministic = deterministic or os.environ.get("BERT_FAST_ATTN_DQ", "") == "separate"
    if dout.dtype != qkv.dtype:
        dout = dout.to(qkv.dtype)
    dqkv = torch.empty(qkv.shape, device=qkv.device, dtype=qkv.dtype)
    if dqkv.numel() == 0:
        return dqkv
    call = _Call.of(qkv, key_mask, cu_seqlens, max_seqlen, softmax_scale, dropout_p, seed)
    if call.batch == 0 or call.seqlen == 0:
        return dqkv.zero_()
    dq = dqkv.unbind(-3)[0]
    delta = torch.empty_like(lse)
    with _Device(qkv):
        pre = call.preprocess(out, dout, delta, lse)
        _attention_bwd_preprocess_kernel[pre.grid(pre.meta)](*pre.args, **pre.meta)
        dq_buf = dq if deterministic else torch.zeros(dq.shape, device=qkv.device, dtype=torch.float32)
        dkdv = call.dkdv(qkv, dout, lse, delta, dq_buf, dqkv, atomic_dq=not deterministic)
        _launch(_attention_bwd_dkdv_kernel, _attention_bwd_dkdv_kernel_tuned, dkdv, qkv)
        if deterministic:
            _launch(_attention_bwd_dq_kernel, _attention_bwd_dq_kernel_tuned, call.dq(qkv, dout, lse, delta, dq), qkv)
        else:
            dq.copy_(dq_buf)
    return dqkv


def dropout_mask(
    batch: int, nheads: int, seqlen: int, dropout_p: float, seed: int, device: torch.device
) -> torch.Tensor:
    """The exact keep-mask (bool [B, heads, S, S], True = keep) that the attention kernels draw for
    (seed, dropout_p); sequence b of a varlen batch uses its top-left L x L block."""
    out = torch.empty((batch, nheads, seqlen, seqlen), device=device, dtype=torch.uint8)
    if out.numel() == 0:
        return out.bool()
    flat = out.view(batch * nheads, seqlen, seqlen)
    bm = bn = 64
    grid = (batch * nheads, triton.cdiv(seqlen, bm), triton.cdiv(seqlen, bn))
    with _Device(out):
        _attention_dropout_mask_kernel[grid](
            flat, dropout_p, seed, *flat.stride(), seqlen, BLOCK_M=bm, BLOCK_N=bn, num_warps=4
        )
    return out.bool()
