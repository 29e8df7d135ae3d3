"""Every touch point of bert_fast with transformers, peft, sentence-transformers, accelerate and FSDP2.

Why one module: those libraries change every few weeks (transformers 5.24 changed the signature of a
private method bert_fast called, and every unfused forward crashed with a TypeError). Everything of
theirs that bert_fast relies on beyond their documented public API lives here, with the reason it is
needed; each use has a test in tests/dropin/test_compat.py. Outside this module bert_fast uses only public
names of those libraries, and ``grep`` proves it (tests/dropin/test_compat.py::test_no_private_use_outside_compat).

What bert_fast relies on, and the versions each form was tested on (CI runs the newest releases
that resolve, and the floor of setup.py; the README's "tested with" line names the exact versions):

transformers (floor and tested range: bert_fast/versions.py; tested 4.41.2 ... 5.24.0)
  * Module tree of BertModel (modeling_bert), and of RobertaModel, XLMRobertaModel and ElectraModel
    (the same names; ElectraModel adds embeddings_project): embeddings.{word,position,token_type}_embeddings,
    LayerNorm, dropout; encoder.layer[i].attention.self.{query,key,value,dropout},
    attention.output.{dense,LayerNorm,dropout}, intermediate.{dense,intermediate_act_fn},
    output.{dense,LayerNorm,dropout}; pooler. Same names and classes in every tested version
    (4.x also has BertSdpaSelfAttention). Checked per model by ``probe_model`` before conversion.
    RoBERTa's position rule (padding_idx + cumsum over non-pad ids; padding_idx + 1 ... from
    inputs_embeds) is the same in 4.41.2 and 5.24.0 and is reproduced in modeling.py, not called.
  * Subclassing by class swap: bert_fast.BertLayer / BertEncoder subclass transformers' BertLayer /
    BertEncoder and are never constructed (``obj.__class__ = ...``), so their constructor
    signatures (BertLayer(config) in 4.41, BertLayer(config, layer_idx=None) in 5.x) do not matter.
    BertModel.__init__(config, add_pooling_layer=True): the same in every tested version.
  * Calls into transformers' own modules for pieces that run unfused (exact mode):
    BertAttention(h, mask), BertSelfAttention(h, attention_mask=mask), BertSelfOutput(ctx, h),
    BertIntermediate(h), BertOutput(f, h1), BertLayer(h, mask), BertEncoder(h, attention_mask=mask).
    Tuples in 4.x, tensors or tuples in 5.x. Their keyword ``**kwargs`` exist from 5.0
    (``accepts_var_kwargs``). Checked by ``probe_signatures``, per family (Roberta*, XLMRoberta*,
    Electra* take the same calls: tests/model/test_families.py).
  * The attention mask those modules take, built by bert_fast itself (``attention_mask_for_modules``):
    eager and sdpa take an additive float mask broadcastable to [B, heads, S, S] (4.41: eager
    [B,1,1,S] from get_extended_attention_mask, sdpa [B,1,S,S]; 5.x: [B,1,S,S] float or bool from
    masking_utils); flash_attention_* take the 2-D [B, S] padding mask (5.x). Which one is in use is
    ``config._attn_implementation`` (private: there is no public getter in 4.41-5.24), read by
    ``attention_implementation``. 3-D and 4-D masks: what transformers makes of each form is probed
    per model class and attention (``mask_form_meaning``): 5.x takes any 4-D mask as already
    prepared, so its eager attention adds a bool one to the scores as 0/1 (pads attended) while
    sdpa masks with it; 4.41's DistilBERT reads an additive 4-D mask inverted; 5.x refuses the 3-D
    form, 4.41's BertModel 4-D ones. Forms read otherwise are refused (``check_mask_meaning``).
  * The return_dict=False tuple: 4.x's BertModel keeps a None pooler_output in it (its heads read
    the rest at [2:]), 5.x drops Nones (``tuple_keeps_empty_pooler``).
  * output_attentions=True runs exact mode with every layer's self-attention through transformers'
    module, on an eager model only (``answers_output_attentions``): BertSelfAttention and
    BertAttention return (output, probabilities [B, heads, S, S]) when called with
    output_attentions=True in 4.x and always in 5.x (``probability_keywords``,
    ``attention_probabilities``); 5.x's BertModel also returns an empty ``cross_attentions`` then
    (``returns_cross_attentions``, from the private ``_can_record_outputs``).
  * 5.x's output capture (``@capture_outputs``) finds what to record in the private registry
    ``modeling_utils._CAN_RECORD_REGISTRY`` that only ``PreTrainedModel.__init__`` fills; bert_fast's
    model classes are entered when they are defined (``register_output_recording``: a dict keyed on
    str(cls) in 4.56-5.17, a dict subclass taking the model in 5.2x, absent before 4.56).
  * ``config.position_embedding_type``: honoured by 4.x (relative_key adds distance embeddings to
    the self-attention and drops absolute positions), ignored by 5.x (absolute positions, the same
    weights); which one is probed, not read from the version (``reads_position_embedding_type``).
  * GradientCheckpointingLayer (transformers.modeling_layers, 4.52+): BertLayer.__call__ checkpoints
    itself when gradient_checkpointing_enable() is on; in older versions the encoder loop did it,
    which our encoder replaces (``layer_checkpoints_itself``).
  * Hooks transformers installs itself that the fused forward reproduces, recognised by function
    name and module: ``output_capturing_hook`` (5.x output collection) and
    ``make_inputs_require_grads`` (enable_input_require_grads, used by PEFT and gradient
    checkpointing) (``is_understood_hook``, ``wants_input_grads``).
  * Keywords transformers' heads and Trainer pass down to BertModel.forward (TransformersKwargs in
    5.x): num_items_in_batch (Trainer, 4.46+), output_hidden_states as a bool or (5.2x) an index or
    list of indices, cache / past_key_values (renamed in 5.24), use_cache (ignored by encoders).
    How a list of indices selects hidden states is probed (``hidden_states_selection``): 5.24
    indexes the num_layers + 1 states (embeddings first; negative indices count from the end; an
    int is an index); 5.17 indexed the layer outputs alone (num_layers entries, no embeddings;
    literal membership, so a negative index selects nothing; an int is a flag); 4.x reads a list
    as a truthy flag, and so does bert_fast there (the differential fuzzer found it taking 5.24's
    meaning instead).
  * activations.ACT2FN (public), modeling_outputs (public), PreTrainedModel.from_pretrained /
    save_pretrained (public).
  * Building a BertModel with a chosen attention implementation for the benchmark
    (``hf_bert_model``): ``attn_implementation=`` of from_config / config (public in 4.41+), and
    ``config._attn_implementation`` to check what was built.

peft (tested 0.13.2 ... 0.21.2)
  * peft.tuners.lora.layer.Linear (``lora_linear_class``), read through its public attributes:
    base_layer, lora_A, lora_B, lora_dropout, scaling, active_adapters, merged, disable_adapters,
    use_dora (0.9+), lora_variant (0.16+, absent before). Anything else (DoRA, variants, other
    tuners) runs through peft's own forward.

sentence-transformers (tested 3.x ... 6.2.0)
  * Only public API: SentenceTransformer(path), .encode(), .fit() / SentenceTransformerTrainer;
    optimize() finds the BertModel inside by walking modules(), nothing of theirs is called.

accelerate: not imported by bert_fast (transformers.Trainer needs it; tests exercise it).

torch.distributed FSDP2 (torch 2.6+): fully_shard swaps a module's class for a dynamic subclass
(``FSDP<Name>`` deriving from FSDPModule and the original class) and registers forward hooks of
its own on it. ``base_class`` maps the subclass back, and ``is_understood_hook`` accepts FSDP's
own hooks (they fire anyway: layers are called as modules), so FSDP2-wrapped layers stay fused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from typing import TYPE_CHECKING, Callable, Optional

from bert_fast.versions import CompatibilityError, describe

if TYPE_CHECKING:
    import torch
    from torch import nn

# torch and transformers are imported inside the functions: ``import bert_fast`` runs
# check_transformers_floor() and must stay light (``bert-fast --help`` imports neither).


# ----------------------------------------------------------------------------- attention masks
def attention_implementation(config) -> str:
    """The attention implementation transformers' modules of ``config`` run ("eager", "sdpa",
    "flash_attention_2", ...). Private attribute: transformers (4.41-5.24) has no public getter."""
    impl = getattr(config, "_attn_implementation", None)
    return impl or "eager"


def answers_output_attentions(config) -> bool:
    """Whether transformers' modules of ``config`` return attention probabilities: its eager
    attention does (4.41-5.24); sdpa and flash_attention_* do not (4.x's sdpa modules fall back to
    eager with a warning, 5.24's BertModel fails on them with an IndexError)."""
    return attention_implementation(config) == "eager"


def probability_keywords(forward: Callable) -> dict:
    """The keywords under which transformers' BertSelfAttention / BertAttention ``forward`` (and
    the Roberta*, XLMRoberta*, Electra* twins) returns its attention probabilities: 4.x returns
    (output, probabilities) only when called with ``output_attentions=True``; 5.x returns
    (output, weights) always, weights being the probabilities of the eager attention."""
    try:
        names = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"output_attentions": True} if "output_attentions" in names else {}


