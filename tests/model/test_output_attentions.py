"""output_attentions=True (issue 33): answered as transformers answers it where its attention
implementation is eager, refused with what to do where it is not.

On an eager model transformers returns the attention probabilities of every layer; bert_fast runs
that call in exact mode (every layer's self-attention through transformers' own eager module,
which materializes them, on the padded layout) and warns once that it is the slow path. Every
family, the unpadded (ragged) and padded models, heads, hidden states, hooks and gradients are
compared with transformers' own eager model on the same weights. Small random configs, CPU-fast.
"""

import warnings

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import compat
from bert_fast.testing import distilbert_config, pick_test_device

DEVICE = pick_test_device()
ATOL = 2e-5 if DEVICE.type == "cpu" else 1e-4  # tests/model/test_families.py's fp32 parity bands
PAD = 1  # RoBERTa's pad_token_id

BASE = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm_roberta": "XLMRobertaModel",
    "electra": "ElectraModel",
    "distilbert": "DistilBertModel",
}
FAMILIES = tuple(BASE)
SLOW = "output_attentions=True runs the slow path"


def make_config(family, attn="eager", hidden=48, heads=2, layers=2, dropout=0.0):
    common = dict(
        vocab_size=61,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        max_position_embeddings=40,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    if family == "bert":
        config = transformers.BertConfig(pad_token_id=0, **common)
    elif family == "roberta":
        config = transformers.RobertaConfig(pad_token_id=PAD, type_vocab_size=1, **common)
    elif family == "xlm_roberta":
        config = transformers.XLMRobertaConfig(pad_token_id=PAD, type_vocab_size=1, **common)
    elif family == "electra":
        config = transformers.ElectraConfig(embedding_size=24, **common)
    else:
        config = distilbert_config(**common, seq_classif_dropout=0.0, qa_dropout=0.0, pad_token_id=0)
    compat.set_attention_implementation(config, attn)
    return config


def pair(family, cls_name=None, attn="eager", padded=False, **config_kw):
    """transformers' model with attention ``attn`` and bert_fast's twin (same weights), eval, on DEVICE."""
    cls_name = cls_name or BASE[family]
    config = make_config(family, attn, **config_kw)
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(config).to(DEVICE).eval()
    with torch.no_grad():  # nonzero biases and LayerNorm shifts, so that a missed term shows
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    fast = getattr(bert_fast, cls_name)(config, padded=padded).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    return hf, fast


def ragged(config, seed=0):
    """Right-padded rows of several lengths (one of a single token), a left-padded row and a fully
    padded one, pads written as a tokenizer writes them."""
    g = torch.Generator().manual_seed(seed)
    s = 9
    ids = torch.randint(3, config.vocab_size, (5, s), generator=g)
    mask = torch.zeros(5, s, dtype=torch.long)
    for i, n in enumerate([9, 6, 1]):
        mask[i, :n] = 1
    mask[3, 4:] = 1
    ids = ids.masked_fill(mask == 0, config.pad_token_id)
    return ids.to(DEVICE), mask.to(DEVICE)


def slow_path_warnings(caught):
    return [w for w in caught if SLOW in str(w.message)]


def assert_same(out, ref, atol=ATOL):
    """The same fields, and every tensor of them (pads included: exact mode is transformers' padded
    layout) within ``atol``."""
    assert set(out.keys()) == set(ref.keys())
    assert len(out.attentions) == len(ref.attentions)
    for got, want in zip(out.attentions, ref.attentions):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    for key in out.keys():
        if key in ("attentions", "cross_attentions"):
            continue
        got, want = out[key], ref[key]
        for a, b in zip(got, want) if isinstance(got, tuple) else [(got, want)]:
            torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ----------------------------------------------------------------------------- base models
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_attentions_and_hidden_states_are_transformers(family, padded):
    hf, fast = pair(family, padded=padded)
    ids, mask = ragged(hf.config)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fast(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert len(slow_path_warnings(caught)) == 1  # one warning per call, not one per layer
    assert len(out.attentions) == len(ref.attentions) == 2
    assert out.attentions[0].shape == (5, 2, 9, 9)
    assert_same(out, ref)
    # Probabilities as transformers gives them: rows sum to one, pads' keys get nothing.
    probs = out.attentions[-1]
    torch.testing.assert_close(probs.sum(-1), torch.ones_like(probs.sum(-1)))
    assert probs[1, :, :, 6:].abs().max() == 0
    # The next call without it runs fused again (the unpadded model zeroes its pads).
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = fast(ids, attention_mask=mask)
    assert not slow_path_warnings(caught) and "attentions" not in again.keys()
    if not padded and family != "distilbert":
        assert again.last_hidden_state[~mask.bool()].abs().max() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_config_output_attentions_and_tuples_answer_as_transformers(family):
    hf, fast = pair(family)
    ids, mask = ragged(hf.config, seed=1)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True, return_dict=False)
        with pytest.warns(RuntimeWarning, match=SLOW):
            out = fast(ids, attention_mask=mask, output_attentions=True, return_dict=False)
        assert len(out) == len(ref)
        for got, want in zip(out, ref):
            for a, b in zip(got, want) if isinstance(got, tuple) else [(got, want)]:
                torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
        hf.config.output_attentions = True  # the same config object: both read it
        assert fast.config.output_attentions
        ref = hf(ids, attention_mask=mask)
        with pytest.warns(RuntimeWarning, match=SLOW):
            out = fast(ids, attention_mask=mask)
        assert_same(out, ref)
        plain = fast(ids, attention_mask=mask, output_attentions=False)  # the keyword overrides the config
    assert "attentions" not in plain.keys()


def test_a_dense_batch_and_a_selection_of_hidden_states():
    hf, fast = pair("bert")
    ids = torch.randint(3, 61, (2, 7), device=DEVICE)
    with torch.no_grad():
        ref = hf(ids, output_attentions=True, output_hidden_states=True)
        with pytest.warns(RuntimeWarning, match=SLOW):
            out = fast(ids, output_attentions=True, output_hidden_states=True)
    assert_same(out, ref)


# ----------------------------------------------------------------------------- heads
HEADS = [
    ("bert", "BertForSequenceClassification"),
    ("bert", "BertForMaskedLM"),
    ("roberta", "RobertaForMaskedLM"),
    ("xlm_roberta", "XLMRobertaForTokenClassification"),
    ("electra", "ElectraForPreTraining"),
    ("distilbert", "DistilBertForQuestionAnswering"),
]


@pytest.mark.parametrize("family,cls_name", HEADS)
def test_heads_return_transformers_attentions(family, cls_name):
    hf, fast = pair(family, cls_name)
    ids, mask = ragged(hf.config, seed=2)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        with pytest.warns(RuntimeWarning, match=SLOW):
            out = fast(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert_same(out, ref)


def test_masked_positions_only_mlm_head_returns_attentions():
    config = make_config("bert")
    torch.manual_seed(0)
    fast = bert_fast.BertForMaskedLM(config, mlm_masked_positions_only=True).to(DEVICE).eval()
    hf = transformers.BertForMaskedLM(config).to(DEVICE).eval()
    hf.load_state_dict(fast.state_dict())
    ids, mask = ragged(config)
    labels = torch.full_like(ids, -100)
    labels[0, 2] = 5
    labels[1, 4] = 7
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=labels, output_attentions=True)
        with pytest.warns(RuntimeWarning, match=SLOW):
            out = fast(ids, attention_mask=mask, labels=labels, output_attentions=True)
    torch.testing.assert_close(out.loss, ref.loss, atol=ATOL, rtol=0)
    for got, want in zip(out.attentions, ref.attentions):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- with other exact-mode pieces
@pytest.mark.parametrize("hooked", ["attention.self", "attention", "intermediate"])
def test_attentions_beside_hooked_modules(hooked):
    """A hook already runs a block of layer 0 through transformers' module: the probabilities come
    from whichever attention module runs (BertAttention returns them too), and the hook fires."""
    hf, fast = pair("bert")
    ids, mask = ragged(hf.config, seed=3)
    calls = []
    module = fast.encoder.layer[0].get_submodule(hooked)
    handle = module.register_forward_hook(lambda m, args, out: calls.append(1))
    try:
        with torch.no_grad():
            ref = hf(ids, attention_mask=mask, output_attentions=True)
            with pytest.warns(RuntimeWarning, match=SLOW):
                out = fast(ids, attention_mask=mask, output_attentions=True)
    finally:
        handle.remove()
    assert calls == [1]
    assert_same(out, ref)


def test_gradients_through_the_slow_path_are_transformers():
    hf, fast = pair("roberta")
    ids, mask = ragged(hf.config, seed=4)
    for model in (hf, fast):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model(ids, attention_mask=mask, output_attentions=True)
        # Losses on real tokens (RoBERTa's position table has a padding row that transformers
        # keeps out of the gradient; the fused embedding op does not, so pads stay out of the loss).
        real_queries = sum(a.transpose(1, 2)[mask.bool()].square().sum() for a in out.attentions)
        (out.last_hidden_state[mask.bool()].sum() + real_queries).backward()
    grads = dict(hf.named_parameters())
    for name, p in fast.named_parameters():
        want = grads[name].grad
        if want is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
        else:
            torch.testing.assert_close(p.grad, want, atol=1e-4, rtol=0, msg=name)


def test_optimize_a_model_loaded_with_eager_attention(tmp_path):
    """The user's way: from_pretrained(..., attn_implementation="eager"), then optimize()."""
    hf, _ = pair("bert", "BertForSequenceClassification")
    hf.save_pretrained(tmp_path)
    loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager")
    loaded = bert_fast.optimize(loaded.to(DEVICE).eval())
    assert isinstance(loaded.bert, bert_fast.BertModel)
    ids, mask = ragged(hf.config, seed=5)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_attentions=True)
        with pytest.warns(RuntimeWarning, match=SLOW):
            out = loaded(ids, attention_mask=mask, output_attentions=True)
    assert_same(out, ref)


