"""bert_fast ops: each fused op registered as a torch op in the ``bert_fast`` namespace.

One module per op (registration with torch.library, validation, dispatch, autograd); the kernels
themselves live in bert_fast.kernels (Triton) and bert_fast._C (CUDA C++ embedding). Dispatch rules:
bert_fast/ops/_dispatch.py.
"""

from bert_fast.ops._dispatch import draw_seed
from bert_fast.ops.attention import attention, varlen_attention
from bert_fast.ops.bias_gelu import bias_gelu
from bert_fast.ops.embedding import embedding_dropout_mask, embedding_layer_norm
from bert_fast.ops.linear import linear
from bert_fast.ops.linear_residual_layer_norm import linear_residual_layer_norm
from bert_fast.ops.residual_layer_norm import residual_layer_norm, residual_layer_norm_dropout_mask

__all__ = [
    "attention",
    "bias_gelu",
    "draw_seed",
    "embedding_dropout_mask",
    "embedding_layer_norm",
    "linear",
    "linear_residual_layer_norm",
    "residual_layer_norm",
    "residual_layer_norm_dropout_mask",
    "varlen_attention",
]
