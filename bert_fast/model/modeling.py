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

The other BERT-family encoders (RobertaModel, XLMRobertaModel, ElectraModel) are the same
classes on the same forward (the ``FastModel`` mixin): their layers are BERT's under other class
names, and what differs (RoBERTa's positions, ELECTRA's embeddings_project, no pooler) is a
``Family`` record, never a copy of the forward.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple

import torch
import transformers
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import (
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from bert_fast.model import compat, direct_ops, dropin, frozen, int8, precision
from bert_fast.model.gemms import cast
from bert_fast.model.layer import ACTIVATIONS, Batch, call_hf, embeddings_forward, first, layer_forward
from bert_fast.model.masks import key_padding_mask
from bert_fast.model.padding import pad, unpad
from bert_fast.versions import describe

logger = logging.getLogger("bert_fast")


def check_config(config, family=None) -> None:
    """Raise a clear error for every BERT variant this encoder does not implement (``family``: a
    Family, for its own fields)."""
    field = family.act_field if family is not None else "hidden_act"
    act = getattr(config, field)
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise ValueError(f"{field}={act!r} is not supported by bert_fast; use one of {sorted(ACTIVATIONS)}")
    for name in ("is_decoder", "add_cross_attention"):
        if getattr(config, name, False):
            raise NotImplementedError(
                f"{name}={getattr(config, name)!r}: bert_fast implements the bidirectional encoder only "
                "(is_decoder and add_cross_attention must be False)"
            )
    # Configs mean what the installed transformers makes of them: 4.x honours relative positions
    # (bert_fast refuses them), 5.x ignores the field and runs absolute positions, as bert_fast then does.
    pos = getattr(config, "position_embedding_type", "absolute")
    if pos not in (None, "absolute"):
        fam = family or BERT
        if compat.reads_position_embedding_type(fam.hf_layer, fam.hf_model.config_class):
            raise NotImplementedError(
                f"position_embedding_type={pos!r} is not supported (only 'absolute'): {describe()} "
                "honours it and bert_fast implements absolute positions only"
            )
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not a multiple of num_attention_heads={config.num_attention_heads}"
        )
    if family is not None and family.padding_offset_positions:
        pad = getattr(config, "pad_token_id", None)
        if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
            raise ValueError(
                f"pad_token_id={pad!r}: {family.name} position ids start after pad_token_id, which must be an int >= 0"
            )
    # Any head dim runs: those the attention kernel does not cover (outside 16..128) take the torch
    # implementation of the same op, with one warning (bert_fast/ops/attention.py).


class FastLayer:
    """Mixin of every class-swapped encoder layer (BertLayer, RobertaLayer, ...): the forward is the
    one fused layer forward of layer.py. The per-family classes below add only the transformers
    base class (so isinstance and state dicts stay transformers')."""

    def forward(self, hidden_states: torch.Tensor, batch: Batch, *args, **kwargs) -> torch.Tensor:
        return layer_forward(self, self.bert_fast_index, hidden_states, batch, self.bert_fast_config, self.training)


class FastEncoder:
    """Mixin of every class-swapped encoder (BertEncoder, RobertaEncoder, ...): the layer loop."""

    def forward(
        self, hidden_states: torch.Tensor, batch: Batch, checkpointed: bool = False, collect=None
    ) -> BaseModelOutputWithPastAndCrossAttentions:
        h = hidden_states
        for layer in self.layer:
            if not isinstance(layer, FastLayer):
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


class BertLayer(FastLayer, transformers.models.bert.modeling_bert.BertLayer):
    """transformers' BertLayer (same parameters) whose forward is our kernel path.

    Layers are converted by class swap, so calls go through the module's own ``__call__``: module
    hooks (FSDP2's per-layer all-gather, transformers' GradientCheckpointingLayer) keep working.
    """


class BertEncoder(FastEncoder, transformers.models.bert.modeling_bert.BertEncoder):
    """transformers' BertEncoder (class-swapped, same parameters) running our layers, so that hooks
    on the encoder fire as on transformers."""


class RobertaLayer(FastLayer, transformers.models.roberta.modeling_roberta.RobertaLayer):
    """transformers' RobertaLayer (the BERT layer under another name) on the fused layer forward."""


class RobertaEncoder(FastEncoder, transformers.models.roberta.modeling_roberta.RobertaEncoder):
    """transformers' RobertaEncoder running our layers."""


class XLMRobertaLayer(FastLayer, transformers.models.xlm_roberta.modeling_xlm_roberta.XLMRobertaLayer):
    """transformers' XLMRobertaLayer on the fused layer forward."""


