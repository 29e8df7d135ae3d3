"""torch's fused attention as the torch implementation's CUDA path (bert_fast/ops/fused_sdpa.py).

No GPU runs this project's CPU suite, so the fused kernels are tested in two halves:
  * plumbing: every aten call of fused_sdpa is run on the ``meta`` device with torch's own meta
    kernels (shapes, dtypes, the lse padding and its slicing, the backward's outputs);
  * logic: the selection and the first-use self-check on CPU tensors, with ``on_cuda`` forced and
    the aten ops replaced by CPU emulations written here from the kernels' documented contract
    (float64 math; lse padded to a multiple of 32 with garbage in the padding; a row whose keys are
    all masked comes out NaN, the worst a kernel may do; the bias and lse alignment asserted). A
    correct emulation is accepted and used; a perturbed, a raising and a NaN one are rejected, the
    op's result is then the materialized path's, and one warning says so.
"""

import math
import warnings

import pytest
import torch

from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import attention as attention_cases
from bert_fast.ops import fused_sdpa, torch_impl

pytestmark = pytest.mark.no_kernels("the torch implementation's fused CUDA path, emulated on the CPU")

A = torch.ops.aten


def _ceil(n, m):
    return (n + m - 1) // m * m


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


# ----------------------------------------------------------------------------- (a) meta plumbing
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,s,h,d", [(2, 17, 3, 32), (1, 1, 2, 64), (3, 64, 4, 16), (2, 129, 2, 128)])
@pytest.mark.parametrize("masked", [True, False])
def test_padded_plumbing_on_meta(dtype, b, s, h, d, masked):
    """The real aten ops (their meta kernels): the op's contract comes out of fused_sdpa."""
    qkv = torch.empty((b, s, 3, h, d), dtype=dtype, device="meta")
    mask = torch.ones((b, s), dtype=torch.bool, device="meta") if masked else None
    # what the kernel returns before our slicing: lse padded to a multiple of 32 along the queries
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    bias = fused_sdpa.key_bias(torch.ones((b, s), dtype=torch.bool), h, dtype)
    assert bias.shape == (b, h, s, s) and bias.dtype == dtype and bias.stride(-1) == 1
    assert all(st % 16 == 0 for st in bias.stride()[:-1])  # the kernel's alignment
    raw = A._scaled_dot_product_efficient_attention(
        q, k, v, _meta(bias) if masked else None, True, 0.0, False, scale=0.3
    )
    assert raw[1].shape == (b, h, _ceil(s, 32))
    out, lse = fused_sdpa._padded_fwd_raw(qkv, mask, 0.3)
    assert out.shape == (b, s, h, d) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32 and lse.is_contiguous()
    dout = torch.empty((b, s, h, d), dtype=dtype, device="meta")
    dqkv = fused_sdpa._padded_bwd_raw(dout, qkv, mask, out, lse, 0.3)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    buf = fused_sdpa._lse_for_bwd(lse, None)
    assert buf.shape == (b, h, _ceil(s, 32)) and buf.stride(0) % 8 == 0 and buf.stride(1) % 8 == 0