def attention_probabilities(out, module_name: str):
    """The attention probabilities in the output of transformers' self-attention or attention
    module (the second element of its tuple, [B, heads, S, S]), or a CompatibilityError naming
    ``module_name`` where the module returned none (not transformers' eager attention)."""
    import torch

    probs = out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
    if not isinstance(probs, torch.Tensor) or probs.dim() != 4:
        raise CompatibilityError(
            f"output_attentions=True: {module_name} returned no attention probabilities ({describe()}); "
            "bert_fast reads them from transformers' eager attention modules (attn_implementation='eager')"
        )
    return probs


@functools.lru_cache(maxsize=None)
def returns_cross_attentions(model_class: type) -> bool:
    """Whether transformers' ``model_class`` (BertModel, RobertaModel, ...) returns
    ``cross_attentions`` beside ``attentions`` when asked for output_attentions: 5.x's output
    capture does (an empty tuple for an encoder) for every key of the private
    ``_can_record_outputs``; 4.x leaves it None."""
    return "cross_attentions" in (getattr(model_class, "_can_record_outputs", None) or {})


def register_output_recording(model_class: type) -> None:
    """Make transformers' output capture (5.x, 4.56+) work for ``model_class`` (a bert_fast model
    class) before any instance of it has been constructed.

    transformers' ``@capture_outputs`` forward looks up what to record (attentions, hidden states)
    in a private registry keyed by the instance's class, ``_CAN_RECORD_REGISTRY`` (modeling_utils),
    which only ``PreTrainedModel.__init__`` fills. ``optimize()`` swaps the class of a live model
    without constructing it, so without this the forwards that run transformers' own code
    (DistilBERT's output_attentions, a warned fallback) returned attentions=None and
    hidden_states=None until some instance of the class had been constructed in the process.
    4.56-5.17 key a plain dict on ``str(cls)``; 5.2x wraps it in a dict whose ``__setitem__``
    takes the model (a bare, unconstructed instance serves); before 4.56 there is no registry
    (outputs are passed down as keywords) and nothing is needed."""
    try:
        from transformers import modeling_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    registry = getattr(modeling_utils, "_CAN_RECORD_REGISTRY", None)
    if registry is None:
        return
    value = getattr(model_class, "_can_record_outputs", None)
    if type(registry) is dict:
        registry[str(model_class)] = value
    else:
        registry[object.__new__(model_class)] = value


