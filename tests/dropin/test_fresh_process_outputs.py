"""output_attentions and output_hidden_states in a fresh process, for every family and head class.

transformers 5 records those outputs through a registry that only constructing a model fills, and
``optimize()`` swaps the class of a live model without constructing ours: until bert_fast registered
its classes itself, DistilBERT's ``output_attentions=True`` (which runs transformers' own forward)
returned attentions=None and hidden_states=None, unless some test earlier in the process had
constructed a ``bert_fast.DistilBertModel``. So each family runs here in a new Python process that
constructs no bert_fast model before its checks: every transformers class ``optimize()`` converts
(base and heads), eager, with the flags as keywords and through the config, alone and together,
against transformers (structure and values, tests/dropin/dropin_diff.py); the same flags on an sdpa
model (hidden states answered, attentions refused); then the bert_fast classes themselves.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch
import transformers

FLAGS = (("output_attentions",), ("output_hidden_states",), ("output_attentions", "output_hidden_states"))


def _inputs(config, model_class: str):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0  # a right-padded row
    ids = ids.masked_fill(mask == 0, config.pad_token_id)
    if model_class.endswith("ForMultipleChoice"):
        ids, mask = ids[:, None].expand(2, 2, 7).contiguous(), mask[:, None].expand(2, 2, 7).contiguous()
    return dict(input_ids=ids, attention_mask=mask)


def _run(model, inputs, flags, through_config):
    config = model.config
    saved = {f: getattr(config, f, False) for f in flags}
    try:
        if through_config:
            for f in flags:
                setattr(config, f, True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the slow-path warning of output_attentions
            return model(**inputs, **({} if through_config else {f: True for f in flags}))
    finally:
        for f, v in saved.items():
            setattr(config, f, v)


def _check(hf, ours, model_class: str, flags, through_config) -> None:
    from dropin_diff import Positions, assert_same_outputs

    inputs = _inputs(hf.config, model_class)
    f64 = copy.deepcopy(hf).double()
    got, want, oracle = (_run(m, inputs, flags, through_config) for m in (ours, hf, f64))
    for key in ("attentions", "hidden_states"):
        if f"output_{key}" in flags:
            assert getattr(got, key, None) is not None, f"{key} is None"
    where = Positions.of(inputs["attention_mask"], padded=False, exact="output_attentions" in flags)
    assert_same_outputs(got, want, oracle, where, model_class, loss_comparable=False)


def check_family(family: str) -> int:
    """Every check of one family, in this (fresh) process; returns how many ran."""
    from dropin_diff import MODEL_CLASSES, make_config

    import bert_fast
    from bert_fast.model.modeling import FastModel

    ran = 0
    for model_class in MODEL_CLASSES[family]:
        torch.manual_seed(0)
        hf = getattr(transformers, model_class)(make_config(family, model_class=model_class)).eval()
        with torch.no_grad():  # nonzero biases, so that a missed term shows
            for name, p in hf.named_parameters():
                if name.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        ours = bert_fast.optimize(copy.deepcopy(hf))
        assert any(isinstance(m, FastModel) for m in ours.modules()), model_class
        for flags in FLAGS:
            for through_config in (False, True):
                try:
                    _check(hf, ours, model_class, flags, through_config)
                except AssertionError as e:
                    how = "config" if through_config else "keyword"
                    raise AssertionError(f"{model_class} optimized, {'+'.join(flags)} by {how}: {e}") from e
                ran += 1
    # sdpa (where transformers builds the family with it: 4.41 only BERT): hidden states answered;
    # attentions refused with what to do (transformers answers ()).
    try:
        hf = getattr(transformers, MODEL_CLASSES[family][0])(make_config(family, attn="sdpa")).eval()
    except ValueError:
        hf = None
    ours = bert_fast.optimize(copy.deepcopy(hf)) if hf is not None else None
    for through_config in (False, True) if hf is not None else ():
        _check(hf, ours, MODEL_CLASSES[family][0], ("output_hidden_states",), through_config)
        # (transformers 5.2x refuses setting config.output_attentions on an sdpa config itself)
        with pytest.raises(ValueError, match="eager"):
            _run(ours, _inputs(hf.config, ""), ("output_attentions",), through_config)
        ran += 2
    # Last, the bert_fast classes themselves (constructed: the registry filled by their __init__ too).
    for model_class in MODEL_CLASSES[family]:
        config = make_config(family, model_class=model_class)
        hf = getattr(transformers, model_class)(config).eval()
        ours = getattr(bert_fast, model_class)(config).eval()
        ours.load_state_dict(hf.state_dict())
        _check(hf, ours, model_class, FLAGS[2], through_config=False)
        ran += 1
    return ran


@pytest.mark.parametrize("family", ("bert", "roberta", "xlm_roberta", "electra", "distilbert"))
def test_outputs_in_a_fresh_process(family):
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); import test_fresh_process_outputs as t; "
        f"print('checks:', t.check_family({family!r}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the path users run on a CPU
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "checks:" in proc.stdout