class XLMRobertaEncoder(FastEncoder, transformers.models.xlm_roberta.modeling_xlm_roberta.XLMRobertaEncoder):
    """transformers' XLMRobertaEncoder running our layers."""


class ElectraLayer(FastLayer, transformers.models.electra.modeling_electra.ElectraLayer):
    """transformers' ElectraLayer on the fused layer forward."""


class ElectraEncoder(FastEncoder, transformers.models.electra.modeling_electra.ElectraEncoder):
    """transformers' ElectraEncoder running our layers."""


class _Namespace:
    """Attribute bag of the DistilBERT name adapter (built per call: a module a user or peft
    replaces later is read as it is then)."""

    def __init__(*args, **kw):  # "self" is one of the names (attention.self)
        args[0].__dict__.update(kw)


_NO_DROPOUT = _Namespace(p=0.0)  # DistilBERT has no dropout between out_lin and its residual


def distilbert_layer_view(block):
    """A DistilBERT TransformerBlock under BERT's names, for the one layer forward (layer.py):
    q_lin/k_lin/v_lin/attention dropout -> attention.self.{query,key,value,dropout};
    out_lin + sa_layer_norm -> attention.output.{dense,LayerNorm} (no dropout there);
    ffn.lin1 -> intermediate.dense; ffn.lin2 + ffn.dropout + output_layer_norm -> output.*."""
    att, ffn = block.attention, block.ffn
    return _Namespace(
        attention=_Namespace(
            self=_Namespace(query=att.q_lin, key=att.k_lin, value=att.v_lin, dropout=att.dropout),
            output=_Namespace(dense=att.out_lin, LayerNorm=block.sa_layer_norm, dropout=_NO_DROPOUT),
        ),
        intermediate=_Namespace(dense=ffn.lin1),
        output=_Namespace(dense=ffn.lin2, LayerNorm=block.output_layer_norm, dropout=ffn.dropout),
    )


_hf_distil = transformers.models.distilbert.modeling_distilbert


class DistilBertLayer(FastLayer, _hf_distil.TransformerBlock):
    """transformers' DistilBERT TransformerBlock on the one fused layer forward, through
    ``distilbert_layer_view``. Called as transformers calls it (not with a Batch: the model's
    exact mode runs transformers' whole forward), it is transformers' own forward."""

    def forward(self, *args, **kwargs):
        if len(args) > 1 and isinstance(args[1], Batch):
            view = distilbert_layer_view(self)
            return layer_forward(view, self.bert_fast_index, args[0], args[1], self.bert_fast_config, self.training)
        return _hf_distil.TransformerBlock.forward(self, *args, **kwargs)


class DistilBertEncoder(FastEncoder, _hf_distil.Transformer):
    """transformers' DistilBERT Transformer running our layers (its own forward when called as
    transformers calls it)."""

    def forward(self, *args, **kwargs):
        if len(args) > 1 and isinstance(args[1], Batch):
            return FastEncoder.forward(self, *args, **kwargs)
        return _hf_distil.Transformer.forward(self, *args, **kwargs)


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


def _with_attention_probabilities(unfused: Dict[int, FrozenSet[str]], num_layers: int):
    """``unfused`` with every layer's self-attention run through transformers' module, which
    returns the attention probabilities (or the whole attention block, where it already is)."""
    return {
        i: blocks if "attention" in blocks else blocks | {"attention.self"}
        for i, blocks in ((i, unfused.get(i, frozenset())) for i in range(num_layers))
    }


