"""docs/models.md's table of refusals, held against what bert_fast does.

Each row of the table (between ``<!-- refusals:start -->`` and ``<!-- refusals:end -->``) has a
trigger here: the call it describes, which must raise the documented exception with the documented
words in its message. A row without a trigger, or a trigger without a row, fails; so does a refusal
class of the differential fuzzer (tests/dropin/dropin_diff.REFUSALS) that no documented row raises. Rows
that depend on the installed transformers ("where transformers honours it") must answer where it
does not.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import transformers
from dropin_diff import PREFIX, REFUSALS, make_config

import bert_fast
from bert_fast.model import compat

DOCS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "models.md")
IDS = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 0]])
NOT_HERE = object()  # a trigger's answer where the installed transformers makes the row not apply


def documented_rows() -> dict:
    """{first column: (exception name, message words)} of the docs' refusal table."""
    text = open(DOCS, encoding="utf-8").read()
    table = text.split("<!-- refusals:start -->")[1].split("<!-- refusals:end -->")[0]
    rows = {}
    for line in table.strip().splitlines()[2:]:
        what, exc, words = (c.strip() for c in line.strip().strip("|").split("|"))
        rows[what] = (exc.strip("`"), words.strip("`"))
    return rows


def model(family="bert", cls=None, **config):
    cfg = make_config(family, **config)
    return getattr(transformers, cls or PREFIX[family] + "Model")(cfg).eval()


def fast(family="bert", **config):
    return bert_fast.optimize(model(family, **config))


def _mask_form_read_otherwise():
    if compat.mask_form_meaning(transformers.BertModel, "eager", "4d_bool") != "other":
        return NOT_HERE
    return fast()(IDS, attention_mask=torch.ones(2, 1, 1, 4, dtype=torch.bool))


def _relative_positions():
    if not compat.reads_position_embedding_type(
        transformers.models.bert.modeling_bert.BertLayer, transformers.BertConfig
    ):
        return NOT_HERE
    return fast(position_embedding_type="relative_key")


def _int8_degrading():
    from bert_fast.model.int8_speed import Int8SpeedError

    calibration = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
    try:
        return bert_fast.optimize(model(), int8=True, calibration=calibration, min_cosine=1.01)
    except Int8SpeedError as e:
        pytest.skip(f"int8 is slower than fp32 on this CPU, refused before its accuracy is checked: {e}")


def _not_key_padding():
    causal = torch.tril(torch.ones(4, 4, dtype=torch.long))[None].expand(2, 4, 4)
    return fast()(IDS, attention_mask=causal)


TRIGGERS = {
    "`output_attentions=True` on an sdpa or flash-attention model": lambda: fast(attn="sdpa")(
        IDS, output_attentions=True
    ),
    "an activation other than `gelu`, `gelu_new`, `gelu_pytorch_tanh`": lambda: fast(act="relu"),
    "a decoder (`is_decoder=True`)": lambda: bert_fast.BertModel(transformers.BertConfig(is_decoder=True)),
    "cross-attention (`add_cross_attention=True`)": lambda: bert_fast.BertModel(
        transformers.BertConfig(add_cross_attention=True)
    ),
    "cross-attention inputs (`encoder_hidden_states`)": lambda: fast()(
        IDS, encoder_hidden_states=torch.zeros(2, 3, 32)
    ),
    "a cache (`past_key_values`)": lambda: fast()(IDS, past_key_values=()),
    "`head_mask`": lambda: fast()(IDS, head_mask=torch.ones(2, 2)),
    "packed-sequence keywords (`cu_seq_lens_q`, …)": lambda: fast()(IDS, cu_seq_lens_q=torch.tensor([0, 4, 8])),
    "`is_causal=True`": lambda: fast()(IDS, is_causal=True),
    "a mask that is not key padding (causal, block, per query)": _not_key_padding,
    "a mask form the installed transformers reads otherwise (transformers 5: a 4-D bool mask on an eager "
    "model, added to the scores as 0/1)": _mask_form_read_otherwise,
    "`position_ids` / `token_type_ids` of another shape than the input": lambda: fast()(
        IDS, position_ids=torch.zeros(3, 4, dtype=torch.long)
    ),
    "`position_embedding_type='relative_key'` where transformers honours it (4.x; 5.x ignores the field, "
    "and so does bert_fast)": _relative_positions,
    "RoBERTa / XLM-R without `pad_token_id`": lambda: bert_fast.RobertaModel(
        transformers.RobertaConfig(pad_token_id=None)
    ),
    "other model families (ModernBERT, DeBERTa, MPNet, …)": lambda: bert_fast.optimize(
        transformers.MPNetModel(transformers.MPNetConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    ),
    "`freeze=True` or `int8=True` on DistilBERT": lambda: bert_fast.optimize(model("distilbert"), freeze=True),
    "`int8=True` where int8 would degrade the model (min cosine below `min_cosine`)": _int8_degrading,
}


def test_every_documented_refusal_has_a_trigger_and_back():
    rows = documented_rows()
    assert set(rows) == set(TRIGGERS), {
        "undocumented": set(TRIGGERS) - set(rows),
        "untested": set(rows) - set(TRIGGERS),
    }


def _raised(what):
    try:
        result = TRIGGERS[what]()
    except Exception as e:  # noqa: BLE001 - the refusal under test
        return e
    return result


@pytest.mark.parametrize("what", list(TRIGGERS))
def test_documented_refusal_is_what_the_code_raises(what):
    exc_name, words = documented_rows()[what]
    got = _raised(what)
    if got is NOT_HERE:  # the row does not apply with this transformers: the call is answered
        return
    assert isinstance(got, BaseException), f"{what}: answered, the docs say it raises {exc_name}"
    assert exc_name in [t.__name__ for t in type(got).__mro__], f"{what}: raised {type(got).__name__}: {got}"
    assert words in str(got), f"{what}: the message does not name {words!r}: {got}"


def test_every_refusal_the_fuzzer_accepts_is_documented():
    """Each class of refusal the fuzzer counts as clear (dropin_diff.REFUSALS) is raised by some
    documented row, so the docs list every refusal a user can meet."""
    messages = [str(e) for e in map(_raised, TRIGGERS) if isinstance(e, BaseException)]
    for reason, pattern in REFUSALS.items():
        if reason.startswith("int8 slower"):
            continue  # machine-dependent: docs/cpu-inference.md, tests/cpu/test_int8_speed.py
        if (
            reason == "mask form transformers reads otherwise"
            and _raised(
                "a mask form the installed transformers reads otherwise (transformers 5: a 4-D bool mask on an "
                "eager model, added to the scores as 0/1)"
            )
            is NOT_HERE
        ):
            continue
        if reason == "relative positions not supported" and not any("position_embedding_type" in m for m in messages):
            continue  # transformers 5 ignores the field: nothing to refuse
        assert any(re.search(pattern, m, flags=re.S) for m in messages), f"{reason}: no documented refusal raises it"
