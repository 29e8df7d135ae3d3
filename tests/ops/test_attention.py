"""attention / varlen_attention: forward and dqkv vs a float64 oracle under the 2x rule.

Same file on the CPU (Triton interpreter, fp32/fp16, small shapes) and on CUDA (all head dims and
lengths, bf16, long sequences). The oracle is bert_fast.reference in float64; "torch in the same
dtype" is the same reference run in the kernel's dtype.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.utils.checkpoint

from bert_fast import reference
from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import attention as attention_cases
from bert_fast.ops import _dispatch, attention, varlen_attention
from bert_fast.testing import assert_close_2x, dtypes_for, philox4x32_10, pick_test_device, uint32_to_uniform_float

# every test launches one of these kernels (tests/conftest.py counts them) unless marked no_kernels
pytestmark = pytest.mark.kernels("attention")
DEVICE = pick_test_device()
CUDA = DEVICE.type == "cuda"
DTYPES = dtypes_for(DEVICE)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

LENGTHS = [1, 17, 97, 129, 257]
HEAD_DIMS = [16, 26, 40, 48, 64, 80, 96, 128]
if CUDA:
    SHAPES = [(s, d) for s in LENGTHS for d in HEAD_DIMS]
else:  # interpreter: every length and a subset of head dims (26 and 80 included), small batches
    SHAPES = [(1, 64), (17, 26), (97, 80), (129, 16), (257, 40), (64, 128), (33, 48), (40, 96)]


def _padded(seed, b, s, h, d, device, dtype, scale=1.0, keep=0.7, empty_row=None):
    """A padded call's qkv [B, S, 3, h, d] (attention_cases.sample_inputs), a cotangent dout
    [B, S, h, d] and a random key mask (_random_key_mask), all from one seed."""
    g = torch.Generator().manual_seed(seed)
    randn = seeded_randn(g, device, dtype)
    qkv, _ = attention_cases.sample_inputs([s] * b, s, h, d, randn, device, varlen=False, scale=scale)
    return qkv, randn(b, s, h, d), _random_key_mask(b, s, g, device, keep, empty_row)


def _varlen(seed, lengths, h, d, device, dtype):
    """A varlen call's qkv [T, 3, h, d] and cu_seqlens (attention_cases.sample_inputs) and a
    cotangent dout [T, h, d], from one seed."""
    randn = seeded_randn(seed, device, dtype)
    qkv, cu = attention_cases.sample_inputs(lengths, max(lengths), h, d, randn, device, varlen=True)
    return qkv, cu, randn(sum(lengths), h, d)


def _fwd_bwd(fn, qkv, dout, *args, **kwargs):
    """fn's output and d(qkv) for the cotangent dout; qkv keeps its strides (a detached view)."""
    x = qkv.detach().requires_grad_(True)
    out = fn(x, *args, **kwargs)
    (g,) = torch.autograd.grad(out, x, dout)
    return out, g


def _random_key_mask(b, s, g, device, keep=0.7, empty_row=None):
    """Keys kept at random (not a prefix: holes anywhere), key 0 of row 0 always, row ``empty_row`` none."""
    m = torch.rand(b, s, generator=g) < keep
    m[0, 0] = True
    if empty_row is not None:
        m[empty_row] = False
    return m.to(device)


def _check_padded(qkv, mask, dout, dropout_p=0.0, scale=None, name=""):
    """Kernel vs reference (2x rule) for out and dqkv; with dropout, the kernel's own mask feeds the
    reference."""
    torch.manual_seed(1234)
    x = qkv.detach().requires_grad_(True)
    out, keep = attention(x, mask, dropout_p, scale, return_dropout_mask=True)
    (g,) = torch.autograd.grad(out, x, dout)
    ref_args = (mask, dropout_p, scale, keep)
    out64, g64 = _fwd_bwd(reference.attention, qkv.double(), dout.double(), *ref_args)
    outt, gt = _fwd_bwd(reference.attention, qkv, dout, *ref_args)
    assert out.shape == out64.shape and g.shape == qkv.shape
    assert_close_2x(out, out64, outt, name=f"out{name}")
    assert_close_2x(g, g64, gt, name=f"dqkv{name}")
    return out, g


# ----------------------------------------------------------------------------- padded, 2x rule
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s,d", SHAPES)
def test_attention_2x_key_padding(device, s, d, dtype):
    qkv, dout, mask = _padded(1000 * s + d, 2, s, 2, d, device, dtype, empty_row=1 if s % 2 else None)
    _check_padded(qkv, mask, dout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_no_mask_and_scale(device, dtype):
    qkv, dout, _ = _padded(7, 2, 65, 3, 32, device, dtype)
    _check_padded(qkv, None, dout)
    _check_padded(qkv, None, dout, scale=0.3, name=" (scale 0.3)")


@pytest.mark.parametrize("scale", [0.0, -0.2])
def test_attention_zero_and_negative_scale(device, scale):
    """The forward folds a positive scale into one FFMA per score (max(s * c) = max(s) * c needs
    c > 0); zero and negative scales take the other path: a zero scale is uniform attention over
    the kept keys (no NaN from -inf * 0 at the masked ones), a negative one favours the lowest
    scores. Key padding with a fully masked row, 70 keys: a full block and a tail block."""
    qkv, dout, mask = _padded(71, 2, 70, 2, 32, device, DTYPES[-1], empty_row=1)
    out, _ = _check_padded(qkv, mask, dout, scale=scale, name=f" (scale {scale})")
    assert torch.isfinite(out).all()


def test_attention_fully_masked_row(device):
    qkv, dout, mask = _padded(3, 3, 40, 2, 32, device, torch.float32, scale=3.0)
    mask[1] = False  # a row (sequence) with no key at all
    out, dqkv = _check_padded(qkv, mask, dout)
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()
    assert (out[1] == 0).all()
    assert (dqkv[1] == 0).all()  # no key: no gradient to its q, k or v
    assert (dqkv[0, :, 1:][~mask[0]] == 0).all()  # masked keys get zero dK and dV


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_fully_masked_row_dtypes_dropout(device, dtype, dropout_p):
    """A sequence without keys next to real ones, in every dtype, with and without dropout:
    zeros and never NaN (on the GPU exp2 of -inf - -inf would be NaN), forward and backward."""
    qkv, dout, mask = _padded(8, 2, 70, 2, 26, device, dtype, scale=3.0, empty_row=1)
    torch.manual_seed(6)
    out, dqkv = _fwd_bwd(attention, qkv, dout, mask, dropout_p)
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()
    assert (out[1] == 0).all() and (dqkv[1] == 0).all()
    assert (dqkv[0, :, 1:][~mask[0]] == 0).all()
    assert out[0].abs().sum() > 0


def test_attention_integer_mask_equals_bool(device):
    qkv, _, mask = _padded(4, 2, 33, 2, 16, device, torch.float32)
    as_int = mask.to(torch.int64) * 2  # any nonzero means "attend"
    torch.testing.assert_close(attention(qkv, as_int), attention(qkv, mask), rtol=0, atol=0)
    torch.testing.assert_close(attention(qkv, mask.to(torch.int32)), attention(qkv, mask), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_noncontiguous(device, dtype):
    g = torch.Generator().manual_seed(5)
    randn = seeded_randn(g, device, dtype)
    b, s, h, d = 2, 50, 2, 40
    big, _ = attention_cases.sample_inputs([s] * b, s, h + 1, d + 8, randn, device, varlen=False)
    qkv = big[:, :, :, 1:, 4 : 4 + d]  # a strided view of a bigger tensor
    dout = randn(b, h, s, d).transpose(1, 2)  # non-contiguous cotangent
    assert not qkv.is_contiguous() and not dout.is_contiguous()
    mask = _random_key_mask(b, s, g, device)
    _check_padded(qkv, mask, dout)


# ----------------------------------------------------------------------------- varlen
def _pack(qkv_padded, lengths):
    """Real tokens of a right-padded [B, S, ...] batch -> ([T, ...], cu_seqlens int32)."""
    parts = [qkv_padded[i, :n] for i, n in enumerate(lengths)]
    return torch.cat(parts, 0), attention_cases.cu_seqlens(lengths, qkv_padded.device)


def _check_varlen(qkv, cu, max_seqlen, dout, dropout_p=0.0, name=""):
    """_check_padded's twin for packed sequences: kernel vs reference (2x rule) for out and dqkv;
    with dropout, the kernel's own mask feeds the reference. Returns the mask."""
    torch.manual_seed(1234)
    x = qkv.detach().requires_grad_(True)
    out, keep = varlen_attention(x, cu, max_seqlen, dropout_p, return_dropout_mask=True)
    (g,) = torch.autograd.grad(out, x, dout)
    ref_args = (cu, max_seqlen, dropout_p, None, keep)
    out64, g64 = _fwd_bwd(reference.varlen_attention, qkv.double(), dout.double(), *ref_args)
    outt, gt = _fwd_bwd(reference.varlen_attention, qkv, dout, *ref_args)
    assert_close_2x(out, out64, outt, name=f"out{name}")
    assert_close_2x(g, g64, gt, name=f"dqkv{name}")
    return keep


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths,d", [([5, 0, 97, 33], 26), ([129, 1, 64], 80), ([17], 64)])
def test_varlen_2x(device, lengths, d, dtype):
    qkv, cu, dout = _varlen(sum(lengths) + d, lengths, 2, d, device, dtype)
    max_s = max(lengths) + 3  # max_seqlen may exceed the longest sequence
    _check_varlen(qkv, cu, max_s, dout)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_equals_padded(device, dtype):
    lengths = [17, 3, 70, 1]
    b, s, h, d = len(lengths), 70, 2, 48
    randn = seeded_randn(11, device, dtype)
    qkv, mask = attention_cases.sample_inputs(lengths, s, h, d, randn, device, varlen=False)
    dout = randn(b, s, h, d) * mask[:, :, None, None]  # no cotangent on pads
    out_p, g_p = _fwd_bwd(attention, qkv, dout, mask)
    qkv_v, cu = _pack(qkv, lengths)
    dout_v, _ = _pack(dout, lengths)
    out_v, g_v = _fwd_bwd(varlen_attention, qkv_v, dout_v, cu, max(lengths))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out_v, _pack(out_p, lengths)[0], **tol)
    torch.testing.assert_close(g_v, _pack(g_p, lengths)[0], **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_noncontiguous(device, dtype):
    lengths = [40, 9]
    t, h, d = sum(lengths), 3, 26
    randn = seeded_randn(12, device, dtype)
    big, cu = attention_cases.sample_inputs(lengths, 40, 2 * h, d + 6, randn, device, varlen=True)
    qkv = big[:, :, ::2, 3 : 3 + d]
    dout = randn(h, t, d).transpose(0, 1)
    assert not qkv.is_contiguous() and not dout.is_contiguous()
    out, dqkv = _fwd_bwd(varlen_attention, qkv, dout, cu, 40)
    out64, g64 = _fwd_bwd(reference.varlen_attention, qkv.double(), dout.double(), cu, 40)
    outt, gt = _fwd_bwd(reference.varlen_attention, qkv, dout, cu, 40)
    assert_close_2x(out, out64, outt, name="out")
    assert_close_2x(dqkv, g64, gt, name="dqkv")


# ----------------------------------------------------------------------------- dropout
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dq_path", ["atomic", "separate"])
def test_dropout_mask_rebuilds_reference(device, dtype, dq_path, monkeypatch):
    """Forward, dK/dV and both dQ kernels apply the debug kernel's mask (each draws it in its own
    orientation and tile: [query, key] in the forward and dQ, [key, query] in dK/dV)."""
    if dq_path == "separate":
        monkeypatch.setenv("BERT_FAST_ATTN_DQ", "separate")
    qkv, dout, mask = _padded(21, 2, 45, 2, 32, device, dtype)
    _check_padded(qkv, mask, dout, dropout_p=0.2, name=" (dropout)")


def test_dropout_varlen_rebuilds_reference(device):
    qkv, cu, dout = _varlen(22, [30, 0, 7], 2, 16, device, torch.float32)
    keep = _check_varlen(qkv, cu, 30, dout, dropout_p=0.3)
    assert keep.shape == (3, 2, 30, 30) and keep.dtype == torch.bool


def test_dropout_varlen_mask_equals_padded_mask(device):
    """Same seed: varlen and padded draw the same bits for the same (sequence, head, query, key)."""
    qkv = _padded(9, 2, 20, 2, 16, device, torch.float32)[0]
    assert _dispatch.use_triton(qkv, uses_dot=True), "the attention kernel must run here (tests/conftest.py)"
    torch.manual_seed(9)
    _, keep_p = attention(qkv, None, 0.4, return_dropout_mask=True)
    torch.manual_seed(9)
    qkv_v, cu = _pack(qkv, [20, 11])
    _, keep_v = varlen_attention(qkv_v, cu, 20, 0.4, return_dropout_mask=True)
    assert torch.equal(keep_p[0], keep_v[0]) and torch.equal(keep_p[1, :, :11, :11], keep_v[1, :, :11, :11])


def _numpy_attention_keep(bh, s, p, seed):
    """keep[bh, q, k]: word k % 4 of Philox at counter (k // 4, q, bh, 0), uniform >= p."""
    i = np.arange(bh, dtype=np.uint64)[:, None, None]
    q = np.arange(s, dtype=np.uint64)[None, :, None]
    k = np.arange(s, dtype=np.uint64)[None, None, :]
    c0, c1, c2 = np.broadcast_arrays(k // np.uint64(4), q, i)
    words = philox4x32_10(c0, c1, c2, np.zeros_like(c0), seed)
    word = np.choose(np.broadcast_to((k % np.uint64(4)).astype(np.int64), c0.shape), words)
    return uint32_to_uniform_float(word) >= np.float32(p)


def test_dropout_mask_matches_numpy_philox(device):
    """The attention dropout stream bit for bit: one Philox4x32-10 per 4 keys of a query row, counter
    (key // 4, query, b * heads + h, 0), key = 64-bit seed, word key % 4 (a length that is not a
    multiple of 4 or of the debug kernel's 64-wide tiles, a seed above 2**32)."""
    from bert_fast.kernels.attention import dropout_mask

    b, h, s, p = 2, 3, 70, 0.3
    for seed in (12345, 0x299F31D0A4093822):
        got = dropout_mask(b, h, s, p, seed, device).reshape(b * h, s, s).cpu().numpy()
        want = _numpy_attention_keep(b * h, s, p, seed)
        assert (got == want).all(), (seed, np.argwhere(got != want)[:5])


def test_dropout_keep_fraction_binomial(device):
    b, s, h, p = 2, 128, 2, 0.3
    qkv = _padded(0, b, s, h, 16, device, torch.float32)[0]
    torch.manual_seed(0)
    _, keep = attention(qkv, None, p, return_dropout_mask=True)
    n = keep.numel()
    frac = keep.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(frac - (1 - p)) < 5 * sigma, f"keep fraction {frac:.4f} vs {1 - p} (sigma {sigma:.2e})"
    # every (batch, head) slice, row parity and column parity: no structure in the stream
    for part in (keep[0, 0], keep[1, 1], keep[..., ::2, :], keep[..., :, 1::2]):
        m = part.numel()
        assert abs(part.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / m)
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])


def test_dropout_same_seed_same_output(device):
    qkv, _, mask = _padded(23, 2, 30, 2, 16, device, torch.float32)
    torch.manual_seed(42)
    a = attention(qkv, mask, 0.25)
    torch.manual_seed(42)
    b = attention(qkv, mask, 0.25)
    c = attention(qkv, mask, 0.25)  # next seed
    gen = torch.Generator().manual_seed(42)
    d = attention(qkv, mask, 0.25, generator=gen)
    assert torch.equal(a, b) and torch.equal(a, d)
    assert not torch.equal(a, c)
    assert torch.equal(attention(qkv, mask, 0.0), attention(qkv, mask))


def test_dropout_checkpoint_recompute(device):
    qkv, dout, _ = _padded(24, 2, 30, 2, 16, device, torch.float32)

    def f(x):
        return attention(x, None, 0.3) * 2.0

    torch.manual_seed(3)
    out1, g1 = _fwd_bwd(f, qkv, dout)
    torch.manual_seed(3)
    x = qkv.detach().requires_grad_(True)
    out2 = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)
    (g2,) = torch.autograd.grad(out2, x, dout)
    assert torch.equal(out1, out2)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- determinism