@functools.lru_cache(maxsize=None)
def hidden_states_selection() -> str:
    """How the installed transformers' BertModel reads a list ``output_hidden_states``: a feature
    probe (a 1-layer model of width 8 on the CPU, asked for ``[0]``), not a version compare.

    "states": (5.2x, 5.24 tested) one entry per hidden state, embeddings + one per layer, None
              where not selected; indices over those num_layers + 1 states, negative from the end,
              an int is an index.
    "layers": (5.17 tested) one entry per layer output, no embeddings entry; an index is kept
              when it is literally in the list (a negative one selects nothing); an int, not being
              a list, is a flag.
    "flag":   (4.x) a list is a truthy flag: every state.
    A probe that fails (a transformers that refuses lists, or anything else) answers "states"."""
    import torch
    import transformers

    try:
        config = transformers.BertConfig(
            vocab_size=4,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            intermediate_size=8,
            max_position_embeddings=4,
            type_vocab_size=1,
        )
        set_attention_implementation(config, "eager")
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():  # the caller's RNG untouched
            model = transformers.BertModel(config, add_pooling_layer=False).eval()
            out = model(torch.zeros((1, 2), dtype=torch.long), output_hidden_states=[0], return_dict=True)
        got = [h is None for h in out.hidden_states]
    except Exception:  # noqa: BLE001 - any failure: the documented 5.24 meaning
        return "states"
    if got == [False, True]:
        return "states"
    if got == [False]:
        return "layers"
    if got == [False, False]:
        return "flag"
    return "states"


