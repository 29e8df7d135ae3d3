"""The instruction set of every native CPU pass is chosen at run time on the CPU that runs it (csrc/cpu_isa.h),
never on the build machine, and BERT_FAST_CPU_ISA caps it: the same build, with its AVX-512 code disabled,
runs what an AVX2-only (or a plain x86-64) CPU runs, with the same answers (issue #33 item 1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bert_fast.ops import cpu_isa

pytestmark = [
    pytest.mark.no_kernels("the native CPU passes, not the Triton kernels"),
    pytest.mark.skipif(cpu_isa._ext is None, reason="bert_fast._C was built without the run-time ISA check"),
]

ROOT = Path(__file__).resolve().parents[2]

# One process per cap: what each native pass runs, and answers to compare across caps.
PROBE = r"""
import json, torch, transformers
from bert_fast.ops import cpu_isa, int8_gemm
import bert_fast
torch.manual_seed(0)
x = torch.randn(37, 300) * 3
q, s = int8_gemm.quantize_rows(x)
acc = torch.randint(-10**6, 10**6, (37, 200), dtype=torch.int32)
y = int8_gemm.dequantize(acc, s, torch.rand(200), torch.randn(200), torch.float32, "tanh")
cfg = transformers.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=128, max_position_embeddings=32)
hf = transformers.BertModel(cfg).eval()
m = bert_fast.optimize(transformers.BertModel(cfg).eval())
m.load_state_dict(hf.state_dict())
ids = torch.randint(5, 100, (3, 17)); mask = torch.ones(3, 17, dtype=torch.long); mask[1, 9:] = 0
with torch.no_grad():
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        h = m.to(dt)(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        out[name] = (h * mask[..., None]).tolist()
print(json.dumps({"passes": cpu_isa.native_passes(), "q": q.tolist(), "s": s.tolist(), "y": y.tolist(), **out}))
"""


def _probe(cap):
    env = {k: v for k, v in os.environ.items() if k != "BERT_FAST_CPU_ISA"}
    if cap is not None:
        env["BERT_FAST_CPU_ISA"] = cap
    env["TRITON_INTERPRET"] = "0"
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_native_passes_name_an_isa_each():
    p = cpu_isa.native_passes()
    assert p["cpu"] in cpu_isa.ISAS and p["cap"] == (os.environ.get("BERT_FAST_CPU_ISA") or "-")
    assert p["keep_mask"] in ("scalar", "avx2", "avx512")
    assert p["int8_passes"] in ("scalar", "avx512")
    assert p["attention_bf16"] == "avx512_bf16" or p["attention_bf16"].startswith("not used: needs avx512_bf16")
    assert p["attention_fp32"] in ("avx512", "avx2") or p["attention_fp32"].startswith("not used: needs avx2")
    line = cpu_isa.describe()
    assert line.startswith("native CPU passes: CPU ") and "int8_passes" in line


def test_a_capped_process_runs_the_portable_code_with_the_same_answers():
    """The widest ISA against BERT_FAST_CPU_ISA=avx2 and =scalar in fresh processes: each pass says the
    version it runs, the int8 passes give the same bits, fp32 outputs agree to fp32 rounding (the fp32
    attention kernel sums in another order on 8 lanes than on 16, and scalar runs torch's) and bf16
    outputs agree within bf16 (torch's attention kernel instead of ours)."""
    widest = _probe(None)
    for cap in ("avx2", "scalar"):
        got = _probe(cap)
        p = got["passes"]
        assert p["cap"] == cap and p["int8_passes"] == "scalar"
        assert p["attention_bf16"].startswith("not used")
        assert p["keep_mask"] == ("scalar" if cap == "scalar" or widest["passes"]["cpu"] == "scalar" else "avx2")
        assert got["q"] == widest["q"] and got["s"] == widest["s"]  # bit for bit
        y, y0 = torch.tensor(got["y"]), torch.tensor(widest["y"])
        assert torch.allclose(y, y0, rtol=3e-7, atol=1e-7)  # the GELU's vector and scalar forms
        assert p["attention_fp32"] == (cap if cap == "avx2" else "not used: needs avx2+fma (torch's kernel runs)")
        assert torch.allclose(torch.tensor(got["fp32"]), torch.tensor(widest["fp32"]), rtol=1e-5, atol=1e-5)
        bf, bf0 = torch.tensor(got["bf16"]), torch.tensor(widest["bf16"])
        assert (bf - bf0).abs().max() < 0.1, (cap, (bf - bf0).abs().max())


def test_a_bad_cap_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "avx9000")
    with pytest.raises(ValueError, match=r"BERT_FAST_CPU_ISA='avx9000': expected one of scalar, avx2"):
        cpu_isa.native_passes()
    with pytest.raises(ValueError, match="BERT_FAST_CPU_ISA=avx9000"):
        cpu_isa._ext.int8_isa()  # the extension says it too, never silently ignores it


def test_explicit_requests_above_the_cap_are_refused_with_why(monkeypatch):
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "scalar")
    assert cpu_isa._ext.int8_isa() == "scalar" and cpu_isa._ext.keep_mask_isa() == "scalar"
    buf = torch.empty(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"cannot run isa=avx2 .*capped by BERT_FAST_CPU_ISA=scalar"):
        cpu_isa._ext.keep_mask_cpu(buf.data_ptr(), 1, 1, 0, 0.5, 1, "avx2")
    with pytest.raises(ValueError, match=r"cannot run isa=avx512"):
        cpu_isa._ext.int8_quantize_rows(0, 0, 0, 1, 0, 0, 1, "avx512")  # zero rows: the ISA is still checked
    from bert_fast.ops import cpu_attention

    assert not cpu_attention.available()


def test_bert_fast_info_names_the_isa_of_each_pass(monkeypatch):
    from bert_fast import cli

    monkeypatch.setenv("BERT_FAST_CPU_ISA", "scalar")
    text = cli.format_info(cli.gather_info("cpu"))
    assert "BERT_FAST_CPU_ISA scalar" in text
    assert re.search(r"int8_passes\s+scalar", text) and re.search(r"keep_mask\s+scalar", text)


def test_the_build_never_targets_the_build_machine():
    """A wheel built on an AVX-512 machine must run on an AVX2 one: no -march / -mavx* flag anywhere in
    the build (the vector versions carry target attributes; the portable code is plain x86-64)."""
    for name in ("CMakeLists.txt", "setup.py"):
        text = (ROOT / name).read_text()
        code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
        assert not re.search(r"-march=|-mavx|-mtune=native|-mfma", code), name
    for src in [*(ROOT / "csrc").glob("*.cpp"), *(ROOT / "csrc").glob("*.h")]:
        # a file-wide target pragma would put AVX-512 code into the portable functions too
        assert "#pragma GCC target" not in src.read_text(), src.name