@pytest.fixture
def deterministic_mode():
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(prev, warn_only=warn)


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_bitwise(device, dtype, deterministic_mode):
    qkv, dout, mask = _padded(31, 2, 97, 2, 26, device, dtype, empty_row=1)
    _, g1 = _fwd_bwd(attention, qkv, dout, mask, 0.1, generator=torch.Generator().manual_seed(1))
    _, g2 = _fwd_bwd(attention, qkv, dout, mask, 0.1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(g1, g2)
    _check_padded(qkv, mask, dout, name=" (deterministic)")
    cu = attention_cases.cu_seqlens([60, 0, 37], device)
    qv, dv = qkv[0], dout[0]
    _, g3 = _fwd_bwd(varlen_attention, qv, dv, cu, 60)
    _, g4 = _fwd_bwd(varlen_attention, qv, dv, cu, 60)
    assert torch.equal(g3, g4)


# ----------------------------------------------------------------------------- op registration
def test_opcheck(device):
    qkv, dout, mask = _padded(41, 2, 17, 2, 16, device, torch.float32)
    mask = mask.view(torch.uint8)
    seed = torch.tensor([123], dtype=torch.int64)
    torch.library.opcheck(torch.ops.bert_fast.attention_fwd.default, (qkv, mask, 0.0, 0.25, None))
    torch.library.opcheck(torch.ops.bert_fast.attention_fwd.default, (qkv, None, 0.2, 0.25, seed))
    qv, cu, _ = _varlen(41, [3, 17], 2, 16, device, torch.float32)
    torch.library.opcheck(torch.ops.bert_fast.varlen_attention_fwd.default, (qv, cu, 17, 0.0, 0.25, None))
    torch.library.opcheck(torch.ops.bert_fast.varlen_attention_fwd.default, (qv, cu, 17, 0.2, 0.25, seed))
    out, lse = torch.ops.bert_fast.attention_fwd(qkv, mask, 0.0, 0.25, None)
    torch.library.opcheck(
        torch.ops.bert_fast.attention_bwd.default,
        (dout, qkv, mask, out, lse, 0.0, 0.25, None),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.no_kernels("float64 has no attention kernel: the torch implementation runs")
def test_gradcheck_float64(device):
    """float64 runs the torch implementation (its materialized path): checks the op plumbing
    (autograd, masks) end to end."""
    qkv = _padded(42, 2, 5, 1, 16, device, torch.float64)[0].requires_grad_(True)
    # a hole in row 0's keys, none in row 1
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool, device=device)
    assert torch.autograd.gradcheck(lambda x: attention(x, mask), (qkv,), fast_mode=True)
    qv, cu, _ = _varlen(42, [2, 4], 1, 16, device, torch.float64)
    qv.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: varlen_attention(x, cu, 4), (qv,), fast_mode=True)


