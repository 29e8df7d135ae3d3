"""The fused encoder forward, written once: embeddings, attention block, MLP block.

Every path runs these functions: training and inference, plain and frozen weights, padded and
unpadded layout, fused and exact mode. What varies is a parameter, never a copy:
  * ``gemms``  how the four GEMMs of a layer run (gemms.ModuleGemms: the modules' own weights;
               frozen._FrozenLayer: oneDNN-prepacked copies; a new precision is one more set);
  * ``batch.ops``  the op namespace of attention and residual+LayerNorm: bert_fast.ops (custom
               ops: autograd, torch.compile, the kernels) or direct_ops (the same torch
               implementation without the custom-op plumbing, for inference);
  * ``batch``  the layout: unpadded (varlen: [T, H] real tokens, cu_seqlens) or padded ([B, S, H]
               with a key-padding mask inside attention);
  * ``batch.unfused``  blocks that run through transformers' own module forward instead (a hook,
               a module bert_fast cannot reproduce, or output_attentions=True: every layer's
               self-attention through transformers' eager module, which returns the attention
               probabilities into ``batch.attentions``), on transformers' padded layout.
The reference oracle (bert_fast/reference.py) is the one deliberate second implementation.

Data flow of one layer (DESIGN.md):
    qkv = gemms.qkv(h)                      [.., 3H]
    ctx = attention(qkv)                    [.., H]   varlen or padded flash attention
    h1  = LN(gemms.out(ctx) + h)            residual + dropout + LayerNorm
    f   = gemms.up(h1, gelu)                [.., I]   GELU fused into the GEMM
    h   = LN(gemms.down(f) + h1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional

import torch
import torch.nn.functional as F

from bert_fast import ops
from bert_fast.model import compat, direct_ops, dropin, frozen, int8
from bert_fast.model.gemms import ModuleGemms, cast
from bert_fast.model.padding import Unpadded

# transformers' hidden_act names -> our fused activation.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass
class Batch:
    """What every layer needs to know about the batch layout, and which pieces run unfused."""

    padded: bool
    unpadded: Optional[Unpadded]  # varlen path
    mask: Optional[torch.Tensor]  # padded path: [B, S] key-padding mask
    batch: int
    seqlen: int
    # Exact mode (some piece runs through its module's forward): per layer index, the blocks
    # ("attention", "attention.self", "attention.output", "intermediate", "output") that do, and
    # the attention mask in the form transformers' own attention modules take.
    unfused: Dict[int, FrozenSet[str]] = field(default_factory=dict)
    hf_mask: Optional[torch.Tensor] = None
    # Keywords the caller passed down (TransformersKwargs in transformers 5): handed on to the
    # transformers modules that run unfused, where those take **kwargs, as transformers does.
    hf_kwargs: dict = field(default_factory=dict)
    # The ops the layers call: bert_fast.ops (custom ops: autograd, torch.compile), or
    # direct_ops (the same torch implementation without the custom-op overhead, for inference;
    # see direct_ops.usable).
    ops: object = ops
    # The model's packed inference weights (frozen.py), when it is frozen and the layers run on
    # direct_ops: {layer index: packed layer}.
    frozen: Optional[dict] = None
    # The model's int8 GEMMs (int8.py), when quantized and the layers run on direct_ops.
    int8: Optional[dict] = None
    # output_attentions=True: the attention probabilities [B, heads, S, S] of each layer, in order,
    # as transformers' eager attention modules return them (every layer's attention runs unfused).
    attentions: Optional[list] = None


# ----------------------------------------------------------------------------- transformers' modules
def first(out):
    """The hidden states of a transformers block's output (a tensor, or a tuple in 4.x)."""
    return out[0] if isinstance(out, tuple) else out


_VAR_KWARGS: Dict[type, bool] = {}


def call_hf(module, batch: Batch, *args, **kwargs):
    """Call a transformers module that runs unfused as transformers calls it: the caller's
    forwarded keywords go along where its forward takes **kwargs (transformers 5)."""
    t = type(module)
    takes = _VAR_KWARGS.get(t)
    if takes is None:
        takes = _VAR_KWARGS[t] = compat.accepts_var_kwargs(t.forward)
    if takes and batch.hf_kwargs:
        kwargs = {**batch.hf_kwargs, **kwargs}
    return module(*args, **kwargs)


_PROBABILITY_KEYWORDS: Dict[type, dict] = {}


def call_hf_attention(module, batch: Batch, *args, **kwargs) -> torch.Tensor:
    """Call transformers' BertAttention or BertSelfAttention (or a family's twin) unfused, as
    ``call_hf``; when the caller asked for output_attentions (``batch.attentions``), also collect
    the attention probabilities the module returns (compat.attention_probabilities)."""
    if batch.attentions is None:
        return first(call_hf(module, batch, *args, **kwargs))
    t = type(module)
    extra = _PROBABILITY_KEYWORDS.get(t)
    if extra is None:
        extra = _PROBABILITY_KEYWORDS[t] = compat.probability_keywords(t.forward)
    out = call_hf(module, batch, *args, **kwargs, **extra)
    batch.attentions.append(compat.attention_probabilities(out, t.__name__))
    return first(out)


