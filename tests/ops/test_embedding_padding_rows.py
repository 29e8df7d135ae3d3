"""The padding rows of the embedding tables get the gradient transformers gives them: none.

RoBERTa / XLM-RoBERTa build ``position_embeddings`` as ``nn.Embedding(max_pos, hidden,
padding_idx=pad_token_id)`` and give every pad the position pad_token_id (fairseq's make_positions),
so nn.Embedding never accumulates a gradient into that row; the word table's padding_idx row gets
none in every family either. The fused embedding op once zeroed the word row only and gave the
position table's padding row the pads' gradient (bug: position padding_idx ignored by the
backward). Checked here against transformers' own embedding modules, on inputs with pads (right and
left padded rows and a fully padded one), for every implementation that runs on this machine: the
torch implementation (the CPU path and the CUDA fallback), the C++ CPU twin (TRITON_INTERPRET=1),
the reference, and on a GPU the CUDA kernel (atomics and deterministic mode). Then through the
drop-in models of every family, padded layout (pads computed), where the pads reach the op.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

import bert_fast
from bert_fast.bench.op_case import seeded_randn
from bert_fast.bench.op_cases import embedding as embedding_cases
from bert_fast.ops import embedding as emb_op
from bert_fast.ops import embedding_layer_norm
from bert_fast.testing import distilbert_config, pick_test_device

DEVICE = pick_test_device()
PAD = 1  # RoBERTa's and XLM-R's pad_token_id: positions start at PAD + 1
VOCAB, MAX_POS, SEQ = 61, 40, 11
TABLES = ("word_embeddings", "position_embeddings", "token_type_embeddings")


def _impl(name, **marks):
    return pytest.param(name, id=name, **marks)


# Every implementation of the op that can run here; "cuda*" skip without a GPU.
IMPLS = [
    _impl("torch"),
    _impl("cpu_twin", marks=pytest.mark.kernels("embedding")),
    _impl("reference"),
    _impl("cuda", marks=pytest.mark.kernels("embedding")),
    _impl("cuda_deterministic", marks=pytest.mark.kernels("embedding")),
]


@pytest.fixture
def impl(request, monkeypatch):
    """(name, device) with the dispatch forced to that implementation for the test."""
    name = request.param
    if name.startswith("cuda"):
        if DEVICE.type != "cuda":
            pytest.skip("the CUDA kernel needs a CUDA device")
        monkeypatch.delenv("BERT_FAST_BACKEND", raising=False)
        if name == "cuda_deterministic":
            prev = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
            request.addfinalizer(lambda: torch.use_deterministic_algorithms(prev))
        assert emb_op._backend(torch.empty(0, device=DEVICE)) == "cuda"
        return name, DEVICE
    if name == "cpu_twin":  # the dispatch reads TRITON_INTERPRET at each call (test_embedding's cpu_twin)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.delenv("BERT_FAST_BACKEND", raising=False)
        assert emb_op._backend(torch.empty(0)) == "cpu", "bert_fast._C is not built"
    else:
        monkeypatch.setenv("BERT_FAST_BACKEND", name)
        assert emb_op._backend(torch.empty(0)) == name
    return name, torch.device("cpu")


def padded_batch(device, vocab=VOCAB, pad=PAD, types=2, seed=0):
    """Ids (embedding_cases.sample_ids) with pads where a tokenizer writes them: right-padded rows of
    several lengths, one left-padded row and one fully padded row; random token types (pads included)."""
    ids, tt = embedding_cases.sample_ids(5, SEQ, vocab, "cpu", torch.Generator().manual_seed(seed), types=types)
    ids = ids.masked_fill(ids == pad, pad + 1)  # pads only where the mask says
    mask = torch.zeros(5, SEQ, dtype=torch.long)
    for i, n in enumerate([11, 7, 1]):
        mask[i, :n] = 1
    mask[3, 4:] = 1  # left padded
    ids = ids.masked_fill(mask == 0, pad)
    return ids.to(device), tt.to(device), mask.to(device)


def make_positions(ids, pad):
    """fairseq's make_positions, as RoBERTa builds them: pad + 1, 2, ... over real tokens, pad at pads."""
    keep = ids.ne(pad).long()
    return torch.cumsum(keep, dim=1) * keep + pad


