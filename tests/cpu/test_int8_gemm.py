"""The int8 GEMM's quantize/dequantize passes (bert_fast/ops/int8_gemm.py): the one-pass C++
versions (bert_fast._C, AVX-512 and portable) equal the torch-op oracle bit for bit, at lengths
that leave vector tails, in fp32 and bf16; and the whole int8 linear stays within int8's own error
of the exact GEMM."""

from __future__ import annotations

import pytest
import torch

from bert_fast.model import int8_speed
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


def native_dequantize(acc, sx, sw, bias, dtype, threads, isa="", gelu=None):
    """bert_fast._C's dequantize pass at a given thread count and ISA: y [m, n] of ``dtype``."""
    return int8_gemm.dequantize(acc, sx, sw, bias, dtype, gelu, threads=threads, isa=isa)


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
        y = native_dequantize(acc, s, sw, b, dtype, 2, isa)
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
    y = native_dequantize(acc, sx, sw, bias, dtype, 2, isa, gelu)
    err = (y.double() - want).abs()
    if dtype == torch.float32:
        assert (err <= 2e-7 * (1 + want.abs()) + 1e-7).all(), (isa, err.max().item())
    else:  # one bf16 step of the result (2^-8 relative), the cast's own rounding
        assert (err <= want.abs() * 2.0**-8 + 1e-6).all(), (isa, err.max().item())
    if isa == int8_gemm._ext.int8_isa():  # the public entry point runs the widest usable ISA
        assert torch.equal(int8_gemm.dequantize(acc, sx, sw, bias, dtype, gelu), y)
    with pytest.raises(ValueError, match="act"):
        int8_gemm._ext.int8_dequantize(0, 1, 1, 0, 0, 0, 0, 0, 1, "", 7)


@pytest.mark.skipif(not int8_speed.int_mm_exact(), reason=int8_speed.INEXACT_NOTE)
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


# ----------------------------------------------------------------------------- the VNNI GEMM (packed weights)
needs_vnni = pytest.mark.skipif(
    not int8_gemm.vnni_available(), reason="needs AVX-512 VNNI (this CPU lacks it, or BERT_FAST_CPU_ISA caps it)"
)


def test_vnni_weight_panels_hold_4_k_steps_of_16_columns_offset_by_128():
    wq_t = (torch.arange(7 * 19, dtype=torch.int16).view(7, 19) % 255 - 127).to(torch.int8)
    p = int8_gemm.pack_weight_vnni(wq_t)
    assert p.shape == (2, 2, 16, 4) and p.dtype == torch.uint8
    for panel, j, lane, t in [(0, 0, 0, 0), (0, 1, 3, 2), (1, 0, 2, 3), (1, 1, 2, 1), (1, 1, 5, 3)]:
        k, col = 4 * j + t, 16 * panel + lane
        assert int(p[panel, j, lane, t]) == (int(wq_t[k, col]) if k < 7 and col < 19 else 0) + 128
    assert p[1, :, 3:, :].eq(128).all() and p[:, 1, :, 3].eq(128).all()  # the padding is a zero weight


@needs_vnni
@pytest.mark.parametrize("m,k,n", [(1, 4, 1), (3, 7, 17), (8, 64, 48), (9, 384, 40), (37, 768, 129), (130, 3000, 64)])
def test_vnni_gemm_equals_int_mm_bit_for_bit(m, k, n):
    """The same int32 sums as torch._int_mm (the oracle: exact int64 products), full-range codes, row
    tails (not a multiple of 8), column tails (not of 16 or 48), K not a multiple of 4, one thread and two."""
    g = torch.Generator().manual_seed(m + k + n)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    wq_t = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    xq[0, :3], wq_t[:3, 0] = torch.tensor([-127, 127, -127]), torch.tensor([-127, -127, 127])
    want = (xq.long() @ wq_t.long()).int()
    packed = int8_gemm.pack_weight_vnni(wq_t)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert torch.equal(int8_gemm.int_mm_vnni(xq, packed, n), want)
    finally:
        torch.set_num_threads(threads)