@functools.lru_cache(maxsize=None)
def reads_position_embedding_type(layer_class: type, config_class: type) -> bool:
    """Whether the installed transformers honours ``config.position_embedding_type``: a feature
    probe, not a version compare. transformers 4.x (4.41.2 tested) builds relative-position
    distance embeddings into the self-attention of a layer whose config says ``relative_key`` (and
    its embeddings then add no absolute positions); 5.x (5.0-5.24 tested) no longer reads the
    field and runs absolute positions with the same weights. Probed by building ``layer_class``
    (transformers' BertLayer, RobertaLayer, ...) from ``config_class()`` on the meta device with
    'relative_key' and with 'absolute': honoured when their parameters differ."""
    import torch

    def parameter_names(kind: str):
        config = config_class()
        config.position_embedding_type = kind
        with torch.device("meta"):
            return {name for name, _ in layer_class(config).named_parameters()}

    return parameter_names("relative_key") != parameter_names("absolute")


def set_attention_implementation(config, name: str) -> None:
    """Select transformers' attention implementation on a config before a model is built from it
    (the same private attribute; the public route, ``attn_implementation=`` of from_pretrained /
    from_config, needs a model class)."""
    config._attn_implementation = name


def attention_mask_for_modules(keep: torch.Tensor, dtype: torch.dtype, config):
    """The mask transformers' own attention modules take, built from bert_fast's [B, S] bool
    key-padding mask (True = real token), for the attention implementation ``config`` selects.

    eager / sdpa: additive float [B, 1, 1, S] in ``dtype`` (0 = attend, finfo.min = pad), which
    both add to the scores and which F.scaled_dot_product_attention broadcasts; it is the form of
    4.x's get_extended_attention_mask and gives the same probabilities as 5.x's [B, 1, S, S]
    masks at every real query. flash_attention_*: the 2-D padding mask (None without pads)."""
    import torch

    impl = attention_implementation(config)
    if impl in ("eager", "sdpa") or impl.endswith("|sdpa") or impl.endswith("|eager"):
        additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
        additive.masked_fill_(~keep, torch.finfo(dtype).min)
        return additive[:, None, None, :]
    if impl.startswith("flash_attention"):
        return None if bool(keep.all()) else keep.to(torch.long)
    raise CompatibilityError(
        f"bert_fast runs unfused pieces through transformers' attention modules, but cannot build the "
        f"attention mask of attn_implementation={impl!r} ({describe()}): use 'sdpa' or 'eager' for a "
        "model with hooks or custom modules, or remove them so that the model runs fused"
    )


def mask_form(mask) -> Optional[str]:
    """ "3d", "4d_bool" or "4d_additive" for a 3-D / 4-D attention_mask tensor, else None."""
    import torch

    if not isinstance(mask, torch.Tensor) or mask.dim() not in (3, 4):
        return None
    if mask.dim() == 3:
        return "3d"
    return "4d_bool" if mask.dtype == torch.bool else "4d_additive"


