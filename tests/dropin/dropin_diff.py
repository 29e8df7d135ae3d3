"""bert_fast against transformers, output by output: what the fresh-process tests and the
differential fuzzer share (tests/dropin/test_fresh_process_outputs.py, tests/dropin/dropin_fuzz.py).

* ``make_config``: a tiny config of any family, with the knobs the fuzzer draws.
* ``MODEL_CLASSES``: per family, the transformers classes ``optimize()`` converts (base + heads).
* ``assert_same_outputs``: the same structure as transformers (fields, None-ness, tuple lengths,
  shapes, dtypes) and the same values by the 2x rule of DESIGN.md (error to transformers run in
  float64 at most twice transformers' own fp32 error, plus a rounding floor), at the positions
  whose value bert_fast promises (``Positions``).
* ``refusal_reason``: the name of a clear refusal (an exception bert_fast raises before any output,
  naming what it does not support), or None for anything else: a crash is not a refusal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch
import transformers
from transformers.utils import ModelOutput

from bert_fast.model import compat
from bert_fast.testing import distilbert_config, max_abs_err, reduction_floor, rounding_floor

FAMILIES = ("bert", "roberta", "xlm_roberta", "electra", "distilbert")
PREFIX = {
    "bert": "Bert",
    "roberta": "Roberta",
    "xlm_roberta": "XLMRoberta",
    "electra": "Electra",
    "distilbert": "DistilBert",
}
_HEADS = {
    "bert": ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice",
             "ForNextSentencePrediction", "ForMaskedLM", "ForPreTraining"),
    "electra": ("ForPreTraining", "ForMaskedLM", "ForSequenceClassification", "ForTokenClassification",
                "ForQuestionAnswering", "ForMultipleChoice"),
}  # fmt: skip
_OTHER_HEADS = ("ForMaskedLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering",
                "ForMultipleChoice")  # fmt: skip
# family -> transformers class names, the base model first
MODEL_CLASSES = {
    f: (PREFIX[f] + "Model",) + tuple(PREFIX[f] + h for h in _HEADS.get(f, _OTHER_HEADS)) for f in FAMILIES
}
PAD = {"bert": 0, "roberta": 1, "xlm_roberta": 1, "electra": 0, "distilbert": 0}
NUM_LABELS = 3

# Fields whose values are one per token ([N, S, ...]) and one per sequence (read at the CLS position).
_TOKEN_FIELDS = {"last_hidden_state", "hidden_states", "start_logits", "end_logits", "prediction_logits"}
_ROW_FIELDS = {"pooler_output", "seq_relationship_logits"}
_TOKEN_LOGITS = ("ForTokenClassification", "ForMaskedLM", "ElectraForPreTraining")


def make_config(
    family: str,
    *,
    attn: str = "eager",
    head_dim: int = 16,
    heads: int = 2,
    layers: int = 2,
    intermediate: int = 64,
    act: str = "gelu",
    max_pos: int = 40,
    vocab: int = 61,
    dropout: float = 0.0,
    embedding_size: Optional[int] = None,
    position_embedding_type: str = "absolute",
    type_vocab: int = 2,
    model_class: str = "",
):
    hidden = head_dim * heads
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        hidden_act=act,
        max_position_embeddings=max_pos,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=PAD[family],
    )
    if family == "distilbert":
        config = distilbert_config(**common, seq_classif_dropout=dropout, qa_dropout=dropout)
    else:
        common.update(classifier_dropout=dropout, position_embedding_type=position_embedding_type)
        if family in ("roberta", "xlm_roberta"):
            common["type_vocab_size"] = 1  # as RoBERTa checkpoints have it
        else:
            common["type_vocab_size"] = type_vocab
        if family == "electra":
            common["embedding_size"] = embedding_size or hidden
            common["summary_last_dropout"] = dropout  # the multiple-choice head's own dropout
        config = getattr(transformers, PREFIX[family] + "Config")(**common)
    config.num_labels = 2 if model_class.endswith("QuestionAnswering") else NUM_LABELS  # start/end
    compat.set_attention_implementation(config, attn)
    return config


def token_types(config) -> int:
    return getattr(config, "type_vocab_size", 0)


def max_tokens(family: str, config) -> int:
    """The longest row the family's positions allow (RoBERTa's start after pad_token_id)."""
    limit = config.max_position_embeddings
    return limit - PAD[family] - 1 if family in ("roberta", "xlm_roberta") else limit


# ----------------------------------------------------------------------------- what must match where
@dataclass
class Positions:
    """Which values of an output bert_fast promises to equal transformers'.

    tokens [N, S] bool and rows [N] bool over the N = batch (x choices) sequences: on the unpadded
    layout, real tokens and the rows whose CLS position is real (pads are zero there, not
    transformers' values); on the padded layout, every position of every row that holds a real
    token (a fully padded row attends to nothing: bert_fast's padded kernel gives zeros there, where
    transformers averages the pads). ``everything``: exact mode (output_attentions, whole-model
    fallbacks) runs transformers' own modules on the padded layout, so every value matches.
    ``zero_pads``: the unpadded layout writes exact zeros at pad positions of its hidden states."""

    tokens: torch.Tensor
    rows: torch.Tensor
    everything: bool = False
    zero_pads: bool = False

    @staticmethod
    def of(keep: torch.Tensor, padded: bool, exact: bool) -> "Positions":
        keep = keep.reshape(-1, keep.shape[-1]).bool()
        if exact:
            return Positions(torch.ones_like(keep), torch.ones_like(keep[:, 0]), everything=True)
        if padded:
            alive = keep.any(dim=1)
            return Positions(alive[:, None].expand_as(keep), alive)
        return Positions(keep, keep[:, 0], zero_pads=True)

    def all_real(self) -> bool:
        return bool(self.tokens.all())


def _field_kind(name: str, model_class: str) -> str:
    base = name.split("[")[0]
    if base in _TOKEN_FIELDS:
        return "tokens"
    if base in _ROW_FIELDS:
        return "rows"
    if base == "attentions":
        return "attentions"
    if base == "logits":
        return "tokens" if model_class.endswith(_TOKEN_LOGITS) else "rows"
    if base == "loss":
        return "loss"
    return "other"


def _select(t: torch.Tensor, kind: str, where: Positions) -> Optional[torch.Tensor]:
    """The values of ``t`` that must match, or None when none do by promise (``kind``)."""
    if where.everything:
        return t
    n, s = where.tokens.shape
    if kind == "tokens":
        return t.reshape(n, s, -1)[where.tokens]
    if kind == "rows":
        return t.reshape(n, -1)[where.rows]
    if kind == "attentions":  # only returned by exact mode
        return t
    return None  # loss and others: compared only where the caller says they read no pads


def assert_same_outputs(
    ours,
    hf32,
    hf64,
    where: Positions,
    model_class: str,
    *,
    values: bool = True,
    loss_comparable: bool = True,
    names: Optional[list] = None,
) -> None:
    """The same structure as transformers' ``hf32`` and, where ``values``, the same values by the 2x
    rule against ``hf64`` (transformers' float64 run, always a ModelOutput). ``names``: the field
    names of a tuple output (return_dict=False), in ModelOutput order."""
    if isinstance(hf32, ModelOutput):
        assert isinstance(ours, ModelOutput), f"{type(ours).__name__} where transformers gives a ModelOutput"
        got, want = list(ours.keys()), list(hf32.keys())
        assert got == want, f"fields {got} where transformers gives {want}"
        pairs = [(key, ours[key], hf32[key]) for key in want]
    else:
        assert isinstance(ours, tuple) and isinstance(hf32, tuple), f"{type(ours).__name__} / {type(hf32).__name__}"
        assert len(ours) == len(hf32), f"a tuple of {len(ours)} where transformers gives {len(hf32)}"
        # Names of the tuple's entries: the ModelOutput's fields, in order, skipping the None
        # entries 4.x keeps in it (a BertModel without pooler: (last, None, ...)).
        fields = iter(names or list(hf64.keys()))
        pairs = [(next(fields) if b is not None else "none", a, b) for a, b in zip(ours, hf32)]
    check = _Check(where, model_class, values, loss_comparable)
    for key, a, b in pairs:
        check.same(a, b, hf64[key] if b is not None else None, key)


@dataclass
class _Check:
    where: Positions
    model_class: str
    values: bool
    loss_comparable: bool

    def same(self, ours, hf32, hf64, name):
        if hf32 is None:
            assert ours is None, f"{name}: a value where transformers gives None"
            return
        assert ours is not None, f"{name}: None where transformers gives a value"
        if isinstance(hf32, (tuple, list)):
            assert isinstance(ours, (tuple, list)), f"{name}: {type(ours).__name__} where transformers gives a tuple"
            assert len(ours) == len(hf32), f"{name}: {len(ours)} entries where transformers gives {len(hf32)}"
            for i in range(len(hf32)):
                self.same(ours[i], hf32[i], hf64[i], f"{name}[{i}]")
            return
        if not isinstance(hf32, torch.Tensor):
            assert ours == hf32, f"{name}: {ours!r} where transformers gives {hf32!r}"
            return
        assert isinstance(ours, torch.Tensor), f"{name}: {type(ours).__name__} where transformers gives a tensor"
        assert ours.shape == hf32.shape, f"{name}: shape {tuple(ours.shape)}, transformers' {tuple(hf32.shape)}"
        assert ours.dtype == hf32.dtype, f"{name}: dtype {ours.dtype} where transformers gives {hf32.dtype}"
        kind = _field_kind(name, self.model_class)
        where = self.where
        if where.zero_pads and name.split("[")[0] in ("last_hidden_state", "hidden_states"):
            pads = ours.reshape(*where.tokens.shape, -1)[~where.tokens]
            assert pads.numel() == 0 or pads.abs().max().item() == 0.0, f"{name}: nonzero values at pads"
        if not self.values:
            assert bool((torch.isfinite(ours) | ~torch.isfinite(hf32)).all()), f"{name}: non-finite values"
            return
        if kind == "loss":
            if self.loss_comparable:
                assert_2x(ours, hf32, hf64, name=name)
            return
        picked = [_select(t, kind, where) for t in (ours, hf32, hf64)]
        if picked[0] is not None:
            assert_2x(*picked, name=name)


def assert_2x(ours, hf32, hf64, *, name: str, rows: int = 1) -> None:
    """|ours - hf64| <= 2 |hf32 - hf64| + floor (max norms) where both transformers runs are finite,
    and non-finite values exactly where transformers' fp32 run has them (its float64 run can be NaN
    where fp32 is not: 4.41's DistilBERT masks with -inf in float64, so a fully padded row is NaN
    there). The floor is 8 fp32 ulps at the oracle's scale (``rows`` > 1: a gradient summed over
    that many rows, bert_fast.testing.reduction_floor)."""
    if ours.numel() == 0:
        return
    assert torch.equal(torch.isfinite(ours), torch.isfinite(hf32)), f"{name}: non-finite where transformers' is not"
    finite = torch.isfinite(hf32) & torch.isfinite(hf64)
    a, b, c = (t.detach().double()[finite] for t in (ours, hf32, hf64))
    floor = reduction_floor(c, torch.float32, rows) if rows > 1 else rounding_floor(c, torch.float32, ulps=8.0)
    err, base = max_abs_err(a, c), max_abs_err(b, c)
    assert err <= 2.0 * base + floor, f"{name}: max error {err:.3e} > 2 x transformers' fp32 {base:.3e} + {floor:.1e}"


def assert_same_grads(ours, hf32, hf64, rows: int) -> int:
    """Every parameter's gradient as transformers' (2x rule, the floor of a sum over ``rows``
    rows); a parameter transformers gives no gradient gets none, and the padding_idx row of every
    nn.Embedding (RoBERTa's position table among them) gets exactly zero where transformers' does.
    Returns how many gradients were compared."""
    theirs = dict(hf32.named_parameters())
    oracle = dict(hf64.named_parameters())
    padding_rows = {  # nn.Embedding's padding_idx rows: never a gradient
        f"{path}.weight": m.padding_idx
        for path, m in hf32.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }
    count = 0
    for name, p in ours.named_parameters():
        want, ref = theirs[name].grad, oracle[name].grad
        if want is None:
            assert p.grad is None or p.grad.abs().max().item() == 0.0, (
                f"grad {name}: a gradient where transformers has none"
            )
            continue
        assert p.grad is not None, f"grad {name}: None where transformers gives one"
        row = padding_rows.get(name)
        if row is not None and bool((want[row] == 0).all()):  # (not where the table is tied to an MLM decoder)
            assert bool((p.grad[row] == 0).all()), f"grad {name}: nonzero at padding_idx row {row}"
        assert_2x(p.grad, want, ref, name=f"grad {name}", rows=rows)
        count += 1
    return count


# ----------------------------------------------------------------------------- refusals
# A clear refusal: one of these exception types, raised before any output, whose message names
# what is unsupported. Anything else (an AttributeError, an IndexError inside forward, a message
# that names nothing) is a crash, and fails the fuzzer.
_CLEAR = (ValueError, TypeError, NotImplementedError, RuntimeError)
REFUSALS = {
    "output_attentions needs eager attention": r"output_attentions=True .*needs transformers' eager attention",
    "activation not supported": r"(hidden_act|activation)=.* is not supported by bert_fast",
    "head_mask not supported": r"head_mask is not supported by bert_fast",
    "relative positions not supported": r"position_embedding_type=.* is not supported",
    "freeze/int8 not implemented for DistilBERT": r"(freeze=True|int8=True|freeze\(\)) is not implemented for DistilBert",
    "int8 less accurate than min_cosine": r"int8 .*cosine",
    "int8 slower than fp32": r"int8 .*(slower|not faster)",
    "mask form transformers reads otherwise": r"attention_mask on a .* reads such a mask otherwise",
    "ids not of the input's shape": r"(position_ids|token_type_ids) must have the shape of input_ids",
    "not a key-padding mask": r"key-padding|attention_mask",
}


def refusal_reason(exc: BaseException) -> Optional[str]:
    if not isinstance(exc, _CLEAR):
        return None
    text = str(exc)
    for reason, pattern in REFUSALS.items():
        if re.search(pattern, text, flags=re.S):
            return reason
    return None


def cosine_rows(a: torch.Tensor, b: torch.Tensor) -> float:
    """Min cosine over rows (the int8 accuracy guard's measure)."""
    cos = torch.nn.functional.cosine_similarity(a.double().flatten(1), b.double().flatten(1), dim=1)
    return float(cos.min()) if cos.numel() else 1.0
