"""An int8 model's attention in bf16 on our AVX-512 BF16 kernel (bert_fast/model/int8.py,
"Attention"): taken by default where the kernel runs, never with BERT_FAST_INT8_ATTENTION=fp32, and
within bf16 rounding of the fp32 attention."""

from __future__ import annotations

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import int8 as int8_mod
from bert_fast.ops import cpu_attention

pytestmark = pytest.mark.skipif(not int8_mod.available(), reason="no torch._int_mm in this torch")


def _model():
    cfg = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100
    )
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    calib = {
        "input_ids": torch.randint(1, 100, (4, 16), generator=g),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
    }
    calib["attention_mask"][1, 9:] = 0
    return bert_fast.optimize(model, int8=True, calibration=calib, min_cosine=0.9), calib


def test_setting_values(monkeypatch):
    qkv = torch.zeros(4, 12)
    monkeypatch.setenv(int8_mod.ATTENTION_ENV, "fp32")
    assert not int8_mod.attention_in_bf16(qkv)
    monkeypatch.setenv(int8_mod.ATTENTION_ENV, "bf16")
    assert int8_mod.attention_in_bf16(qkv) and not int8_mod.attention_in_bf16(qkv.bfloat16())
    monkeypatch.setenv(int8_mod.ATTENTION_ENV, "auto")
    assert int8_mod.attention_in_bf16(qkv) == cpu_attention.available()


@pytest.mark.parametrize("padded", [False, True], ids=["varlen", "padded"])
def test_bf16_attention_agrees_with_fp32_and_takes_our_kernel(monkeypatch, padded):
    monkeypatch.setenv("BERT_FAST_BACKEND", "torch")  # the CPU path users run (not the interpreter's kernels)
    model, calib = _model()
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "on")  # ours, not its measured choice against torch's bf16 flash
    if padded:
        model = bert_fast.optimize(model, padded=True)
    calls = []
    for name in ("varlen", "padded"):
        real = getattr(cpu_attention, name)

        def spy(*a, _r=real, **k):  # the bf16 calls: fp32 attention may run our fp32 kernel through these too
            if a[0].dtype == torch.bfloat16:
                calls.append(1)
            return _r(*a, **k)

        monkeypatch.setattr(cpu_attention, name, spy)
    out = {}
    for mode in ("fp32", "bf16"):
        monkeypatch.setenv(int8_mod.ATTENTION_ENV, mode)
        calls.clear()
        with torch.no_grad():
            out[mode] = model(**calib).last_hidden_state
        if mode == "fp32":
            assert calls == []  # fp32 attention never reaches the bf16 kernel
        elif cpu_attention.available():
            assert calls, "bf16 attention did not run our kernel"
    assert out["bf16"].dtype == torch.float32
    mask = calib["attention_mask"].bool()
    cos = torch.nn.functional.cosine_similarity(out["bf16"][mask], out["fp32"][mask], dim=-1)
    assert cos.min() > 0.999


@pytest.mark.parametrize("backend", ["int_mm", "avx2"])
@pytest.mark.parametrize("m", [1, 7, 128])
def test_bf16_qkv_and_context_skip_the_casts_with_the_same_values(backend, m):
    """The QKV GEMM writes bf16 from its dequantize pass and the output GEMM quantizes the bf16 context
    as it is (layer.attention_block): bit for bit what the two casts gave (qkv.to(bf16), ctx.to(fp32))."""
    from bert_fast.ops import int8_gemm

    if backend == "avx2" and not int8_gemm.avx2_available():
        pytest.skip("our AVX2 int8 GEMM does not run on this CPU")
    g = torch.Generator().manual_seed(m)
    qkv = int8_mod._Int8Linear(torch.randn(96, 32, generator=g) / 6, torch.randn(96, generator=g), backend)
    out = int8_mod._Int8Linear(torch.randn(32, 32, generator=g) / 6, torch.randn(32, generator=g), backend)
    h = torch.randn(m, 32, generator=g) * 3
    y = qkv(h, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), qkv(h).to(torch.bfloat16).view(torch.int16))
    ctx = torch.randn(m, 32, generator=g).bfloat16()
    assert torch.equal(out(ctx, out_dtype=torch.float32), out(ctx.float()))
    res, w, b = torch.randn(m, 32, generator=g), torch.rand(32, generator=g), torch.rand(32, generator=g)
    fused = out.residual_ln(ctx, res, w, b, 1e-12)
    if backend == "int_mm":
        assert fused.dtype == torch.float32 and torch.equal(fused, out.residual_ln(ctx.float(), res, w, b, 1e-12))
    else:
        assert fused is None  # the AVX2 GEMM dequantizes in its epilogue: the caller runs the LayerNorm


def test_int8_model_runs_no_casts_around_bf16_attention(monkeypatch):
    """An int8 model whose attention runs in bf16 casts neither the QKV nor the context (the GEMMs
    around the attention read and write bf16 themselves)."""
    if not cpu_attention.available():
        pytest.skip("the bf16 attention kernel does not run on this CPU")
    monkeypatch.setenv("BERT_FAST_BACKEND", "torch")
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "on")
    monkeypatch.setenv(int8_mod.ATTENTION_ENV, "bf16")
    model, calib = _model()
    dtypes = []
    real = cpu_attention.varlen

    def spy(qkv, *a, **k):
        dtypes.append(qkv.dtype)
        return real(qkv, *a, **k)

    monkeypatch.setattr(cpu_attention, "varlen", spy)
    casts = []
    real_to = torch.Tensor.to

    def to(self, *a, **k):
        if torch.bfloat16 in a or k.get("dtype") == torch.bfloat16 or (self.dtype == torch.bfloat16 and a):
            casts.append((self.dtype, a, k))
        return real_to(self, *a, **k)

    with torch.no_grad():
        monkeypatch.setattr(torch.Tensor, "to", to)
        try:
            out = model(**calib).last_hidden_state
        finally:
            monkeypatch.setattr(torch.Tensor, "to", real_to)
    assert dtypes and all(d == torch.bfloat16 for d in dtypes)
    assert casts == [], casts
    assert out.dtype == torch.float32
