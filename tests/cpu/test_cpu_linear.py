"""Our one-call linear (csrc/cpu_linear.cpp, bert_fast/ops/cpu_linear.py), bf16 and fp32, against the
float64 oracle by the 2x rule: its error at most twice plain torch's in the same dtype (F.linear, then
F.gelu or add + F.layer_norm, what the frozen path ran before it) plus a floor of one rounding of the
output in that dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bert_fast.ops import cpu_linear

DTYPES = [
    pytest.param(dtype, id=str(dtype)[6:], marks=pytest.mark.skipif(not cpu_linear.available(dtype), reason=why))
    for dtype, why in (
        (torch.bfloat16, "needs AVX-512 BF16 (this CPU lacks it, or BERT_FAST_CPU_ISA caps it)"),
        (torch.float32, "needs AVX-512 (this CPU lacks it, or BERT_FAST_CPU_ISA caps it)"),
    )
]


def _case(m, k, n, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g)
    residual = torch.randn(m, n, generator=g).to(dtype)
    ln_w, ln_b = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    return x, w, b, residual, ln_w, ln_b


def _within_2x(got, plain, oracle):
    assert got.dtype == plain.dtype
    floor = torch.finfo(got.dtype).eps * oracle.abs().max().item()
    err, err_plain = (got.double() - oracle).abs().max().item(), (plain.double() - oracle).abs().max().item()
    assert err <= 2 * err_plain + floor, (err, err_plain, floor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 2, 1), (7, 26, 17), (17, 384, 129), (129, 312, 48), (128, 1536, 384)])
def test_linear_and_gelu_within_twice_plain(dtype, m, k, n):
    """Row tails (not a multiple of 8), column tails (not of 16 or 48), K not a power of two; GELU erf
    and tanh in the epilogue; with and without a bias; one thread and two."""
    x, w, b, *_ = _case(m, k, n, m + k + n, dtype)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for bias in (b, None):
                lin = cpu_linear.OneCallLinear(w, bias)
                exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
                plain = F.linear(x, w, None if bias is None else bias.to(dtype))
                _within_2x(lin.linear(x), plain, exact)
                for approximate in ("none", "tanh"):
                    oracle = F.gelu(exact, approximate=approximate)
                    _within_2x(lin.linear(x, approximate), F.gelu(plain, approximate=approximate), oracle)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 2, 16), (7, 26, 17), (129, 384, 312), (300, 64, 3000)])
def test_residual_layer_norm_within_twice_plain(dtype, m, k, n):
    """LayerNorm(x W^T + b + residual) in one call against plain F.linear, add, F.layer_norm in the
    same dtype (300 x 3000: the sums past the scratch kept between calls)."""
    x, w, b, residual, ln_w, ln_b = _case(m, k, n, m * n, dtype)
    lin = cpu_linear.OneCallLinear(w, b)
    exact = x.double() @ w.double().t() + b.double() + residual.double()
    oracle = F.layer_norm(exact, (n,), ln_w.double(), ln_b.double(), 1e-12)
    plain = F.layer_norm(F.linear(x, w, b.to(dtype)) + residual, (n,), ln_w.to(dtype), ln_b.to(dtype), 1e-12)
    _within_2x(lin.linear_residual_ln(x, residual, ln_w, ln_b, 1e-12), plain, oracle)


def test_weight_panels_hold_16_columns():
    w = torch.arange(19 * 6, dtype=torch.float32).view(19, 6)
    p = cpu_linear.pack_weight(w)  # fp32: [panel, k, lane]
    assert p.shape == (2, 6, 16) and p.dtype == torch.float32
    for panel, k, lane in [(0, 0, 0), (0, 5, 3), (1, 2, 2)]:
        assert p[panel, k, lane] == w[16 * panel + lane, k]
    assert p[1, :, 3:].eq(0).all()  # zero columns past N
    b = cpu_linear.pack_weight(w.bfloat16())  # bf16: [panel, pair, lane, 2] of the bits
    assert b.shape == (2, 3, 16, 2) and b.dtype == torch.int16
    for panel, j, lane, t in [(0, 0, 0, 0), (0, 2, 3, 1), (1, 1, 2, 0)]:
        assert b[panel, j, lane, t] == w.bfloat16().view(torch.int16)[16 * panel + lane, 2 * j + t]
    assert b[1, :, 3:, :].eq(0).all()


@pytest.mark.skipif(not cpu_linear.available(torch.bfloat16), reason="needs AVX-512 BF16")
def test_refuses_what_it_cannot_run(monkeypatch):
    ext = cpu_linear._ext
    with pytest.raises(ValueError, match="k must be even"):
        ext.Bf16Linear(0, 3, 16, 0)
    with pytest.raises(ValueError, match="act must be"):
        ext.F32Linear(0, 4, 16, 0).linear(0, 1, 0, 5, 1)
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "avx512")
    assert not cpu_linear.available(torch.bfloat16) and cpu_linear.available(torch.float32)
    with pytest.raises(ValueError, match="AVX-512 BF16"):
        ext.Bf16Linear(0, 4, 16, 0).linear(0, 1, 0, 0, 1)
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "avx2")
    assert not cpu_linear.available(torch.float32)
    with pytest.raises(ValueError, match="needs AVX-512"):
        ext.F32Linear(0, 4, 16, 0).linear(0, 1, 0, 0, 1)
