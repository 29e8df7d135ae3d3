"""What a user meets on each CPU class, whatever CPU runs the tests (issue #33 item 5): the CPU's flags
and optimize(int8=True)'s speed check are faked per class, and the bf16 and int8 refusals, the doctor's
advice and the bench's choice of cases and int8 provider line are checked together.

The classes: AVX2 only (AMD Zen 2/3, older Intel: no bf16 units, no VNNI, torch's int8 GEMM a slow
loop), AVX-512 with VNNI (Cascade Lake, Ice Lake), AVX-512 BF16 (Zen 4/5, Cooper Lake) and AMX
(Sapphire Rapids and later)."""

from __future__ import annotations

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import int8, int8_speed, precision

pytestmark = pytest.mark.no_kernels("CPU precision choices, not the Triton kernels")

CLASSES = {
    "avx2": dict(flags={"avx2", "fma"}, bf16=False, int8_speedup=0.02),
    "avx512-vnni": dict(flags={"avx2", "avx512f", "avx512_vnni"}, bf16=False, int8_speedup=2.0),
    "avx512-bf16": dict(flags={"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, bf16=True, int8_speedup=1.6),
    "amx": dict(
        flags={"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile"},
        bf16=True,
        int8_speedup=1.2,
    ),
}


@pytest.fixture(params=list(CLASSES))
def cpu_class(request, monkeypatch):
    """Pretend to be a CPU of this class: its flags for every reader, its measured int8 speed."""
    from bert_fast.bench import cpu_caps

    c = CLASSES[request.param]
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(c["flags"]))
    monkeypatch.setattr(cpu_caps, "mkldnn_bf16", lambda: c["bf16"])
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: c["bf16"])
    monkeypatch.setattr(precision, "_WARNED", set())
    fp32 = 0.2
    speed = int8_speed.Int8Speed(
        int8_tops=fp32 * c["int8_speedup"], fp32_tflops=fp32, shape=int8_speed.SHAPE, threads=2, rounds=3
    )
    monkeypatch.setattr(int8_speed, "_CACHE", {torch.get_num_threads(): speed})
    return request.param, c, speed


def tiny():
    cfg = transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


BATCH = {"input_ids": torch.randint(5, 100, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.long)}


def test_bf16_is_refused_exactly_where_the_cpu_has_no_bf16_units(cpu_class):
    name, c, _ = cpu_class
    if c["bf16"]:
        precision.check_requested(torch.bfloat16, torch.device("cpu"))  # accepted
    else:
        with pytest.raises(ValueError, match="this CPU has no bf16 units"):
            bert_fast.optimize(tiny(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float16 on the CPU has no fast GEMMs"):
        bert_fast.optimize(tiny(), dtype=torch.float16)  # on every class


def test_int8_is_refused_exactly_where_it_measures_slower(cpu_class, monkeypatch):
    name, c, speed = cpu_class
    model = tiny()
    if speed.faster:
        if not int8.available():
            pytest.skip("torch._int_mm does not run on this CPU build")
        if not int8_speed.int_mm_exact():  # the faked class's backend is torch._int_mm
            pytest.skip(int8_speed.INEXACT_NOTE)
        out = bert_fast.optimize(model, int8=True, calibration=BATCH, min_cosine=0.9)
        assert int8.store_of(out)  # quantized (the faked class's speed decided; the accuracy guard passed)
    else:
        with pytest.raises(bert_fast.Int8SpeedError, match=r"TOPS .*vs fp32 .*TFLOP/s \(0\.02x\)"):
            bert_fast.optimize(model, int8=True, calibration=BATCH)
        assert type(model) is transformers.BertModel


def test_the_doctor_advises_each_class(cpu_class):
    from bert_fast import doctor_precision as dp
    from bert_fast.bench import cpu_caps

    name, c, speed = cpu_class
    caps = cpu_caps.capabilities()
    fp32 = 0.2
    rates = {
        "fp32": fp32,
        "bf16": 3 * fp32 if c["bf16"] else 0.3 * fp32,
        "bf16_linear": None,
        "bf16_packed": None,
        "int8": speed.int8_tops,
        "int8_check": speed.as_dict(),
        "threads": 2,
    }
    rec = dp.recommend(caps, rates)
    assert rec["precision"] == ("bf16" if c["bf16"] else "fp32")
    why = " ".join(rec["why"])
    if not c["bf16"]:
        assert "emulated and slow" in why
    if name == "avx2":
        assert rec["int8"] is not None and "refuses on this CPU (Int8SpeedError)" in rec["int8"]
    elif name == "avx512-vnni":  # int8 2x the recommended fp32: mentioned, behind its accuracy guard
        assert rec["int8"] is not None and dp.CALL_INT8 in rec["int8"] and "Int8SpeedError" not in rec["int8"]
    else:  # bf16 is recommended, and int8 is not 1.3x faster than it
        assert rec["int8"] is None
    shown = dp.format_report({"capabilities": caps, "rates": rates, "recommendation": rec})
    assert f"recommended: {rec['precision']}" in shown


def test_the_bench_picks_its_cases_and_says_why(cpu_class, monkeypatch):
    from bert_fast import cli
    from bert_fast.bench import cpu_caps, model_bench, model_providers
    from bert_fast.bench.timing import ProviderUnavailable

    name, c, speed = cpu_class
    args = cli.build_parser().parse_args(["bench", "--device", "cpu"])
    model_bench.apply_defaults(args)
    assert args.dtypes == (["fp32", "bf16"] if c["bf16"] else ["fp32"])
    assert (args.bf16_skipped is None) == c["bf16"]
    if not c["bf16"]:
        assert "no bf16 units" in args.bf16_skipped
    assert "native passes" in cpu_caps.describe(args.cpu)  # the ISA each native pass runs
    model = bert_fast.optimize(tiny())
    if not speed.faster:
        monkeypatch.setattr(int8, "available", lambda: True)
        with pytest.raises(ProviderUnavailable, match=r"refused by its speed check: .*TOPS .*vs fp32"):
            model_providers.quantize_int8(model, model.config, "cpu", "infer")
