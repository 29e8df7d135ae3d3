"""bert_fast: a fast BERT encoder for NVIDIA GPUs.

Our kernels (Triton: fused QKV/FFN GEMMs with epilogues, flash-style varlen attention, bias+GELU,
residual+dropout+LayerNorm; CUDA C++: the embedding sum + LayerNorm) behind a drop-in
transformers BertModel and its task heads.
"""
from bert_fast._build_info import build_info
from bert_fast import ops
from bert_fast.modeling import BertModel
from bert_fast.heads import (BertForMaskedLM, BertForMultipleChoice, BertForNextSentencePrediction,
                             BertForPreTraining, BertForQuestionAnswering, BertForSequenceClassification,
                             BertForTokenClassification)
from bert_fast.optimize import optimize

__all__ = [
    "build_info", "ops", "optimize", "BertModel", "BertForPreTraining", "BertForMaskedLM",
    "BertForNextSentencePrediction", "BertForSequenceClassification", "BertForTokenClassification",
    "BertForQuestionAnswering", "BertForMultipleChoice",
]
__version__ = "0.1.0"
