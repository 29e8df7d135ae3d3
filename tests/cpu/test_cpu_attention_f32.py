"""fp32 attention of CPU inference (csrc/attention_f32_cpu.cpp through bert_fast/ops/cpu_attention.py,
#32 item 3): the 2x rule against the float64 oracle, with torch's fp32 SDPA as "plain PyTorch in the
same dtype", over lengths, head dims (even, odd, not a multiple of the vector width), masks with a
fully padded sequence, varlen sequences and separate q/k/v; on every instruction set this CPU has
(AVX-512 and AVX2 through BERT_FAST_CPU_ISA: the same build, its AVX-512 code disabled, runs exactly
what an AVX2-only CPU runs); the choice against torch's kernel; and an fp32 model taking it.

Skipped, with the reason, where the CPU has neither AVX-512 nor AVX2 + FMA."""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import (  # the checks of the bf16 tests, run here on fp32 tensors
    VARLEN_CASES,
    check_choice_is_measured_and_cached,
    check_separate_qkv_equals_fused_layout,
    check_varlen_equals_each_sequence_alone,
    record_layouts,
)

from bert_fast.ops import cpu_attention
from bert_fast.ops import cpu_isa as isa_info
from bert_fast.testing import assert_close_2x, padded_key_mask

pytestmark = [
    pytest.mark.no_kernels("CPU inference attention, not the Triton kernels"),
    pytest.mark.skipif(
        not cpu_attention.available(torch.float32), reason="needs a CPU with AVX-512 or AVX2+FMA and the built kernel"
    ),
]

_ORDER = ["scalar", "avx2", "avx512", "avx512_bf16"]


def _isas():
    """The instruction sets this CPU runs the fp32 kernel on (avx2 always where it runs at all)."""
    cpu = isa_info.native_passes()["cpu"] if cpu_attention.available(torch.float32) else "scalar"
    out = [i for i in ("avx2", "avx512") if _ORDER.index(cpu) >= _ORDER.index(i)]
    return out or ["avx2"]


@pytest.fixture(params=_isas())
def isa(request, monkeypatch):
    monkeypatch.setenv("BERT_FAST_CPU_ISA", request.param)
    assert cpu_attention._ext.attention_f32_isa() == request.param
    return request.param


def _oracle(q, k, v, mask, scale):
    q, k, v = (t.double() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v


def _torch_fp32(q, k, v, mask, scale):
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape).masked_fill_(~mask.bool(), float("-inf"))[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale).nan_to_num(0.0)


def _qkv(b, s, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, 3, h, d, generator=g) * 1.5


@pytest.mark.parametrize(
    "b,s,h,d",
    [(2, 1, 2, 64), (2, 7, 3, 64), (2, 17, 2, 32), (1, 127, 4, 26), (1, 129, 12, 64), (1, 300, 2, 80), (3, 33, 2, 16)]
    + [(2, 40, 2, d) for d in (5, 8, 40, 96, 128)],
)
@pytest.mark.parametrize("masked", [False, True])
def test_padded_attention_within_2x_of_torch(isa, b, s, h, d, masked):
    qkv = _qkv(b, s, h, d, seed=b * 1000 + s * 10 + d)
    mask = padded_key_mask(b, s, seed=s) if masked else None
    scale = d**-0.5
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = cpu_attention.padded(qkv, mask, scale).transpose(1, 2)
    assert out.dtype == torch.float32
    assert_close_2x(out, _oracle(q, k, v, mask, scale), _torch_fp32(q, k, v, mask, scale))
    if masked and b > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("lengths,h,d", VARLEN_CASES)
def test_varlen_equals_each_sequence_alone(isa, lengths, h, d):
    check_varlen_equals_each_sequence_alone(_qkv, lengths, h, d)


def test_separate_qkv_equals_fused_layout(isa):
    check_separate_qkv_equals_fused_layout(_qkv)


def test_scalar_cap_keeps_torch(monkeypatch):
    monkeypatch.setenv("BERT_FAST_CPU_ISA", "scalar")
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "1")
    assert not cpu_attention.available(torch.float32)
    assert not cpu_attention.eligible(torch.zeros(4, 3, 2, 64), 2)


def test_choice_is_measured_per_dtype_and_cached(monkeypatch):
    check_choice_is_measured_and_cached(monkeypatch, torch.zeros(4, 3, 2, 64))
    assert len(cpu_attention._CHOICES) == 1


@pytest.mark.parametrize("freeze", [False, True])
def test_fp32_model_takes_it_and_matches_transformers(isa, freeze, monkeypatch):
    """An fp32 model's no-grad forward runs this kernel (varlen, padded and separate-QKV layouts)
    and stays within the 2x rule of transformers' fp32 model against its float64 twin."""
    from transformers import BertConfig
    from transformers import BertModel as HFBertModel

    import bert_fast

    calls = record_layouts(monkeypatch)
    monkeypatch.setenv("BERT_FAST_BACKEND", "torch")  # the CPU path users run (not the interpreter's kernels)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=99)
    torch.manual_seed(0)
    ref = HFBertModel(cfg, add_pooling_layer=False).eval()
    oracle = HFBertModel(cfg, add_pooling_layer=False).eval().double()
    oracle.load_state_dict(ref.state_dict())
    import copy

    fast = bert_fast.optimize(copy.deepcopy(ref), freeze=freeze)
    ids = torch.randint(1, 99, (3, 21))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    mask[2, 4:] = 0
    with torch.no_grad():
        for m in (mask, torch.ones_like(ids)):  # ragged (varlen) and dense (separate QKV)
            got = fast(input_ids=ids, attention_mask=m).last_hidden_state
            want = oracle(input_ids=ids, attention_mask=m).last_hidden_state
            base = ref(input_ids=ids, attention_mask=m).last_hidden_state
            keep = m.bool()
            assert_close_2x(got[keep], want[keep], base[keep])
        keep = mask.bool()
        got = fast(input_ids=ids, attention_mask=mask, padded=True).last_hidden_state  # the padded layout
        want = oracle(input_ids=ids, attention_mask=mask).last_hidden_state
        assert_close_2x(got[keep], want[keep], ref(input_ids=ids, attention_mask=mask).last_hidden_state[keep])
    # a frozen layer's packed QKV runs the dense batch on the varlen layout (one fused GEMM)
    assert {"varlen", "padded"} | (set() if freeze else {"separate"}) <= set(calls)