@pytest.mark.no_kernels("BERT_FAST_BACKEND=reference on purpose")
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_reference_backend(device, monkeypatch, dropout_p):
    """BERT_FAST_BACKEND=reference (the oracle, forced): the ops' analytic backward equals
    autograd through bert_fast.reference with the mask the op reports."""
    monkeypatch.setenv("BERT_FAST_BACKEND", "reference")
    qkv, dout, mask = _padded(44, 2, 9, 2, 16, device, torch.float32, empty_row=1)
    torch.manual_seed(0)
    x = qkv.detach().requires_grad_(True)
    out, keep = attention(x, mask, dropout_p, return_dropout_mask=True)
    (dqkv,) = torch.autograd.grad(out, x, dout)
    out_r, g_r = _fwd_bwd(reference.attention, qkv, dout, mask, dropout_p, None, keep)
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(dqkv, g_r)
    cu = attention_cases.cu_seqlens([9, 0, 3], device)
    qv, dv = qkv.reshape(18, 3, 2, 16)[:12], dout.reshape(18, 2, 16)[:12]
    torch.manual_seed(0)
    x = qv.detach().requires_grad_(True)
    out, keep = varlen_attention(x, cu, 9, dropout_p, return_dropout_mask=True)
    (dqkv,) = torch.autograd.grad(out, x, dv)
    out_r, g_r = _fwd_bwd(reference.varlen_attention, qv, dv, cu, 9, dropout_p, None, keep)
    torch.testing.assert_close(out, out_r)
    torch.testing.assert_close(dqkv, g_r)


