"""How one encoder layer's four GEMMs run: the one thing the layer forward (layer.py) leaves open.

A *GEMM set* has four callables, each ``(x, activation=None) -> y``:
    qkv(h)          [.., H] -> [.., 3H]   the fused Q/K/V projection
    out(ctx)        [.., H] -> [.., H]    the attention output projection
    up(h1, act)     [.., H] -> [.., I]    the FFN up-projection, its GELU fused
    down(f)         [.., I] -> [.., H]    the FFN down-projection
Two sets exist:
  * ``ModuleGemms``: the layer's own nn.Linear (or peft LoRA) weights, read at every call and run
    through an op namespace (bert_fast.ops: custom ops with autograd; or direct_ops: the same
    torch implementation without the plumbing, for inference). Training and every default path.
  * ``frozen._FrozenLayer``: oneDNN-prepacked copies made by ``BertModel.freeze()`` (CPU inference).
A new way to run GEMMs (another precision, int8 behind a guard) is one more set, not another copy
of the layer forward.

Also here: the QKV weight concatenation (``fused_qkv``, ``frozen_qkv`` for CUDA-graph capture)
and the LoRA terms added into a base GEMM's output.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F

from bert_fast import ops
from bert_fast.model import dropin
from bert_fast.ops.torch_impl import GELU_APPROXIMATE


def cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` in ``dtype`` (no copy when it already is; None stays None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


# ----------------------------------------------------------------------------- the fused QKV weight
_FROZEN_QKV = "_bert_fast_frozen_qkv"  # attribute set on a BertSelfAttention by frozen_qkv()


def _cat_qkv(self_attn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    parts = (self_attn.query, self_attn.key, self_attn.value)
    return (torch.cat([cast(p.weight, dtype) for p in parts]), torch.cat([cast(p.bias, dtype) for p in parts]))


def fused_qkv(self_attn, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cat(Wq, Wk, Wv) [3H, H] and cat(bq, bk, bv) for one BertSelfAttention, in ``dtype``: built
    from the current weights at every call (no cache can see every write to a weight: see
    modeling.py), except inside ``frozen_qkv``."""
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
        self_attn.__dict__[_FROZEN_QKV] = store.setdefault(i, {})  # not a buffer: never saved
    try:
        yield store
    finally:
        for self_attn in layers:
            self_attn.__dict__.pop(_FROZEN_QKV, None)


# ----------------------------------------------------------------------------- LoRA terms
def _lora_delta(x: torch.Tensor, terms: list, dtype: torch.dtype, o=ops):
    """The LoRA terms of Linear layers as one skinny GEMM pair: returns (u, w_extra) such that
    u @ w_extra^T = sum_j scaling_j * B_j A_j dropout_j(x) for every output row block. ``terms``:
    per output block (the query, key and value rows of the fused QKV weight, or a single Linear),
    (rows, [LoraTerm]).

    u = [A_1 x | A_2 x | ...] is one GEMM for the adapters whose dropout is off (their A's
    concatenated) plus one per adapter with an active dropout (each draws its own mask, as in
    peft); w_extra [sum rows, sum r] holds each adapter's scaled B in its block's rows, zeros
    elsewhere. Returns (None, None) when no term is active."""
    flat = [(i, t) for i, (_, ts) in enumerate(terms) for t in ts]
    if not flat:
        return None, None
    shared = [(i, t) for i, t in flat if t.dropout is None]
    own = [(i, t) for i, t in flat if t.dropout is not None]
    order = shared + own
    us = []
    if shared:
        a = torch.cat([cast(t.a, dtype) for _, t in shared]) if len(shared) > 1 else cast(shared[0][1].a, dtype)
        us.append(o.linear(x, a))
    for _, t in own:
        us.append(o.linear(t.dropout(x), cast(t.a, dtype)))
    u = torch.cat(us, dim=-1) if len(us) > 1 else us[0]
    ranks = [t.a.shape[0] for _, t in order]
    blocks = []
    for i, (rows, _) in enumerate(terms):
        row = [
            (cast(t.b, dtype) * t.scaling) if owner == i else u.new_zeros((rows, r))
            for (owner, t), r in zip(order, ranks)
        ]
        blocks.append(torch.cat(row, dim=1))
    return u, torch.cat(blocks, dim=0)