def randomize_(module, seed=0):
    """Random tables (padding rows too: their gradient, not their value, is the point) and LayerNorm."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        module.LayerNorm.weight.add_(1.0)
    return module


def hf_embeddings(family, hidden, device):
    """transformers' own embeddings module of ``family`` (its config: family_config, below)."""
    cls = getattr(transformers, FAMILY_MODELS[family][0])
    torch.manual_seed(0)
    return randomize_(cls(family_config(family, hidden)).embeddings).to(device)


def grads_of(tables, out, dy):
    return torch.autograd.grad(out, tables, dy)


def assert_grads_match(ours, want, names, atol, rtol=1e-4):
    for name, a, b in zip(names, ours, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- op vs transformers
@pytest.mark.parametrize("hidden", [48, 3000])
@pytest.mark.parametrize("unpad", [False, True])
@pytest.mark.parametrize("family", ["roberta", "xlm_roberta"])
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_roberta_padding_rows_match_transformers(impl, family, unpad, hidden):
    name, device = impl
    emb = hf_embeddings(family, hidden, device)
    assert emb.position_embeddings.padding_idx == PAD and emb.word_embeddings.padding_idx == PAD
    ids, tt, _ = padded_batch(device)
    pos = make_positions(ids, PAD)
    dy = seeded_randn(1, device, torch.float32)(*ids.shape, hidden)

    hf_params = [getattr(emb, t).weight for t in TABLES] + [emb.LayerNorm.weight, emb.LayerNorm.bias]
    want_out = emb(input_ids=ids, token_type_ids=tt)
    indices = None
    if unpad:  # keep every token of the first four rows, pads included, and drop the fully padded row
        indices = torch.arange(4 * SEQ, device=device)
        dy[4] = 0.0  # what transformers' gradient sees of the dropped row
    want = grads_of(hf_params, want_out, dy)

    ours_params = [p.detach().clone().requires_grad_() for p in hf_params]
    out = embedding_layer_norm(
        ids,
        pos,
        tt,
        *ours_params,
        eps=emb.LayerNorm.eps,
        padding_idx=emb.word_embeddings.padding_idx,
        position_padding_idx=emb.position_embeddings.padding_idx,
        token_type_padding_idx=emb.token_type_embeddings.padding_idx,
        indices=indices,
    )
    flat = lambda t: t.reshape(-1, hidden) if unpad else t
    sel = (lambda t: flat(t).index_select(0, indices)) if unpad else (lambda t: t)
    torch.testing.assert_close(out, sel(want_out.detach()), atol=2e-5, rtol=1e-4)  # same positions
    ours = grads_of(ours_params, out, sel(dy))

    # the pads' position row is gathered (with a gradient), and transformers gives it none
    assert torch.count_nonzero(want[1][PAD]) == 0 and torch.count_nonzero(want[0][PAD]) == 0
    assert torch.count_nonzero(ours[1][PAD]) == 0, f"{name}: the position padding row got a gradient"
    assert torch.count_nonzero(ours[0][PAD]) == 0, f"{name}: the word padding row got a gradient"
    # 3000 wide rows sum more terms: a looser absolute floor
    assert_grads_match(ours, want, TABLES + ("weight", "bias"), atol=2e-5 if hidden < 1000 else 1e-4)


# ----------------------------------------------------------------------------- op vs nn.Embedding
@pytest.mark.parametrize("implicit", [False, True], ids=["explicit_ids", "implicit_ids"])
@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_every_table_padding_row_as_nn_embedding(impl, implicit):
    """Each table's padding_idx as nn.Embedding's, on the explicit and on the implicit position /
    type paths (position_ids None: row % S; token_type_ids None: type 0), negative indices too."""
    name, device = impl
    hidden = 40
    randn = seeded_randn(3, device, torch.float32)
    tables = embedding_cases.sample_inputs(hidden, VOCAB, randn, max_pos=MAX_POS, types=3).values()
    ids, tt, _ = padded_batch(device, types=3)
    pads = {"padding_idx": PAD, "position_padding_idx": 3, "token_type_padding_idx": 0 if implicit else 2}
    pos = None if implicit else make_positions(ids, 3)  # position 3 at pads: gathered, no gradient
    tt = None if implicit else tt
    dy = randn(*ids.shape, hidden)

    ref = [t.clone().requires_grad_() for t in tables]
    p_ref = torch.arange(SEQ, device=device).expand(ids.shape) if pos is None else pos
    t_ref = torch.zeros_like(ids) if tt is None else tt
    x = (
        F.embedding(ids, ref[0], padding_idx=pads["padding_idx"])
        + F.embedding(p_ref, ref[1], padding_idx=pads["position_padding_idx"])
        + F.embedding(t_ref, ref[2], padding_idx=pads["token_type_padding_idx"])
    )
    want = grads_of(ref, F.layer_norm(x, (hidden,), ref[3], ref[4], 1e-12), dy)

    ours_params = [t.clone().requires_grad_() for t in tables]
    # negative indices count from the end, as nn.Embedding's
    neg = {k: v - (VOCAB, MAX_POS, 3)[i] for i, (k, v) in enumerate(pads.items())}
    out = embedding_layer_norm(ids, pos, tt, *ours_params, **neg)
    ours = grads_of(ours_params, out, dy)
    for i, row in enumerate(pads.values()):
        assert torch.count_nonzero(want[i][row]) == 0
        assert torch.count_nonzero(ours[i][row]) == 0, f"{name}: {TABLES[i]} padding row {row} got a gradient"
    assert_grads_match(ours, want, TABLES + ("weight", "bias"), atol=2e-5)


@pytest.mark.no_kernels("input validation")
@pytest.mark.parametrize("key,rows", [("position_padding_idx", MAX_POS), ("token_type_padding_idx", 2)])
def test_bad_table_padding_idx_raises(key, rows):
    tables = embedding_cases.sample_inputs(8, VOCAB, seeded_randn(0, "cpu", torch.float32), max_pos=MAX_POS).values()
    ids = torch.zeros(2, 3, dtype=torch.long)
    for bad in (rows, -rows - 1, 1.0, True):
        with pytest.raises(ValueError, match=key):
            embedding_layer_norm(ids, None, None, *tables, **{key: bad})


# ----------------------------------------------------------------------------- drop-in models
FAMILY_MODELS = {
    "bert": ("BertModel", transformers.BertConfig),
    "roberta": ("RobertaModel", transformers.RobertaConfig),
    "xlm_roberta": ("XLMRobertaModel", transformers.XLMRobertaConfig),
    "electra": ("ElectraModel", transformers.ElectraConfig),
    "distilbert": ("DistilBertModel", transformers.DistilBertConfig),
}


def family_config(family, hidden=48):
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_attention_heads=2,
        num_hidden_layers=1,
        intermediate_size=2 * hidden,
        max_position_embeddings=MAX_POS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=PAD,
    )
    if family == "distilbert":
        return distilbert_config(**kw)
    kw["type_vocab_size"] = 2
    if family == "electra":
        kw["embedding_size"] = 24
    return FAMILY_MODELS[family][1](**kw)