def test_lse_matches_reference(device):
    qkv, _, mask = _padded(43, 2, 33, 2, 16, device, torch.float32, empty_row=1)
    mask = mask.view(torch.uint8)
    _, lse = torch.ops.bert_fast.attention_fwd(qkv, mask, 0.0, 0.25, None)
    q, k = qkv[:, :, 0].transpose(1, 2).double(), qkv[:, :, 1].transpose(1, 2).double()
    s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    ref = torch.logsumexp(s, -1)
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 33)
    assert torch.isposinf(lse[1]).all()
    torch.testing.assert_close(lse[0].double(), ref[0], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- edge cases
@pytest.mark.no_kernels("empty batches return before any launch")
@pytest.mark.parametrize("shape", [(0, 5, 3, 2, 16), (2, 0, 3, 2, 16)])
def test_empty_padded(device, shape):
    qkv = torch.randn(shape, device=device, requires_grad=True)
    out = attention(qkv, torch.ones(shape[:2], dtype=torch.bool, device=device), 0.1)
    assert out.shape == (shape[0], shape[1], shape[3], shape[4])
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape


@pytest.mark.no_kernels("empty batches return before any launch")
def test_empty_varlen(device):
    qkv = torch.randn(0, 3, 2, 16, device=device, requires_grad=True)
    for cu in (torch.tensor([0], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32)):
        out = varlen_attention(qkv, cu.to(device), 0)
        assert out.shape == (0, 2, 16)
        out.sum().backward()
        assert qkv.grad.shape == qkv.shape


def test_varlen_compiles_without_a_graph_break(device):
    """The default validate=True reads cu_seqlens on the host; under torch.compile that check is
    skipped rather than breaking the graph (fullgraph=True raises on a break)."""
    qkv, cu, _ = _varlen(31, [3, 4], 2, 16, device, torch.float32)
    eager = varlen_attention(qkv, cu, 4)
    compiled = torch.compile(lambda x, c: varlen_attention(x, c, 4), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(qkv, cu), eager)


@pytest.mark.no_kernels("validation raises before any launch")
def test_bad_inputs(device):
    qkv = torch.randn(2, 8, 3, 2, 16, device=device)
    with pytest.raises(ValueError, match="5 dimensions"):
        attention(qkv[0])
    with pytest.raises(ValueError, match="must be 3"):
        attention(torch.randn(2, 8, 2, 2, 16, device=device))
    with pytest.raises(ValueError, match="head dim"):
        attention(torch.randn(2, 8, 3, 2, 0, device=device))
    with pytest.raises(TypeError, match="dtype"):
        attention(qkv.to(torch.int32))
    with pytest.raises(TypeError, match="float32"):
        attention(qkv, torch.ones(2, 8, device=device))
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        attention(qkv, torch.ones(2, 7, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match="device"):
        attention(qkv, torch.ones(2, 8, dtype=torch.bool, device="meta"))
    for p in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="dropout_p"):
            attention(qkv, None, p)
    with pytest.raises(ValueError, match="softmax_scale"):
        attention(qkv, None, 0.0, float("nan"))

    qv = torch.randn(10, 3, 2, 16, device=device)
    ok = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="4 dimensions"):
        varlen_attention(qkv, ok, 6)
    with pytest.raises(ValueError, match="int32"):
        varlen_attention(qv, ok.long(), 6)
    with pytest.raises(ValueError, match="1-D"):
        varlen_attention(qv, ok[None], 6)
    with pytest.raises(ValueError, match="start at 0"):
        varlen_attention(qv, torch.tensor([1, 4, 10], dtype=torch.int32, device=device), 6)
    with pytest.raises(ValueError, match="non-decreasing"):
        varlen_attention(qv, torch.tensor([0, 6, 4, 10], dtype=torch.int32, device=device), 6)
    with pytest.raises(ValueError, match="T = 10"):
        varlen_attention(qv, torch.tensor([0, 4, 9], dtype=torch.int32, device=device), 6)
    with pytest.raises(ValueError, match="max_seqlen = 5"):
        varlen_attention(qv, ok, 5)
    with pytest.raises(ValueError, match="device"):
        varlen_attention(qv, ok.to("meta"), 6)
    with pytest.raises(ValueError, match="dropout_p"):
        varlen_attention(qv, ok, 6, 1.0)


# ----------------------------------------------------------------------------- CUDA only
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,d", [(1024, 64), (2048, 128), (4096, 64), (1500, 80)])
def test_long_sequences_cuda(device, s, d, dtype):
    qkv, dout, mask = _padded(s + d, 1, s, 2, d, device, dtype, keep=0.9)
    _check_padded(qkv, mask, dout)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_varlen_dropout_cuda(device, dtype):
    qkv, cu, dout = _varlen(51, [4096, 1000, 1], 2, 64, device, dtype)
    _check_varlen(qkv, cu, 4096, dout, dropout_p=0.1)


# ----------------------------------------------------------------------------- every config of the search space
def _attention_space():
    """{kind: [(BLOCK_M, BLOCK_N), ...]}: every tile kernels/attention.py may launch on a GPU, the
    autotune space (_TUNE_SPACE) and the fixed choices of _configs (BERT_FAST_AUTOTUNE=0, fp32, the
    99 KB parts) over the parts, head dims, dtypes and dropout it distinguishes. (Warps and stages
    are not part of a tile: the interpreter cannot tell them apart; offline compiles check them.)"""
    from bert_fast.kernels import attention as A

    class Props:
        major = minor = 0
        shared_memory_per_block_optin = 0

    space = {kind: {(c[0], c[1]) for c in cands} for kind, cands in A._TUNE_SPACE.items()}
    with pytest.MonkeyPatch.context() as mp:
        for major, smem in ((8, 101376), (8, 166912), (9, 232448)):
            mp.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
            mp.setattr(A, "_smem_per_block", lambda device, s=smem: s)
            for kind in space:
                for block_d in (32, 64, 128):
                    for dtype in (torch.float16, torch.float32):
                        for dropout in (False, True):
                            c = A._configs(kind, block_d, dtype, torch.device("cuda", 0), dropout)
                            space[kind].add((c["BLOCK_M"], c["BLOCK_N"]))
    return [(kind, bm, bn) for kind in ("fwd", "dkdv", "dq") for bm, bn in sorted(space[kind])]


_KERNEL_OF = {"fwd": "_attention_fwd_kernel", "dkdv": "_attention_bwd_dkdv_kernel", "dq": "_attention_bwd_dq_kernel"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16] if CUDA else [torch.float32, torch.float16])
@pytest.mark.parametrize("kind,bm,bn", _attention_space(), ids=lambda v: str(v))
def test_every_config_tile(device, kind, bm, bn, dtype, monkeypatch, kernel_launches):
    """Each tile of the attention search space, pinned for its kernel (forward, dK/dV, or the
    separate dQ kernel) while the others keep their usual config: padded, key padding with a fully
    masked sequence, dropout (the Philox draw must not depend on the tile), head dim 26, and a
    length S with two full blocks and a tail along the loop the kernel walks (keys for the forward
    and dQ, queries for dK/dV) and two or more programs along the other. 2x rule vs the reference
    fed the kernel's own mask (the forward's output alone for a forward tile); the launch record
    shows the tile ran."""
    from bert_fast.kernels import attention as A

    # judged here against the oracle, tile by tile: the ops' first-use check keys its verdicts on the
    # specialization, not the tile, so a verdict must not carry over from one tile's test to the next
    monkeypatch.setenv("BERT_FAST_VERIFY", "off")
    configs = A._configs
    tile = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=1 if device.type == "cpu" else 2)
    monkeypatch.setattr(A, "_configs", lambda k, *a: tile if k == kind else configs(k, *a))
    monkeypatch.setattr(A, "_autotuning", lambda t: False)
    monkeypatch.setattr(A, "_num_sms", lambda dev: 0)  # no small-grid switch to 64-row tiles: the pinned tile runs
    if kind == "dq":
        monkeypatch.setenv("BERT_FAST_ATTN_DQ", "separate")
    step = bm if kind == "dkdv" else bn  # the block its loop walks: queries for dK/dV, else keys
    s = max(2 * step, bm, bn) + 9
    qkv, dout, mask = _padded(bm + 3 * bn, 2, s, 1, 26, device, dtype, empty_row=1)
    if kind == "fwd":
        torch.manual_seed(1234)
        out, keep = attention(qkv, mask, 0.2, return_dropout_mask=True)
        assert_close_2x(
            out,
            reference.attention(qkv.double(), mask, 0.2, None, keep),
            reference.attention(qkv, mask, 0.2, None, keep),
            name=f"out ({kind} {bm}x{bn})",
        )
    else:
        _check_padded(qkv, mask, dout, dropout_p=0.2, name=f" ({kind} {bm}x{bn})")
    ran = {(t["BLOCK_M"], t["BLOCK_N"]) for t in kernel_launches.tiles(_KERNEL_OF[kind])}
    assert ran == {(bm, bn)}, ran