@functools.lru_cache(maxsize=None)
def mask_form_meaning(model_class: type, impl: str, form: str) -> str:
    """What the installed transformers' ``model_class`` (BertModel, DistilBertModel, ...) with
    attention implementation ``impl`` makes of a key-padding attention_mask of ``form``
    (``mask_form``): "mask" (the answer of the 2-D mask with the same pads), "other" (another
    answer: 5.x takes any 4-D mask as already prepared and its eager attention adds a bool one to
    the scores as 0/1; 4.41's DistilBERT reads an additive one inverted) or "error" (5.x refuses
    the 3-D form inside its mask code; 4.41's BertModel refuses 4-D masks). A feature probe (a
    1-layer model of width 8 on the CPU, one right pad), not a version compare."""
    import torch

    small = dict(vocab_size=8, max_position_embeddings=8, pad_token_id=1)
    if model_class.config_class.model_type == "distilbert":
        small.update(dim=8, n_layers=1, n_heads=1, hidden_dim=8)
    else:
        small.update(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
        small.update(type_vocab_size=1, embedding_size=8)
    config = model_class.config_class(**small)
    set_attention_implementation(config, impl)
    keep = torch.tensor([[True, True, False]])
    given = {
        "3d": keep[:, None, :].expand(1, 3, 3).long(),
        "4d_bool": keep[:, None, None, :],
        "4d_additive": torch.zeros(1, 1, 1, 3).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min),
    }[form]
    try:  # its own RNG stream: a forward must not move the caller's (dropout masks, sampling)
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
            torch.manual_seed(0)
            model = model_class(config).eval()
            ids = torch.tensor([[3, 4, 1]])
            two = model(ids, attention_mask=keep.long(), return_dict=True)[0][0, :2]
            other = model(ids, attention_mask=given, return_dict=True)[0][0, :2]
    except Exception:  # noqa: BLE001 - transformers refuses this form
        return "error"
    return "mask" if torch.allclose(two, other, atol=1e-5) else "other"


def check_mask_meaning(mask, config, model_class: type) -> None:
    """Refuse a 3-D / 4-D attention_mask that transformers' ``model_class`` reads otherwise than as
    the key-padding mask bert_fast takes it for (``mask_form_meaning``): bert_fast would answer
    differently. Forms transformers answers as a key-padding mask, or refuses, pass."""
    form = mask_form(mask)
    if form is None:
        return
    impl = attention_implementation(config)
    if mask_form_meaning(model_class, impl, form) == "other":
        what = {"3d": "a 3-D", "4d_bool": "a 4-D bool", "4d_additive": "a 4-D additive"}[form]
        raise ValueError(
            f"{what} attention_mask on a {model_class.__name__} with attn_implementation={impl!r}: {describe()} "
            "reads such a mask otherwise than the 2-D mask of the same pads (5.x's eager attention adds a "
            "4-D bool mask to the scores as 0/1; 4.41's DistilBERT reads an additive one inverted), and "
            "bert_fast refuses it rather than answer differently; pass the 2-D [batch, seq] mask"
        )


@functools.lru_cache(maxsize=None)
def tuple_keeps_empty_pooler() -> bool:
    """Whether the installed transformers' BertModel (and RobertaModel, XLMRobertaModel) keeps a
    None pooler_output in its return_dict=False tuple: 4.x returns (sequence_output, pooled_output)
    + the rest, None included, and its heads built without a pooler read the rest at [2:]; 5.x
    returns ModelOutput.to_tuple(), which drops the Nones. A feature probe."""
    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=4, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8,
        max_position_embeddings=4, type_vocab_size=1,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():  # the caller's RNG untouched
        model = transformers.BertModel(config, add_pooling_layer=False).eval()
        out = model(torch.zeros((1, 2), dtype=torch.long), return_dict=False)
    return len(out) >= 2 and out[1] is None


# ----------------------------------------------------------------------------- hooks and checkpoints
_TRANSFORMERS_HOOKS = ("output_capturing_hook", "make_inputs_require_grads")


def _is_fsdp_hook(fn) -> bool:
    owner = getattr(fn, "__self__", None)
    mod = type(owner).__module__ if owner is not None else getattr(fn, "__module__", "") or ""
    return mod.startswith("torch.distributed.fsdp") or mod.startswith("torch.distributed._composable.fsdp")


def is_understood_hook(fn) -> bool:
    """A hook whose effect the fused forward reproduces or that fires anyway: transformers'
    output-capturing and input-require-grads hooks, and FSDP2's per-module hooks."""
    if getattr(fn, "__name__", "") in _TRANSFORMERS_HOOKS and (getattr(fn, "__module__", "") or "").startswith(
        "transformers."
    ):
        return True
    return _is_fsdp_hook(fn)


def wants_input_grads(word_embeddings: nn.Module) -> bool:
    """Whether transformers' enable_input_require_grads() hook is on the word embeddings."""
    return any(
        getattr(f, "__name__", "") == "make_inputs_require_grads" for f in word_embeddings._forward_hooks.values()
    )


@functools.lru_cache(maxsize=None)
def _gradient_checkpointing_layer():
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers < 4.52
        return None
    return GradientCheckpointingLayer


@functools.lru_cache(maxsize=None)
def layer_checkpoints_itself(layer_class: Optional[type] = None) -> bool:
    """Whether transformers' BertLayer.__call__ (or ``layer_class``'s: RobertaLayer, ...) applies
    gradient checkpointing itself (4.52+)."""
    if layer_class is None:
        from transformers.models.bert import modeling_bert

        layer_class = modeling_bert.BertLayer
    gcl = _gradient_checkpointing_layer()
    return gcl is not None and issubclass(layer_class, gcl)


# ----------------------------------------------------------------------------- FSDP2
def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def base_class(t: type) -> type:
    """The class a module had before FSDP2's fully_shard swapped it for its dynamic subclass
    (``FSDP<Name>(FSDPModule, <Name>)``); ``t`` itself for any other class. Called only for
    modules of a class the fused path does not know, so no cache is needed."""
    fsdp = _fsdp_module_class()
    if fsdp is None or t is fsdp or not issubclass(t, fsdp):
        return t
    for base in t.__bases__:
        if base is not fsdp and not issubclass(base, fsdp):
            return base
    return t


# ----------------------------------------------------------------------------- peft
@functools.lru_cache(maxsize=None)
def lora_linear_class():
    """peft's LoRA Linear layer class, or None (peft absent or its layout changed: LoRA layers are
    then "not plain" and run through peft's forward)."""
    try:
        from peft.tuners.lora.layer import Linear
    except Exception:  # noqa: BLE001 - peft absent or broken: LoRA runs unfused
        return None
    needed = ("update_layer", "merge", "unmerge")
    return Linear if all(hasattr(Linear, n) for n in needed) else None


def lora_variant_or_dora(m: nn.Module, adapter: str) -> bool:
    """Whether adapter ``adapter`` of a peft LoRA Linear is DoRA or another variant (peft 0.16+
    keeps variants in ``lora_variant``; 0.9-0.15 has only ``use_dora``)."""
    return adapter in getattr(m, "lora_variant", {}) or bool(getattr(m, "use_dora", {}).get(adapter, False))


# ----------------------------------------------------------------------------- transformers' models
def hf_bert_model(config, attn: str, device=None):
    """transformers.BertModel built from ``config`` with attention implementation ``attn``."""
    import copy

    import torch
    import transformers

    cfg = copy.deepcopy(config)
    set_attention_implementation(cfg, attn)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = transformers.BertModel(cfg)
    built = attention_implementation(model.config)
    if built != attn:
        raise CompatibilityError(f"transformers built attention {built!r} instead of {attn!r} ({describe()})")
    return model


