"""Odd machines and late changes take a correct path with at most one warning (issue #32 item 8): a CPU
whose flags cannot be read, a head dim the native kernels do not cover, and a hook added after the
first forward of a plain, frozen or int8 model. (A torch without the CPU int8 op: tests/cpu/test_int8_speed.py.)"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import frozen, int8, int8_speed, precision

pytestmark = pytest.mark.no_kernels("the CPU path, not the Triton kernels")


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(precision, "_WARNED", set())


def hf_model(hidden=64, heads=4, layers=2, seed=0):
    cfg = transformers.BertConfig(
        vocab_size=120,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden + 3,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return transformers.BertModel(cfg).eval()


def batch(b=3, s=13):
    g = torch.Generator().manual_seed(b * s)
    ids = torch.randint(5, 120, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def real(h, mask):
    return h * mask[..., None].to(h.dtype)


def run(model, x):
    with torch.inference_mode():
        return real(model(**x).last_hidden_state.float(), x["attention_mask"])


def test_unreadable_cpu_flags_refuse_nothing_and_warn_nothing(monkeypatch):
    """No /proc/cpuinfo (not Linux, a locked-down container): the capability is unknown, so bf16 is
    neither refused nor warned about; int8 still decides from its measured speed check."""
    from bert_fast.bench import cpu_caps

    monkeypatch.setattr(precision, "cpu_flags", lambda: None)
    assert precision.has_bf16_units() is None and precision.has_int8_units() is None
    hf = hf_model()
    x = batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = bert_fast.optimize(copy.deepcopy(hf), dtype=torch.bfloat16)
        got = run(m, x)
    want = run(hf, x)
    assert (got - want).abs().max() < 0.1  # bf16 answers
    caps = cpu_caps.capabilities()
    assert all(v is None for v in caps["flags"].values())
    assert "?" in cpu_caps.describe(caps)
    ok, why = cpu_caps.bf16_supported(caps)
    assert isinstance(ok, bool) and why


def test_bf16_units_that_onednn_may_not_use_count_as_none(monkeypatch):
    """A CPU with bf16 units under ONEDNN_MAX_CPU_ISA=AVX2 (say): oneDNN cannot use them, so bf16 would
    run converted in software. It is refused, saying why, and a forward on bf16 weights warns once,
    as on a CPU without the units; the flags alone would have let it through (and freeze() refuse)."""
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(precision, "_WARNED", set())
    assert precision.has_bf16_units() is False
    with pytest.raises(ValueError, match="bf16 units but oneDNN may not use them"):
        bert_fast.optimize(hf_model(), dtype=torch.bfloat16)
    m = bert_fast.optimize(hf_model()).to(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="oneDNN may not use them") as seen:
        run(m, batch())
        run(m, batch())
    assert len([w for w in seen if issubclass(w.category, RuntimeWarning)]) == 1


@pytest.mark.parametrize("hidden,heads", [(39, 3), (50, 2), (36, 12)], ids=["d13", "d25", "d3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_the_native_kernels_do_not_cover(hidden, heads, dtype):
    """Odd head dims (the bf16 attention kernel needs an even one) and hidden sizes off every vector
    width: transformers' answers, plain and frozen, without a warning."""
    if dtype == torch.bfloat16 and precision.has_bf16_units() is False:
        pytest.skip("no bf16 units on this CPU: bf16 is refused here (tested in test_cpu_classes.py)")
    hf = hf_model(hidden, heads)
    x = batch()
    want = run(hf, x)
    # freeze=True packs bf16 only where oneDNN runs it (not under ONEDNN_MAX_CPU_ISA=AVX2, say): refused there
    for freeze in (False, True) if frozen.dtype_supported(dtype) else (False,):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m = bert_fast.optimize(copy.deepcopy(hf), dtype=dtype, freeze=freeze)
            got = run(m, x)
        tol = 1e-5 if dtype == torch.float32 else 0.1
        assert (got - want).abs().max() < tol, (freeze, (got - want).abs().max())


@pytest.mark.skipif(not int8.available(), reason="torch._int_mm does not run on this CPU build")
def test_int8_with_an_odd_head_dim_and_hidden_size(monkeypatch):
    monkeypatch.setattr(int8_speed.Int8Speed, "faster", property(lambda self: True))  # numbers, whatever the speed
    hf = hf_model(39, 3)
    x = batch()
    m = bert_fast.optimize(copy.deepcopy(hf), int8=True, calibration=x, min_cosine=0.9)
    assert int8.store_of(m)
    got, want = run(m, x), run(hf, x)
    cos = torch.nn.functional.cosine_similarity(got.flatten(1), want.flatten(1)).min()
    assert cos > 0.99


def _zeroing_hook(module, args, output):
    return output * 0.0


@pytest.mark.parametrize("kind", ["plain", "frozen", "int8"])
def test_a_hook_added_after_the_first_forward_is_honoured(kind, monkeypatch):
    """The first forward runs fused; a forward hook registered afterwards on one Linear changes the
    next forward exactly as on transformers, with at most one warning."""
    if kind == "int8":
        if not int8.available():
            pytest.skip("torch._int_mm does not run on this CPU build")
        monkeypatch.setattr(int8_speed.Int8Speed, "faster", property(lambda self: True))
    hf = hf_model()
    x = batch()
    m = copy.deepcopy(hf)
    if kind == "int8":
        bert_fast.optimize(m, int8=True, calibration=x, min_cosine=0.9)
    else:
        bert_fast.optimize(m, freeze=kind == "frozen")
    before = run(m, x)
    hf.encoder.layer[1].output.dense.register_forward_hook(_zeroing_hook)
    m.encoder.layer[1].output.dense.register_forward_hook(_zeroing_hook)
    want = run(hf, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run(m, x)
        again = run(m, x)
    assert len(caught) <= 1, [str(w.message) for w in caught]
    assert not torch.allclose(before, want, atol=1e-3)  # the hook changes the answer...
    tol = 1e-5 if kind != "int8" else 0.2  # ...and the model gives transformers' (int8: within int8)
    assert (got - want).abs().max() < tol, (got - want).abs().max()
    assert torch.equal(got, again)