# ----------------------------------------------------------------------------- embeddings
def embeddings_forward(
    emb, input_ids, inputs_embeds, position_ids, token_type_ids, batch: Batch, training: bool
) -> torch.Tensor:
    """Embedding sum + LayerNorm + dropout of transformers' BertEmbeddings ``emb``, for the real
    tokens only on the varlen path ([T, H]), every position on the padded one ([B, S, H])."""
    p = emb.dropout.p if training else 0.0
    indices = None if batch.padded else batch.unpadded.indices
    if inputs_embeds is None:
        return ops.embedding_layer_norm(
            input_ids,
            position_ids,
            token_type_ids,
            emb.word_embeddings.weight,
            emb.position_embeddings.weight,
            emb.token_type_embeddings.weight,
            emb.LayerNorm.weight,
            emb.LayerNorm.bias,
            eps=emb.LayerNorm.eps,
            dropout_p=p,
            padding_idx=emb.word_embeddings.padding_idx,
            indices=indices,
            # RoBERTa / XLM-R: the position table's padding_idx row (pad_token_id, every pad's
            # position) gets no gradient, as in transformers; each table's own nn.Embedding rule.
            position_padding_idx=getattr(emb.position_embeddings, "padding_idx", None),
            token_type_padding_idx=getattr(emb.token_type_embeddings, "padding_idx", None),
        )
    # inputs_embeds: the word vectors are given, so only positions and token types are looked up.
    b, s = inputs_embeds.shape[:2]
    position_ids = _ids_of("position_ids", position_ids, b, s, torch.arange(s, device=inputs_embeds.device))
    token_type_ids = _ids_of("token_type_ids", token_type_ids, b, s, inputs_embeds.new_zeros((), dtype=torch.long))
    x = inputs_embeds + emb.position_embeddings(position_ids) + emb.token_type_embeddings(token_type_ids)
    if indices is not None:
        x = x.reshape(b * s, -1).index_select(0, indices)
    x = emb.LayerNorm(x)
    return F.dropout(x, p=p, training=training)


def _ids_of(name: str, ids, b: int, s: int, default: torch.Tensor) -> torch.Tensor:
    """``ids`` (else ``default``) broadcast to [b, s], or the op's ValueError (ops.embedding)."""
    try:
        return (default if ids is None else ids).expand(b, s)
    except RuntimeError:
        raise ValueError(
            f"{name} must have the shape of input_ids {(b, s)} (or broadcast to it), got {tuple(ids.shape)}"
        ) from None


# ----------------------------------------------------------------------------- one layer
def gemms_for(layer, index: int, dtype: torch.dtype, batch: Batch):
    """The GEMM set this layer runs: its int8 GEMMs when the model is quantized (int8.py), its packed
    copies when the model is frozen (and they apply), else its own module weights through the
    batch's op namespace."""
    if batch.int8:
        entry = int8.entry_for(batch.int8, index, layer)
        if entry is not None:
            return entry
    if batch.frozen is not None and batch.ops is direct_ops:
        entry = frozen.entry_for(batch.frozen, index, layer, dtype)
        if entry is not None:
            return entry
    return ModuleGemms(layer, dtype, batch.ops)


def attention_block(sa, gemms, h: torch.Tensor, batch: Batch, heads: int, training: bool) -> torch.Tensor:
    """Context [.., H] of one BertSelfAttention: QKV GEMM(s) + flash attention (varlen or padded)."""
    o, u = batch.ops, batch.unpadded
    hidden = h.shape[-1]
    if o is direct_ops and u is not None and h.shape[0] > 0 and u.max_seqlen * u.batch == h.shape[0]:
        # Inference on a dense batch (every sequence full length): three GEMMs over the separate
        # weights beat one over their per-call concatenation (direct_ops.dense_self_attention).
        separate = gemms.separate_qkv()
        if separate is not None:
            return direct_ops.dense_self_attention(h, *separate, u.batch, u.max_seqlen, heads)
    p_attn = sa.dropout.p if training else 0.0
    if batch.int8 and o is direct_ops and int8.is_int8_layer(gemms) and int8.attention_in_bf16(h):
        # An int8 model's attention in bf16 on our AVX-512 BF16 kernel (int8.py, "Attention"): the QKV
        # GEMM's dequantize pass writes bf16, and the context stays bf16 for the output GEMM, which
        # quantizes it as it is (_gemm_residual_ln): the same values as two casts, without them.
        qkv = gemms.qkv(h, out_dtype=torch.bfloat16)
        return attention_block_ops(o, qkv, batch, heads, hidden, p_attn).reshape(h.shape)
    qkv = gemms.qkv(h)
    return attention_block_ops(o, qkv, batch, heads, hidden, p_attn).reshape(h.shape)