def _plus_lora(y: torch.Tensor, u: torch.Tensor, w_extra: torch.Tensor, activation) -> torch.Tensor:
    """act(y + u @ w_extra^T): the skinny GEMM accumulates into the base GEMM's output (addmm,
    beta = 1), so a frozen base weight never gets a weight gradient (folding the LoRA columns into
    the base GEMM's K would make the whole concatenated weight require one)."""
    n = y.shape[-1]
    z = torch.addmm(y.reshape(-1, n), u.reshape(-1, u.shape[-1]).to(y.dtype), w_extra.t().to(y.dtype)).view(y.shape)
    return z if activation is None else F.gelu(z, approximate=GELU_APPROXIMATE[activation])


def linear(x: torch.Tensor, lin: dropin.LinearTerms, dtype: torch.dtype, activation=None, o=ops) -> torch.Tensor:
    """act(x W^T + b [+ LoRA]); with LoRA the activation follows the low-rank term."""
    w, b = cast(lin.weight, dtype), cast(lin.bias, dtype)
    u, w_extra = _lora_delta(x, [(w.shape[0], lin.lora)], dtype, o)
    if u is None:
        return o.linear(x, w, b, activation=activation)
    return _plus_lora(o.linear(x, w, b), u, w_extra, activation)


# ----------------------------------------------------------------------------- the module weights
class ModuleGemms:
    """The four GEMMs of a transformers BertLayer on its own Linear modules (plain or natively run
    peft LoRA), in ``dtype``, through op namespace ``o`` (bert_fast.ops or direct_ops)."""

    __slots__ = ("layer", "dtype", "o")

    def __init__(self, layer, dtype: torch.dtype, o=ops):
        self.layer, self.dtype, self.o = layer, dtype, o

    def qkv(self, h: torch.Tensor) -> torch.Tensor:
        """The fused QKV projection [.., 3H], LoRA terms of query/key/value included."""
        sa = self.layer.attention.self
        wqkv, bqkv = fused_qkv(sa, self.dtype)
        parts = [dropin.linear_terms(m) for m in (sa.query, sa.key, sa.value)]
        u, w_extra = _lora_delta(h, [(p.weight.shape[0], p.lora) for p in parts], self.dtype, self.o)
        y = self.o.linear(h, wqkv, bqkv)
        return y if u is None else _plus_lora(y, u, w_extra, None)

    def separate_qkv(self):
        """(Wq, bq, Wk, bk, Wv, bv) in the layer's dtype when Q, K and V are plain Linear modules,
        else None: the dense inference path runs three GEMMs on them (see layer.attention_block)."""
        sa = self.layer.attention.self
        if not type(sa.query) is type(sa.key) is type(sa.value) is torch.nn.Linear:
            return None
        d = self.dtype
        return (
            cast(sa.query.weight, d),
            cast(sa.query.bias, d),
            cast(sa.key.weight, d),
            cast(sa.key.bias, d),
            cast(sa.value.weight, d),
            cast(sa.value.bias, d),
        )

    def out(self, ctx: torch.Tensor) -> torch.Tensor:
        return linear(ctx, dropin.linear_terms(self.layer.attention.output.dense), self.dtype, o=self.o)

    def up(self, h1: torch.Tensor, activation: Optional[str] = None) -> torch.Tensor:
        return linear(
            h1, dropin.linear_terms(self.layer.intermediate.dense), self.dtype, activation=activation, o=self.o
        )

    def down(self, f: torch.Tensor) -> torch.Tensor:
        return linear(f, dropin.linear_terms(self.layer.output.dense), self.dtype, o=self.o)