@needs_vnni
@pytest.mark.skipif(not int8_speed.int_mm_exact(), reason=int8_speed.INEXACT_NOTE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
@pytest.mark.parametrize("m,k,n", [(5, 8, 40), (37, 384, 129), (128, 768, 96)])
def test_vnni_dequantizing_epilogue_equals_the_dequantize_pass_bit_for_bit(dtype, gelu, m, k, n):
    """The one-call linear's epilogue, (acc * s_x) * s_w + b and GELU, gives the dequantize pass's bits, in
    fp32 and bf16, with and without a bias, at row and column tails. (K not a multiple of 4 runs the
    separate passes on int_mm_vnni's sums: test_vnni_gemm_equals_int_mm_bit_for_bit.)"""
    x, wq_t, sw, b = _quantized(m, k, n, m + n)
    x = x.to(dtype)
    packed = int8_gemm.pack_weight_vnni(wq_t)
    for bias in (b, None):
        want = int8_gemm.int8_linear(x, wq_t, sw, bias, gelu)
        assert torch.equal(int8_gemm.VnniLinear(packed, k, n, sw, bias).linear(x, gelu, dtype), want)


@needs_vnni
@pytest.mark.skipif(not int8_speed.int_mm_exact(), reason=int8_speed.INEXACT_NOTE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(5, 8, 40), (37, 384, 129), (128, 1536, 96), (3000, 64, 700)])
def test_vnni_one_call_linear_equals_the_separate_passes_bit_for_bit(dtype, m, k, n):
    """VnniLinear: quantize, GEMM and dequantize (with the GELU, or the residual add and LayerNorm) in one
    call, on one and two threads: the bits of quantize_rows + torch._int_mm + the dequantize passes
    (3000 x 700: sums past the scratch kept between calls, taken per call)."""
    x, wq_t, sw, b = _quantized(m, k, n, m + k)
    x = x.to(dtype)
    g = torch.Generator().manual_seed(n)
    residual = torch.randn(m, n, generator=g).to(dtype)
    ln_w, ln_b = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    one = int8_gemm.VnniLinear(int8_gemm.pack_weight_vnni(wq_t), k, n, sw, b)
    xq, sx = int8_gemm.quantize_rows(x)
    want_ln = int8_gemm.dequantize_residual_ln(torch._int_mm(xq, wq_t), sx, sw, b, residual, ln_w, ln_b, 1e-12)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for gelu in (None, "none", "tanh"):
                for out_dtype in (torch.float32, torch.bfloat16):
                    want = int8_gemm.int8_linear(x, wq_t, sw, b, gelu, out_dtype)
                    assert torch.equal(one.linear(x, gelu, out_dtype), want)
            assert torch.equal(one.linear_residual_ln(x, residual, ln_w, ln_b, 1e-12), want_ln)
    finally:
        torch.set_num_threads(threads)


@needs_vnni
def test_vnni_gemm_refuses_what_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="multiple of 4"):
        int8_gemm._ext.int8_gemm_vnni(0, 1, 3, 0, 1, 0, 1)
    with pytest.raises(ValueError, match="multiple of 4"):
        int8_gemm._ext.Int8VnniLinear(0, 6, 16, 0, 0)
    with pytest.raises(ValueError, match="act 0, 1 or 2"):
        int8_gemm._ext.Int8VnniLinear(0, 8, 16, 0, 0).linear(0, 0, 1, 0, 0, 7, 1)
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "avx2")
    assert not int8_gemm.vnni_available()
    with pytest.raises(ValueError, match="AVX-512 VNNI"):
        int8_gemm._ext.int8_gemm_vnni(0, 0, 4, 0, 1, 0, 1)


# ----------------------------------------------------------------------------- the AVX2 GEMM (CPUs without VNNI)
needs_avx2 = pytest.mark.skipif(
    not int8_gemm.avx2_available(), reason="needs AVX2 + FMA (this CPU lacks it, or BERT_FAST_CPU_ISA=scalar)"
)


def _quantized(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=g) * 2, torch.randn(n, k, generator=g) * 0.1, torch.randn(n, generator=g)
    sw = (w.abs().amax(1) / 127).clamp_min(1e-12)
    wq_t = torch.round(w / sw[:, None]).clamp(-127, 127).to(torch.int8).t().contiguous()
    wq_t[0, : min(n, 3)] = torch.tensor([127, -127, 127], dtype=torch.int8)[: min(n, 3)]  # full-range codes
    return x, wq_t, sw, b


def test_avx2_weight_panels_hold_the_pairs_of_16_columns():
    wq_t = torch.arange(5 * 19, dtype=torch.int16).view(5, 19).to(torch.int8)
    p = int8_gemm.pack_weight_avx2(wq_t)
    assert p.shape == (2, 3, 16, 2) and p.dtype == torch.int16
    for panel, j, lane, t in [(0, 0, 0, 0), (0, 1, 3, 1), (1, 2, 2, 0), (1, 0, 2, 1)]:
        k, col = 2 * j + t, 16 * panel + lane
        assert p[panel, j, lane, t] == (wq_t[k, col] if k < 5 and col < 19 else 0)
    assert p[1, 2, :, 1].eq(0).all() and p[1, :, 3:, :].eq(0).all()  # the padding is zero


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 7, 17), (4, 16, 16), (9, 384, 40), (37, 768, 129), (130, 3000, 64)])
def test_avx2_gemm_equals_the_int_mm_path_bit_for_bit(dtype, m, k, n):
    """The same exact int32 sums as torch._int_mm and the dequantization in the same order: equal bits,
    row and column tails, odd K, bias and none."""
    x, wq_t, sw, b = _quantized(m, k, n, m + k + n)
    x = x.to(dtype)
    packed = int8_gemm.pack_weight_avx2(wq_t)
    for bias in (b, None):
        want = int8_gemm.dequantize_torch(
            torch.mm(int8_gemm.quantize_rows(x)[0].long(), wq_t.long()).to(torch.int32),
            int8_gemm.quantize_rows(x)[1],
            sw,
            bias,
            dtype,
        )
        got = int8_gemm.int8_linear_avx2(x, packed, n, sw, bias, None)
        assert torch.equal(got, want), (m, k, n, (got.float() - want.float()).abs().max())