# Keywords transformers' BertModel.forward takes (TransformersKwargs in 5.x) and heads and
# trainers pass down: as on transformers, the encoder accepts them, the fused path has no use for
# them (num_items_in_batch, shift_labels, ... concern the head's loss), and modules that run
# unfused get them (``_call_hf``). Those that would change the result on transformers (packed-sequence
# attention boundaries, a causal mask) are refused rather than ignored.
_REFUSED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _refuse_unsupported(given: dict, kwargs: dict) -> None:
    """Refuse what bert_fast does not run (decoder, cross-attention, head_mask, packed sequences)."""
    if given["encoder_hidden_states"] is not None or given["encoder_attention_mask"] is not None:
        raise ValueError("cross-attention (encoder_hidden_states) is not supported by bert_fast")
    if given["past_key_values"] is not None or given["cache"] is not None:
        raise ValueError("past_key_values / cache are decoder features, not supported by bert_fast")
    # use_cache: an encoder ignores it, as transformers' BertModel does when is_decoder is False.
    if given["head_mask"] is not None:
        raise ValueError("head_mask is not supported by bert_fast")
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
    if (given["input_ids"] is None) == (given["inputs_embeds"] is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")


def _selected_hidden_states(flag, count: int, mode: Optional[str] = None) -> Tuple[Optional[FrozenSet[int]], bool]:
    """(which of the ``count`` hidden states (embeddings + one per layer) ``output_hidden_states``
    asks for: None for none, else indices; whether the returned tuple leaves out the embeddings'
    entry), as the installed transformers reads it (``mode``: compat.hidden_states_selection(),
    probed when a list or an int is given). "states" (transformers 5.2x; also what 4.x users get):
    a bool, or an index or list of indices over the ``count`` states (negative ones count from the
    end; out-of-range ones select nothing). "flag" (transformers 4.x): an index or a list is a
    truthy flag, every state. "layers" (transformers 5.17): a list selects layer
    outputs, one entry per layer and none for the embeddings, an index kept when it is literally
    in the list; an int is a flag. A falsy value (False, [], 0) asks for none, as transformers
    reads it."""
    if isinstance(flag, torch.Tensor):
        flag = flag.tolist()
    if not flag:
        return None, False
    if flag is True:
        return frozenset(range(count)), False
    picks = [flag] if isinstance(flag, int) else list(flag)
    for i in picks:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"output_hidden_states must be a bool, an int or a list of ints, got {flag!r}")
    mode = mode or compat.hidden_states_selection()
    if mode == "flag":  # transformers 4.x: any truthy value asks for every state
        return frozenset(range(count)), False
    if mode == "layers":
        if isinstance(flag, int):  # not a list: a truthy flag
            return frozenset(range(count)), False
        return frozenset(i + 1 for i in picks if 0 <= i < count - 1), True
    return frozenset(i % count for i in picks if -count <= i < count), False


@dataclass(frozen=True)
class Family:
    """What differs between the BERT-family encoders that run on the one fused layer forward
    (layer.py): the transformers classes and their class-swapped twins, and the embeddings. The
    layers themselves are the same post-LN BERT layer under another class name."""

    name: str  # as users know it, for messages
    hf_model: type  # transformers' base model class (converted when type(m) is exactly it)
    hf_encoder: type
    hf_layer: type
    fast_encoder: type
    fast_layer: type
    module: str  # transformers.models.<module>.modeling_<module>
    prefix: str  # transformers' class-name prefix in that module ("Roberta")
    # RoBERTa / XLM-R: position ids are padding_idx + (1, 2, ...) over the real tokens of each row,
    # padding_idx at pads (fairseq's make_positions); from inputs_embeds padding_idx + 1 ... + S.
    padding_offset_positions: bool = False
    # ELECTRA and DistilBERT have no pooler; bert_fast returns BaseModelOutputWithPastAndCrossAttentions.
    pooler_output: bool = True
    # DistilBERT: the encoder is ``transformer``, the activation ``config.activation``, no token
    # types (a zero table in the fused embeddings), layers read through distilbert_layer_view, and a
    # piece that must run unfused (a hook...) runs transformers' whole forward (exact mode).
    encoder_attr: str = "encoder"
    act_field: str = "hidden_act"
    token_types: bool = True
    whole_model_exact: bool = False
    probe: Optional[tuple] = None  # compat.probe_model's (embedding parts, layers path, layer parts)


