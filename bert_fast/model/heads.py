"""The task heads of the BERT paper, as transformers' own classes with the fast encoder inside.

Each class is transformers' BertFor* (same names, parameters, outputs and losses, so checkpoints
move freely both ways) whose ``self.bert`` is converted in place to bert_fast.BertModel. Extra
constructor keywords: ``padded`` (see BertModel) and, for the two MLM heads,
``mlm_masked_positions_only``: when labels are given, run the MLM head only on the labelled
positions (the ~15% BERT masks), returning logits [num_masked, vocab] instead of [B, S, vocab].
"""

from __future__ import annotations

import torch
import transformers
from torch.nn import CrossEntropyLoss
from transformers.modeling_outputs import MaskedLMOutput
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

from bert_fast.model.modeling import to_fast_bert


def _fast_head(hf_cls):
    """A subclass of transformers' head ``hf_cls`` whose encoder (``self.bert``, ``self.roberta``,
    ``self.electra``: the class's base_model_prefix) is converted to bert_fast's."""

    def __init__(self, config, *args, padded: bool = False, **kwargs):
        hf_cls.__init__(self, config, *args, **kwargs)
        to_fast_bert(getattr(self, hf_cls.base_model_prefix), padded=padded)

    cls = type(
        hf_cls.__name__,
        (hf_cls,),
        {"__init__": __init__, "__module__": __name__, "__doc__": f"{hf_cls.__name__} with bert_fast's encoder."},
    )
    return cls


BertForSequenceClassification = _fast_head(transformers.BertForSequenceClassification)
BertForTokenClassification = _fast_head(transformers.BertForTokenClassification)
BertForQuestionAnswering = _fast_head(transformers.BertForQuestionAnswering)
BertForMultipleChoice = _fast_head(transformers.BertForMultipleChoice)
BertForNextSentencePrediction = _fast_head(transformers.BertForNextSentencePrediction)

# The heads of the other families bert_fast runs: transformers' own classes, the encoder converted.
_TASK_HEADS = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
)
_FAMILY_HEADS = {
    "Roberta": _TASK_HEADS,
    "XLMRoberta": _TASK_HEADS,
    "DistilBert": _TASK_HEADS,
    "Electra": ("ForPreTraining",) + _TASK_HEADS,
}
FAMILY_HEADS = tuple(prefix + suffix for prefix, suffixes in _FAMILY_HEADS.items() for suffix in suffixes)
globals().update({name: _fast_head(getattr(transformers, name)) for name in FAMILY_HEADS})


def _masked_rows(sequence_output: torch.Tensor, labels: torch.Tensor):
    """Hidden rows [N, H] and labels [N] of the positions whose label is not -100."""
    flat = labels.reshape(-1)
    sel = torch.nonzero(flat != -100, as_tuple=False).flatten()
    rows = sequence_output.reshape(-1, sequence_output.shape[-1]).index_select(0, sel)
    return rows, flat.index_select(0, sel)


_ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")


class _MaskedPositionsOnly:
    """Mixin of the two MLM heads: the ``padded`` and ``mlm_masked_positions_only`` options. With
    the latter and labels, the encoder runs as usual and the head (``_masked_output``) sees only
    the labelled rows; otherwise the call is transformers' own forward."""

    def __init__(self, config, *args, padded: bool = False, mlm_masked_positions_only: bool = False, **kwargs):
        super().__init__(config, *args, **kwargs)
        to_fast_bert(self.bert, padded=padded)
        self.mlm_masked_positions_only = mlm_masked_positions_only

    def _forward(self, inputs: tuple, labels, head_labels: dict, return_dict, kwargs: dict):
        """The forward of both heads: ``inputs`` in the order of _ENCODER_INPUTS, ``head_labels``
        the head's other labels (next_sentence_label)."""
        named = dict(zip(_ENCODER_INPUTS, inputs))
        if not (self.mlm_masked_positions_only and labels is not None):
            return super().forward(**named, labels=labels, **head_labels, return_dict=return_dict, **kwargs)
        input_ids = named.pop("input_ids")  # positional, as transformers' heads call their encoder
        out = self.bert(input_ids, **named, return_dict=True, **kwargs)
        rows, targets = _masked_rows(out.last_hidden_state, labels)
        result = self._masked_output(out, rows, targets, **head_labels)
        return result if return_dict is not False else result.to_tuple()


class BertForMaskedLM(_MaskedPositionsOnly, transformers.BertForMaskedLM):
    """transformers.BertForMaskedLM with bert_fast's encoder (see module doc for the options)."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        return_dict=None,
        **kwargs,
    ):
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        return self._forward(inputs, labels, {}, return_dict, kwargs)

    def _masked_output(self, out, rows: torch.Tensor, targets: torch.Tensor) -> MaskedLMOutput:
        logits = self.cls(rows)
        loss = CrossEntropyLoss()(logits.view(-1, self.config.vocab_size), targets)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions)


class BertForPreTraining(_MaskedPositionsOnly, transformers.BertForPreTraining):
    """transformers.BertForPreTraining (MLM + NSP) with bert_fast's encoder."""

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        labels=None,
        next_sentence_label=None,
        return_dict=None,
        **kwargs,
    ):
        inputs = (input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        return self._forward(inputs, labels, dict(next_sentence_label=next_sentence_label), return_dict, kwargs)

    def _masked_output(self, out, rows: torch.Tensor, targets: torch.Tensor, next_sentence_label):
        prediction_scores, seq_relationship = self.cls(rows, out.pooler_output)
        loss = None
        if next_sentence_label is not None:
            ce = CrossEntropyLoss()
            loss = ce(prediction_scores.view(-1, self.config.vocab_size), targets) + ce(
                seq_relationship.view(-1, 2), next_sentence_label.view(-1)
            )
        return BertForPreTrainingOutput(
            loss=loss,
            prediction_logits=prediction_scores,
            seq_relationship_logits=seq_relationship,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )
