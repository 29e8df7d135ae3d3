"""bert_fast.optimize(model): put the fast encoder into an existing transformers model, in place."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from bert_fast.model import int8 as int8_mod
from bert_fast.model import int8_speed, precision
from bert_fast.model.modeling import FAMILIES, SUPPORTED, FastModel, check_config, family_of, to_fast


def _found_models(model: torch.nn.Module) -> list:
    """Names of the transformers models inside ``model`` (for the error when none is supported)."""
    names = []
    for m in model.modules():
        t = type(m)
        if t.__module__.startswith("transformers.") and hasattr(m, "config") and hasattr(m, "base_model_prefix"):
            name = f"{t.__name__} (model_type {getattr(m.config, 'model_type', '?')!r})"
            if name not in names:
                names.append(name)
    return names


def optimize(
    model: torch.nn.Module,
    padded: bool = False,
    freeze: bool = False,
    dtype=None,
    int8: bool = False,
    calibration=None,
    tokenizer=None,
    min_cosine: float = int8_mod.DEFAULT_MIN_COSINE,
) -> torch.nn.Module:
    """Convert every transformers BertModel, RobertaModel, XLMRobertaModel, ElectraModel and
    DistilBertModel inside ``model`` to bert_fast's twin class, in place.

    Works on such a base model itself, on any of its head classes (BertFor*, RobertaFor*,
    XLMRobertaFor*, ElectraForPreTraining / ElectraForMaskedLM / ..., DistilBertFor*), and on models that contain
    one (a sentence-transformers SentenceTransformer, a peft model). Parameters are shared, not
    copied: the model keeps its state dict, optimizer state and device; only the encoder's forward
    changes. Returns ``model``. Raises TypeError when there is no supported encoder inside (naming
    what was found), ValueError/NotImplementedError for
    configurations bert_fast does not implement (before anything is converted). When the installed
    transformers builds a model that bert_fast does not recognise (bert_fast/model/compat.py), the
    model keeps transformers' own forward, with a warning naming the version and the tested range.

    ``freeze=True`` also packs the encoders' linear weights for CPU inference
    (``freeze()``: faster no-grad eval forwards on the CPU, one more copy of those
    weights in memory; freeze again after writing weights through ``.data``).

    ``dtype`` (``torch.bfloat16`` / ``"bf16"`` or ``torch.float32``) converts the whole ``model`` to
    that dtype first (``model.to(dtype)``, which is also what ``model.to(torch.bfloat16)`` does on
    its own: every GEMM and attention in bf16, LayerNorm statistics and softmax in fp32). On the CPU,
    bf16 is refused where the CPU has no bf16 units (or oneDNN may not use them: ONEDNN_MAX_CPU_ISA) and
    fp16 always (both would be slower than fp32).

    ``int8=True`` runs the encoder GEMMs in int8 for no-grad CPU inference (bert_fast/model/int8.py:
    per-row activations, per-channel weights), only after checking accuracy: the mean-pooled outputs
    of ``calibration`` (a tokenizer's batch, or a list of sentences tokenized with ``tokenizer`` /
    the model's own tokenizer; default: the shipped encode sentences) must keep min cosine >=
    ``min_cosine`` (0.99) to the fp32 model, else ``int8.Int8AccuracyError`` names the cosine and
    nothing is quantized. Before that, int8 GEMMs are timed against fp32 ones on this CPU (once per
    process, bert_fast/model/int8_speed.py): where int8 is not faster (CPUs without AVX-512 VNNI or
    AMX-INT8), ``int8_speed.Int8SpeedError`` names both measured rates and nothing is changed.
    """
    dtype = precision.parse_dtype(dtype)
    targets = [m for m in model.modules() if type(m) in FAMILIES or isinstance(m, FastModel)]
    if not targets:
        found = _found_models(model)
        raise TypeError(
            f"{type(model).__name__} contains no {SUPPORTED} to optimize"
            + (f"; found {', '.join(found)}, which bert_fast does not support" if found else "")
        )
    for m in targets:  # validate all first: never leave a model half converted
        check_config(m.config, family_of(m))
        if (freeze or int8) and family_of(m).whole_model_exact:
            what = "freeze=True" if freeze else "int8=True"
            raise NotImplementedError(f"{what} is not implemented for {type(m).__name__}")
        if dtype is not None:
            precision.check_requested(dtype, next(m.parameters()).device)
    batch = None
    if int8:
        if dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"int8=True runs beside float32 or bfloat16 activations, not {dtype}")
        int8_speed.require_faster()  # measured before calibrating: never a silent slow path
        batch = _calibration_batch(model, calibration, tokenizer)
        # the fp32 answers, before any dtype change: the bound is to the model as the user had it in fp32
        references = {id(m): int8_mod.reference_pooled(m, batch) for m in targets}
    if dtype is not None:
        model.to(dtype)
    converted = []
    for m in targets:
        ref = references[id(m)] if int8 else None
        m = to_fast(m, padded=padded)
        if isinstance(m, FastModel):  # not after a warned fallback (compat.py)
            converted.append((m, ref))
            if freeze:
                m.freeze()
    for m, ref in converted if int8 else ():
        int8_mod.quantize(m, batch, min_cosine=min_cosine, reference=ref)
    return model


def _calibration_batch(model, calibration, tokenizer) -> dict:
    """The calibration inputs: a tokenizer's batch as given, else sentences (default: the shipped
    encode sentences) tokenized by ``tokenizer``, the model's own (a SentenceTransformer's), or
    the tokenizer saved beside a local checkpoint."""
    if isinstance(calibration, Mapping):
        return {k: v for k, v in calibration.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        path = getattr(getattr(model, "config", None), "name_or_path", "") or ""
        if path and os.path.isdir(path):
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer is None:
        raise ValueError(
            "int8=True checks accuracy on calibration sentences and needs a tokenizer for them: pass "
            "calibration=tokenizer(sentences, padding=True, return_tensors='pt') or tokenizer=..."
        )
    if isinstance(calibration, str):
        calibration = [calibration]
    return int8_mod.calibration_batch(tokenizer, calibration)