def _to_bsh(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A hidden state in transformers' [B, S, H] layout (pads zero on the varlen path)."""
    return x if batch.padded else pad(x, batch.unpadded)


class _HiddenStates:
    """Hidden states as transformers 5 returns them: one entry per state (the embeddings', then one
    per layer), None where not selected. The encoder calls it after each layer."""

    def __init__(self, selected: FrozenSet[int], batch: Batch):
        self.selected, self.batch, self.states = selected, batch, []

    def __call__(self, x: torch.Tensor) -> None:
        self.states.append(_to_bsh(x, self.batch) if len(self.states) in self.selected else None)

    def returned(self, layers_only: bool) -> tuple:
        return tuple(self.states[1:] if layers_only else self.states)


class _FusedCall:
    """One forward call on the fused path, in three steps: its arguments as the fused path runs them
    (the constructor: refusals before any output, transformers' defaults from the config, the mask
    reduced to [B, S]), the encoder run (``run``) and transformers' outputs (``outputs``)."""

    def __init__(self, model: "FastModel", given: dict, output_attentions: bool, padded, kwargs: dict):
        _refuse_unsupported(given, kwargs)
        self.model, config = model, model.config
        output_hidden_states = given["output_hidden_states"]
        if output_hidden_states is None:
            output_hidden_states = getattr(config, "output_hidden_states", False)
        self.num_layers = len(getattr(model, model.bert_fast_family.encoder_attr).layer)
        # The hidden states asked for (None: none); whether their tuple leaves out the embeddings'.
        self.selected, self.layers_only = _selected_hidden_states(output_hidden_states, self.num_layers + 1)
        self.return_dict = given["return_dict"]  # truthy: a ModelOutput, else a tuple
        if self.return_dict is None:
            self.return_dict = getattr(config, "return_dict", True)
        self.input_ids, self.inputs_embeds = given["input_ids"], given["inputs_embeds"]
        self.token_type_ids = given["token_type_ids"]
        self.position_ids = given["position_ids"]  # the caller's: handed on to modules that run unfused
        weight = model.embeddings.word_embeddings.weight
        b, s = self.b, self.s = self._check_inputs(weight)
        # What the fused embeddings gather (RoBERTa's computed), checked against the table's length.
        self.fused_positions = model._bert_fast_positions(self.input_ids, self.inputs_embeds, self.position_ids, b, s)
        mask = given["attention_mask"]
        if mask is None:
            self.mask = torch.ones((b, s), dtype=torch.bool, device=weight.device)
        else:
            self.mask = key_padding_mask(mask, b, s, weight.device)  # [B, S] bool, True = real token
        self.output_attentions, self.padded, self.kwargs = output_attentions, padded, kwargs

    def _check_inputs(self, weight: torch.Tensor) -> Tuple[int, int]:
        """(batch, seq) of the input, checked for device and shape; a slow CPU dtype warned once."""
        input_ids, inputs_embeds = self.input_ids, self.inputs_embeds
        source = input_ids if input_ids is not None else inputs_embeds
        if source.device != weight.device:
            raise ValueError(f"input is on device {source.device} but the model is on device {weight.device}")
        if weight.device.type == "cpu" and weight.dtype in (torch.float16, torch.bfloat16):
            precision.warn_slow_dtype(weight.dtype)  # once: fp16, bf16 without units
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if inputs_embeds is not None and inputs_embeds.dim() != 3:
            raise ValueError(f"inputs_embeds must be [batch, seq, hidden], got shape {tuple(inputs_embeds.shape)}")
        return source.shape[:2]

    # ------------------------------------------------------------------ the encoder run
    def run(self) -> torch.Tensor:
        """Embeddings and layers: the last hidden state in the batch's layout (``self.batch``)."""
        model = self.model
        self.batch, embeddings_unfused, exact = self._plan_batch()
        batch = self.batch
        h = self._embed(embeddings_unfused)
        if exact:
            batch.hf_mask = compat.attention_mask_for_modules(self.mask, h.dtype, model.config)
        # Inference: direct_ops (no custom-op plumbing), with the packed (freeze()) or int8 weights.
        if not exact and direct_ops.usable(h, model.training):
            batch.ops = direct_ops
            batch.frozen = frozen.store_of(model)
        quantized = int8.store_of(model)
        if quantized:
            if not exact and int8.usable(h, model.training):
                batch.int8 = quantized
            else:
                int8.warn_not_inference(model)
        self.hidden = _HiddenStates(self.selected, batch) if self.selected is not None else None
        if self.hidden is not None:
            self.hidden(h)
        return self._encode(h)

    def _plan_batch(self) -> Tuple[Batch, bool, bool]:
        """The batch's layout and what runs unfused: (Batch, embeddings unfused, exact mode)."""
        # Pieces a hook, a non-transformers module or a parametrization makes us run unfused: then
        # the whole batch runs in transformers' padded layout (exact mode), so that those pieces and
        # their hooks see the tensors they see on transformers.
        found = self.model.unfused_pieces()
        if found:
            self.model._log_unfused(found)
        embeddings_unfused, unfused = _unfused_blocks(found, self.num_layers)
        if self.output_attentions:  # transformers' eager attention materializes them, for this call
            unfused = _with_attention_probabilities(unfused, self.num_layers)
        exact = bool(found) or self.output_attentions
        padded = exact or (self.model.padded if self.padded is None else bool(self.padded))
        kwargs, position_ids = self.kwargs, self.position_ids
        batch = Batch(
            padded=padded,
            unpadded=None if padded else unpad(self.mask),
            mask=self.mask if padded else None,
            batch=self.b,
            seqlen=self.s,
            unfused=unfused,
            hf_kwargs=dict(kwargs, position_ids=position_ids) if position_ids is not None else kwargs,
            attentions=[] if self.output_attentions else None,
        )
        return batch, embeddings_unfused, exact

    def _embed(self, unfused: bool) -> torch.Tensor:
        """The embeddings (transformers' module where it runs unfused), then ELECTRA's projection."""
        model = self.model
        emb = model.embeddings
        if unfused:
            h = emb(
                input_ids=self.input_ids,
                position_ids=self.position_ids,
                token_type_ids=self.token_type_ids,
                inputs_embeds=self.inputs_embeds,
            )
        else:
            h = embeddings_forward(
                emb if model.bert_fast_family.token_types else _no_token_types(emb),
                self.input_ids,
                self.inputs_embeds,
                self.fused_positions,
                self.token_type_ids,
                self.batch,
                model.training,
            )
            if torch.is_grad_enabled() and not h.requires_grad and dropin.wants_input_grads(emb.word_embeddings):
                h.requires_grad_(True)  # what transformers' enable_input_require_grads hook does
        project = model._modules.get("embeddings_project")  # (no AttributeError raised on the others)
        if project is not None:  # ELECTRA: embedding_size -> hidden_size, called as a module (hooks fire)
            h = project(h)
        # The residual stream stays in the parameters' dtype, as on transformers: under autocast
        # the GEMMs (and attention on their outputs) run in the autocast dtype (ops.linear casts
        # as nn.Linear does), while the residual adds and LayerNorms stay fp32.
        return cast(h, emb.word_embeddings.weight.dtype)

    def _encode(self, h: torch.Tensor) -> torch.Tensor:
        """The encoder: ours, or a user's own encoder class called as transformers calls it."""
        fam, batch = self.model.bert_fast_family, self.batch
        encoder = getattr(self.model, fam.encoder_attr)
        if not isinstance(encoder, FastEncoder):  # (reported by unfused_pieces)
            out = first(call_hf(encoder, batch, h, attention_mask=batch.hf_mask))
            return out.last_hidden_state if hasattr(out, "last_hidden_state") else out
        # transformers 5.x (and late 4.x) checkpoint inside BertLayer.__call__ (and RobertaLayer's,
        # ...); older versions did it in the encoder loop, which our forward replaces, so there we
        # checkpoint ourselves.
        checkpointed = (
            self.model.training
            and torch.is_grad_enabled()
            and not compat.layer_checkpoints_itself(fam.hf_layer)
            and getattr(encoder, "gradient_checkpointing", False)
        )
        return encoder(h, batch, checkpointed=checkpointed, collect=self.hidden).last_hidden_state

    # ------------------------------------------------------------------ the outputs
    def outputs(self, h: torch.Tensor):
        """transformers' output: a ModelOutput, or its tuple form as the installed version builds it."""
        fam = self.model.bert_fast_family
        last = _to_bsh(h, self.batch)
        pooler = getattr(self.model, "pooler", None)
        pooled = pooler(last) if pooler is not None and self.s > 0 else None
        if pooler is not None and self.s == 0:
            # No CLS position: pool the all-zero state, as for a fully padded row.
            pooled = pooler(last.new_zeros((self.b, 1, self.model.config.hidden_size)))
        hidden_states = self.hidden.returned(self.layers_only) if self.hidden is not None else None
        attentions = crossed = None
        if self.output_attentions:
            # One entry per layer (a checkpointed layer's recomputation appends to the list later).
            attentions = tuple(self.batch.attentions[: self.num_layers])
            # transformers 5 returns an encoder's (empty) cross-attentions beside them.
            crossed = () if compat.returns_cross_attentions(fam.hf_model) else None
        if not self.return_dict:
            rest = tuple(v for v in (hidden_states, attentions, crossed) if v is not None)
            if fam.pooler_output and compat.tuple_keeps_empty_pooler():  # 4.x: (last, pooled or None, ...)
                return (last, pooled) + rest
            return tuple(v for v in (last, pooled) if v is not None) + rest
        fields = dict(
            last_hidden_state=last, hidden_states=hidden_states, attentions=attentions, cross_attentions=crossed
        )
        if not fam.pooler_output:
            return BaseModelOutputWithPastAndCrossAttentions(**fields)
        return BaseModelOutputWithPoolingAndCrossAttentions(pooler_output=pooled, **fields)


class FastModel:
    """Mixin of bert_fast's BertModel, RobertaModel, XLMRobertaModel and ElectraModel: transformers'
    class with bert_fast's kernels as its forward. Same constructor, parameters, state dict,
    outputs; ``padded=True`` computes every position (masked attention) instead of the real tokens
    only. What differs per family is ``bert_fast_family`` (a Family), never the forward."""

    bert_fast_family: "Family"

    def __init_subclass__(cls, **kwargs):
        # optimize() swaps a live model's class without constructing ours: transformers' output
        # capture must know the class beforehand (DistilBERT's output_attentions returned None).
        super().__init_subclass__(**kwargs)
        compat.register_output_recording(cls)

    def _bert_fast_init(self, config, padded: bool, **hf_kwargs) -> None:
        """The constructor of every family's model: the config checked, transformers' own, then ours."""
        check_config(config, self.bert_fast_family)
        super().__init__(config, **hf_kwargs)
        # An installed transformers whose model bert_fast does not recognise: warned fallback to
        # transformers' own forward (never a TypeError inside forward or a different answer).
        fam = self.bert_fast_family
        self.bert_fast_fallback = compat.incompatibility(self, fam.module, fam.prefix, fam.probe)
        if self.bert_fast_fallback:
            compat.warn_fallback(self.bert_fast_fallback)
            self.padded = bool(padded)
            return
        self.setup_fast(padded)

    def setup_fast(self, padded: bool = False):
        """Make this (possibly class-swapped) module ready for the fast forward."""
        fam = self.bert_fast_family
        check_config(self.config, fam)
        self.padded = bool(padded)
        self.bert_fast_fallback = None
        self.bert_fast_expected_act = dropin.expected_activation(self.config, fam.act_field)
        self.bert_fast_logged = set()
        encoder = getattr(self, fam.encoder_attr)
        if type(encoder) is fam.hf_encoder:
            encoder.__class__ = fam.fast_encoder
        # What layer_forward reads of the config (DistilBERT's fields have other names).
        layer_config = self.config
        if fam.act_field != "hidden_act":
            layer_config = _Namespace(
                hidden_act=getattr(self.config, fam.act_field), num_attention_heads=self.config.num_attention_heads
            )
        for i, layer in enumerate(encoder.layer):
            if type(layer) is fam.hf_layer:
                layer.__class__ = fam.fast_layer
            layer.bert_fast_config = layer_config
            layer.bert_fast_index = i
        return self

    def _bert_fast_positions(self, input_ids, inputs_embeds, position_ids, b: int, s: int):
        """The position ids the fused embeddings gather (the caller's when given), and checks the
        length against max_position_embeddings as transformers' embeddings would index them."""
        limit = self.config.max_position_embeddings
        if position_ids is not None:
            return position_ids
        if not self.bert_fast_family.padding_offset_positions:
            if s > limit:
                raise ValueError(f"sequence length {s} exceeds max_position_embeddings={limit}")
            return None
        pad = self.embeddings.padding_idx
        if input_ids is not None:
            keep = input_ids.ne(pad).int()
            position_ids = (torch.cumsum(keep, dim=1).type_as(keep) * keep).long() + pad
        else:
            position_ids = torch.arange(pad + 1, s + pad + 1, dtype=torch.long, device=inputs_embeds.device)
            position_ids = position_ids.unsqueeze(0).expand(b, s)
        if s + pad + 1 > limit and position_ids.numel() and int(position_ids.max()) >= limit:
            raise ValueError(
                f"sequence length {s} exceeds max_position_embeddings={limit} minus pad_token_id + 1 = "
                f"{pad + 1} ({self.bert_fast_family.name} positions start after pad_token_id): at most "
                f"{limit - pad - 1} real tokens"
            )
        return position_ids

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

    def _log_unfused(self, found: Dict[str, str], whole: bool = False) -> None:
        key = frozenset(found.items())
        if key in self.bert_fast_logged:
            return
        self.bert_fast_logged.add(key)
        pieces = "; ".join(f"{p} ({r})" for p, r in sorted(found.items()))
        if whole:  # DistilBERT: its modules have no BERT-shaped per-block exact mode
            logger.warning(
                "bert_fast: %s runs transformers' own (unfused) forward while these pieces need their own forward: %s",
                type(self).__name__,
                pieces,
            )
            return
        logger.warning(
            "bert_fast: %d piece(s) of %s run through their own forward, unfused, on "
            "transformers' padded layout, so that they compute what they compute on "
            "transformers: %s",
            len(found),
            type(self).__name__,
            pieces,
        )

    def _check_output_attentions(self) -> None:
        """output_attentions=True: answered, as transformers answers it, where transformers' attention
        implementation is eager (its modules materialize the probabilities, which the fused
        attention never does); refused with what to do on the others. Warns that it is the slow path."""
        impl = compat.attention_implementation(self.config)
        if not compat.answers_output_attentions(self.config):
            raise ValueError(
                "output_attentions=True (as a keyword or config.output_attentions) needs transformers' "
                f"eager attention, but this model's attn_implementation is {impl!r}: bert_fast's flash "
                "attention never materializes the attention probabilities; load the model with "
                "attn_implementation='eager' (from_pretrained(..., attn_implementation='eager')) to get them"
            )
        encoder = getattr(self, self.bert_fast_family.encoder_attr)
        if not self.bert_fast_family.whole_model_exact and (
            not isinstance(encoder, FastEncoder) or not all(isinstance(layer, FastLayer) for layer in encoder.layer)
        ):
            raise ValueError(
                "output_attentions=True is not supported by bert_fast on a model whose encoder or "
                "encoder layers were replaced by other modules (their attention probabilities are not "
                "returned to it)"
            )
        warnings.warn(
            "bert_fast: output_attentions=True runs the slow path for this call: every layer's "
            "self-attention runs through transformers' eager attention, which materializes the "
            "[batch, heads, seq, seq] attention probabilities, on the padded layout; calls without "
            "output_attentions run fused",
            RuntimeWarning,
            stacklevel=5,  # the caller of model(...): here <- forward <- Module._call_impl <- __call__
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
        if self.__dict__.get("bert_fast_fallback"):
            return super().forward(**{k: v for k, v in given.items() if v is not None}, **kwargs)
        fam = self.bert_fast_family
        # From the keyword or from the config: one path, one answer (as transformers reads them).
        if output_attentions is None:
            output_attentions = getattr(self.config, "output_attentions", False)
        output_attentions = bool(output_attentions)
        if output_attentions:
            self._check_output_attentions()
        compat.check_mask_meaning(attention_mask, self.config, fam.hf_model)
        whole = fam.whole_model_exact and self.unfused_pieces()
        if whole or (fam.whole_model_exact and output_attentions):
            return super().forward(**self._whole_model_arguments(given, output_attentions, whole), **kwargs)
        call = _FusedCall(self, given, output_attentions, padded, kwargs)
        return call.outputs(call.run())

    def _whole_model_arguments(self, given: dict, output_attentions: bool, whole) -> dict:
        """DistilBERT's exact mode: the arguments of transformers' whole forward (its eager attention
        returns the probabilities when output_attentions is asked for), given the 2-D form of a
        3-D / 4-D mask (the same answer where transformers takes the form, one where it refuses it)."""
        if whole:
            self._log_unfused(whole, whole=True)
        given["output_attentions"] = output_attentions or None
        mask = given["attention_mask"]
        if compat.mask_form(mask):
            given["attention_mask"] = key_padding_mask(mask, mask.shape[0], mask.shape[-1], mask.device).long()
        return {k: v for k, v in given.items() if v is not None}


class BertModel(FastModel, transformers.BertModel):
    """transformers.BertModel with bert_fast's kernels as its forward (see FastModel)."""

    def __init__(self, config, add_pooling_layer: bool = True, padded: bool = False):
        self._bert_fast_init(config, padded, add_pooling_layer=add_pooling_layer)


class RobertaModel(FastModel, transformers.RobertaModel):
    """transformers.RobertaModel with bert_fast's kernels as its forward: the BERT layer, with
    RoBERTa's positions (after pad_token_id) computed for the fused embeddings."""

    def __init__(self, config, add_pooling_layer: bool = True, padded: bool = False):
        self._bert_fast_init(config, padded, add_pooling_layer=add_pooling_layer)


class XLMRobertaModel(FastModel, transformers.XLMRobertaModel):
    """transformers.XLMRobertaModel (RoBERTa's architecture) with bert_fast's kernels as its forward."""

    def __init__(self, config, add_pooling_layer: bool = True, padded: bool = False):
        self._bert_fast_init(config, padded, add_pooling_layer=add_pooling_layer)


class ElectraModel(FastModel, transformers.ElectraModel):
    """transformers.ElectraModel (discriminator or generator encoder) with bert_fast's kernels as
    its forward; its embeddings_project (embedding_size != hidden_size) runs as its own Linear."""

    def __init__(self, config, padded: bool = False):
        self._bert_fast_init(config, padded)


class DistilBertModel(FastModel, transformers.DistilBertModel):
    """transformers.DistilBertModel with bert_fast's kernels as its forward: the same layer forward
    through a name adapter (distilbert_layer_view); no token types, no pooler. ``freeze()`` is not
    implemented for it."""

    def __init__(self, config, padded: bool = False):
        self._bert_fast_init(config, padded)

    def freeze(self) -> int:
        raise NotImplementedError("freeze() is not implemented for DistilBertModel (its layers have other names)")


# transformers' base model class -> (family, bert_fast's class), in the order of messages (SUPPORTED)
FAMILIES: Dict[type, Tuple[Family, type]] = {}


def _family(name: str, model: type, encoder: type, layer: type, module: str, prefix, **differences) -> Family:
    """The Family of bert_fast's class-swapped ``model``, ``encoder`` and ``layer`` (transformers'
    classes are their last bases), registered as the model class's and in FAMILIES."""
    hf_model, hf_encoder, hf_layer = (cls.__bases__[-1] for cls in (model, encoder, layer))
    fam = Family(name, hf_model, hf_encoder, hf_layer, encoder, layer, module, prefix, **differences)
    model.bert_fast_family = fam
    FAMILIES[hf_model] = (fam, model)
    return fam


BERT = _family("BERT", BertModel, BertEncoder, BertLayer, "bert", "Bert")
ROBERTA = _family(
    "RoBERTa", RobertaModel, RobertaEncoder, RobertaLayer, "roberta", "Roberta", padding_offset_positions=True
)
XLM_ROBERTA = _family(
    "XLM-RoBERTa",
    XLMRobertaModel,
    XLMRobertaEncoder,
    XLMRobertaLayer,
    "xlm_roberta",
    "XLMRoberta",
    padding_offset_positions=True,
)
ELECTRA = _family("ELECTRA", ElectraModel, ElectraEncoder, ElectraLayer, "electra", "Electra", pooler_output=False)
DISTILBERT = _family(
    "DistilBERT",
    DistilBertModel,
    DistilBertEncoder,
    DistilBertLayer,
    "distilbert",
    None,  # no per-module exact calls: exact mode is transformers' whole forward
    pooler_output=False,
    encoder_attr="transformer",
    act_field="activation",
    token_types=False,
    whole_model_exact=True,
    probe=(
        ("word_embeddings", "position_embeddings", "LayerNorm", "dropout"),
        "transformer.layer",
        (
            "attention.q_lin",
            "attention.k_lin",
            "attention.v_lin",
            "attention.out_lin",
            "attention.dropout",
            "sa_layer_norm",
            "ffn.lin1",
            "ffn.lin2",
            "ffn.activation",
            "ffn.dropout",
            "output_layer_norm",
        ),
    ),
)
dropin.register_fast_types(*(t for fam, _ in FAMILIES.values() for t in (fam.fast_layer, fam.fast_encoder)))
_NAMES = [cls.__name__ for cls in FAMILIES]
SUPPORTED = "transformers." + ", ".join(_NAMES[:-1]) + " or " + _NAMES[-1]  # for messages


def family_of(module) -> Optional[Family]:
    """The family of a transformers base model bert_fast converts (exactly that class, or ours)."""
    if isinstance(module, FastModel):
        return module.bert_fast_family
    entry = FAMILIES.get(type(module))
    return entry[0] if entry else None


class _ZeroTable:
    """A one-row zero embedding table (DistilBERT has no token types): adding zero changes nothing,
    and it never gets a gradient."""

    def __init__(self, like: torch.Tensor):
        self.weight = like.new_zeros((1, like.shape[1]))

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)


def _no_token_types(emb):
    """DistilBERT's embeddings under BERT's names, with a zero token-type table."""
    return _Namespace(
        word_embeddings=emb.word_embeddings,
        position_embeddings=emb.position_embeddings,
        token_type_embeddings=_ZeroTable(emb.word_embeddings.weight),
        LayerNorm=emb.LayerNorm,
        dropout=emb.dropout,
    )


def to_fast(module, padded: bool = False):
    """Turn a live transformers BertModel, RobertaModel, XLMRobertaModel or ElectraModel into
    bert_fast's twin class, in place, sharing every parameter. When the installed transformers
    builds a model bert_fast does not recognise, the module is left as it is (transformers' own
    forward) with a warning naming the version and the tested range."""
    fam = family_of(module)
    if fam is None:
        raise TypeError(f"can only convert {SUPPORTED}, got {type(module).__name__}")
    if not isinstance(module, FastModel):
        check_config(module.config, fam)
        reason = compat.incompatibility(module, fam.module, fam.prefix, fam.probe)
        if reason:
            compat.warn_fallback(reason)
            return module
        module.__class__ = FAMILIES[fam.hf_model][1]
    elif module.bert_fast_fallback:
        return module
    return module.setup_fast(padded)


to_fast_bert = to_fast  # the heads' name for it (heads.py)