@needs_avx2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_avx2_gemm_gelu_epilogue_matches_torch_gelu(dtype, gelu):
    """The GELU in the AVX2 epilogue equals torch's GELU of the exact dequantized values to 2e-7
    relative (fp32 output) or within one bf16 step (bf16 output)."""
    m, k, n = 21, 96, 203
    x, wq_t, sw, b = _quantized(m, k, n, 5)
    x = x.to(dtype)
    got = int8_gemm.int8_linear_avx2(x, int8_gemm.pack_weight_avx2(wq_t), n, sw, b, gelu)
    xq, sx = int8_gemm.quantize_rows(x)
    exact = int8_gemm.dequantize_torch(torch.mm(xq.long(), wq_t.long()).to(torch.int32), sx, sw, b, torch.float32)
    want = torch.nn.functional.gelu(exact.double(), approximate=gelu)
    err = (got.double() - want).abs()
    if dtype == torch.float32:
        assert (err <= 2e-7 * (1 + want.abs()) + 1e-7).all(), err.max().item()
    else:
        assert (err <= want.abs() * 2.0**-8 + 1e-6).all(), err.max().item()


@needs_avx2
def test_avx2_gemm_refuses_what_it_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="act must be"):
        int8_gemm._ext.int8_linear_avx2(0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 9, 1)
    with pytest.raises(ValueError, match="dtype code"):
        int8_gemm._ext.int8_linear_avx2(0, 1, 1, 0, 1, 0, 0, 0, 0, 3, 0, 1)
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "scalar")
    assert not int8_gemm.avx2_available()
    with pytest.raises(ValueError, match="cannot run isa=avx2"):
        int8_gemm._ext.int8_linear_avx2(0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 1)


@native
@pytest.mark.parametrize("gelu", [None, "none"])
def test_a_pass_split_over_threads_equals_one_thread(gelu):
    """split_rows weighs an element by the pass's cost (the GELU epilogue 4x): batch 1's FFN-up shape
    (128 x 1536) now runs on two threads, with the one-thread result bit for bit (rows are independent)."""
    m, n = 128, 1536
    g = torch.Generator().manual_seed(2)
    acc = torch.randint(-(10**5), 10**5, (m, n), dtype=torch.int32, generator=g)
    sx, sw, bias = torch.rand(m, generator=g) * 1e-4, torch.rand(n, generator=g) * 1e-2, torch.randn(n, generator=g)
    one, two = (native_dequantize(acc, sx, sw, bias, torch.float32, threads, gelu=gelu) for threads in (1, 2))
    assert torch.equal(one, two)


@native
def test_the_passes_read_non_contiguous_inputs_whole():
    """A transposed accumulator and a strided scale: their contiguous copies must live through the C++
    pass (made inside its argument list, they were freed before it read them)."""
    g = torch.Generator().manual_seed(3)
    m, n = 64, 96
    acc = torch.randint(-(10**6), 10**6, (n, m), dtype=torch.int32, generator=g).t()
    sx = torch.rand(m, 2, generator=g)[:, 0]
    sw, bias = torch.rand(n, generator=g), torch.randn(n, generator=g)
    assert not acc.is_contiguous() and not sx.is_contiguous()
    for _ in range(3):  # allocations in between would reuse a freed copy's memory
        y = int8_gemm.dequantize(acc, sx, sw, bias, torch.float32)
        assert torch.equal(y, int8_gemm.dequantize_torch(acc, sx, sw, bias, torch.float32))
    residual, w, b = torch.randn(m, n, generator=g), torch.rand(n, generator=g), torch.randn(n, generator=g)
    y = int8_gemm.dequantize_residual_ln(acc, sx, sw, bias, residual, w, b, 1e-12)
    ref = int8_gemm.dequantize_residual_ln_torch(acc, sx, sw, bias, residual, w, b, 1e-12)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