def attention_block_ops(o, qkv: torch.Tensor, batch: Batch, heads: int, hidden: int, p_attn: float) -> torch.Tensor:
    """Flash attention (padded or varlen) over a packed QKV projection."""
    u = batch.unpadded
    if batch.padded:
        ctx = o.attention(qkv.view(batch.batch, batch.seqlen, 3, heads, hidden // heads), batch.mask, dropout_p=p_attn)
    else:
        # cu_seqlens comes from unpad(), valid by construction: skip the per-call host-sync check.
        ctx = o.varlen_attention(
            qkv.view(-1, 3, heads, hidden // heads), u.cu_seqlens, u.max_seqlen, dropout_p=p_attn, validate=False
        )
    return ctx


def _residual_ln(o, x: torch.Tensor, residual: torch.Tensor, out_module, dtype, training: bool) -> torch.Tensor:
    """LayerNorm(dropout(x) + residual) of a BertSelfOutput / BertOutput (its LayerNorm, dropout)."""
    ln = out_module.LayerNorm
    return o.residual_layer_norm(
        x, residual, cast(ln.weight, dtype), cast(ln.bias, dtype), ln.eps, out_module.dropout.p if training else 0.0
    )


def _gemm_residual_ln(
    o, gemm, x: torch.Tensor, residual: torch.Tensor, out_module, dtype, training: bool
) -> torch.Tensor:
    """LayerNorm(dropout(gemm(x)) + residual) of a BertSelfOutput / BertOutput. An int8 GEMM of
    inference folds the add and the LayerNorm into its dequantize pass (int8._Int8Linear.residual_ln:
    one pass over the row instead of two more ops); every other GEMM set runs the GEMM, then the op.
    x is in the model's dtype, or bf16 in an int8 model whose attention ran in bf16 (attention_block):
    the int8 GEMM then writes the model's dtype itself."""
    fused = getattr(gemm, "residual_ln", None)
    if fused is not None and o is direct_ops and not training:
        ln = out_module.LayerNorm
        y = fused(x, residual, ln.weight, ln.bias, ln.eps)
        if y is not None:
            return y
    if o is ops and not training and isinstance(getattr(gemm, "__self__", None), ModuleGemms):
        # The module's own weights on the kernel path: one op, which at small M splits the GEMM
        # over K to fill the GPU and sums the slices inside the LayerNorm kernel
        # (ops/linear_residual_layer_norm.py); elsewhere the same two ops as below.
        lin, ln = dropin.linear_terms(out_module.dense), out_module.LayerNorm
        if not lin.lora:
            w, b, lw, lb = (cast(t, dtype) for t in (lin.weight, lin.bias, ln.weight, ln.bias))
            return ops.linear_residual_layer_norm(x, w, b, residual, lw, lb, ln.eps)
    y = gemm(x, out_dtype=dtype) if int8.is_int8_linear(gemm) else gemm(x)
    return _residual_ln(o, cast(y, dtype), residual, out_module, dtype, training)


def layer_forward(layer, index: int, h: torch.Tensor, batch: Batch, config, training: bool) -> torch.Tensor:
    """One transformers BertLayer, run by our kernels. h: [T, H] (varlen) or [B, S, H] (padded).

    A block listed in ``batch.unfused`` (it holds a hook or a module we cannot reproduce) runs
    through its own module forward instead, on the same tensors transformers gives it."""
    dtype = h.dtype
    heads = config.num_attention_heads
    activation = ACTIVATIONS[config.hidden_act]
    unfused = batch.unfused.get(index, frozenset())
    o = batch.ops
    gemms = ModuleGemms(layer, dtype, o) if unfused else gemms_for(layer, index, dtype, batch)
    att = layer.attention

    if "attention" in unfused:
        h1 = cast(call_hf_attention(att, batch, h, batch.hf_mask), dtype)
    else:
        if "attention.self" in unfused:
            ctx = cast(call_hf_attention(att.self, batch, h, attention_mask=batch.hf_mask), dtype)
        else:
            ctx = attention_block(att.self, gemms, h, batch, heads, training)
        if "attention.output" in unfused:
            h1 = cast(att.output(ctx, h), dtype)
        else:
            h1 = _gemm_residual_ln(o, gemms.out, ctx, h, att.output, dtype, training)

    if "intermediate" in unfused:
        f = cast(layer.intermediate(h1), dtype)
    else:
        f = gemms.up(h1, activation)
    if "output" in unfused:
        return cast(layer.output(f, h1), dtype)
    return _gemm_residual_ln(o, gemms.down, f, h1, layer.output, dtype, training)