@pytest.mark.parametrize("backend", ["session", "torch"])
@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_model_embedding_gradients_match_transformers(family, backend, monkeypatch):
    """The drop-in model (padded layout: pads computed, so their rows reach the embedding op) gives
    every embedding table transformers' gradient, padding rows included, through the embedding
    output (hidden_states[0])."""
    if backend == "torch":
        monkeypatch.setenv("BERT_FAST_BACKEND", "torch")
    cls_name, _ = FAMILY_MODELS[family]
    config = family_config(family)
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(config).to(DEVICE).eval()
    randomize_(hf.embeddings)
    fast = getattr(bert_fast, cls_name)(config, padded=True).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict(), strict=True)
    ids, tt, mask = padded_batch(DEVICE)
    kw = {} if family == "distilbert" else {"token_type_ids": tt}
    dy = None
    got = {}
    for label, model in (("hf", hf), ("fast", fast)):
        h0 = model(ids, attention_mask=mask, output_hidden_states=True, **kw).hidden_states[0]
        if dy is None:
            dy = seeded_randn(2, DEVICE, torch.float32)(*h0.shape)
        h0.backward(dy)
        got[label] = {n: p.grad for n, p in model.embeddings.named_parameters()}
    assert got["fast"].keys() == got["hf"].keys()
    for n, want in got["hf"].items():
        ours = got["fast"][n]
        assert ours is not None, n
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{family} {n}: {m}")
        if n.endswith("word_embeddings.weight") or (n.endswith("position_embeddings.weight") and "roberta" in family):
            assert torch.count_nonzero(ours[PAD]) == 0, f"{family} {n}: the padding row got a gradient"
