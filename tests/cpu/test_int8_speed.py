"""int8 is never a silent slow path (issue #32 item 4): optimize(int8=True), int8.quantize, the bench's
int8 provider and the doctor all decide from one measured check of the int8 GEMM against the fp32 one
on this CPU (bert_fast/model/int8_speed.py), made before anything is calibrated and cached per process.
Where int8 measures slower (CPUs without AVX-512 VNNI / AMX-INT8, faked here by a slow GEMM) it is
refused with both rates; a torch without the int8 op gets a clear error."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import int8, int8_speed
from bert_fast.ops import int8_gemm
from bert_fast.testing import tiny_bert_config

pytestmark = pytest.mark.no_kernels("the CPU int8 path, not the Triton kernels")

needs_int8 = pytest.mark.skipif(not int8.available(), reason="torch._int_mm does not run on this CPU build")


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch):
    monkeypatch.setattr(int8_speed, "_CACHE", {})


def slow(speedup: float = 0.03) -> int8_speed.Int8Speed:
    return int8_speed.Int8Speed(
        int8_tops=0.003, fp32_tflops=0.003 / speedup, shape=int8_speed.SHAPE, threads=2, rounds=1
    )


def tiny_model():
    cfg = tiny_bert_config(hidden=32, heads=2, vocab=120, dropout=0.1)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


@needs_int8
def test_the_check_measures_both_rates_once_per_process_and_thread_count():
    speed = int8_speed.check()
    assert speed.int8_tops > 0 and speed.fp32_tflops > 0 and speed.rounds >= 1
    assert speed.threads == torch.get_num_threads() and speed.shape == int8_speed.SHAPE
    assert speed.faster == (speed.speedup >= int8_speed.MIN_SPEEDUP)
    assert int8_speed.check() is speed  # cached
    d = speed.as_dict()
    assert d["faster"] == speed.faster and d["shape"] == list(int8_speed.SHAPE)
    assert "TOPS" in speed.describe() and "TFLOP/s" in speed.describe()


def crawling(real, calls=None):
    def slow_call(*args):
        if calls is not None:
            calls.append(real)
        time.sleep(0.5)  # > CLEARLY_SLOWER x an fp32 call even on a loaded 2-core machine
        return real(*args)

    return slow_call


@needs_int8
def test_slow_int8_gemms_are_found_in_one_round(monkeypatch):
    """A CPU where every int8 GEMM is slow (torch's plain loop without VNNI, 35-55x fp32): one call of
    each decides, in a few seconds at most, and int8 is refused with the rates."""
    calls = []
    monkeypatch.setattr(int8_gemm, "int8_linear", crawling(int8_gemm.int8_linear, calls))
    monkeypatch.setattr(int8_gemm.VnniLinear, "linear", crawling(int8_gemm.VnniLinear.linear, calls))
    monkeypatch.setattr(int8_gemm, "int8_linear_avx2", crawling(int8_gemm.int8_linear_avx2, calls))
    speed = int8_speed.check()
    assert not speed.faster and speed.rounds == 1
    # warm-up and one timed call of each backend, not MAX_ROUNDS of slow calls (counted, not timed:
    # the clock failed this on a loaded lease machine, 4.6 s for the same calls)
    assert calls and len(calls) <= 2 * len(set(calls)), calls
    with pytest.raises(int8_speed.Int8SpeedError, match=r"slower than float32 .*TOPS .*vs fp32 .*TFLOP/s"):
        int8_speed.require_faster()


@needs_int8
@pytest.mark.skipif(not int8_gemm.avx2_available(), reason="needs AVX2 for bert_fast's own int8 GEMM")
@pytest.mark.skipif(not int8_speed.int_mm_exact(), reason=int8_speed.INEXACT_NOTE)
def test_every_int8_backend_gives_the_same_model_outputs(monkeypatch):
    """quantize(backend="avx2"), ("vnni") and ("int_mm") run the same int32 sums: the same outputs (bit
    for bit between int_mm and vnni, which share the passes; up to the GELU's vector forms, ~1e-7, for
    avx2), and every int8 GEMM of the model runs the backend asked for."""
    monkeypatch.setattr(int8_speed.Int8Speed, "faster", property(lambda self: True))
    batch = {"input_ids": torch.randint(5, 100, (3, 11)), "attention_mask": torch.ones(3, 11, dtype=torch.long)}
    batch["attention_mask"][1, 6:] = 0
    outs = {}
    for backend in ("int_mm", "avx2") + (("vnni",) if int8_gemm.vnni_available() else ()):
        model = bert_fast.optimize(tiny_model())
        int8.quantize(model, batch, min_cosine=0.9, backend=backend)
        store = int8.store_of(model)
        assert {lin.backend for e in store.values() for lin in (e.qkv, e.out, e.up, e.down)} == {backend}
        with torch.inference_mode():
            outs[backend] = model(**batch).last_hidden_state
    torch.testing.assert_close(outs["avx2"], outs["int_mm"], rtol=1e-5, atol=1e-5)
    if "vnni" in outs:
        assert torch.equal(outs["vnni"], outs["int_mm"])


def test_an_inexact_int_mm_is_never_a_backend(monkeypatch):
    """torch._int_mm whose int32 sums saturate (oneDNN's int16 pair sums without VNNI; a fake that
    clamps every sum to int16 here) is left out of the speed check, with the reason, and refused
    when asked for by name; our VNNI or AVX2 GEMM runs instead where it can, and int8 is refused otherwise."""
    real = torch._int_mm

    def saturating(a, b):
        return real(a, b).clamp(-(2**15), 2**15 - 1)

    monkeypatch.setattr(int8_speed, "_EXACT", {})
    if int8.available():  # the probe says what a direct full-range product says of the real one
        g = torch.Generator().manual_seed(5)
        a = torch.randint(-127, 128, (64, 384), dtype=torch.int8, generator=g)
        b = torch.randint(-127, 128, (384, 128), dtype=torch.int8, generator=g)
        assert int8_speed.int_mm_exact() == torch.equal(real(a, b).long(), a.long() @ b.long())
    monkeypatch.setattr(int8_speed, "_EXACT", {})
    monkeypatch.setattr(torch, "_int_mm", saturating)
    assert not int8_speed.int_mm_exact()
    monkeypatch.setattr(int8_speed, "_CACHE", {})
    speed = int8_speed.check()
    assert "int_mm" not in speed.rates and int8_speed.INEXACT_NOTE in speed.describe()
    batch = {"input_ids": torch.randint(5, 100, (2, 6)), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    with pytest.raises(ValueError, match="'int_mm' refused"):
        int8.quantize(bert_fast.optimize(tiny_model()), batch, min_cosine=0.0, backend="int_mm")
    ours = [b for b, ok in (("vnni", int8_gemm.vnni_available()), ("avx2", int8_gemm.avx2_available())) if ok]
    if ours:
        assert speed.backend in ours and set(speed.rates) == set(ours)
    else:
        assert speed.backend == "none" and not speed.rates
        with pytest.raises(int8_speed.Int8SpeedError, match="cannot run correctly"):
            int8_speed.require_faster()