def _bind(schema, args, kwargs):
    """{name: value} of a call against an op schema; raises on extra or unknown arguments."""
    names = [a.name for a in schema.arguments]
    assert len(args) <= len(names), f"{len(args)} positional arguments, the schema has {len(names)}"
    bound = dict(zip(names, args))
    for k, v in kwargs.items():
        assert k in names and k not in bound, f"argument {k!r} unknown or given twice"
        bound[k] = v
    for a in schema.arguments:
        if a.name not in bound:
            assert a.has_default_value(), f"argument {a.name!r} missing"
            continue
        v, t = bound[a.name], str(a.type)
        if t == "Tensor":
            assert isinstance(v, torch.Tensor), f"{a.name}: {type(v)}"
        elif t == "Optional[Tensor]":
            assert v is None or isinstance(v, torch.Tensor), a.name
        elif t in ("int", "SymInt", "Optional[int]", "Optional[SymInt]"):
            assert (v is None and t.startswith("Optional")) or isinstance(v, int) and not isinstance(v, bool), a.name
        elif t in ("float", "Optional[float]"):
            assert isinstance(v, float) or (v is None and t.startswith("Optional")), a.name
        elif t == "bool":
            assert isinstance(v, bool), a.name
    return bound


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", [[5, 17], [1], [33, 7, 64]])
def test_varlen_plumbing_on_meta(monkeypatch, dtype, lengths):
    h, d = 3, 32
    t, b, mx = sum(lengths), len(lengths), max(lengths)
    qkv = torch.empty((t, 3, h, d), dtype=dtype, device="meta")
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(b)], dtype=torch.int32, device="meta")
    q = qkv[:, 0].unsqueeze(0)
    raw = A._efficient_attention_forward(q, q, q, None, cu, cu, mx, mx, 0.0, 0, True, scale=0.3)
    assert raw[1].shape == (b, h, _ceil(mx, 32))  # [sequences, h, ceil32(max)]
    out, lse = fused_sdpa._varlen_fwd_raw(qkv, cu, mx, 0.3)
    assert out.shape == (t, h, d) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (h, t) and lse.dtype == torch.float32 and lse.is_contiguous()
    # The backward: torch 2.13's meta kernel of _efficient_attention_backward lacks the schema's ``out``
    # argument (torch/_meta_registrations.py), so it cannot run. Bind our call to the schema instead,
    # and check the tensors against what the CUDA kernel reads.
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        qq = args[1]
        return torch.empty_like(qq), torch.empty_like(qq), torch.empty_like(qq), torch.empty(())

    monkeypatch.setattr(fused_sdpa, "VARLEN_BWD", record)
    dout = torch.empty((t, h, d), dtype=dtype, device="meta")
    dqkv = fused_sdpa._varlen_bwd_raw(dout, qkv, cu, mx, out, lse, 0.3)
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    ((args, kwargs),) = calls
    p = _bind(A._efficient_attention_backward.default._schema, args, kwargs)
    for name in ("grad_out_", "query", "key", "value", "out"):
        assert p[name].shape == (1, t, h, d), name
    assert p["out"].is_contiguous() and p["grad_out_"].is_contiguous()
    assert p["cu_seqlens_q"].dtype == torch.int32 and p["cu_seqlens_q"].shape == (b + 1,)
    assert p["max_seqlen_q"] == p["max_seqlen_k"] == mx
    lse_b = p["logsumexp"]
    assert lse_b.shape == (b, h, _ceil(mx, 32)) and lse_b.dtype == torch.float32
    assert lse_b.stride(0) % 8 == 0 and lse_b.stride(1) % 8 == 0
    assert p["dropout_p"] == 0.0 and p["custom_mask_type"] == 0 and p["bias_requires_grad"] is False


def test_varlen_lse_layout_on_cpu():
    """The lse conversions between the kernel's [B, h, ceil32(max)] and the op's [h, T], by value."""
    lengths, h = [5, 17, 3], 2
    t, mx = sum(lengths), max(lengths)
    cu = torch.tensor([0, 5, 22, 25], dtype=torch.int32)
    kern = torch.full((3, h, _ceil(mx, 32)), 777.0)
    expect = torch.empty(h, t)
    for i, (lo, n) in enumerate(zip([0, 5, 22], lengths)):
        vals = torch.arange(n, dtype=torch.float32) + 100 * i
        kern[i, :, :n] = vals
        expect[:, lo : lo + n] = vals
    seq, pos = fused_sdpa._token_index(cu, t, mx)
    assert torch.equal(kern[seq, :, pos].t(), expect)


