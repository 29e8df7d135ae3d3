"""Which submodules the fast forward may bypass, checked at every forward.

The fast forward reads the weights of transformers' Linear / LayerNorm / Embedding modules and runs
our fused ops instead of calling those modules. That is only equal to transformers' forward while
every bypassed module is *plain*: exactly the class transformers builds, no forward/backward hooks
of its own or global ones, no parametrization. Anything else (a user hook, a PEFT layer, a
quantized or subclassed Linear, weight norm, a pruning pre-hook) is found here, and the model runs
that piece through the module's own forward (see modeling.py): never a silently different answer.

PEFT LoRA on a Linear is the one customization run natively: the low-rank term goes into the
fused GEMM (``linear_terms``), with peft's semantics (scaling, lora_dropout, several adapters,
disabled or merged adapters).

Cost: one walk over the module tree per forward (~100 modules for MiniLM), a type lookup and four
dict truth tests each; measured in benchmarks/notes/2026-11-24-cpu-path.md ("Drop-in check and LoRA").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.modules.module as _module_globals
import transformers
from torch import nn
from transformers.models.bert import modeling_bert as hf_bert
from transformers.models.distilbert import modeling_distilbert as hf_distilbert
from transformers.models.electra import modeling_electra as hf_electra
from transformers.models.roberta import modeling_roberta as hf_roberta
from transformers.models.xlm_roberta import modeling_xlm_roberta as hf_xlm_roberta

from bert_fast.model import compat

# PEFT's LoRA Linear, run natively when present (None: peft absent or changed, LoRA runs unfused).
LORA_LINEAR = compat.lora_linear_class()


# The families whose modules the fast path runs (modeling.Family): transformers' module, class prefix.
_FAMILY_MODULES = ((hf_bert, "Bert"), (hf_roberta, "Roberta"), (hf_xlm_roberta, "XLMRoberta"), (hf_electra, "Electra"))


def _hf_classes(*suffixes) -> Tuple[type, ...]:
    """transformers' classes <prefix><suffix> of every family, skipping those this version does not have."""
    names = ((m, p + s) for m, p in _FAMILY_MODULES for s in suffixes)
    return tuple(getattr(m, n) for m, n in names if hasattr(m, n))


# Modules whose forward the fast path reproduces (or that it calls itself, like the pooler).
# BertSdpaSelfAttention & co. exist in transformers 4.x only.
_PLAIN_TYPES = frozenset(
    (
        nn.Linear,
        nn.LayerNorm,
        nn.Embedding,
        nn.Dropout,
        nn.ModuleList,
        nn.Tanh,
        *_hf_classes(
            "Embeddings",
            "Encoder",
            "Layer",
            "Attention",
            "SelfAttention",
            "SdpaSelfAttention",
            "FlashAttention2",
            "SelfOutput",
            "Intermediate",
            "Output",
            "Pooler",
        ),
        # DistilBERT's modules (class names across 4.41 ... 5.24)
        *(
            getattr(hf_distilbert, n)
            for n in (
                "Embeddings",
                "Transformer",
                "TransformerBlock",
                "FFN",
                "MultiHeadSelfAttention",
                "DistilBertSdpaAttention",
                "DistilBertFlashAttention2",
                "DistilBertSelfAttention",
            )
            if hasattr(hf_distilbert, n)
        ),
    )
)
_INTERMEDIATE_TYPES = frozenset(_hf_classes("Intermediate"))


# Hooks whose effect the fast forward reproduces, or that fire anyway (compat.is_understood_hook):
#  * output_capturing_hook (transformers 5): installed for good on BertLayer/BertSelfAttention the
#    first time a model is asked for hidden states; inert unless an output collector is active
#    (our forward collects hidden states itself);
#  * make_inputs_require_grads (enable_input_require_grads(), which PEFT and gradient
#    checkpointing install on the word embeddings): the model applies it to its embedding output;
#  * FSDP2's per-layer hooks: layers are called as modules, so they fire on the fused path too.
wants_input_grads = compat.wants_input_grads


def _hook_reason(m: nn.Module) -> Optional[str]:
    if m._forward_pre_hooks and not all(compat.is_understood_hook(f) for f in m._forward_pre_hooks.values()):
        return "forward pre-hook"
    if m._forward_hooks and not all(compat.is_understood_hook(f) for f in m._forward_hooks.values()):
        return "forward hook"
    if m._backward_hooks or m._backward_pre_hooks:
        return "backward hook"
    return None


def global_hooks() -> Optional[str]:
    """A reason when a global module hook is registered (it must fire on every module)."""
    g = _module_globals
    if g._global_forward_pre_hooks or g._global_forward_hooks:
        return "global forward hook"
    if g._global_backward_hooks or g._global_backward_pre_hooks:
        return "global backward hook"
    return None


# ----------------------------------------------------------------------------- LoRA
@dataclass
class LoraTerm:
    """One active adapter on one Linear: y += scaling * B(A(dropout(x)))."""

    a: torch.Tensor  # lora_A weight [r, in]
    b: torch.Tensor  # lora_B weight [out, r]
    scaling: float
    dropout: Optional[nn.Module]  # None when it is the identity (p == 0, eval, nn.Identity)