# ----------------------------------------------------------------------------- autotuned launches
@pytest.fixture
def autotuned_attention(monkeypatch):
    """The autotuned launch path (what fp16/bf16 on CUDA take), made to run anywhere: on the CPU the
    interpreter runs every candidate, timed by the clock instead of CUDA events (Triton's benchmarker
    needs a GPU driver), with an H100's shared memory for the pruning."""
    from bert_fast.kernels import attention as A

    monkeypatch.setenv("BERT_FAST_AUTOTUNE", "1")
    if not CUDA:
        import time

        def clock_bench(kernel_call, quantiles):
            t0 = time.perf_counter()
            kernel_call()
            t = time.perf_counter() - t0
            return [t, t, t]

        monkeypatch.setattr(A, "_autotuning", lambda t: True)
        monkeypatch.setattr(A, "_smem_per_block", lambda device: 232448)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        for tuned in (
            A._attention_fwd_kernel_tuned,
            A._attention_bwd_dkdv_kernel_tuned,
            A._attention_bwd_dq_kernel_tuned,
        ):
            monkeypatch.setitem(tuned.__dict__, "do_bench", clock_bench)  # a cached_property
            monkeypatch.setattr(tuned, "cache", {})
            monkeypatch.setattr(tuned, "cache_results", False)  # its disk key asks the GPU driver
    return A


@pytest.mark.parametrize("dq_path", ["atomic", "separate"])
def test_autotuned_launch_2x(device, autotuned_attention, dq_path, monkeypatch):
    """Every autotune candidate runs (each once per benchmark) before the chosen one: the grid follows
    the config's BLOCK_M / BLOCK_N, and the atomic dQ buffer is zeroed before each benchmarked run and
    the final one (reset_to_zero), or dQ would come out summed over every candidate. Dropout + mask,
    against the reference fed the kernel's own mask; varlen too."""
    A = autotuned_attention
    if dq_path == "separate":
        monkeypatch.setenv("BERT_FAST_ATTN_DQ", "separate")
    dtype = torch.bfloat16 if CUDA else torch.float32
    qkv, dout, mask = _padded(97, 2, 70, 2, 32, device, dtype, empty_row=1)
    _check_padded(qkv, mask, dout, dropout_p=0.2, name=" (autotuned)")
    assert A._attention_fwd_kernel_tuned.cache and A._attention_bwd_dkdv_kernel_tuned.cache
    if dq_path == "separate":
        assert A._attention_bwd_dq_kernel_tuned.cache
    qv, cu, dv = _varlen(98, [70, 0, 33], 2, 32, device, dtype)
    _check_varlen(qv, cu, 70, dv, name=" (autotuned varlen)")


@pytest.mark.no_kernels("a host-side helper")
def test_autotune_key_buckets_sequence_length():
    """The autotune key buckets the (max) sequence length, so a varlen batch with a new max_seqlen
    reuses the tuned config of its bucket instead of benchmarking every candidate again."""
    from bert_fast.kernels.attention import _seq_bucket

    assert [_seq_bucket(n) for n in (1, 16, 17, 100, 128, 129, 512, 4096)] == [16, 16, 32, 128, 128, 256, 512, 4096]


