"""Error bounds of the attention op's first-use check: how far a correct implementation may be
from torch's in the dtype it runs in, per output element (bert_fast/ops/_verify.py compares with
them). Used by the op's check (attention.py) and by the fused-SDPA self-check (fused_sdpa.py); it
imports neither, nor torch_impl, so that the three import one way."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from bert_fast.ops import _verify


class Seqs:
    """Per-token views of one layout for the bounds: q, k, v [..., h, d] (padded [B, S, h, d],
    varlen [T, h, d]) as |.| in fp32, and ``seqmax(t)``: the max of t [..., h(, d)] over the keys of
    each token's sequence, broadcast back to the tokens."""

    def __init__(self, qkv: Tensor, cu_seqlens: Optional[Tensor]):
        a = _verify.absf(qkv)
        self.q, self.k, self.v = a.unbind(-3)
        self.cu = cu_seqlens
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
            self.seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=qkv.device), lengths)

    def seqmax(self, t: Tensor) -> Tensor:
        if self.cu is None:
            return t.amax(dim=1, keepdim=True)
        index = self.seq.view(-1, *([1] * (t.dim() - 1))).expand_as(t)
        per_seq = torch.zeros((self.cu.numel() - 1,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        per_seq.scatter_reduce_(0, index, t, "amax")
        return per_seq[self.seq]


def fwd_checks(qkv, cu_seqlens, key_mask, seqlen, dropout_p, scale, k, t):
    """out = sum_j p_j v_j: the torch implementation's scores, rounded in the dtype, are off by at most
    u sigma (sigma = scale |q| max|k| >= |s|, Cauchy-Schwarz), which moves p_j by 2 u sigma p_j, and
    sum_j p_j |v_j| <= max_j |v_j|; the probabilities are rounded once more, the sums run over S keys
    (and d for the scores). lse = log sum exp(s) moves by the scores' error. Rows without keys: the
    kernel saves lse = +inf there, the torch implementation a finite stand-in: not compared."""
    sq = Seqs(qkv, cu_seqlens)
    d = qkv.shape[-1]
    sd = 1.0 / (1.0 - dropout_p) if dropout_p > 0.0 else 1.0
    sigma = scale * sq.q.norm(dim=-1) * sq.seqmax(sq.k.norm(dim=-1))  # [..., h]
    vbar = sq.seqmax(sq.v)  # [..., h, d]
    out_mag = sd * vbar * (3.0 + 2.0 * sigma)[..., None]
    out_acc = sd * vbar * (seqlen + (2 * d + 4) * sigma + 4.0)[..., None]
    lse_sigma = sigma.t() if cu_seqlens is not None else sigma.transpose(1, 2)  # lse's layout
    where = None
    if key_mask is not None:
        where = key_mask.to(torch.bool).any(dim=-1)[:, None, None]
    return [
        _verify.Check("out", k[0], t[0], mag=out_mag, acc=out_acc),
        _verify.Check("lse", k[1], t[1], mag=2.0 * lse_sigma, acc=(d + 4) * lse_sigma + seqlen + 4.0, where=where),
    ]


def bwd_checks(dout, qkv, cu_seqlens, max_seqlen, key_mask, seqlen, dropout_p, scale, k, t, torch_attention):
    """With P the softmax, dS = P (dP - delta), |dP_ij| <= s_d |dO_i| |v_j| =: D_i and |delta_i| <= D_i:
    |dV| <= s_d P^T |dO|, |dK| <= scale P^T (2 D |q|), |dQ_i| <= 2 scale D_i max_j |k_j|, each
    widened by (1 + 2 sigma) for the torch implementation's rounded scores. P^T x is the dV of the
    torch implementation's backward (fp32, dropout off) for dO = x: ``torch_attention`` is that
    implementation's (attention_fwd, attention_bwd, varlen_attention_fwd, varlen_attention_bwd),
    handed in by the caller (this module sits below torch_impl, which calls fused_sdpa, which
    calls it)."""
    pt_fwd, pt_bwd, pt_varlen_fwd, pt_varlen_bwd = torch_attention
    sq = Seqs(qkv, cu_seqlens)
    d = qkv.shape[-1]
    sd = 1.0 / (1.0 - dropout_p) if dropout_p > 0.0 else 1.0
    sigma = scale * sq.q.norm(dim=-1) * sq.seqmax(sq.k.norm(dim=-1))
    ado = _verify.absf(dout)
    big = (sd * ado.norm(dim=-1) * sq.seqmax(sq.v.norm(dim=-1)) * (1.0 + 2.0 * sigma))[..., None]
    q32 = qkv.detach().to(ado.dtype)
    if cu_seqlens is None:
        o, lse = pt_fwd(q32, key_mask, 0.0, scale, None)
        pt = lambda x: pt_bwd(x, q32, key_mask, o, lse, 0.0, scale, None)[:, :, 2]
    else:
        o, lse = pt_varlen_fwd(q32, cu_seqlens, max_seqlen, 0.0, scale, None)
        pt = lambda x: pt_varlen_bwd(x, q32, cu_seqlens, max_seqlen, o, lse, 0.0, scale, None)[:, 2]
    mags = {
        "dq": 2.0 * scale * big * sq.seqmax(sq.k),
        "dk": pt(2.0 * scale * big * sq.q),
        "dv": pt(sd * ado * (1.0 + 2.0 * sigma)[..., None]),
    }
    checks = []
    for i, name in enumerate(("dq", "dk", "dv")):
        part = (lambda g: g[:, :, i]) if cu_seqlens is None else (lambda g: g[:, i])
        checks.append(_verify.Check(name, part(k), part(t), mag=mags[name], acc=(seqlen + d + 8) * mags[name]))
    return checks