# ----------------------------------------------------------------------------- CPU emulations
def _probs(q, k, bias, scale, lse=None):
    """(P, lse) in float64 for q, k [..., M|N, d]; P from ``lse`` when given (the backward's way):
    exp(-inf - (-inf)) = NaN on a row without keys, as a kernel may produce."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    ls = torch.logsumexp(s, dim=-1) if lse is None else lse.double()
    return torch.exp(s - ls[..., None]), ls


def _grads(go, q, k, v, out, p, scale):
    go, q, k, v, out = (t.double() for t in (go, q, k, v, out))
    dv = p.transpose(-1, -2) @ go
    dp = go @ v.transpose(-1, -2)
    ds = p * (dp - (go * out).sum(-1, keepdim=True))
    return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv


def _check_bias(bias, q):
    if bias is None:
        return
    b, h, m, _ = q.shape
    assert bias.dim() == 4 and tuple(bias.shape) == (b, h, m, m) and bias.dtype == q.dtype
    assert bias.stride(-1) == 1 and all(st % 16 == 0 for st in bias.stride()[:-1]), bias.stride()


class Emu:
    """CPU stand-ins of the four aten ops, with call counters and a fault to inject."""

    def __init__(self, fault=None, where=("fwd", "bwd")):
        self.calls = {"fwd": 0, "bwd": 0, "vfwd": 0, "vbwd": 0}
        self.fault, self.where = fault, where

    def _out(self, kind, x):
        if self.fault is None or kind not in self.where:
            return x
        if self.fault == "raise":
            raise RuntimeError("cutlassF: no kernel found to launch!")
        x = x.clone()
        flat = x.as_strided((x.numel(),), (1,))  # x's storage (dense, any layout)
        if self.fault == "nan":
            flat[0] = float("nan")
        elif self.fault == "perturb":
            flat[0] += 1.0 + x.abs().max().item()  # what _verify says its bound catches
        return x

    def eff_fwd(self, q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, *, scale=None):
        self.calls["fwd"] += 1
        assert compute_lse and dropout_p == 0.0 and not is_causal
        _check_bias(bias, q)
        meta = A._scaled_dot_product_efficient_attention(*map(_meta, (q, k, v, bias)), True, 0.0, False, scale=scale)
        b, h, m, d = q.shape
        p, lse = _probs(q, k, bias, scale)
        out = torch.empty((b, m, h, d), dtype=q.dtype).transpose(1, 2)
        out.copy_(p @ v.double())
        buf = torch.full((b, h, _ceil(m, 32)), 1.0e4)  # garbage in the padding
        buf[:, :, :m] = lse
        assert out.shape == meta[0].shape and buf.shape == meta[1].shape and buf.dtype == meta[1].dtype
        return self._out("fwd", out), buf, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    def eff_bwd(self, go, q, k, v, bias, out, lse, seed, off, dropout_p, mask, is_causal=False, *, scale=None):
        self.calls["bwd"] += 1
        assert dropout_p == 0.0 and list(mask) == [True, True, True, False] and not is_causal
        _check_bias(bias, q)
        b, h, m, d = q.shape
        assert lse.shape == (b, h, _ceil(m, 32)) and lse.dtype == torch.float32
        assert lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0
        assert out.transpose(1, 2).is_contiguous()  # BMHK, as the kernel reads it
        meta = A._scaled_dot_product_efficient_attention_backward(
            *map(_meta, (go, q, k, v, bias, out, lse, seed, off)), 0.0, [True, True, True, False], False, scale=scale
        )
        p, _ = _probs(q, k, bias, scale, lse[:, :, :m])
        dq, dk, dv = (t.to(q.dtype) for t in _grads(go, q, k, v, out, p, scale))
        assert dq.shape == meta[0].shape
        return self._out("bwd", dq), dk, dv, None

    def _seqs(self, cu):
        c = cu.tolist()
        return list(zip(c[:-1], c[1:]))

    def var_fwd(self, q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p, mask_type, compute_lse, *, scale=None, **_):
        self.calls["vfwd"] += 1
        assert bias is None and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and mask_type == 0
        assert compute_lse and dropout_p == 0.0 and q.shape[0] == 1
        meta = A._efficient_attention_forward(
            *map(_meta, (q, k, v, None, cu_q, cu_k)), max_q, max_k, 0.0, 0, True, scale=scale
        )
        _, t, h, d = q.shape
        out = torch.empty_like(q)
        buf = torch.full((cu_q.numel() - 1, h, _ceil(max_q, 32)), 1.0e4)
        for i, (lo, hi) in enumerate(self._seqs(cu_q)):
            qs, ks, vs = (x[0, lo:hi].transpose(0, 1) for x in (q, k, v))  # [h, L, d]
            p, lse = _probs(qs, ks, None, scale)
            out[0, lo:hi] = (p @ vs.double()).transpose(0, 1).to(q.dtype)
            buf[i, :, : hi - lo] = lse
        assert buf.shape == meta[1].shape and out.shape == meta[0].shape
        return self._out("vfwd", out), buf, torch.zeros(()), torch.zeros(()), max_q, max_k

    def var_bwd(
        self,
        go,
        q,
        k,
        v,
        bias,
        out,
        cu_q,
        cu_k,
        max_q,
        max_k,
        lse,
        dropout_p,
        seed,
        off,
        mask_type,
        bias_rg,
        *,
        scale=None,
        **_,
    ):
        self.calls["vbwd"] += 1
        assert bias is None and not bias_rg and dropout_p == 0.0 and mask_type == 0
        assert lse.shape == (cu_q.numel() - 1, q.shape[2], _ceil(max_q, 32))
        assert lse.stride(0) % 8 == 0 and lse.stride(1) % 8 == 0
        assert out.is_contiguous() and out.shape == q.shape
        dq, dk, dv = (torch.zeros_like(q) for _ in range(3))
        for i, (lo, hi) in enumerate(self._seqs(cu_q)):
            sl = lambda x: x[0, lo:hi].transpose(0, 1)
            p, _ = _probs(sl(q), sl(k), None, scale, lse[i, :, : hi - lo])
            g = _grads(sl(go), sl(q), sl(k), sl(v), sl(out), p, scale)
            for dst, src in zip((dq, dk, dv), g):
                dst[0, lo:hi] = src.transpose(0, 1).to(q.dtype)
        return self._out("vbwd", dq), dk, dv, torch.empty(())


@pytest.fixture
def emulate(monkeypatch):
    """Install an Emu as the aten ops, CPU tensors treated as CUDA (the flash CPU kernel off)."""
    fused_sdpa.reset()
    monkeypatch.setattr(fused_sdpa, "on_cuda", lambda t: t.device.type == "cpu")
    monkeypatch.setattr(torch_impl, "_use_flash", lambda qkv, keep: False)
    monkeypatch.setattr(torch_impl, "_use_flash_bwd", lambda qkv, keep: False)

    def install(emu):
        monkeypatch.setattr(fused_sdpa, "EFF_FWD", emu.eff_fwd)
        monkeypatch.setattr(fused_sdpa, "EFF_BWD", emu.eff_bwd)
        monkeypatch.setattr(fused_sdpa, "VARLEN_FWD", emu.var_fwd)
        monkeypatch.setattr(fused_sdpa, "VARLEN_BWD", emu.var_bwd)
        return emu

    yield install
    fused_sdpa.reset()


def _padded_problem(dtype, d=32, seed=3):
    """qkv [3, 33, 3, 2, d] and its key-padding mask (attention_cases.sample_inputs; the last sequence
    without keys), a cotangent, the softmax scale."""
    lengths, s, h = [9, 33, 0], 33, 2
    randn = seeded_randn(seed, "cpu", dtype)
    qkv, mask = attention_cases.sample_inputs(lengths, s, h, d, randn, "cpu", varlen=False)
    return qkv, mask, randn(len(lengths), s, h, d), 0.8 / math.sqrt(d)


def _varlen_problem(dtype, d=32, seed=5):
    """qkv [62, 3, 2, d] and cu_seqlens of 3 packed sequences (attention_cases.sample_inputs), their
    max length, a cotangent, the softmax scale."""
    lengths, h = [17, 5, 40], 2
    randn = seeded_randn(seed, "cpu", dtype)
    qkv, cu = attention_cases.sample_inputs(lengths, max(lengths), h, d, randn, "cpu", varlen=True)
    return qkv, cu, max(lengths), randn(sum(lengths), h, d), 0.8 / math.sqrt(d)


def _padded_op(qkv, mask, dout, scale):
    out, lse = torch_impl.attention_fwd(qkv, mask, 0.0, scale, None)
    return out, lse, torch_impl.attention_bwd(dout, qkv, mask, out, lse, 0.0, scale, None)


def _varlen_op(qkv, cu, mx, dout, scale):
    out, lse = torch_impl.varlen_attention_fwd(qkv, cu, mx, 0.0, scale, None)
    return out, lse, torch_impl.varlen_attention_bwd(dout, qkv, cu, mx, out, lse, 0.0, scale, None)


def _reference64(qkv, mask, dout, scale):
    """float64 out and d(qkv) of the padded problem (the materialized formulas, exact in float64)."""
    x = qkv.double()
    out, _ = torch_impl.materialized_fwd(x, mask, scale)
    return out, torch_impl.materialized_bwd(dout.double(), x, mask, scale)


# ----------------------------------------------------------------------------- (b) selection + check
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_fused_padded_is_checked_then_used(emulate, dtype):
    emu = emulate(Emu())
    qkv, mask, dout, scale = _padded_problem(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_sdpa.FusedAttentionWarning)
        out, lse, dqkv = _padded_op(qkv, mask, dout, scale)
        _padded_op(qkv, mask, dout, scale)
    # one self-check call each, then two calls of the op each
    assert emu.calls["fwd"] == 3 and emu.calls["bwd"] == 3, emu.calls
    v = fused_sdpa.verdicts()
    assert v[("cpu", None, dtype, 32, "padded", "fwd")] == "fused"
    assert v[("cpu", None, dtype, 32, "padded", "bwd")] == "fused"
    # the op's contract
    assert out.shape == (3, 33, 2, 32) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (3, 2, 33) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert dqkv.shape == qkv.shape and dqkv.dtype == dtype
    # fully masked sequence: zeros, never NaN, forward and backward
    assert torch.isfinite(out).all() and torch.isfinite(dqkv).all()
    assert out[2].abs().max() == 0 and dqkv[2].abs().max() == 0
    # against float64: within 2x of the materialized path's own error (+ a rounding floor)
    ref_out, ref_d = _reference64(qkv, mask, dout, scale)
    m_out, m_lse = torch_impl.materialized_fwd(qkv, mask, scale)
    m_d = torch_impl.materialized_bwd(dout, qkv, mask, scale)
    floor = 4 * torch.finfo(dtype).eps
    assert (out.double() - ref_out).abs().max() <= 2 * (m_out.double() - ref_out).abs().max() + floor
    assert (dqkv.double() - ref_d).abs().max() <= 2 * (m_d.double() - ref_d).abs().max() + floor * 4
    keys = mask.any(-1)
    torch.testing.assert_close(lse[keys], m_lse[keys], atol=0.05 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    assert torch.isinf(lse[2]).all() and (lse[2] > 0).all()  # the kernel's convention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_fused_varlen_is_checked_then_used(emulate, dtype):
    emu = emulate(Emu())
    qkv, cu, mx, dout, scale = _varlen_problem(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fused_sdpa.FusedAttentionWarning)
        out, lse, dqkv = _varlen_op(qkv, cu, mx, dout, scale)
    assert emu.calls["vfwd"] == 2 and emu.calls["vbwd"] == 2, emu.calls
    assert emu.calls["fwd"] == 0 and emu.calls["bwd"] == 0  # no grouping into padded calls
    assert out.shape == (62, 2, 32) and out.is_contiguous() and out.dtype == dtype
    assert lse.shape == (2, 62) and lse.dtype == torch.float32 and lse.is_contiguous()
    m_out, m_lse = torch_impl.varlen_fwd_grouped(qkv, cu, mx, 0.0, scale, None)
    m_d = torch_impl.varlen_bwd_grouped(dout, qkv, cu, mx, m_out, m_lse, 0.0, scale, None)
    tol = dict(atol=0.05, rtol=0.05) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), m_out.float(), **tol)
    torch.testing.assert_close(lse, m_lse, **tol)
    torch.testing.assert_close(dqkv.float(), m_d.float(), **tol)


FAULTS = ["perturb", "raise", "nan"]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_wrong_fused_padded_is_rejected(emulate, fault, direction):
    emu = emulate(Emu(fault, where=(direction,)))
    dtype = torch.float32
    qkv, mask, dout, scale = _padded_problem(dtype)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, lse, dqkv = _padded_op(qkv, mask, dout, scale)
        out2, _, dqkv2 = _padded_op(qkv, mask, dout, scale)
    fw = [x for x in w if issubclass(x.category, fused_sdpa.FusedAttentionWarning)]
    assert len(fw) == 1 and direction in str(fw[0].message), [str(x.message) for x in fw]
    v = fused_sdpa.verdicts()
    other = "bwd" if direction == "fwd" else "fwd"
    assert v[("cpu", None, dtype, 32, "padded", direction)] == "materialized"
    assert v[("cpu", None, dtype, 32, "padded", other)] == "fused"
    assert emu.calls[direction] == 1  # the check only, never again
    m_out, m_lse = torch_impl.materialized_fwd(qkv, mask, scale)
    m_d = torch_impl.materialized_bwd(dout, qkv, mask, scale)
    if direction == "fwd":
        assert torch.equal(out, m_out.contiguous()) and torch.equal(lse, m_lse.contiguous()) and torch.equal(out2, out)
    else:
        assert torch.equal(dqkv, m_d) and torch.equal(dqkv2, m_d)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_wrong_fused_varlen_is_rejected(emulate, fault, direction):
    emu = emulate(Emu(fault, where=("v" + direction,)))
    qkv, cu, mx, dout, scale = _varlen_problem(torch.bfloat16)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out, lse, dqkv = _varlen_op(qkv, cu, mx, dout, scale)
        _varlen_op(qkv, cu, mx, dout, scale)
    fw = [x for x in w if issubclass(x.category, fused_sdpa.FusedAttentionWarning)]
    assert len(fw) == 1, [str(x.message) for x in fw]
    assert emu.calls["v" + direction] == 1
    assert emu.calls["fwd"] == 0 and emu.calls["bwd"] == 0  # the fallback: materialized groups
    m_out, m_lse = torch_impl.varlen_fwd_grouped(qkv, cu, mx, 0.0, scale, None)
    if direction == "fwd":
        assert torch.equal(out, m_out) and torch.equal(lse, m_lse)
    else:
        m_d = torch_impl.varlen_bwd_grouped(dout, qkv, cu, mx, out, lse, 0.0, scale, None)
        assert torch.equal(dqkv, m_d)


def test_exception_at_a_later_call_falls_back(emulate):
    emu = emulate(Emu())
    qkv, mask, dout, scale = _padded_problem(torch.float32)
    _padded_op(qkv, mask, dout, scale)
    emu.fault, emu.where = "raise", ("fwd",)
    with pytest.warns(fused_sdpa.FusedAttentionWarning, match="at a call"):
        out, lse = torch_impl.attention_fwd(qkv, mask, 0.0, scale, None)
    assert torch.equal(out, torch_impl.materialized_fwd(qkv, mask, scale)[0].contiguous())


def test_ineligible_calls_take_the_materialized_path(emulate):
    emu = emulate(Emu())
    qkv, mask, dout, scale = _padded_problem(torch.float32, d=26)  # head dim not a multiple of 8
    _padded_op(qkv, mask, dout, scale)
    qkv64, _, dout64, _ = _padded_problem(torch.float64)  # float64: gradcheck's dtype
    _padded_op(qkv64, mask, dout64, scale)
    big, _, dout32, _ = _padded_problem(torch.float32, d=40)
    _padded_op(big[..., 2:34], mask, dout32[..., :32], scale)  # a view 8 bytes off alignment
    assert sum(emu.calls.values()) == 0 and fused_sdpa.verdicts() == {}


def test_no_check_during_capture(emulate, monkeypatch):
    emu = emulate(Emu())
    qkv, mask, dout, scale = _padded_problem(torch.float32)
    monkeypatch.setattr(fused_sdpa, "_capturing", lambda t: True)
    _padded_op(qkv, mask, dout, scale)  # unchecked key under capture: materialized
    assert sum(emu.calls.values()) == 0 and fused_sdpa.verdicts() == {}
    monkeypatch.setattr(fused_sdpa, "_capturing", lambda t: False)
    _padded_op(qkv, mask, dout, scale)  # checked and used outside the capture
    monkeypatch.setattr(fused_sdpa, "_capturing", lambda t: True)
    _padded_op(qkv, mask, dout, scale)  # a kept verdict is honoured
    assert emu.calls["fwd"] == 3 and emu.calls["bwd"] == 3


# ----------------------------------------------------------------------------- (c) dropout
@pytest.mark.parametrize("padded", [True, False])
def test_dropout_keeps_the_materialized_path(emulate, padded):
    emu = emulate(Emu())
    seed = torch.tensor(1234, dtype=torch.int64)
    if padded:
        qkv, mask, dout, scale = _padded_problem(torch.float32)
        out, lse = torch_impl.attention_fwd(qkv, mask, 0.2, scale, seed)
        dq = torch_impl.attention_bwd(dout, qkv, mask, out, lse, 0.2, scale, seed)
        keep = torch_impl._dropout_mask((3, 2, 33, 33), 0.2, seed, qkv.device)
        assert torch.equal(out, torch_impl.materialized_fwd(qkv, mask, scale, keep, 0.2)[0].contiguous())
        assert torch.equal(dq, torch_impl.materialized_bwd(dout, qkv, mask, scale, keep, 0.2))
    else:
        qkv, cu, mx, dout, scale = _varlen_problem(torch.float32)
        out, lse = torch_impl.varlen_attention_fwd(qkv, cu, mx, 0.2, scale, seed)
        torch_impl.varlen_attention_bwd(dout, qkv, cu, mx, out, lse, 0.2, scale, seed)
    assert sum(emu.calls.values()) == 0 and fused_sdpa.verdicts() == {}


def test_cpu_tensors_never_reach_the_fused_path():
    """Without the test's override the device test is CUDA only."""
    assert not fused_sdpa.eligible(torch.zeros(1, 2, 3, 2, 8), False)


@pytest.mark.parametrize("bad", [float("-inf"), float("nan")])
def test_fully_masked_rows_backward_whatever_lse(emulate, bad):
    """The backward may be handed any lse on rows without keys (a kernel's -inf, garbage): their
    gradients are zeros, never NaN, and the other rows are untouched."""
    emulate(Emu())
    qkv, mask, dout, scale = _padded_problem(torch.float32)
    out, lse = torch_impl.materialized_fwd(qkv, mask, scale)
    lse = lse.contiguous().clone()
    lse[2] = bad
    d = fused_sdpa._padded_bwd_raw(dout, qkv, mask, out, lse, scale)
    assert torch.isfinite(d).all() and d[2].abs().max() == 0
    torch.testing.assert_close(d, torch_impl.materialized_bwd(dout, qkv, mask, scale), atol=1e-5, rtol=1e-5)
