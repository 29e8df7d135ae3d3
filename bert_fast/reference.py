"""Pure-torch references of every bert_fast op: the test oracles and the library's CPU path.

Each function is written with plain torch ops in the dtype of its inputs, so that
  * run on float64 (upcast) inputs it is the oracle, and
  * run on the same low-precision inputs as a kernel it is "plain PyTorch in the same dtype",
which is exactly what the tolerance rule of DESIGN.md compares against (bert_fast.testing).

Dropout takes an explicit keep-mask (``dropout_mask``, bool) because no reference can reproduce a
kernel's Philox bits; the ops build that mask from their seed (see ops/_dispatch.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

GELU_APPROXIMATIONS = ("none", "tanh")
LINEAR_ACTIVATIONS = (None, "gelu", "gelu_tanh")


def apply_dropout(x: torch.Tensor, dropout_p: float, dropout_mask: Optional[torch.Tensor]) -> torch.Tensor:
    if dropout_mask is None or dropout_p == 0.0:
        return x
    return x * dropout_mask.to(x.dtype) * (1.0 / (1.0 - dropout_p))


def default_position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """0..S-1 along the last dimension of ``input_ids``, broadcast to its shape."""
    s = input_ids.shape[-1] if input_ids.dim() > 0 else 0
    return torch.arange(s, device=input_ids.device).expand(input_ids.shape)


# ----------------------------------------------------------------------------- embedding
def embedding_layer_norm(
    input_ids,
    position_ids,
    token_type_ids,
    word_embeddings,
    position_embeddings,
    token_type_embeddings,
    weight,
    bias,
    eps: float = 1e-12,
    dropout_p: float = 0.0,
    padding_idx: Optional[int] = None,
    indices: Optional[torch.Tensor] = None,
    dropout_mask: Optional[torch.Tensor] = None,
    *,
    position_padding_idx: Optional[int] = None,
    token_type_padding_idx: Optional[int] = None,
) -> torch.Tensor:
    """LayerNorm(word[ids] + position[pos] + token_type[tt]) * weight + bias, then dropout.

    ids/pos/tt share one shape (position_ids None -> 0..S-1 along the last dim, token_type_ids
    None -> 0). ``indices`` (int, into the flattened ids) keeps only those tokens: output [T, H];
    otherwise the output is ids.shape + (H,). The ``padding_idx`` row of the word table, the
    ``position_padding_idx`` row of the position table (RoBERTa / XLM-R: pads sit at position
    pad_token_id) and the ``token_type_padding_idx`` row of the type table get no gradient (as
    nn.Embedding's padding_idx).
    """
    if position_ids is None:
        position_ids = default_position_ids(input_ids)
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    if indices is not None:
        input_ids = input_ids.reshape(-1)[indices]
        position_ids = position_ids.reshape(-1)[indices]
        token_type_ids = token_type_ids.reshape(-1)[indices]
    x = (
        F.embedding(input_ids, word_embeddings, padding_idx=padding_idx)
        + F.embedding(position_ids, position_embeddings, padding_idx=position_padding_idx)
        + F.embedding(token_type_ids, token_type_embeddings, padding_idx=token_type_padding_idx)
    )
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return apply_dropout(y, dropout_p, dropout_mask)


# ----------------------------------------------------------------------------- residual + LN
def residual_layer_norm(
    x, residual, weight, bias, eps: float = 1e-12, dropout_p: float = 0.0, dropout_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """LayerNorm(dropout(x) + residual) over the last dimension (BERT's post-LN sublayer end)."""
    h = apply_dropout(x, dropout_p, dropout_mask) + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps)


# ----------------------------------------------------------------------------- bias + GELU
def bias_gelu(x, bias, approximate: str = "none") -> torch.Tensor:
    """GELU(x + bias); approximate "none" is the exact erf form, "tanh" the tanh approximation."""
    return F.gelu(x + bias, approximate=approximate)


def linear(x, weight, bias=None, activation: Optional[str] = None) -> torch.Tensor:
    """act(x @ weight.T + bias), activation None, "gelu" (erf) or "gelu_tanh"."""
    y = F.linear(x, weight, bias)
    if activation is None:
        return y
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


# ----------------------------------------------------------------------------- attention
def attention(
    qkv,
    attention_mask=None,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    dropout_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """softmax(q k^T * scale, keys masked) v for qkv [B, S, 3, heads, d] -> [B, S, heads, d].

    attention_mask [B, S] (1/True = attend) masks keys only: every query position, pads included,
    attends to the real keys of its row, as in transformers. A row with no real key gives zeros.
    dropout_mask: keep-mask [B, heads, S, S] on the probabilities.
    """
    b, s, three, h, d = qkv.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # [B, h, S, d]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, h, S, S]
    if attention_mask is not None:
        keep = attention_mask.to(torch.bool)[:, None, None, :]
        # finfo.min rather than -inf: a fully masked row stays finite (uniform), and is zeroed below,
        # so neither forward nor backward ever sees NaN.
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if attention_mask is not None:
        has_key = attention_mask.to(torch.bool).any(dim=-1)[:, None, None, None]
        probs = probs * has_key.to(probs.dtype)
    probs = apply_dropout(probs, dropout_p, dropout_mask)
    return torch.matmul(probs, v).transpose(1, 2)  # [B, S, h, d]


def varlen_attention(
    qkv,
    cu_seqlens,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    dropout_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention over packed sequences: qkv [T, 3, heads, d], cu_seqlens [B+1] -> [T, heads, d].

    Sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]; tokens attend within their sequence only.
    dropout_mask: keep-mask [B, heads, max_seqlen, max_seqlen] (sequence b uses its top-left L x L).
    """
    bounds = [int(c) for c in cu_seqlens.tolist()]
    outs = []
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        m = None if dropout_mask is None else dropout_mask[i : i + 1, :, : hi - lo, : hi - lo]
        outs.append(attention(qkv[lo:hi].unsqueeze(0), None, dropout_p, softmax_scale, m)[0])
    if not outs:
        return qkv.new_zeros((qkv.shape[0],) + tuple(qkv.shape[2:]))
    return torch.cat(outs, dim=0)
