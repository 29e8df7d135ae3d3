"""The CPU path's fp32 linear on oneDNN (bert_fast/ops/cpu_fp32_gemm.py): chosen by measurement,
forced either way by BERT_FAST_CPU_FP32_GEMM, held to the 2x rule against the float64 oracle with
and without the fused GELU, and the same answer from the op and the direct inference path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bert_fast.ops import cpu_fp32_gemm, torch_impl

pytestmark = pytest.mark.skipif(not cpu_fp32_gemm.available(), reason="this torch has no oneDNN linear")


@pytest.fixture(autouse=True)
def fresh():
    cpu_fp32_gemm.reset()
    yield
    cpu_fp32_gemm.reset()


def test_mode_values(monkeypatch):
    for m in ("auto", "onednn", "aten"):
        monkeypatch.setenv(cpu_fp32_gemm.ENV, m)
        assert cpu_fp32_gemm.mode() == m
    monkeypatch.setenv(cpu_fp32_gemm.ENV, "mkl")
    with pytest.raises(ValueError, match="auto, onednn or aten"):
        cpu_fp32_gemm.mode()


def test_forced_choices_skip_the_measurement(monkeypatch):
    monkeypatch.setattr(cpu_fp32_gemm, "_measure", lambda: pytest.fail("measured although forced"))
    monkeypatch.setenv(cpu_fp32_gemm.ENV, "onednn")
    assert cpu_fp32_gemm.use_onednn()
    monkeypatch.setenv(cpu_fp32_gemm.ENV, "aten")
    assert not cpu_fp32_gemm.use_onednn()


def test_auto_measures_once_per_thread_count(monkeypatch):
    calls = []
    real = cpu_fp32_gemm._measure
    monkeypatch.setenv(cpu_fp32_gemm.ENV, "auto")
    monkeypatch.setattr(cpu_fp32_gemm, "_measure", lambda: calls.append(1) or True)
    assert cpu_fp32_gemm.use_onednn() and cpu_fp32_gemm.use_onednn()
    assert len(calls) == 1 and cpu_fp32_gemm.choices() == {torch.get_num_threads(): True}
    # the real measurement answers a bool on this CPU, whichever it is
    assert real(reps=2) in (True, False)


def _err(y, ref):
    return (y.double() - ref).abs().max().item()


@pytest.mark.parametrize("rows,n,k", [(1, 768, 768), (37, 2304, 768), (128, 3072, 768), (200, 768, 3072)])
@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh"])
@pytest.mark.parametrize("save_z", [False, True])
def test_onednn_within_2x_of_aten_against_float64(monkeypatch, rows, n, k, activation, save_z):
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k**0.5
    b = torch.randn(n, generator=g, dtype=torch.float64)
    z64 = F.linear(x, w, b)
    y64 = z64 if activation is None else F.gelu(z64, approximate=torch_impl.GELU_APPROXIMATE[activation])
    out = {}
    for m in ("aten", "onednn"):
        monkeypatch.setenv(cpu_fp32_gemm.ENV, m)
        out[m] = torch_impl.linear_fwd(x.float(), w.float(), b.float(), activation, save_z)
    floor = 8 * torch.finfo(torch.float32).eps * y64.abs().max().item()
    assert _err(out["onednn"][0], y64) <= 2 * _err(out["aten"][0], y64) + floor
    if save_z and activation is not None:  # the backward's input, unactivated
        assert _err(out["onednn"][1], z64) <= 2 * _err(out["aten"][1], z64) + floor
    else:
        assert out["onednn"][1] is None


def test_model_runs_onednn_and_agrees_with_aten(monkeypatch):
    """A whole no-grad forward with each choice: the same hidden states within fp32 rounding."""
    import transformers

    import bert_fast

    cfg = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100
    )
    torch.manual_seed(0)
    model = bert_fast.BertModel(cfg).eval()
    ids = torch.randint(0, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    outs = {}
    for m in ("aten", "onednn"):
        monkeypatch.setenv(cpu_fp32_gemm.ENV, m)
        monkeypatch.setenv("BERT_FAST_BACKEND", "torch")
        with torch.no_grad():
            outs[m] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(outs["onednn"], outs["aten"], rtol=1e-4, atol=1e-4)
