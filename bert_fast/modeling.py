"""The drop-in BertModel: transformers' BertModel, parameters and all, with our kernels as forward.

Design (a deliberate refinement of "fuse QKV at load, split at save", see DESIGN.md): the module
tree and parameters are exactly transformers' (``encoder.layer.0.attention.self.query.weight``...),
so transformers' own from_pretrained / save_pretrained / heads / gradient checkpointing flags work
unchanged and ``optimize()`` can convert a live model in place sharing its parameters. The QKV
fusion is a torch.cat of the three weights at every call (inside autograd when they train): ~3H^2
elements per layer, ~0.6% of a BERT-base forward at 128 x 128 tokens. It is not cached, because no
cache key can see every write to a weight: fused AdamW, FSDP2's all-gather and ``p.data`` edits
leave the version counter unchanged, and a cached fusion then silently computes with old weights.
The one place that needs fixed addresses, CUDA-graph capture, freezes the fused weights explicitly
(``frozen_qkv``) and owns their refresh (``CudaGraphRunner.reset``).

Forward (DESIGN.md data flow): unpad once -> embedding kernel gathers only real tokens (+ LayerNorm,
dropout) -> per layer: fused QKV GEMM, varlen flash attention, out-proj GEMM, residual+dropout+LN,
GEMM+bias+GELU, GEMM, residual+dropout+LN -> pad once (pads are zero) -> transformers' pooler.
``padded=True`` keeps all B*S positions with the key-padding mask applied inside the attention
kernel and matches transformers at every position, pads included.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from torch.utils.checkpoint import checkpoint

from bert_fast import ops
from bert_fast.padding import Unpadded, pad, unpad

# transformers' hidden_act names -> our fused activation.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128


def check_config(config) -> None:
    """Raise a clear error for every BERT variant this encoder does not implement."""
    act = config.hidden_act
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported by bert_fast; use one of {sorted(ACTIVATIONS)}")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise NotImplementedError("bert_fast implements the BERT encoder only: is_decoder and "
                                  "add_cross_attention must be False")
    pos = getattr(config, "position_embedding_type", "absolute")
    if pos not in (None, "absolute"):
        raise NotImplementedError(f"position_embedding_type={pos!r} is not supported (only 'absolute')")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size={config.hidden_size} is not a multiple of "
                         f"num_attention_heads={config.num_attention_heads}")
    head_dim = config.hidden_size // config.num_attention_heads
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} (hidden_size / num_attention_heads) is outside "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], which the attention kernel supports")


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype the kernels run in: autocast's when it is on (weights are cast, as autocast would
    for nn.Linear), else the parameters' own."""
    dev = param.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return param.dtype


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


_FROZEN_QKV = "_bert_fast_frozen_qkv"    # attribute set on a BertSelfAttention by frozen_qkv()