# ----------------------------------------------------------------------------- real GPU targets, offline
_COMPILE_SCRIPT = textwrap.dedent("""
    import json, sys, torch, triton
    from triton.compiler import ASTSource, make_backend
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import create_function_from_signature
    import bert_fast.kernels.attention as A

    arch, smem, dims = int(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    target = GPUTarget("cuda", arch, 32)

    class Props:
        major, minor = divmod(arch, 10)
        shared_memory_per_block_optin = smem

    torch.cuda.get_device_capability = lambda device=None: divmod(arch, 10)
    torch.cuda.get_device_properties = lambda device=None: Props()
    configs = A._configs
    A._configs = lambda kind, bd, dt, dev, *a: configs(kind, bd, dt, torch.device("cuda", 0), *a)

    class Compile:   # stands in for kernel[grid](...): compiles for `target` what the launcher would run
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                backend = make_backend(target)
                binder = create_function_from_signature(self.k.signature, self.k.params, backend)
                bound, spec, opts = binder(*args, **kwargs)
                opts, sig, constexprs, attrs = self.k._pack_args(backend, kwargs, bound, spec, opts)
                c = triton.compile(ASTSource(self.k, sig, constexprs, attrs), target=target,
                                   options=opts.__dict__)
                print(json.dumps(dict(kernel=self.k.fn.__name__, shared=c.metadata.shared,
                                      cfg={n: kwargs.get(n) for n in ("BLOCK_M", "BLOCK_N", "num_warps",
                                                                      "num_stages")})), flush=True)
            return launch

    for name in ("_attention_fwd_kernel", "_attention_bwd_preprocess_kernel",
                 "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel"):
        setattr(A, name, Compile(getattr(A, name)))

    def run(dtype, d, cases):
        b, s, h = 2, 130, 2
        qkv = torch.randn(b, s, 3, h, d).to(dtype)
        mask = (torch.rand(b, s) < 0.8).view(torch.uint8)
        for p, det in cases:
            out, lse = A.attention_fwd(qkv, mask, None, s, d ** -0.5, p, 7)
            A.attention_bwd(torch.randn(b, s, h, d).to(dtype), qkv, mask, None, s, out, lse,
                            d ** -0.5, p, 7, det)

    if sys.argv[4] == "fixed":          # what _configs picks (BERT_FAST_AUTOTUNE=0, fp32)
        for dtype in (torch.float16, torch.float32):
            for d in dims:
                run(dtype, d, ((0.0, False), (0.1, True)))
    else:                               # every autotune candidate that _tune_candidates keeps
        for d in dims:
            bd = max(16, triton.next_power_of_2(d))
            for kind in ("fwd", "dkdv", "dq"):
                for cand in A._tune_candidates(kind, bd, smem):
                    A._configs = (lambda kind_, bd_, dt, dev, *a, kind=kind, cand=cand:
                                  cand if kind_ == kind else configs(kind_, bd_, dt, torch.device("cuda", 0), *a))
                    # dropout + mask: the most registers; dQ's own kernel only on the deterministic path
                    run(torch.float16, d, ((0.1, kind == "dq"),))
""")


@pytest.mark.no_kernels("offline sm_80/sm_86/sm_90 compile in a subprocess")
@pytest.mark.slow
@pytest.mark.parametrize("arch,smem", [(90, 232448), (80, 166912), (86, 101376)])
def test_configs_fit_shared_memory(arch, smem):
    """Compile (no GPU needed, TRITON_INTERPRET off) the kernels the launchers would run with the
    configs _configs picks for sm_90 (227 KB), sm_80 (163 KB) and sm_86/89/120 (99 KB), fp16 and
    fp32, mask and dropout, atomic and separate dQ; each must fit the part's shared memory
    (the interpreter never checks it, a GPU fails at launch: "out of resources")."""
    rows = _compile_offline(arch, smem, "fixed")
    kernels = {row["kernel"] for row in rows}
    assert {"_attention_fwd_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_dq_kernel"} <= kernels
    too_big = [row for row in rows if row["shared"] > smem]
    assert not too_big, f"sm_{arch}: configs over {smem} B of shared memory: {too_big}"


def _compile_offline(arch, smem, mode):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, str(arch), str(smem), "64,128", mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.mark.no_kernels("offline sm_80/sm_90 compile in a subprocess")
@pytest.mark.slow
@pytest.mark.parametrize("arch,part_smem", [(90, 232448), (80, 166912)])
def test_autotune_candidates_fit(arch, part_smem):
    """Every config the autotuner may try on an H100/H200 (sm_90, 227 KB) or an A100 (sm_80, 163 KB)
    at head dims 64 and 128, with mask and dropout, compiles for that part within its shared memory
    (_tune_candidates' estimate is what prunes the space, so it must not let through a tile that
    fails at launch); and on sm_90 the fixed BERT_FAST_AUTOTUNE=0 choice is among the candidates
    (tuning can only match or beat it)."""
    from bert_fast.kernels import attention as A

    smem = 232448

    class Props:
        major, minor, shared_memory_per_block_optin = 9, 0, smem

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        mp.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
        for kind in ("fwd", "dkdv", "dq"):
            for bd in (64, 128):
                cands = A._tune_candidates(kind, bd, smem)
                assert len(cands) >= 3, (kind, bd, cands)
                assert A._tune_candidates(kind, bd, 160 * 1024), (kind, bd)  # the smallest tuned part
                for dropout in (False, True):
                    fixed = A._configs(kind, bd, torch.bfloat16, torch.device("cuda", 0), dropout)
                    assert fixed in cands, (kind, bd, dropout, fixed)
    rows = _compile_offline(arch, part_smem, "tune")
    tried = {(row["kernel"], tuple(row["cfg"].values())) for row in rows}
    assert sum(1 for k, _ in tried if k == "_attention_fwd_kernel") >= (6 if arch == 90 else 4)
    too_big = [row for row in rows if row["shared"] > part_smem]
    assert not too_big, f"sm_{arch}: autotune candidates over {part_smem} B of shared memory: {too_big}"


# ----------------------------------------------------------------------------- CUDA only: GPU-only paths
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dq_path", ["atomic", "separate"])
def test_dropout_head_dims_dq_paths_cuda(device, d, dtype, dq_path, monkeypatch):
    """Dropout changes the forward's config (BLOCK_N) and adds the Philox draw to every kernel:
    every head dim, fp16/bf16, padded + varlen, both dQ kernels, against the reference fed the
    kernel's own mask."""
    if dq_path == "separate":
        monkeypatch.setenv("BERT_FAST_ATTN_DQ", "separate")
    qkv, dout, mask = _padded(61 + d, 2, 193, 3, d, device, dtype, empty_row=1)
    _check_padded(qkv, mask, dout, dropout_p=0.15, name=f" (dropout, {dq_path} dQ)")
    qv, cu, dv = _varlen(161 + d, [150, 0, 1, 193, 64], 3, d, device, dtype)
    _check_varlen(qv, cu, 193, dv, dropout_p=0.15, name=f" (varlen dropout, {dq_path} dQ)")


