"""bert_fast.optimize(model): put the fast encoder into an existing transformers model, in place."""

from __future__ import annotations

import torch
import transformers

from bert_fast.model.modeling import BertModel, to_fast_bert


def optimize(model: torch.nn.Module, padded: bool = False, freeze: bool = False) -> torch.nn.Module:
    """Convert every transformers.BertModel inside ``model`` to bert_fast.BertModel, in place.

    Works on a BertModel itself, on any BertFor* head, and on models that contain one (a
    sentence-transformers SentenceTransformer, say). Parameters are shared, not copied: the model
    keeps its state dict, optimizer state and device; only the encoder's forward changes. Returns
    ``model``. Raises TypeError when there is no BertModel inside, ValueError/NotImplementedError for
    configurations bert_fast does not implement (before anything is converted). When the installed
    transformers builds a BertModel that bert_fast does not recognise (bert_fast/model/compat.py), the
    model keeps transformers' own forward, with a warning naming the version and the tested range.

    ``freeze=True`` also packs the encoders' linear weights for CPU inference
    (``BertModel.freeze()``: faster no-grad eval forwards on the CPU, one more copy of those
    weights in memory; freeze again after writing weights through ``.data``).
    """
    targets = [m for m in model.modules() if type(m) is transformers.BertModel or isinstance(m, BertModel)]
    if not targets:
        raise TypeError(f"{type(model).__name__} contains no transformers.BertModel to optimize")
    from bert_fast.model.modeling import check_config

    for m in targets:  # validate all first: never leave a model half converted
        check_config(m.config)
    for m in targets:
        m = to_fast_bert(m, padded=padded)
        if freeze and isinstance(m, BertModel):  # not after a warned fallback (compat.py)
            m.freeze()
    return model
