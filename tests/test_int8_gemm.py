"""The int8 GEMM's quantize/dequantize passes (bert_fast/ops/int8_gemm.py): the one-pass C++
versions (bert_fast._C, AVX-512 and portable) equal the torch-op oracle bit for bit, at lengths
that leave vector tails, in fp32 and bf16; and the whole int8 linear stays within int8's own error
of the exact GEMM."""

from __future__ import annotations

import pytest
import torch

from bert_fast.ops import int8_gemm

pytestmark = pytest.mark.no_kernels("CPU passes of the int8 path, not the Triton kernels")

native = pytest.mark.skipif(not int8_gemm.native(), reason="bert_fast._C was built without the int8 passes")


def _avx512_usable() -> bool:
    """The AVX-512 versions can run here: asked of the extension itself (a call of zero rows checks
    the ISA before anything else), so a CPU without AVX-512, or BERT_FAST_CPU_ISA below it, says no."""
    try:
        int8_gemm._ext.int8_quantize_rows(0, 0, 0, 1, 0, 0, 1, "avx512")
        return True
    except (ValueError, AttributeError, TypeError):
        return False


# The portable code runs on every CPU; the AVX-512 version where the CPU (and BERT_FAST_CPU_ISA) allows.
ISAS = [
    "scalar",
    pytest.param(
        "avx512",
        marks=pytest.mark.skipif(
            not (int8_gemm.native() and _avx512_usable()),
            reason="needs AVX-512 F/BW/VL/DQ (this CPU lacks it, or BERT_FAST_CPU_ISA caps it below avx512)",
        ),
    ),
]


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 1), (1, 7), (5, 384), (37, 17), (300, 1536)])
def test_quantize_and_dequantize_equal_the_torch_oracle(isa, dtype, m, k):
    g = torch.Generator().manual_seed(m * 7 + k)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, 0] = 0.0
    if m > 2:
        x[1] = 0.0  # an all-zero row: scale floor, all-zero codes
        x[2, : min(k, 4)] = torch.tensor([127.0, 0.5, -0.5, 1.5])[: min(k, 4)].to(dtype)  # ties to even
    q0, s0 = int8_gemm.quantize_rows_torch(x)
    n = k + 3
    acc = torch.randint(-(10**6), 10**6, (m, n), dtype=torch.int32, generator=g)
    sw, bias = torch.rand(n, generator=g), torch.randn(n, generator=g)
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m)
    int8_gemm._ext.int8_quantize_rows(x.data_ptr(), int8_gemm._CODES[dtype], m, k, q.data_ptr(), s.data_ptr(), 2, isa)
    assert torch.equal(q, q0) and torch.equal(s, s0), isa
    for b in (bias, None):
        y = torch.empty(m, n, dtype=dtype)
        int8_gemm._ext.int8_dequantize(
            acc.data_ptr(),
            m,
            n,
            s.data_ptr(),
            sw.data_ptr(),
            0 if b is None else b.data_ptr(),
            y.data_ptr(),
            int8_gemm._CODES[dtype],
            2,
            isa,
        )
        assert torch.equal(y, int8_gemm.dequantize_torch(acc, s0, sw, b, dtype)), isa
    # and the public entry points take the same path
    q1, s1 = int8_gemm.quantize_rows(x)
    assert torch.equal(q1, q0) and torch.equal(s1, s0)


@native
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_dequantize_with_gelu_matches_torch_gelu(isa, dtype, gelu):
    """The GELU inside the dequantize pass (AVX-512 and portable) equals torch's GELU of the
    dequantized fp32 values to 2e-7 relative (fp32 output) or within one bf16 step (bf16 output)."""
    m, n = 37, 1000 + 3
    g = torch.Generator().manual_seed(1)
    acc = torch.randint(-(10**6), 10**6, (m, n), dtype=torch.int32, generator=g)
    acc[0, :40] = torch.arange(-20, 20, dtype=torch.int32)  # values near 0, both signs
    sx, sw, bias = torch.rand(m, generator=g) * 1e-5, torch.rand(n, generator=g) * 1e-2, torch.randn(n, generator=g)
    pre = int8_gemm.dequantize_torch(acc, sx, sw, bias, torch.float32)
    want = torch.nn.functional.gelu(pre.double(), approximate=gelu)
    y = torch.empty(m, n, dtype=dtype)
    int8_gemm._ext.int8_dequantize(
        acc.data_ptr(),
        m,
        n,
        sx.data_ptr(),
        sw.data_ptr(),
        bias.data_ptr(),
        y.data_ptr(),
        int8_gemm._CODES[dtype],
        2,
        isa,
        int8_gemm._ACT_CODES[gelu],
    )
    err = (y.double() - want).abs()
    if dtype == torch.float32:
        assert (err <= 2e-7 * (1 + want.abs()) + 1e-7).all(), (isa, err.max().item())
    else:  # one bf16 step of the result (2^-8 relative), the cast's own rounding
        assert (err <= want.abs() * 2.0**-8 + 1e-6).all(), (isa, err.max().item())
    if isa == int8_gemm._ext.int8_isa():  # the public entry point runs the widest usable ISA
        assert torch.equal(int8_gemm.dequantize(acc, sx, sw, bias, dtype, gelu), y)
    with pytest.raises(ValueError, match="act"):
        int8_gemm._ext.int8_dequantize(0, 1, 1, 0, 0, 0, 0, 0, 1, "", 7)


@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
def test_int8_linear_is_within_int8_error(gelu):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(64, 96, generator=g), torch.randn(40, 96, generator=g) * 0.1, torch.randn(40, generator=g)
    sw = w.abs().amax(1) / 127
    wq = torch.round(w / sw[:, None]).to(torch.int8)
    y = int8_gemm.int8_linear(x, wq.t().contiguous(), sw, b, gelu)
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    if gelu is not None:
        exact = torch.nn.functional.gelu(exact, approximate=gelu)
    # rounding each operand to its grid moves it by at most half a step: sum_k |dx_k w_k| + |x_k dw_k|
    sx = x.abs().amax(1, keepdim=True) / 127
    bound = sx / 2 * w.abs().sum(1)[None, :] + x.abs().sum(1, keepdim=True) * sw[None, :] / 2
    if gelu is not None:
        bound = bound * 1.13  # GELU's slope is at most ~1.13
    assert ((y.double() - exact).abs() <= bound.double() + 1e-4).all()
    assert (y.double() - exact).abs().max() > 0  # int8 really ran


def test_bad_dtype_code_is_refused():
    if not int8_gemm.native():
        pytest.skip("bert_fast._C was built without the int8 passes")
    with pytest.raises(ValueError, match="dtype code"):
        int8_gemm._ext.int8_quantize_rows(0, 5, 1, 1, 0, 0, 1)