# ----------------------------------------------------------------------------- refused elsewhere
@pytest.mark.parametrize("family", FAMILIES)
def test_other_attention_implementations_keep_the_clear_error(family):
    try:
        _, fast = pair(family, attn="sdpa")
    except ValueError:  # transformers 4.41 has no sdpa for RoBERTa & co: a config that says it
        _, fast = pair(family)
        compat.set_attention_implementation(fast.config, "sdpa")
    ids, mask = ragged(fast.config)
    with pytest.raises(ValueError, match=r"attn_implementation='eager'") as by_keyword:
        fast(ids, attention_mask=mask, output_attentions=True)
    assert "'sdpa'" in str(by_keyword.value)
    try:
        fast.config.output_attentions = True
    except ValueError as e:  # transformers 5 refuses it on an sdpa config itself, naming eager
        assert "eager" in str(e)
    else:  # transformers 4 accepts it: bert_fast then gives the keyword's error
        with pytest.raises(ValueError, match=r"attn_implementation='eager'") as by_config:
            fast(ids, attention_mask=mask)
        assert str(by_config.value) == str(by_keyword.value)
    fast.config.output_attentions = False
    fast(ids, attention_mask=mask, output_attentions=False)


def test_a_replaced_layer_is_refused_clearly():
    _, fast = pair("bert")
    fast.encoder.layer[1] = transformers.models.bert.modeling_bert.BertLayer(fast.config).to(DEVICE).eval()
    ids, mask = ragged(fast.config)
    with pytest.raises(ValueError, match="replaced"):
        fast(ids, attention_mask=mask, output_attentions=True)
