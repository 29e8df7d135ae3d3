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

import logging
from typing import Dict, FrozenSet, Optional

import torch
import transformers
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from bert_fast.model import compat, direct_ops, dropin, frozen
from bert_fast.model.gemms import cast
from bert_fast.model.layer import ACTIVATIONS, Batch, call_hf, embeddings_forward, first, layer_forward
from bert_fast.model.masks import key_padding_mask
from bert_fast.model.padding import pad, unpad

logger = logging.getLogger("bert_fast")


def check_config(config) -> None:
    """Raise a clear error for every BERT variant this encoder does not implement."""
    act = config.hidden_act
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} is not supported by bert_fast; use one of {sorted(ACTIVATIONS)}")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise NotImplementedError(
            "bert_fast implements the BERT encoder only: is_decoder and add_cross_attention must be False"
        )
    pos = getattr(config, "position_embedding_type", "absolute")
    if pos not in (None, "absolute"):
        raise NotImplementedError(f"position_embedding_type={pos!r} is not supported (only 'absolute')")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads={config.num_attention_heads}"
        )
    # Any head dim runs: those the attention kernel does not cover (outside 16..128) take the torch
    # implementation of the same op, with one warning (bert_fast/ops/attention.py).


class BertLayer(transformers.models.bert.modeling_bert.BertLayer):
    """transformers' BertLayer (same parameters) whose forward is our kernel path.

    Layers are converted by class swap, so calls go through the module's own ``__call__``: module
    hooks (FSDP2's per-layer all-gather, transformers' GradientCheckpointingLayer) keep working.
    """

    def forward(self, hidden_states: torch.Tensor, batch: Batch, *args, **kwargs) -> torch.Tensor:
        return layer_forward(self, self.bert_fast_index, hidden_states, batch, self.bert_fast_config, self.training)


class BertEncoder(transformers.models.bert.modeling_bert.BertEncoder):
    """transformers' BertEncoder (class-swapped, same parameters) running our layers, so that hooks
    on the encoder fire as on transformers."""

    def forward(
        self, hidden_states: torch.Tensor, batch: Batch, checkpointed: bool = False, collect=None
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        h = hidden_states
        for layer in self.layer:
            if not isinstance(layer, BertLayer):
                # A layer module the user replaced: called as transformers' encoder calls it.
                h = cast(first(call_hf(layer, batch, h, batch.hf_mask)), h.dtype)
            elif checkpointed:
                # Dropout seeds come from torch's RNG, which checkpoint restores before recomputing,
                # so the recomputed masks are the forward's.
                h = checkpoint(layer, h, batch, use_reentrant=False)
            else:
                h = layer(h, batch)
            if collect is not None:
                collect(h)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=h)


dropin.register_fast_types(BertLayer, BertEncoder)


def _unfused_blocks(found: Dict[str, str], num_layers: int):
    """From ``dropin.find_unfused``'s paths: (embeddings unfused?, {layer index: blocks})."""
    all_blocks = frozenset(("attention", "intermediate", "output"))
    if "*" in found:  # global hooks: every module must be called
        return True, {i: all_blocks for i in range(num_layers)}
    embeddings, layers = False, {}
    for path in found:
        parts = path.split(".")
        if parts[0] == "embeddings":
            embeddings = True
        elif parts[0] == "encoder" and len(parts) >= 4 and parts[1] == "layer":
            rest = parts[3:]
            block = rest[0] if rest[0] != "attention" or len(rest) == 1 else f"attention.{rest[1]}"
            layers.setdefault(int(parts[2]), set()).add(block)
    return embeddings, {i: frozenset(b) for i, b in layers.items()}


# transformers 5.x (and late 4.x) checkpoint inside BertLayer.__call__; older versions did it in
# the encoder loop, which our forward replaces, so there we checkpoint ourselves.
_LAYER_CHECKPOINTS_ITSELF = compat.layer_checkpoints_itself()


# Keywords transformers' BertModel.forward takes (TransformersKwargs in 5.x) and heads and
# trainers pass down: as on transformers, the encoder accepts them, the fused path has no use for
# them (num_items_in_batch, shift_labels, ... concern the head's loss), and modules that run
# unfused get them (``_call_hf``). Those that would change the result on transformers (packed-sequence
# attention boundaries, a causal mask) are refused rather than ignored.
_REFUSED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _check_kwargs(kwargs: dict) -> None:
    for key, value in kwargs.items():
        if value is None or value is False:
            continue
        if key in _REFUSED_KWARGS:
            raise ValueError(
                f"{key} (packed sequences for flash attention) is not supported by "
                "bert_fast.BertModel.forward: pass a padded batch with attention_mask; "
                "bert_fast unpads it itself"
            )
        if key == "is_causal":
            raise ValueError("is_causal=True is not supported: bert_fast implements the bidirectional BERT encoder")