def _cat_qkv(self_attn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    parts = (self_attn.query, self_attn.key, self_attn.value)
    return (torch.cat([_cast(p.weight, dtype) for p in parts]),
            torch.cat([_cast(p.bias, dtype) for p in parts]))


def fused_qkv(self_attn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cat(Wq, Wk, Wv) [3H, H] and cat(bq, bk, bv) for one BertSelfAttention, in ``dtype``: built
    from the current weights at every call, except inside ``frozen_qkv``."""
    frozen = self_attn.__dict__.get(_FROZEN_QKV)
    if frozen is None:
        return _cat_qkv(self_attn, dtype)
    if dtype not in frozen:
        with torch.no_grad():
            frozen[dtype] = _cat_qkv(self_attn, dtype)
    return frozen[dtype]


@contextmanager
def frozen_qkv(model, store: dict):
    """Within this block every layer of ``model`` (a BertModel) uses one fused QKV weight per
    dtype, built at its first use and kept in ``store`` (layer index -> {dtype: (w, b)}) for the
    next block. A captured CUDA graph reads those tensors by address: the caller keeps ``store``
    alive as long as the graph, and empties it when the weights change (their values are copied,
    not tracked)."""
    layers = [layer.attention.self for layer in model.encoder.layer]
    for i, self_attn in enumerate(layers):
        self_attn.__dict__[_FROZEN_QKV] = store.setdefault(i, {})   # not a buffer: never saved
    try:
        yield store
    finally:
        for self_attn in layers:
            self_attn.__dict__.pop(_FROZEN_QKV, None)


@dataclass
class _Batch:
    """What every layer needs to know about the batch layout."""
    padded: bool
    unpadded: Optional[Unpadded]         # varlen path
    mask: Optional[torch.Tensor]         # padded path: [B, S] key-padding mask
    batch: int
    seqlen: int


def _layer_forward(layer, h: torch.Tensor, batch: _Batch, config, training: bool) -> torch.Tensor:
    """One transformers BertLayer, run by our kernels. h: [T, H] (varlen) or [B, S, H] (padded)."""
    dtype = h.dtype
    heads = config.num_attention_heads
    hidden = config.hidden_size
    p_hidden = config.hidden_dropout_prob if training else 0.0
    p_attn = config.attention_probs_dropout_prob if training else 0.0
    att = layer.attention

    wqkv, bqkv = fused_qkv(att.self, dtype)
    qkv = ops.linear(h, wqkv, bqkv)
    if batch.padded:
        ctx = ops.attention(qkv.view(batch.batch, batch.seqlen, 3, heads, hidden // heads),
                            batch.mask, dropout_p=p_attn)
    else:
        u = batch.unpadded
        # cu_seqlens comes from unpad(), valid by construction: skip the per-call host-sync check.
        ctx = ops.varlen_attention(qkv.view(-1, 3, heads, hidden // heads), u.cu_seqlens,
                                   u.max_seqlen, dropout_p=p_attn, validate=False)
    ctx = ctx.reshape(h.shape)

    dense, ln = att.output.dense, att.output.LayerNorm
    a = ops.linear(ctx, _cast(dense.weight, dtype), _cast(dense.bias, dtype))
    h1 = ops.residual_layer_norm(a, h, _cast(ln.weight, dtype), _cast(ln.bias, dtype), ln.eps, p_hidden)

    up = layer.intermediate.dense
    f = ops.linear(h1, _cast(up.weight, dtype), _cast(up.bias, dtype),
                   activation=ACTIVATIONS[config.hidden_act])
    down, ln2 = layer.output.dense, layer.output.LayerNorm
    o = ops.linear(f, _cast(down.weight, dtype), _cast(down.bias, dtype))
    return ops.residual_layer_norm(o, h1, _cast(ln2.weight, dtype), _cast(ln2.bias, dtype), ln2.eps, p_hidden)


class BertLayer(transformers.models.bert.modeling_bert.BertLayer):
    """transformers' BertLayer (same parameters) whose forward is our kernel path.

    Layers are converted by class swap, so calls go through the module's own ``__call__``: module
    hooks (FSDP2's per-layer all-gather, transformers' GradientCheckpointingLayer) keep working.
    """

    def forward(self, hidden_states: torch.Tensor, batch: _Batch, *args, **kwargs) -> torch.Tensor:
        return _layer_forward(self, hidden_states, batch, self.bert_fast_config, self.training)


# transformers 5.x (and late 4.x) checkpoint inside BertLayer.__call__; older versions did it in
# the encoder loop, which our forward replaces, so there we checkpoint ourselves.
try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:
    GradientCheckpointingLayer = None
_LAYER_CHECKPOINTS_ITSELF = (GradientCheckpointingLayer is not None
                             and issubclass(transformers.models.bert.modeling_bert.BertLayer, GradientCheckpointingLayer))


def _check_mask(attention_mask, input_shape, device) -> torch.Tensor:
    """Validate a [B, S] key-padding mask (bool, integer, or 0/1 floats) and return it as bool."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(input_shape):
        raise ValueError(f"attention_mask must have shape {tuple(input_shape)} (batch, seq), "
                         f"got {tuple(attention_mask.shape)}")
    if attention_mask.device != device:
        raise ValueError(f"attention_mask is on {attention_mask.device} but input is on {device}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_complex():
        raise TypeError(f"attention_mask dtype {attention_mask.dtype} is not supported: use bool, an "
                        "integer type or 0/1 floats")
    if attention_mask.is_floating_point() and bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("a floating attention_mask must hold only 0 and 1 (1 = attend); "
                         "extended additive masks are not accepted")
    return attention_mask != 0


class BertModel(transformers.BertModel):
    """transformers.BertModel with bert_fast's kernels as its forward. Same constructor, parameters,
    state dict, outputs; ``padded=True`` computes every position (masked attention) instead of the
    real tokens only."""

    def __init__(self, config, add_pooling_layer: bool = True, padded: bool = False):
        check_config(config)
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        self.setup_fast(padded)

    def setup_fast(self, padded: bool = False) -> "BertModel":
        """Make this (possibly class-swapped) module ready for the fast forward."""
        check_config(self.config)
        self.padded = bool(padded)
        for layer in self.encoder.layer:
            if not isinstance(layer, BertLayer):
                layer.__class__ = BertLayer
            layer.bert_fast_config = self.config
        return self

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_hidden_states=None, return_dict=None, output_attentions=None,
                encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None,
                use_cache=None, head_mask=None, padded: Optional[bool] = None, **kwargs):
        if output_attentions:
            raise ValueError("output_attentions=True is not supported: bert_fast's flash attention never "
                             "materializes the attention probabilities")
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ValueError("cross-attention (encoder_hidden_states) is not supported by bert_fast")
        if past_key_values is not None or use_cache:
            raise ValueError("past_key_values / use_cache are decoder features, not supported by bert_fast")
        if head_mask is not None:
            raise ValueError("head_mask is not supported by bert_fast")
        unknown = {k for k, v in kwargs.items() if v is not None and v is not False}
        if unknown:
            raise TypeError(f"unexpected arguments for bert_fast.BertModel.forward: {sorted(unknown)}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        config = self.config
        padded = self.padded if padded is None else bool(padded)
        output_hidden_states = (output_hidden_states if output_hidden_states is not None
                                else getattr(config, "output_hidden_states", False))
        return_dict = return_dict if return_dict is not None else getattr(config, "return_dict", True)
        emb = self.embeddings
        device = emb.word_embeddings.weight.device

        source = input_ids if input_ids is not None else inputs_embeds
        if source.device != device:
            raise ValueError(f"input is on device {source.device} but the model is on device {device}")
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if inputs_embeds is not None and inputs_embeds.dim() != 3:
            raise ValueError(f"inputs_embeds must be [batch, seq, hidden], got shape {tuple(inputs_embeds.shape)}")
        b, s = source.shape[:2]
        if position_ids is None and s > config.max_position_embeddings:
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings="
                             f"{config.max_position_embeddings}")
        if attention_mask is None:
            attention_mask = torch.ones((b, s), dtype=torch.bool, device=device)
        else:
            attention_mask = _check_mask(attention_mask, (b, s), device)

        batch = _Batch(padded=padded, unpadded=None if padded else unpad(attention_mask),
                       mask=attention_mask if padded else None, batch=b, seqlen=s)
        h = self._embed(input_ids, inputs_embeds, position_ids, token_type_ids, batch)
        dtype = compute_dtype(emb.word_embeddings.weight)
        h = _cast(h, dtype)

        def to_bsh(x):
            return x if padded else pad(x, batch.unpadded)

        all_hidden = [to_bsh(h)] if output_hidden_states else None
        encoder_ckpt = (self.training and torch.is_grad_enabled() and not _LAYER_CHECKPOINTS_ITSELF
                        and getattr(self.encoder, "gradient_checkpointing", False))
        for layer in self.encoder.layer:
            if encoder_ckpt:
                # Dropout seeds come from torch's RNG, which checkpoint restores before recomputing,
                # so the recomputed masks are the forward's.
                h = checkpoint(layer, h, batch, use_reentrant=False)
            else:
                h = layer(h, batch)
            if output_hidden_states:
                all_hidden.append(to_bsh(h))

        last = to_bsh(h)
        pooled = self.pooler(last) if self.pooler is not None and s > 0 else None
        if self.pooler is not None and s == 0:
            # No CLS position: pool the all-zero state, as for a fully padded row.
            pooled = self.pooler(last.new_zeros((b, 1, config.hidden_size)))
        hidden_states = tuple(all_hidden) if output_hidden_states else None
        if not return_dict:
            return tuple(v for v in (last, pooled, hidden_states) if v is not None)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=last, pooler_output=pooled, hidden_states=hidden_states)

    def _embed(self, input_ids, inputs_embeds, position_ids, token_type_ids, batch: _Batch) -> torch.Tensor:
        """Embedding sum + LayerNorm + dropout, for the real tokens only on the varlen path."""
        emb = self.embeddings
        p = self.config.hidden_dropout_prob if self.training else 0.0
        indices = None if batch.padded else batch.unpadded.indices
        if inputs_embeds is None:
            return ops.embedding_layer_norm(
                input_ids, position_ids, token_type_ids, emb.word_embeddings.weight,
                emb.position_embeddings.weight, emb.token_type_embeddings.weight, emb.LayerNorm.weight,
                emb.LayerNorm.bias, eps=emb.LayerNorm.eps, dropout_p=p,
                padding_idx=emb.word_embeddings.padding_idx, indices=indices)
        # inputs_embeds: the word vectors are given, so only positions and token types are looked up.
        b, s = inputs_embeds.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(s, device=inputs_embeds.device).expand(b, s)
        if token_type_ids is None:
            token_type_ids = torch.zeros((b, s), dtype=torch.long, device=inputs_embeds.device)
        x = inputs_embeds + emb.position_embeddings(position_ids) + emb.token_type_embeddings(token_type_ids)
        if indices is not None:
            x = x.reshape(b * s, -1).index_select(0, indices)
        x = emb.LayerNorm(x)
        return F.dropout(x, p=p, training=self.training)


def to_fast_bert(module: transformers.BertModel, padded: bool = False) -> BertModel:
    """Turn a live transformers.BertModel into ours, in place, sharing every parameter."""
    if not isinstance(module, BertModel):
        if type(module) is not transformers.BertModel:
            raise TypeError(f"can only convert transformers.BertModel, got {type(module).__name__}")
        check_config(module.config)
        module.__class__ = BertModel
    return module.setup_fast(padded)