def accepts_var_kwargs(fn: Callable) -> bool:
    """Whether ``fn`` takes ``**kwargs`` (transformers' modules do from 5.0; 4.x lists its keywords)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# What the fused forward reads from each module of a transformers BertModel (probe_model).
_EMBEDDING_PARTS = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout")
_LAYER_PARTS = (
    "attention.self.query",
    "attention.self.key",
    "attention.self.value",
    "attention.self.dropout",
    "attention.output.dense",
    "attention.output.LayerNorm",
    "attention.output.dropout",
    "intermediate.dense",
    "intermediate.intermediate_act_fn",
    "output.dense",
    "output.LayerNorm",
    "output.dropout",
)

# The calls exact mode makes into transformers' modules: (class name after the family's prefix,
# positional args, keywords). The same for every family bert_fast runs (Bert, Roberta, XLMRoberta,
# Electra: "Copied from" BERT's modules in 4.x, generated from them in 5.x).
_EXACT_CALLS = (
    ("Attention", 2, ()),
    ("SelfAttention", 1, ("attention_mask",)),
    ("SelfOutput", 2, ()),
    ("Intermediate", 1, ()),
    ("Output", 2, ()),
    ("Layer", 2, ()),
    ("Encoder", 1, ("attention_mask",)),
)


def _get(module: nn.Module, dotted: str):
    for name in dotted.split("."):
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def probe_model(model: nn.Module, parts: Optional[tuple] = None) -> Optional[str]:
    """None when ``model`` (a transformers BertModel) has every piece the fused forward reads, else
    what is missing. ``parts``: (embedding parts, layers path, layer parts) of a family whose names
    differ from BERT's (DistilBERT)."""
    embedding_parts, layers_path, layer_parts = parts or (_EMBEDDING_PARTS, "encoder.layer", _LAYER_PARTS)
    missing = [f"embeddings.{p}" for p in embedding_parts if _get(model, f"embeddings.{p}") is None]
    layers = _get(model, layers_path)
    if layers is None:
        missing.append(layers_path)
    else:
        for i, layer in enumerate(layers):
            missing += [f"{layers_path}.{i}.{p}" for p in layer_parts if _get(layer, p) is None]
            if missing:
                break
    return ("missing " + ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")) if missing else None


@functools.lru_cache(maxsize=None)
def probe_signatures(family: str = "bert", prefix: str = "Bert") -> Optional[str]:
    """None when transformers' modules (of transformers.models.<family>, class names starting with
    ``prefix``) take the calls exact mode makes, else which one does not."""
    import importlib

    module = f"transformers.models.{family}.modeling_{family}"
    try:
        modeling = importlib.import_module(module)
    except ImportError as e:
        return f"{module} cannot be imported ({e})"
    for suffix, positional, keywords in _EXACT_CALLS:
        name = prefix + suffix
        cls = getattr(modeling, name, None)
        if cls is None:
            return f"{module}.{name} is gone"
        try:
            inspect.signature(cls.forward).bind(None, *range(positional), **{k: None for k in keywords})
        except TypeError as e:
            return f"{name}.forward no longer takes {positional} positional argument(s) {keywords or ''}: {e}"
    return None


def incompatibility(
    model: nn.Module, family: str = "bert", prefix: Optional[str] = "Bert", parts: Optional[tuple] = None
) -> Optional[str]:
    """Why bert_fast cannot run this transformers BertModel (or RobertaModel, ...: ``family`` and
    ``prefix`` as for ``probe_signatures``; ``parts`` as for ``probe_model``) with the installed
    transformers, or None. ``prefix`` None: the family makes no per-module exact calls (DistilBERT
    runs transformers' whole forward in exact mode), so only the module tree is probed."""
    reason = probe_model(model, parts) or (probe_signatures(family, prefix) if prefix else None)
    if reason is None:
        return None
    return (
        f"bert_fast does not recognise the {type(model).__name__} of {describe()}: {reason}. Please report it "
        "to bert_fast with this message"
    )


def warn_fallback(reason: str) -> None:
    warnings.warn(f"{reason}; the model keeps transformers' own (unfused) forward", RuntimeWarning, stacklevel=3)
