"""Benchmark cases of the fused embedding op: LayerNorm(word[ids] + pos[0..S-1] + type[tt]) then
dropout (BERT's hidden dropout p = 0.1), T = B*S = 16384 tokens (B=128, S=128, no padding),
vocab 30522 (bert-base), 512 positions, 2 token types, forward and backward; memory-bound.

Providers: "bert_fast" (our op, with ``validate=False``: the default range check costs one host
sync per call, which is an API choice, not kernel time), "torch" (three F.embedding + add +
F.layer_norm + F.dropout, as transformers' BertEmbeddings) and "torch.compile" of the same.

``bytes`` is the minimal traffic: every token's word row is read once (rows repeat only by chance),
the position/type tables and gamma/beta once; forward writes y and fp32 mean/rstd; backward reads
dy and the rows again (x is recomputed) and writes the dense gradients of all three tables (the
word-table gradient, V*H elements, is an output no implementation can skip) plus dgamma/dbeta.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from bert_fast.bench.op_case import OpCase, device_randn, dtype_name, fwd_bwd

TOKENS = 16384
SEQ = 128
HIDDEN = (768, 1024)
VOCAB = 30522
MAX_POS = 512
TYPES = 2
DROPOUT_P = 0.1
EPS = 1e-12


def sample_ids(batch: int, seq: int, vocab: int, device, generator=None, types: int = TYPES):
    """(word ids, token-type ids) [B, S]: random ids from 1 with the padding id 0 last in every row,
    random token types below ``types``."""
    ids = torch.randint(1, vocab, (batch, seq), generator=generator).to(device)
    ids[:, -1] = 0  # a padding-index token in every row
    return ids, torch.randint(0, types, (batch, seq), generator=generator).to(device)


def sample_inputs(h: int, vocab: int, randn, max_pos: int = MAX_POS, types: int = TYPES) -> dict:
    """One call's float inputs, in the op's order: the word, position and token-type tables (vocab,
    max_pos and types rows), the LayerNorm's weight (near 1) and bias."""
    tables = {"word": randn(vocab, h), "position": randn(max_pos, h), "token_type": randn(types, h)}
    return {**tables, "weight": 1.0 + randn(h, scale=0.1), "bias": randn(h, scale=0.1)}


def _eager(ids, pos, tt, word, pe, te, w, b):
    x = F.embedding(ids, word) + F.embedding(pos, pe) + F.embedding(tt, te)
    return F.dropout(F.layer_norm(x, (x.shape[-1],), w, b, EPS), DROPOUT_P, training=True)


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(_eager, dynamic=False)


def _ours(ids, pos, tt, word, pe, te, w, b):
    from bert_fast.ops import embedding_layer_norm

    return embedding_layer_norm(ids, None, tt, word, pe, te, w, b, EPS, DROPOUT_P, validate=False)


def _fn(provider):
    return {"bert_fast": _ours, "torch": _eager}.get(provider) or _compiled()


def _factory(provider, direction, h, device, dtype):
    def make():
        fn = _fn(provider)
        batch = TOKENS // SEQ
        ids, tt = sample_ids(batch, SEQ, VOCAB, device)
        pos = torch.arange(SEQ, device=device).expand(batch, SEQ)
        params = list(sample_inputs(h, VOCAB, device_randn(device, dtype)).values())
        if direction == "fwd":
            return lambda: fn(ids, pos, tt, *params)
        params = [t_.requires_grad_(True) for t_ in params]
        y = fn(ids, pos, tt, *params)
        dy = torch.randn_like(y)
        return lambda: torch.autograd.grad(y, params, dy, retain_graph=True)

    return make


def minimal_bytes(
    direction: str,
    t: int,
    h: int,
    es: int,
    seq: int = SEQ,
    vocab: int = VOCAB,
    max_pos: int = MAX_POS,
    types: int = TYPES,
) -> int:
    ids = 2 * 8 * t  # int64 word and token-type ids (positions are implicit)
    if direction == "fwd":
        return (
            t * h * es  # word rows
            + (seq + types) * h * es  # position / type rows used, once
            + 2 * h * es  # gamma, beta
            + ids
            + t * h * es  # y
            + 8 * t
        )  # fp32 mean, rstd
    return (
        t * h * es  # dy
        + t * h * es  # word rows (x recomputed)
        + (seq + types) * h * es
        + h * es
        + 8 * t
        + ids
        + (vocab + max_pos + types) * h * es  # dense table gradients
        + 2 * h * es
    )  # dgamma, dbeta


def cases(device, dtype) -> list[OpCase]:
    es = torch.empty((), dtype=dtype).element_size()
    out = []
    for h in HIDDEN:
        costs = {
            d: ((12.0 if d == "fwd" else 20.0) * TOKENS * h, float(minimal_bytes(d, TOKENS, h, es)))
            for d in ("fwd", "bwd")
        }
        params = {"T": TOKENS, "S": SEQ, "H": h, "vocab": VOCAB, "dtype": dtype_name(dtype), "dropout_p": DROPOUT_P}
        factory = lambda p, direction: _factory(p, direction, h, device, dtype)
        out += fwd_bwd(
            "embedding", f"T={TOKENS} H={h}", "memory", costs, factory, ("bert_fast", "torch", "torch.compile"), params
        )
    return out
