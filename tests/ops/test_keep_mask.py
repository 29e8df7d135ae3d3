"""The dropout keep-mask of the torch and reference implementations (bert_fast/ops/keep_mask.py and
csrc/keep_mask_cpu.cpp): the exact bits of the Philox stream it is defined by, against the numpy
re-implementation in bert_fast.testing, on every vector width this CPU has, any thread split, and
without the compiled module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bert_fast.ops import _dispatch
from bert_fast.ops import keep_mask as km
from bert_fast.testing import philox4x32_10

_ext = km._ext
needs_ext = pytest.mark.skipif(_ext is None, reason="bert_fast._C is not built")

SHAPES = [(1,), (3, 1), (7, 129), (2, 3, 5, 17), (4, 64), (1000, 13), (2, (1 << 10) + 3)]
SEEDS = [0, 5, 2**62 + 12345, 2**64 - 3]


def oracle(shape, p, seed):
    """The mask from its definition, with numpy's Philox."""
    cols = shape[-1]
    rows = int(np.prod(shape)) // cols
    r = np.arange(rows, dtype=np.uint64)[:, None]
    j = np.arange(cols, dtype=np.uint64)[None, :]
    words = philox4x32_10(j // np.uint64(4), np.zeros_like(j), r & np.uint64(0xFFFFFFFF), r >> np.uint64(32), seed)
    w = np.choose((j % np.uint64(4)).astype(np.int64), words)
    return torch.from_numpy(w >= np.uint64(km.keep_threshold(p))).reshape(shape)


def _isas():
    """The versions this CPU (and BERT_FAST_CPU_ISA) lets keep_mask_cpu run."""
    if _ext is None:
        return []
    out, buf = [], torch.empty(1, dtype=torch.uint8)  # kept alive across the call
    for isa in ("scalar", "avx2", "avx512"):
        try:
            _ext.keep_mask_cpu(buf.data_ptr(), 1, 1, 0, 0.5, 1, isa)
            out.append(isa)
        except ValueError:
            pass
    return out


# Every version is a test case: the portable one runs everywhere, a vector one skips with the reason
# where the CPU lacks its instructions.
ISA_CASES = [
    isa
    if isa in _isas() or _ext is None
    else pytest.param(isa, marks=pytest.mark.skip(reason=f"this CPU (or BERT_FAST_CPU_ISA) does not run {isa}"))
    for isa in ("scalar", "avx2", "avx512")
]


@needs_ext
@pytest.mark.parametrize("isa", ISA_CASES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_mask_is_the_philox_stream(isa, threads, shape):
    for seed in SEEDS:
        for p in (0.1, 0.5):
            cols = shape[-1]
            rows = int(np.prod(shape)) // cols
            out = torch.empty(shape, dtype=torch.uint8)
            signed = seed - (1 << 64) if seed >= 1 << 63 else seed
            _ext.keep_mask_cpu(out.data_ptr(), rows, cols, signed, p, threads, isa)
            assert torch.equal(out.bool(), oracle(shape, p, seed)), (isa, threads, shape, seed, p)


@needs_ext
def test_unknown_isa_is_refused():
    buf = torch.empty(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="isa=bogus"):
        _ext.keep_mask_cpu(buf.data_ptr(), 1, 1, 0, 0.5, 1, "bogus")
    assert _ext.keep_mask_isa() in _isas()


@needs_ext
def test_threads_split_large_masks_the_same_way():
    # large enough that the row split really uses several threads (>= 2^16 elements a thread)
    shape = (3 * 12 * 64, 128)
    outs = []
    for threads in (1, 2, 5):
        t = torch.empty(shape, dtype=torch.uint8)
        _ext.keep_mask_cpu(t.data_ptr(), shape[0], shape[1], 77, 0.1, threads)
        outs.append(t)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(outs[0].bool(), oracle(shape, 0.1, 77))


@pytest.mark.parametrize("shape", SHAPES[:5])
def test_torch_version_draws_the_same_bits(shape):
    for seed in SEEDS[:3] + [2**64 - 3]:
        cols = shape[-1]
        got = km.keep_mask_torch(int(np.prod(shape)) // cols, cols, 0.3, seed, rows_per_chunk=4)
        assert torch.equal(got.bool().reshape(shape), oracle(shape, 0.3, seed))


def test_without_the_compiled_module(monkeypatch):
    monkeypatch.setattr(km, "_ext", None)
    seed = torch.tensor([123456789], dtype=torch.int64)
    got = _dispatch.reference_dropout_mask((2, 3, 9, 9), 0.2, seed, "cpu")
    assert got.dtype == torch.bool and torch.equal(got, oracle((2, 3, 9, 9), 0.2, 123456789))


def test_mask_is_host_memory_under_another_default_device(monkeypatch):
    seed = torch.tensor([9], dtype=torch.int64)
    want = oracle((4, 8), 0.1, 9)
    for ext in (km._ext, None):
        monkeypatch.setattr(km, "_ext", ext)
        with torch.device("meta"):
            got = _dispatch.reference_dropout_mask((4, 8), 0.1, seed, "cpu")
        assert torch.equal(got, want)


def test_reference_dropout_mask_edges():
    seed = torch.tensor([42], dtype=torch.int64)
    assert _dispatch.reference_dropout_mask((4, 4), 0.0, seed, "cpu") is None
    assert _dispatch.reference_dropout_mask((4, 4), 0.5, None, "cpu") is None
    empty = _dispatch.reference_dropout_mask((0, 7), 0.5, seed, "cpu")
    assert empty.shape == (0, 7) and empty.dtype == torch.bool
    tiny = _dispatch.reference_dropout_mask((64, 64), 1e-12, seed, "cpu")  # rounds to p = 0
    assert bool(tiny.all())
    almost = _dispatch.reference_dropout_mask((64, 64), 1 - 1e-12, seed, "cpu")  # rounds to p = 1
    assert not bool(almost.any())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_fraction_and_independence(p):
    """Bernoulli(1 - p): the kept fraction within 5 sigma, different seeds and rows not equal."""
    shape = (96, 1024)
    a = _dispatch.reference_dropout_mask(shape, p, torch.tensor([1]), "cpu")
    b = _dispatch.reference_dropout_mask(shape, p, torch.tensor([2]), "cpu")
    n = a.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(a.float().mean().item() - (1 - p)) < 5 * sigma
    assert not torch.equal(a, b)
    assert not torch.equal(a[0], a[1])
    # neighbouring elements are not correlated (the 4 words of one Philox call included)
    x = a.float() - (1 - p)
    corr = (x[:, :-1] * x[:, 1:]).mean().item() / (p * (1 - p))
    assert abs(corr) < 5 / n**0.5