def _selected_hidden_states(flag, count: int) -> Optional[FrozenSet[int]]:
    """Which of the ``count`` hidden states (embeddings + one per layer) ``output_hidden_states``
    asks for: None for none, else indices. As transformers 5 reads it: a bool, or an index or list
    of indices (negative ones count from the end; out-of-range ones select nothing); a falsy value
    (False, [], 0) asks for none, as transformers reads it."""
    if isinstance(flag, torch.Tensor):
        flag = flag.tolist()
    if not flag:
        return None
    if flag is True:
        return frozenset(range(count))
    picks = [flag] if isinstance(flag, int) else list(flag)
    for i in picks:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"output_hidden_states must be a bool, an int or a list of ints, got {flag!r}")
    return frozenset(i % count for i in picks if -count <= i < count)


class BertModel(transformers.BertModel):
    """transformers.BertModel with bert_fast's kernels as its forward. Same constructor, parameters,
    state dict, outputs; ``padded=True`` computes every position (masked attention) instead of the
    real tokens only."""

    def __init__(self, config, add_pooling_layer: bool = True, padded: bool = False):
        check_config(config)
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        # An installed transformers whose BertModel bert_fast does not recognise: warned fallback to
        # transformers' own forward (never a TypeError inside forward or a different answer).
        self.bert_fast_fallback = compat.incompatibility(self)
        if self.bert_fast_fallback:
            compat.warn_fallback(self.bert_fast_fallback)
            self.padded = bool(padded)
            return
        self.setup_fast(padded)

    def setup_fast(self, padded: bool = False) -> "BertModel":
        """Make this (possibly class-swapped) module ready for the fast forward."""
        check_config(self.config)
        self.padded = bool(padded)
        self.bert_fast_fallback = None
        self.bert_fast_expected_act = dropin.expected_activation(self.config)
        self.bert_fast_logged = set()
        hf_bert = transformers.models.bert.modeling_bert
        if type(self.encoder) is hf_bert.BertEncoder:
            self.encoder.__class__ = BertEncoder
        for i, layer in enumerate(self.encoder.layer):
            if type(layer) is hf_bert.BertLayer:
                layer.__class__ = BertLayer
            layer.bert_fast_config = self.config
            layer.bert_fast_index = i
        return self

    def freeze(self) -> int:
        """Pack the encoder's linear weights for CPU inference (bert_fast/model/frozen.py: oneDNN prepacked
        weights, the QKV weight fused once): no-grad eval forwards on the CPU then run on them.
        float32 or bfloat16 models on the CPU. Returns the bytes the packed copies take. The copies
        follow in-place changes of the parameters (optimizer steps, load_state_dict, ``.to()``)
        but not writes through ``.data``: freeze again after those."""
        return frozen.freeze(self)

    def unfreeze(self) -> None:
        """Drop the packed copies of ``freeze()``."""
        frozen.unfreeze(self)

    def unfused_pieces(self) -> Dict[str, str]:
        """{module path: reason} of the pieces the next forward runs through their own module
        forward (hooks, non-transformers classes, parametrizations); empty when all are fused."""
        return dropin.find_unfused(self, self.bert_fast_expected_act)

    def _log_unfused(self, found: Dict[str, str]) -> None:
        key = frozenset(found.items())
        if key in self.bert_fast_logged:
            return
        self.bert_fast_logged.add(key)
        pieces = "; ".join(f"{p} ({r})" for p, r in sorted(found.items()))
        logger.warning(
            "bert_fast: %d piece(s) of %s run through their own forward, unfused, on "
            "transformers' padded layout, so that they compute what they compute on "
            "transformers: %s",
            len(found),
            type(self).__name__,
            pieces,
        )

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        position_ids=None,
        inputs_embeds=None,
        output_hidden_states=None,
        return_dict=None,
        output_attentions=None,
        encoder_hidden_states=None,
        encoder_attention_mask=None,
        past_key_values=None,
        use_cache=None,
        head_mask=None,
        padded: Optional[bool] = None,
        cache=None,
        **kwargs,
    ):
        config = self.config
        if self.__dict__.get("bert_fast_fallback"):
            given = dict(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
                position_ids=position_ids,
                inputs_embeds=inputs_embeds,
                output_hidden_states=output_hidden_states,
                return_dict=return_dict,
                output_attentions=output_attentions,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=past_key_values,
                use_cache=use_cache,
                head_mask=head_mask,
                cache=cache,
            )
            return super().forward(**{k: v for k, v in given.items() if v is not None}, **kwargs)
        # From the keyword or from the config: one path, one answer (as transformers reads them).
        if output_attentions is None:
            output_attentions = getattr(config, "output_attentions", False)
        if output_attentions:
            raise ValueError(
                "output_attentions=True (as a keyword or config.output_attentions) is not "
                "supported: bert_fast's flash attention never materializes the attention "
                "probabilities; use transformers' BertModel with attn_implementation='eager' "
                "to inspect them"
            )
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ValueError("cross-attention (encoder_hidden_states) is not supported by bert_fast")
        if past_key_values is not None or cache is not None:
            raise ValueError("past_key_values / cache are decoder features, not supported by bert_fast")
        # use_cache: an encoder ignores it, as transformers' BertModel does when is_decoder is False.
        if head_mask is not None:
            raise ValueError("head_mask is not supported by bert_fast")
        _check_kwargs(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else getattr(config, "output_hidden_states", False)
        )
        selected = _selected_hidden_states(output_hidden_states, len(self.encoder.layer) + 1)
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
            raise ValueError(f"sequence length {s} exceeds max_position_embeddings={config.max_position_embeddings}")
        if attention_mask is None:
            attention_mask = torch.ones((b, s), dtype=torch.bool, device=device)
        else:
            attention_mask = key_padding_mask(attention_mask, b, s, device)

        # Pieces a hook, a non-transformers module or a parametrization makes us run unfused: then
        # the whole batch runs in transformers' padded layout (exact mode), so that those pieces and
        # their hooks see the tensors they see on transformers.
        found = self.unfused_pieces()
        if found:
            self._log_unfused(found)
        embeddings_unfused, unfused = _unfused_blocks(found, len(self.encoder.layer))
        padded = bool(found) or (self.padded if padded is None else bool(padded))

        batch = Batch(
            padded=padded,
            unpadded=None if padded else unpad(attention_mask),
            mask=attention_mask if padded else None,
            batch=b,
            seqlen=s,
            unfused=unfused,
            hf_kwargs=dict(kwargs, position_ids=position_ids) if position_ids is not None else kwargs,
        )
        if embeddings_unfused:
            h = emb(
                input_ids=input_ids,
                position_ids=position_ids,
                token_type_ids=token_type_ids,
                inputs_embeds=inputs_embeds,
            )
        else:
            h = embeddings_forward(emb, input_ids, inputs_embeds, position_ids, token_type_ids, batch, self.training)
            if torch.is_grad_enabled() and not h.requires_grad and dropin.wants_input_grads(emb.word_embeddings):
                h.requires_grad_(True)  # what transformers' enable_input_require_grads hook does
        # The residual stream stays in the parameters' dtype, as on transformers: under autocast
        # the GEMMs (and attention on their outputs) run in the autocast dtype (ops.linear casts
        # as nn.Linear does), while the residual adds and LayerNorms stay fp32.
        h = cast(h, emb.word_embeddings.weight.dtype)
        if found:
            batch.hf_mask = compat.attention_mask_for_modules(attention_mask, h.dtype, config)
        if not found and direct_ops.usable(h, self.training):
            batch.ops = direct_ops
            batch.frozen = frozen.store_of(self)

        def to_bsh(x):
            return x if padded else pad(x, batch.unpadded)

        # Hidden states as transformers 5 returns them: one entry per state, None where not selected.
        all_hidden = [] if selected is not None else None

        def collect(x):
            all_hidden.append(to_bsh(x) if len(all_hidden) in selected else None)

        if selected is not None:
            collect(h)
        encoder_ckpt = (
            self.training
            and torch.is_grad_enabled()
            and not _LAYER_CHECKPOINTS_ITSELF
            and getattr(self.encoder, "gradient_checkpointing", False)
        )
        if isinstance(self.encoder, BertEncoder):
            h = self.encoder(
                h, batch, checkpointed=encoder_ckpt, collect=collect if selected is not None else None
            ).last_hidden_state
        else:  # a user's own encoder class (reported by unfused_pieces): called as transformers does
            h = first(call_hf(self.encoder, batch, h, attention_mask=batch.hf_mask))
            h = h.last_hidden_state if hasattr(h, "last_hidden_state") else h

        last = to_bsh(h)
        pooled = self.pooler(last) if self.pooler is not None and s > 0 else None
        if self.pooler is not None and s == 0:
            # No CLS position: pool the all-zero state, as for a fully padded row.
            pooled = self.pooler(last.new_zeros((b, 1, config.hidden_size)))
        hidden_states = tuple(all_hidden) if selected is not None else None
        if not return_dict:
            return tuple(v for v in (last, pooled, hidden_states) if v is not None)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=last, pooler_output=pooled, hidden_states=hidden_states
        )


def to_fast_bert(module: transformers.BertModel, padded: bool = False) -> transformers.BertModel:
    """Turn a live transformers.BertModel into ours, in place, sharing every parameter. When the
    installed transformers builds a BertModel bert_fast does not recognise, the module is left as
    it is (transformers' own forward) with a warning naming the version and the tested range."""
    if not isinstance(module, BertModel):
        if type(module) is not transformers.BertModel:
            raise TypeError(f"can only convert transformers.BertModel, got {type(module).__name__}")
        check_config(module.config)
        reason = compat.incompatibility(module)
        if reason:
            compat.warn_fallback(reason)
            return module
        module.__class__ = BertModel
    elif module.bert_fast_fallback:
        return module
    return module.setup_fast(padded)
