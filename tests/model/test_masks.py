"""Attention masks in every form transformers users pass, and the keywords trainers pass.

Each accepted form gives transformers' output (on real tokens); a mask that is not a key-padding
mask, and keywords that would change the result, raise clear errors.
"""

import pytest
import torch
import transformers

import bert_fast
from bert_fast.testing import pick_test_device, tiny_bert_config

DEVICE = pick_test_device()


def _pair():
    cfg = tiny_bert_config(hidden=32, heads=2, vocab=61, max_pos=16)
    torch.manual_seed(0)
    hf = transformers.BertModel(cfg).to(DEVICE).eval()
    fast = bert_fast.BertModel(cfg).to(DEVICE).eval()
    fast.load_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 61, (3, 7), generator=g).to(DEVICE)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5], device=DEVICE)
    return hf, fast, ids, mask


def _forms(mask):
    b, s = mask.shape
    keep4 = mask[:, None, None, :].bool()
    minf = torch.finfo(torch.float32).min
    outer = (mask[:, :, None] * mask[:, None, :]).bool()  # pad query rows fully masked
    return {
        "2d-long": mask,
        "2d-bool": mask.bool(),
        "2d-float01": mask.float(),
        "3d-long": mask[:, None, :].expand(b, s, s).long(),
        "3d-bool": mask[:, None, :].expand(b, s, s).bool(),
        "4d-b11s-bool": keep4,
        "4d-b1ss-bool": keep4.expand(b, 1, s, s),
        "4d-b11s-additive-finfo": (~keep4).float() * minf,
        "4d-b1ss-additive-1e4": ((~keep4).float() * -10000.0).expand(b, 1, s, s),
        "4d-additive-inf": torch.zeros(keep4.shape, device=mask.device).masked_fill(~keep4, float("-inf")),
        "4d-outer-product-bool": outer[:, None],
    }


@pytest.mark.parametrize("form", list(_forms(torch.ones(1, 2, dtype=torch.long))))
def test_mask_form_matches_transformers(form):
    hf, fast, ids, mask = _pair()
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask).last_hidden_state  # the tokenizer's 2-D mask
        out = fast(ids, attention_mask=_forms(mask)[form]).last_hidden_state
    real = mask.bool()
    assert (out - ref)[real].abs().max().item() <= 1e-5
    assert out[~real].abs().max().item() == 0.0  # unpadded path: pads are zero


@pytest.mark.parametrize("form", ["4d-b11s-bool", "4d-b11s-additive-finfo", "4d-b1ss-bool"])
def test_4d_masks_are_accepted_by_transformers_too(form):
    """Where transformers takes the 4-D form itself, outputs agree with it given that same mask."""
    hf, fast, ids, mask = _pair()
    m = _forms(mask)[form]
    with torch.no_grad():
        try:
            ref = hf(ids, attention_mask=m).last_hidden_state
        except ValueError:  # transformers 4.41's SDPA path takes 2-D masks only: compare with that answer
            ref = hf(ids, attention_mask=mask).last_hidden_state
        out = fast(ids, attention_mask=m).last_hidden_state
    assert (out - ref)[mask.bool()].abs().max().item() <= 1e-5


def test_causal_mask_is_refused():
    _, fast, ids, mask = _pair()
    s = ids.shape[1]
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=DEVICE))[None, None].expand(3, 1, s, s)
    with pytest.raises(ValueError, match="not a key-padding mask"):
        fast(ids, attention_mask=causal)


@pytest.mark.parametrize(
    "bad,err,match",
    [
        ("4d-float01", ValueError, "additive"),
        ("4d-long", TypeError, "bool"),
        ("5d", ValueError, "2-D"),
        ("3d-shape", ValueError, "3-D"),
    ],
)
def test_bad_masks_raise_clear_errors(bad, err, match):
    _, fast, ids, mask = _pair()
    m = {
        "4d-float01": mask[:, None, None, :].float(),
        "4d-long": mask[:, None, None, :].long(),
        "5d": mask[:, None, None, None, :],
        "3d-shape": mask[:, None, :],
    }[bad]
    with pytest.raises(err, match=match):
        fast(ids, attention_mask=m)


def test_trainer_keywords():
    hf, fast, ids, mask = _pair()
    with torch.no_grad():
        ref = fast(ids, attention_mask=mask).last_hidden_state
        out = fast(
            ids,
            attention_mask=mask,
            num_items_in_batch=torch.tensor(5),
            output_attentions=False,
            output_router_logits=False,
        ).last_hidden_state
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        fast(ids, attention_mask=mask, cu_seq_lens_q=torch.tensor([0, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="is_causal"):
        fast(ids, attention_mask=mask, is_causal=True)
    # Other forwarded keywords (a head's **kwargs, e.g. shift_labels) are accepted as transformers
    # 5 accepts them (TransformersKwargs), and change nothing on the fused path.
    with torch.no_grad():
        out = fast(ids, attention_mask=mask, shift_labels=ids, use_cache=True).last_hidden_state
    assert torch.equal(out, ref)


@pytest.mark.parametrize("interpret", ["1", "0"])
def test_empty_batch_has_no_warnings(interpret, monkeypatch):
    import warnings

    monkeypatch.setenv("TRITON_INTERPRET", interpret)  # kernels (interpreter) and the CPU path
    _, fast, ids, mask = _pair()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = fast(ids[:0], attention_mask=mask[:0])
            out2 = fast(ids[:, :0], attention_mask=mask[:, :0])
    assert out.last_hidden_state.shape == (0, 7, 32)
    assert out2.last_hidden_state.shape == (3, 0, 32)