# One sequence whose q/k/v rows span more than 2**31 elements, run step by step in its own process
# (CUDA_LAUNCH_BLOCKING=1): an out-of-bounds access kills only that process, and the last step printed
# names the culprit. On the 11-28 H200 lease the padded op faulted here inside its first-use check
# (the kernel alone under the interpreter matches the compact copy), poisoning 170 later tests of
# the worker that ran it.
_INT64_SCRIPT = textwrap.dedent("""
    import os, torch
    from bert_fast.ops import attention, varlen_attention
    from bert_fast.bench.op_case import seeded_randn
    from bert_fast.bench.op_cases import attention as cases

    s, h, d, row = 4096, 1, 16, 786432
    dev = torch.device("cuda")
    randn = seeded_randn(71, dev, torch.float16)
    compact, cu = cases.sample_inputs([s], s, h, d, randn, dev, varlen=True)
    dout = randn(s, h, d)
    buf = torch.zeros(s * row, device=dev, dtype=torch.float16)
    big = buf.as_strided((s, 3, h, d), (row, h * d, d, 1))
    big.copy_(compact)
    torch.use_deterministic_algorithms(True, warn_only=True)  # separate dQ: bitwise comparable

    def fwd_bwd(fn, qkv, dout, *args):
        x = qkv.detach().requires_grad_(True)
        out = fn(x, *args)
        (g,) = torch.autograd.grad(out, x, dout)
        torch.cuda.synchronize()
        return out, g

    def same(step, a, b):
        print("step:", step, flush=True)
        torch.testing.assert_close(a[0].reshape(b[0].shape), b[0], rtol=0, atol=0, msg=lambda m: step + ": " + m)
        torch.testing.assert_close(a[1].reshape(b[1].shape), b[1], rtol=0, atol=0, msg=lambda m: step + ": " + m)

    mask = torch.ones(1, s, dtype=torch.bool, device=dev)
    ref = fwd_bwd(varlen_attention, compact, dout, cu, s)
    os.environ["BERT_FAST_VERIFY"] = "off"  # read at every call
    same("varlen kernel", fwd_bwd(varlen_attention, big, dout, cu, s), ref)
    same("padded kernel", fwd_bwd(attention, big[None], dout[None], mask), ref)
    os.environ["BERT_FAST_VERIFY"] = "strict"  # a failed check raises (the suite's mode)
    same("varlen op with its first-use check", fwd_bwd(varlen_attention, big, dout, cu, s), ref)
    same("padded op with its first-use check", fwd_bwd(attention, big[None], dout[None], mask), ref)
    print("step: done", flush=True)
""")


@needs_cuda
@pytest.mark.slow
@pytest.mark.no_kernels("runs the kernels in a subprocess")
def test_int64_offsets_cuda(device, tmp_path):
    """The key/query block offsets inside the loops (n0 * stride) must be int64: the same result
    as a compact copy, bit for bit, padded and varlen, kernel alone and through the op's check."""
    need = 4096 * 786432 * 2
    free, _ = torch.cuda.mem_get_info(device)
    if free < need + (2 << 30):
        pytest.skip(f"needs {need / 2**30:.1f} GiB free on the GPU")
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", BERT_FAST_VERIFY_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _INT64_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step:")]
    assert r.returncode == 0 and steps[-1:] == ["step: done"], (
        f"failed at {steps[-1] if steps else 'setup'}: " + r.stderr[-3000:]
    )


@needs_cuda
def test_tensor_on_second_gpu_cuda():
    """Launch on the tensor's GPU (not the current one) with that GPU's configs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    qkv, dout, mask = _padded(81, 2, 77, 2, 64, torch.device("cuda:0"), torch.float16)
    torch.manual_seed(0)
    out0, g0 = _fwd_bwd(attention, qkv, dout, mask, 0.1)
    with torch.cuda.device(0):
        torch.manual_seed(0)
        out1, g1 = _fwd_bwd(attention, qkv.to("cuda:1"), dout.to("cuda:1"), mask.to("cuda:1"), 0.1)
    assert out1.device == torch.device("cuda:1")
    if torch.cuda.get_device_capability(0) == torch.cuda.get_device_capability(1):
        torch.testing.assert_close(out1.cpu(), out0.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(g1.cpu(), g0.cpu(), rtol=2e-3, atol=2e-3)


@pytest.mark.no_kernels("head dims outside 16..128 run the torch implementation, never the kernel")
@pytest.mark.parametrize("d", [8, 160, 256])
def test_head_dims_outside_the_kernel_run_torch_with_one_warning(device, d, monkeypatch):
    """transformers' own tiny configs use head dim 8 and some models 256: they run (padded and
    varlen), equal to the reference, with one warning where a kernel would otherwise run."""
    attention_mod = sys.modules["bert_fast.ops.attention"]
    monkeypatch.setattr(attention_mod, "_WARNED_HEAD_DIMS", set())
    randn = seeded_randn(5, device, torch.float32)
    qkv, mask = attention_cases.sample_inputs([7, 4], 7, 2, d, randn, device, varlen=False)
    kernel_would_run = attention_mod._dispatch.implementation(qkv, uses_dot=True) == "kernel"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = attention(qkv, mask)
        packed, cu = _pack(qkv, [7, 4])
        out_varlen = varlen_attention(packed, cu, 7)
    ref = reference.attention(qkv.double(), mask).float()
    torch.testing.assert_close(out[mask], ref[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_varlen, torch.cat([ref[0], ref[1, :4]]), atol=1e-5, rtol=1e-5)
    mine = [w for w in caught if f"head dim {d}" in str(w.message)]
    assert len(mine) == (1 if kernel_would_run else 0)
