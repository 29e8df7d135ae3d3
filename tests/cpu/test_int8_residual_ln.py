"""The int8 dequantize pass with the residual add and LayerNorm folded in (csrc/int8_cpu.cpp
``int8_dequantize_residual_ln``, bert_fast/ops/int8_gemm.py ``dequantize_residual_ln``; #32 item 2):
the 2x rule against a float64 oracle, with torch's unfused fp32 ops (dequantize, add, layer_norm) as
"plain PyTorch in the same dtype"; its AVX-512 and scalar versions; bf16 residuals; and an int8 model
taking it in both GEMMs a residual LayerNorm follows, agreeing with the unfused path."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import int8 as int8_mod
from bert_fast.model import int8_speed
from bert_fast.ops import int8_gemm
from bert_fast.testing import assert_close_2x

pytestmark = [
    pytest.mark.no_kernels("the int8 CPU passes, not the Triton kernels"),
    pytest.mark.skipif(not int8_gemm.native(), reason="bert_fast._C was built without the int8 passes"),
]


def _isas():
    return ["scalar"] + (["avx512"] if int8_gemm._ext.int8_isa() == "avx512" else [])


@pytest.fixture(params=_isas())
def isa(request, monkeypatch):
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "scalar" if request.param == "scalar" else "avx512")
    assert int8_gemm._ext.int8_isa() == request.param
    return request.param


def _case(m, n, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    acc = torch.randint(-(2**20), 2**20, (m, n), generator=g, dtype=torch.int32)
    sx = torch.rand(m, generator=g) * 1e-4 + 1e-6
    sw = torch.rand(n, generator=g) * 1e-3 + 1e-5
    b = torch.randn(n, generator=g) if bias else None
    res = torch.randn(m, n, generator=g) * 2
    w, lb = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return acc, sx, sw, b, res, w, lb


def _oracle(acc, sx, sw, b, res, w, lb, eps):
    v = acc.double() * sx.double()[:, None] * sw.double() + res.double()
    if b is not None:
        v = v + b.double()
    return torch.nn.functional.layer_norm(v, (v.shape[-1],), w.double(), lb.double(), eps)


@pytest.mark.parametrize("m,n", [(1, 384), (5, 37), (130, 768), (3, 16), (2, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_within_2x_of_torch(isa, m, n, bias):
    acc, sx, sw, b, res, w, lb = _case(m, n, seed=m * 100 + n, bias=bias)
    got = int8_gemm.dequantize_residual_ln(acc, sx, sw, b, res, w, lb, 1e-12)
    plain = int8_gemm.dequantize_residual_ln_torch(acc, sx, sw, b, res, w, lb, 1e-12)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert_close_2x(got, _oracle(acc, sx, sw, b, res, w, lb, 1e-12), plain)


@pytest.mark.parametrize("m,n", [(1, 384), (7, 100)])
def test_bf16_residual_rounds_once(isa, m, n):
    """bf16 in and out: computed in fp32 with one rounding at the end, so within half a bf16 ulp of the
    fp32 computation on the same (bf16) inputs, where the unfused ops round three times."""
    acc, sx, sw, b, res, w, lb = _case(m, n, seed=7)
    res = res.bfloat16()
    got = int8_gemm.dequantize_residual_ln(acc, sx, sw, b, res, w, lb, 1e-5)
    assert got.dtype == torch.bfloat16
    want = int8_gemm.dequantize_residual_ln_torch(acc, sx, sw, b, res.float(), w, lb, 1e-5)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(2.0**-126)
    assert ((got.float() - want).abs() <= 0.5 * ulp + 1e-6).all()


def test_scalar_and_avx512_agree(monkeypatch):
    if "avx512" not in _isas():
        pytest.skip("this CPU has no AVX-512: only the scalar version runs here")
    acc, sx, sw, b, res, w, lb = _case(33, 384, seed=3)
    out = {}
    for cap in ("scalar", "avx512"):
        monkeypatch.setenv("BERT_FAST_CPU_ISA", cap)
        out[cap] = int8_gemm.dequantize_residual_ln(acc, sx, sw, b, res, w, lb, 1e-12)
    assert torch.allclose(out["scalar"], out["avx512"], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not int8_mod.available(), reason="no torch._int_mm in this torch")
@pytest.mark.skipif(not int8_speed.int_mm_exact(), reason=int8_speed.INEXACT_NOTE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_model_takes_it_and_agrees_with_the_unfused_path(monkeypatch, dtype):
    monkeypatch.setenv("BERT_FAST_BACKEND", "torch")  # the CPU path users run (not the interpreter's kernels)
    # the fused pass follows torch._int_mm: pin that backend, which the speed check picks on a VNNI CPU
    # but may not on a loaded machine (where the AVX2 GEMM, which dequantizes in its own epilogue, can time faster)
    measured = int8_speed.require_faster()
    monkeypatch.setattr(int8_speed, "require_faster", lambda: dataclasses.replace(measured, backend="int_mm"))
    cfg = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100
    )
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    calib = {
        "input_ids": torch.randint(1, 100, (4, 16), generator=g),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
    }
    calib["attention_mask"][1, 9:] = 0
    model = bert_fast.optimize(
        transformers.BertModel(cfg).eval().to(dtype), int8=True, calibration=calib, min_cosine=0.9
    )
    calls = []
    real = int8_mod._Int8Linear.residual_ln

    def spy(self, *a, **k):
        y = real(self, *a, **k)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(int8_mod._Int8Linear, "residual_ln", spy)
    with torch.no_grad():
        fused = model(**calib).last_hidden_state
    assert calls and all(calls) and len(calls) == 2 * cfg.num_hidden_layers
    monkeypatch.setattr(int8_mod._Int8Linear, "residual_ln", lambda self, *a, **k: None)  # the unfused path
    with torch.no_grad():
        unfused = model(**calib).last_hidden_state
    keep = calib["attention_mask"].bool()
    cos = torch.nn.functional.cosine_similarity(fused[keep].float(), unfused[keep].float(), dim=-1)
    assert cos.min() > (0.9999 if dtype == torch.bfloat16 else 0.999999)
