"""bert_fast.optimize(model): put the fast encoder into an existing transformers model, in place."""

from __future__ import annotations

import torch

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


def optimize(model: torch.nn.Module, padded: bool = False, freeze: bool = False) -> torch.nn.Module:
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
    """
    targets = [m for m in model.modules() if type(m) in FAMILIES or isinstance(m, FastModel)]
    if not targets:
        found = _found_models(model)
        raise TypeError(
            f"{type(model).__name__} contains no {SUPPORTED} to optimize"
            + (f"; found {', '.join(found)}, which bert_fast does not support" if found else "")
        )
    for m in targets:  # validate all first: never leave a model half converted
        check_config(m.config, family_of(m))
        if freeze and family_of(m).whole_model_exact:
            raise NotImplementedError(f"freeze=True is not implemented for {type(m).__name__}")
    for m in targets:
        m = to_fast(m, padded=padded)
        if freeze and isinstance(m, FastModel):  # not after a warned fallback (compat.py)
            m.freeze()
    return model
