"""bert_fast: a fast BERT encoder for NVIDIA GPUs.

Our kernels (Triton: fused QKV/FFN GEMMs with epilogues, flash-style varlen attention, bias+GELU,
residual+dropout+LayerNorm; CUDA C++: the embedding sum + LayerNorm) behind a drop-in
transformers BertModel and its task heads.

Imports are lazy (PEP 562) so that ``bert-fast --help`` or ``build_info()`` do not pay for
importing transformers and triton; ``bert_fast.BertModel`` etc. load on first use.
"""

import importlib

from bert_fast import onednn_caches

onednn_caches.bound()  # before any oneDNN op of ours: RSS stays flat under varying shapes (item 7)

from bert_fast._build_info import build_info  # noqa: E402
from bert_fast.versions import check_transformers_floor  # noqa: E402

check_transformers_floor()  # a transformers older than setup.py's floor is refused here, by name

__version__ = "0.1.0"

_SUBMODULES = ("ops", "reference", "testing")
_LAZY = {
    **{name: f"bert_fast.{name}" for name in _SUBMODULES},
    "BertModel": "bert_fast.model.modeling",
    "RobertaModel": "bert_fast.model.modeling",
    "XLMRobertaModel": "bert_fast.model.modeling",
    "ElectraModel": "bert_fast.model.modeling",
    "DistilBertModel": "bert_fast.model.modeling",
    "optimize": "bert_fast.model.optimize",
    "Int8AccuracyError": "bert_fast.model.int8",
    "Int8SpeedError": "bert_fast.model.int8_speed",
    "CudaGraphRunner": "bert_fast.model.cuda_graphs",
    **{
        name: "bert_fast.model.heads"
        for name in (
            "BertForPreTraining",
            "BertForMaskedLM",
            "BertForNextSentencePrediction",
            "BertForSequenceClassification",
            "BertForTokenClassification",
            "BertForQuestionAnswering",
            "BertForMultipleChoice",
            *(
                f"{prefix}{suffix}"
                for prefix in ("Roberta", "XLMRoberta", "DistilBert")
                for suffix in (
                    "ForMaskedLM",
                    "ForSequenceClassification",
                    "ForTokenClassification",
                    "ForQuestionAnswering",
                    "ForMultipleChoice",
                )
            ),
            "ElectraForPreTraining",
            "ElectraForMaskedLM",
            "ElectraForSequenceClassification",
            "ElectraForTokenClassification",
            "ElectraForQuestionAnswering",
            "ElectraForMultipleChoice",
        )
    },
}
__all__ = ["build_info", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bert_fast' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name in _SUBMODULES else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