@dataclass
class LinearTerms:
    """What a (possibly LoRA-wrapped) Linear computes: x W^T + bias + sum of LoRA terms."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    lora: List[LoraTerm]


def _active_dropout(d: nn.Module) -> Optional[nn.Module]:
    if type(d) is nn.Identity or (type(d) is nn.Dropout and (d.p == 0.0 or not d.training)):
        return None
    return d


def _lora_reason(m: nn.Module) -> Optional[str]:
    """None when this peft LoRA Linear can run natively, else why not."""
    if type(m.base_layer) is not nn.Linear or _hook_reason(m.base_layer):
        return "LoRA over a non-plain base layer"
    if m.disable_adapters:
        return "LoRA disabled while merged (peft unmerges in forward)" if m.merged else None
    if m.merged:
        return None
    for name in m.active_adapters:
        if name not in m.lora_A:
            continue
        if compat.lora_variant_or_dora(m, name):
            return f"LoRA variant (DoRA or other) on adapter {name!r}"
        a, b, d = m.lora_A[name], m.lora_B[name], m.lora_dropout[name]
        if type(a) is not nn.Linear or type(b) is not nn.Linear or b.bias is not None or a.bias is not None:
            return f"LoRA adapter {name!r} is not a plain pair of bias-free Linear layers"
        if type(d) not in (nn.Dropout, nn.Identity):
            return f"LoRA adapter {name!r} has a custom dropout module"
        if _hook_reason(a) or _hook_reason(b) or _hook_reason(d):
            return f"hook inside LoRA adapter {name!r}"
    return None


def linear_terms(m: nn.Module) -> LinearTerms:
    """The weights a plain or natively supported LoRA Linear computes with (call only on modules
    that ``find_unfused`` did not report)."""
    if type(m) is nn.Linear:
        return LinearTerms(m.weight, m.bias, [])
    base = m.base_layer
    if m.disable_adapters or m.merged:
        return LinearTerms(base.weight, base.bias, [])
    terms = []
    for name in m.active_adapters:
        if name in m.lora_A:
            terms.append(
                LoraTerm(
                    m.lora_A[name].weight,
                    m.lora_B[name].weight,
                    float(m.scaling[name]),
                    _active_dropout(m.lora_dropout[name]),
                )
            )
    return LinearTerms(base.weight, base.bias, terms)


# ----------------------------------------------------------------------------- the walk
_FAST_TYPES: frozenset = frozenset()  # our class-swapped BertLayer / BertEncoder (set by modeling.py)


def register_fast_types(*types: type) -> None:
    global _FAST_TYPES
    _FAST_TYPES = frozenset(types)


def _module_reason(m: nn.Module, t: type, expected_act: type) -> Optional[str]:
    """Why module ``m`` (of type ``t``) itself, not its children, is not plain, or None.

    Hot path (every module, every forward): parameters are read from ``_parameters`` rather than
    through nn.Module.__getattr__, which costs several times more."""
    if t is LORA_LINEAR:
        return _hook_reason(m) or _lora_reason(m)
    if t not in _PLAIN_TYPES and t not in _FAST_TYPES:
        if hasattr(m, "parametrizations"):
            return "parametrization (" + ", ".join(m.parametrizations.keys()) + ")"
        if t is expected_act:
            return _hook_reason(m)
        t = compat.base_class(t)  # FSDP2's fully_shard subclass of a layer is that layer
        if t not in _PLAIN_TYPES and t not in _FAST_TYPES:
            return f"type {t.__module__}.{t.__qualname__}"
    if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
        reason = _hook_reason(m)
        if reason:
            return reason
    if t is nn.Linear and m._parameters["bias"] is None:
        return "Linear without bias"
    if t is nn.LayerNorm and (m._parameters.get("weight") is None or m._parameters.get("bias") is None):
        return "LayerNorm without affine weight or bias"
    if t in _INTERMEDIATE_TYPES and type(m.intermediate_act_fn) is not expected_act:
        return f"activation {type(m.intermediate_act_fn).__qualname__} instead of {expected_act.__qualname__}"
    return None


def find_unfused(model: nn.Module, expected_act: type) -> Dict[str, str]:
    """{dotted path: reason} of every submodule of ``model`` (a BertModel) that is not plain.

    A natively run LoRA Linear is plain; its children are not walked (``_lora_reason`` checks
    them). Iterative over ``_modules``, with a module's dotted path built only when it is needed
    (it has children, or a reason): named_modules() costs ~3x more."""
    g = global_hooks()
    if g:
        return {"*": g}
    found: Dict[str, str] = {}
    stack = [(None, name, child) for name, child in model._modules.items() if child is not None]
    while stack:
        parent, name, m = stack.pop()
        t = type(m)
        reason = _module_reason(m, t, expected_act)
        children = m._modules
        if reason or (children and t is not LORA_LINEAR):
            path = name if parent is None else f"{parent}.{name}"
            if reason:
                found[path] = reason
            if t is not LORA_LINEAR:
                stack.extend((path, n, c) for n, c in children.items() if c is not None)
    return found


def expected_activation(config, field: str = "hidden_act") -> type:
    """The class transformers builds for config.hidden_act (or DistilBERT's ``activation``; e.g.
    GELUActivation for "gelu")."""
    return type(transformers.activations.ACT2FN[getattr(config, field)])
