"""bf16 attention of CPU inference (csrc/attention_cpu.cpp through bert_fast/ops/cpu_attention.py):
the 2x rule against the float64 oracle, with torch's bf16 SDPA as "plain PyTorch in the same
dtype", over lengths, head dims, masks with a fully padded row, varlen sequences, separate q/k/v
and non-contiguous qkv; the choice against torch's kernel; and the model taking it in bf16.

Runs where the CPU has AVX-512 BF16 (skipped elsewhere, where the model keeps torch's kernel)."""

from __future__ import annotations

import pytest
import torch

from bert_fast.ops import cpu_attention
from bert_fast.testing import assert_close_2x, padded_key_mask

pytestmark = [
    pytest.mark.no_kernels("CPU inference attention, not the Triton kernels"),
    pytest.mark.skipif(not cpu_attention.available(), reason="needs a CPU with AVX-512 BF16 and the built kernel"),
]


def _oracle(q, k, v, mask, scale, dtype):
    """softmax(scale q k^T + mask) v in ``dtype`` ([B, h, S, d] operands); all-masked rows are 0."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    p = torch.softmax(s.float() if dtype == torch.bfloat16 else s, dim=-1).nan_to_num(0.0).to(dtype)
    return p @ v


def _torch_bf16(q, k, v, mask, scale):
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask.bool(), float("-inf"))[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale).nan_to_num(0.0)


def _qkv(b, s, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, 3, h, d, generator=g) * 1.5).to(torch.bfloat16)


@pytest.mark.parametrize(
    "b,s,h,d",
    [(2, 1, 2, 64), (2, 7, 3, 64), (2, 17, 2, 32), (1, 127, 4, 26), (1, 129, 12, 64), (1, 512, 2, 80), (3, 33, 2, 16)]
    + [(2, 40, 2, d) for d in (40, 48, 96, 128)],
)
@pytest.mark.parametrize("masked", [False, True])
def test_padded_attention_within_2x_of_torch(b, s, h, d, masked):
    qkv = _qkv(b, s, h, d, seed=b * 1000 + s * 10 + d)
    mask = padded_key_mask(b, s, seed=s) if masked else None
    scale = d**-0.5
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = cpu_attention.padded(qkv, mask, scale).transpose(1, 2)
    assert_close_2x(out, _oracle(q, k, v, mask, scale, torch.float64), _torch_bf16(q, k, v, mask, scale))
    if masked and b > 1:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))


def test_non_contiguous_qkv():
    base = _qkv(2, 24, 2, 64, seed=3)
    qkv = torch.cat([base, base], dim=1)[:, ::2]  # every other token: a strided view
    assert not qkv.is_contiguous()
    scale = 0.125
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = cpu_attention.padded(qkv, None, scale).transpose(1, 2)
    assert_close_2x(out, _oracle(q, k, v, None, scale, torch.float64), _torch_bf16(q, k, v, None, scale))


# The checks that are the same in bf16 and fp32 (tests/cpu/test_cpu_attention_f32.py runs them too, with its
# own _qkv). VARLEN_CASES' second packs (12 heads x 64 dims, ~1,200 token rows) take several of the
# kernel's 2 MiB chunks: sequences packed in different chunks must not change a value.
VARLEN_CASES = [([5, 1, 17, 64, 33], 3, 32), ([130, 7, 200, 16, 255, 129, 31, 190, 240], 12, 64)]


def check_varlen_equals_each_sequence_alone(make_qkv, lengths, h, d):
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    qkv = make_qkv(1, int(cu[-1]), h, d, seed=11)[0]  # [T, 3, h, d]
    out = cpu_attention.varlen(qkv, cu, d**-0.5)
    for i in range(len(lengths)):
        alone = cpu_attention.padded(qkv[cu[i] : cu[i + 1]][None], None, d**-0.5)[0]
        assert torch.equal(out[cu[i] : cu[i + 1]], alone)  # no sequence sees another's keys


def check_separate_qkv_equals_fused_layout(make_qkv):
    b, s, h, d = 2, 19, 4, 32
    qkv = make_qkv(b, s, h, d, seed=5)
    q, k, v = (t.reshape(b * s, h * d) for t in qkv.unbind(2))
    sep = cpu_attention.separate(q, k, v, b, s, h, d**-0.5)
    assert torch.equal(sep, cpu_attention.padded(qkv, None, d**-0.5).reshape(b * s, h * d))


def check_choice_is_measured_and_cached(monkeypatch, x):
    """BERT_FAST_CPU_ATTENTION=auto: a timing decides per (dtype, heads, head dim, threads); a kept
    verdict is honoured, a missing one measured once and cached."""
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "auto")
    key = (x.dtype, 2, x.shape[-1], torch.get_num_threads())
    monkeypatch.setattr(cpu_attention, "_CHOICES", {key: False})
    assert not cpu_attention.eligible(x, 2)  # torch's kernel won the timing: keep it
    monkeypatch.setattr(cpu_attention, "_CHOICES", {})
    cpu_attention.eligible(x, 2)
    assert key in cpu_attention._CHOICES  # measured once, then cached


def record_layouts(monkeypatch) -> list:
    """Our attention kernels forced on (BERT_FAST_CPU_ATTENTION=1); the list returned records the layout
    of each call (padded, varlen, separate)."""
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "1")
    calls = []
    for name in ("padded", "varlen", "separate"):
        real = getattr(cpu_attention, name)
        monkeypatch.setattr(cpu_attention, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    return calls


@pytest.mark.parametrize("lengths,h,d", VARLEN_CASES)
def test_varlen_equals_each_sequence_alone(lengths, h, d):
    check_varlen_equals_each_sequence_alone(_qkv, lengths, h, d)


def test_separate_qkv_equals_fused_layout():
    check_separate_qkv_equals_fused_layout(_qkv)


def test_eligibility_and_switch(monkeypatch):
    x = torch.zeros(4, 3, 2, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "1")
    assert cpu_attention.eligible(x, 2)
    assert not cpu_attention.eligible(x.half(), 2)  # fp16: torch's kernel
    assert not cpu_attention.eligible(torch.zeros(4, 3, 2, 63, dtype=torch.bfloat16), 2)  # odd head dim
    monkeypatch.setenv("BERT_FAST_CPU_ATTENTION", "0")
    assert not cpu_attention.eligible(x, 2)
    check_choice_is_measured_and_cached(monkeypatch, x)


def test_bf16_model_takes_it_and_stays_close_to_fp32(monkeypatch):
    """A bf16 model's no-grad forward runs this kernel (padded, varlen and separate-QKV layouts) and
    stays within bf16 rounding of the fp32 model, as with torch's kernel."""
    from transformers import BertConfig

    import bert_fast
    from bert_fast import BertModel

    calls = record_layouts(monkeypatch)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=99)
    torch.manual_seed(0)
    ref = BertModel(cfg).eval()
    fast = bert_fast.optimize(BertModel(cfg).eval(), dtype=torch.bfloat16)
    fast.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    ids = torch.randint(1, 99, (3, 21))
    for mask in (torch.ones(3, 21, dtype=torch.long), torch.arange(21)[None, :] < torch.tensor([[21], [9], [1]])):
        with torch.no_grad():
            want = ref(ids, attention_mask=mask.long()).last_hidden_state
            got = fast(ids, attention_mask=mask.long()).last_hidden_state.float()
        keep = mask.bool()
        cos = torch.nn.functional.cosine_similarity(got[keep], want[keep], dim=-1)
        assert cos.min().item() > 0.999
    assert "varlen" in calls and {"padded", "separate"} & set(calls), calls
